"""The one token estimate (envs.cache.tokens) and the call reservation (ccpo_jax.llm.calls.reserve_tokens).

Oracles: integer arithmetic for ``ceil(n / 4)`` ((n + 3) // 4, no float) and the reservation's formula
as written before issue 52 moved it (``math.ceil(chars * ratio) + 16 * n_messages``).
"""
from __future__ import annotations

import ast
import math
import random

from ccpo_jax.gateway.engine import _side
from ccpo_jax.llm.calls import PROMPT_TOKENS_PER_CHAR, TOKENS_PER_MESSAGE, reserve_tokens
from ccpo_jax.llm.wire import Reply
from envs.cache.tokens import CHARS_PER_TOKEN, estimate_tokens, tokens_for_chars
from tests.helpers import REPO

ALPHABET = "abc xyz,.\n\u00e9\u4e2d\U0001f600"


def _random_text(rng: random.Random) -> str:
    n = rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, rng.randrange(10, 20_000)])
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_estimate_is_ceil_chars_over_four_on_random_strings():
    rng = random.Random(52)
    assert CHARS_PER_TOKEN == 4
    for _ in range(300):
        s = _random_text(rng)
        assert estimate_tokens(s) == (len(s) + 3) // 4 == math.ceil(len(s) / 4)
        assert tokens_for_chars(len(s)) == estimate_tokens(s)


def test_reserve_tokens_equals_the_formula_it_had():
    rng = random.Random(7)
    assert (PROMPT_TOKENS_PER_CHAR, TOKENS_PER_MESSAGE) == (0.5, 16)
    for _ in range(300):
        chars, n_msgs = rng.randrange(0, 200_000), rng.randrange(0, 9)
        ratio = rng.choice([None, rng.uniform(0.05, 2.0)])
        old = math.ceil(chars * (0.5 if ratio is None else ratio)) + 16 * n_msgs
        got = reserve_tokens(chars, n_msgs) if ratio is None else reserve_tokens(chars, n_msgs, ratio)
        assert got == old


def test_the_gateway_estimates_a_reply_without_usage_with_the_one_estimate():
    msgs = [{"role": "system", "content": "x" * 13}, {"role": "user", "content": "y" * 30}]
    assert _side(Reply("z" * 9, None, None, None, "stop"), msgs) == (11, 3, True)
    assert _side(Reply("z" * 9, 5, 6, None, "stop"), msgs) == (5, 6, False)


def _divides_by_four(tree: ast.AST) -> list[int]:
    """Lines of ``math.ceil(... / 4)`` (or ``/ CHARS_PER_TOKEN``): a token estimate written in place."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "ceil"
                and node.args and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Div)
                and (isinstance(node.args[0].right, ast.Constant) and node.args[0].right.value == 4
                     or isinstance(node.args[0].right, ast.Name) and node.args[0].right.id == "CHARS_PER_TOKEN")):
            out.append(node.lineno)
    return out


def test_no_module_writes_its_own_four_characters_a_token():
    found = []
    for root in ("ccpo_jax", "envs"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "envs" / "cache" / "tokens.py":  # the estimate itself
                continue
            lines = _divides_by_four(ast.parse(path.read_text(encoding="utf-8")))
            found += [f"{path.relative_to(REPO)}:{n}" for n in lines]
    assert found == [], f"use envs.cache.tokens.estimate_tokens / tokens_for_chars: {found}"
