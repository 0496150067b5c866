"""The value rules of a response cache: one place for every reader and writer.

docs/caches.md ("Validation"). Each rule is a small function that takes one
value and returns ``None`` or the problem as text (``"expected a number >= 0
and <= 1e+07, got -5"``). The JSONL reader applies them to the values as
written (so a message shows what the user wrote); :func:`cache_problem`
applies the same rules to a whole cache's arrays, vectorised to find the first
bad cell and then through the scalar rule for its message, so the fast-format
reader, ``data export``, ``data collect`` and the JSONL reader (as its last
check) refuse the same things with the same ``FIELD: problem`` text. Only the
place differs: ``FILE:LINE`` for JSONL, ``DIR/arrays.npz: question 'ID'`` for
the fast format.

The bounds keep every derived number finite in float32: a call costs at most
``MAX_TOKENS * MAX_PRICE / 1e6 * 100 = 1e8`` cents per token kind and role.

This module imports nothing from the rest of ``envs`` (``envs.cache.schema`` and
``envs.cache.jsonl`` import it).
"""
from __future__ import annotations

import json
import math
import unicodedata
from typing import Any, NamedTuple, Sequence

import numpy as np

#: Largest token count of one call (anything above is a data error).
MAX_TOKENS = 1e7
#: Largest cached EXIT cost of one question, in cents (float32-safe).
MAX_CENTS = 1e9
#: Largest list price, USD per million tokens (the dearest public list price is below 1e3).
MAX_PRICE = 1e5
#: Largest T (rounds per question).
MAX_T = 64

TOKENS_WHAT = f"a number >= 0 and <= {MAX_TOKENS:.0e}"
CENTS_WHAT = f"a number >= 0 and <= {MAX_CENTS:.0e}"
PRICE_WHAT = f"a number >= 0 and <= {MAX_PRICE:.0e} (USD per million tokens)"
UNIT_WHAT = "a number in [0, 1] or null"
ACTION_WHAT = "an action 0 (base), 1 (guide) or 2 (next)"
ROLES = ("base", "guide")
TOKEN_KEYS = ("tokens_in", "tokens_out")

#: Longest group name accepted.
MAX_GROUP_CHARS = 200


def json_type_name(v: Any) -> str:
    """The JSON name of a parsed value's type (for error messages): null, boolean, number, ..."""
    if v is None:
        return "null"
    if isinstance(v, (bool, np.bool_)):
        return "boolean"
    if isinstance(v, (int, float, np.integer, np.floating)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def plain(v: Any) -> Any:
    """A NumPy scalar as the Python value a JSON reader would have produced (float32 as the
    shortest decimal that reads back as the same float32, integral floats as ints), so a
    message about a stored value reads like one about the value as written."""
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        f = float(str(v)) if v.dtype == np.float32 else float(v)
        return int(f) if math.isfinite(f) and f.is_integer() and abs(f) < 2**53 else f
    if isinstance(v, np.str_):
        return str(v)
    return v


def show(v: Any) -> str:
    """A short rendering of a JSON value (or a NumPy scalar) for error messages."""
    v = plain(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (dict, list, tuple)):
        return json_type_name(v)
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def printable(text: Any) -> str:
    """``text`` for a terminal or a report: as it is when every character is printable, else quoted
    the way Python writes a string (``'red\\x1b[0m'``), so that a name from a cache (a model, a
    group, the cache itself) cannot colour the terminal, move its cursor or break a line."""
    s = str(text)
    return s if s.isprintable() else repr(s)


def md_cell(text: Any) -> str:
    """``text`` in a markdown table cell: :func:`printable`, and ``|`` escaped (it would end the cell)."""
    return printable(text).replace("|", "\\|")


def md_code(text: Any) -> str:
    """``text`` as a markdown code span: :func:`printable`, fenced by one backtick more than its
    longest run of backticks (padded when it starts or ends with one), and ``|`` escaped so that
    the span can stand in a table too."""
    s = printable(text).replace("|", "\\|")
    longest, cur = 0, 0
    for ch in s:
        cur = cur + 1 if ch == "`" else 0
        longest = max(longest, cur)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def number_problem(v: Any, lo: float, hi: float, what: str) -> str | None:
    """``None`` if ``v`` is a finite number in [lo, hi], else ``expected WHAT, got V``."""
    if not is_number(v):
        return f"expected {what}, got {json_type_name(v)} {show(v)}"
    v = plain(v)
    # (ints are compared exactly: math.isfinite would overflow on 10**400)
    if (isinstance(v, float) and not math.isfinite(v)) or not lo <= v <= hi:
        return f"expected {what}, got {show(v)}"
    return None


def tokens_problem(v: Any) -> str | None:
    return number_problem(v, 0.0, MAX_TOKENS, TOKENS_WHAT)


def cents_problem(v: Any) -> str | None:
    return number_problem(v, 0.0, MAX_CENTS, CENTS_WHAT)


def price_problem(v: Any) -> str | None:
    return number_problem(v, 0.0, MAX_PRICE, PRICE_WHAT)


def unit_problem(v: Any) -> str | None:
    """Confidence / uncertainty: absent (None, or NaN in the arrays) or in [0, 1]."""
    if v is None or (isinstance(v, (np.floating,)) and np.isnan(v)):
        return None
    return number_problem(v, 0.0, 1.0, UNIT_WHAT)


def exit_rounds_problem(n: Any, T: int) -> str | None:
    n = plain(n)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= T:
        return f"expected an integer in [1, {T}], got {show(n)}"
    return None


def actions_problem(acts: Any, n_rounds: int) -> tuple[str, str] | None:
    """The LLM-as-policy's actions of one question: ``None`` or ``(suffix, problem)``, the
    suffix being ``""`` (the list) or ``"[t]"`` (one action)."""
    if not isinstance(acts, (list, tuple)) or not acts:
        return "", f"expected a non-empty array of actions, got {show(acts)}"
    if len(acts) > n_rounds:
        return "", f"{len(acts)} actions, but the question has {n_rounds} rounds"
    for t, a in enumerate(acts):
        a = plain(a)
        if isinstance(a, bool) or not isinstance(a, int) or a not in (0, 1, 2):
            return f"[{t}]", f"expected {ACTION_WHAT}, got {show(a)}"
        last = t == len(acts) - 1
        if not last and a != 2:
            return f"[{t}]", f"action {a} answers and ends the episode, but more actions follow"
        if last and a == 2:
            return f"[{t}]", "the last action must answer (0 or 1), got 2 (next)"
    return None


def model_names_problem(v: Any) -> str | None:
    """``exit_models`` / ``llm_policy_models``: an array of distinct non-empty strings."""
    if not isinstance(v, (list, tuple)) or not all(isinstance(m, str) and m for m in v):
        return f"expected an array of model names, got {json_type_name(v)} {show(v)}"
    if len(set(v)) != len(v):
        dup = next(m for i, m in enumerate(v) if m in v[:i])
        return f"duplicate model name {dup!r}"
    return None


def control_char(text: str) -> int | None:
    """Index of the first control character (Unicode category Cc: NUL, ESC, newline, tab, DEL, ...) in ``text``."""
    return next((i for i, ch in enumerate(text) if unicodedata.category(ch) == "Cc"), None)


def group_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid group name (a non-empty string of at most 200 characters, without
    control characters), or None.

    Control characters are refused because NumPy's unicode arrays (the fast format, the importers)
    drop trailing NULs, which merged ``"a"`` and ``"a\\x00"`` into one group, and because an ESC or a
    newline would reach reports and terminals raw.
    """
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        return f"expected a non-empty string, got {kind}"
    if not value:
        return "expected a non-empty string, got an empty string"
    if len(value) > MAX_GROUP_CHARS:
        return f"at most {MAX_GROUP_CHARS} characters, got {len(value)}"
    i = control_char(value)
    if i is not None:
        shown = repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
        return (f"{shown} contains the control character U+{ord(value[i]):04X} at index {i}; "
                "a group name is printable text (no NUL, ESC, newline, tab, ...)")
    return None


def text_problem(s: str) -> str | None:
    """A string that UTF-8 cannot encode: a lone surrogate (JSON's ``"\\ud800"``) is not text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate U+{ord(s[e.start]):04X} at character {e.start} (not Unicode text)"
    return None


def lone_surrogate(obj: Any, path: str = "") -> tuple[str, str] | None:
    """The first string (value or key) in a parsed JSON value that UTF-8 cannot encode:
    ``(field path, problem)`` or ``None``."""
    if isinstance(obj, str):
        p = text_problem(obj)
        return (path, p) if p else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            p = text_problem(k)
            if p:
                return sub, "key " + p
            hit = lone_surrogate(v, sub)
            if hit:
                return hit
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            hit = lone_surrogate(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


class Problem(NamedTuple):
    """A value a cache must not hold: ``question`` is the row (None: the manifest), ``field``
    the JSONL field name (``rounds[0].base.tokens_in``, ``manifest.models.guide.price_in``)."""

    question: int | None
    field: str
    message: str


def manifest_problem(prices: dict[str, tuple[Any, Any]], exit_models: Any, llm_policy_models: Any) -> Problem | None:
    """The manifest's values: ``prices`` is ``{role: (price_in, price_out)}``."""
    for role, pair in prices.items():
        for key, v in zip(("price_in", "price_out"), pair):
            p = price_problem(v)
            if p:
                return Problem(None, f"manifest.models.{role}.{key}", p)
    for key, v in (("exit_models", exit_models), ("llm_policy_models", llm_policy_models)):
        p = model_names_problem(v)
        if p:
            return Problem(None, f"manifest.{key}", p)
    return None


def _first(bad: np.ndarray) -> tuple[int, ...] | None:
    if not bad.any():
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0])


def cache_problem(T: int, prices: dict[str, tuple[float, float]], exit_models: Sequence[str],
                  llm_policy_models: Sequence[str], arrays: dict[str, np.ndarray],
                  normalise=None, has_guide: bool = True) -> Problem | None:
    """The first value rule a cache breaks (shapes and dtypes are checked before), or ``None``.

    ``normalise`` is the answer normalisation (for "an answer equal to gold must be correct");
    without it that rule is skipped. ``has_guide`` False (a guide-less cascade): every guide
    array must hold its "no call" value (:data:`NO_GUIDE`) on every round.
    """
    p = manifest_problem(prices, list(exit_models), list(llm_policy_models))
    if p:
        return p
    a = arrays
    mask = a["round_mask"]
    for key in ("question_ids", "gold", "answer_text"):
        p = _text_arrays_problem(a[key], key)
        if p:
            return p
    empty = np.char.str_len(a["question_ids"]) == 0
    if empty.any():
        return Problem(int(np.argmax(empty)), "id", 'expected a non-empty string, got ""')
    if not has_guide:
        p = _guide_present(a, llm_policy_models)
        if p:
            return p
    for role in ROLES if has_guide else ROLES[:1]:
        for key in TOKEN_KEYS:
            v = a[f"{role}_{key}"]
            hit = _first(~np.isfinite(v) | (v < 0) | (v > MAX_TOKENS))
            if hit:
                q, t = hit
                return Problem(q, f"rounds[{t}].{role}.{key}", tokens_problem(v[q, t]))
        key = "confidence" if role == "base" else "uncertainty"
        v = a[f"{role}_{key}"]
        hit = _first(np.isinf(v) | (v < 0) | (v > 1))
        if hit:
            q, t = hit
            return Problem(q, f"rounds[{t}].{role}.{key}", unit_problem(v[q, t]))
        v = a[f"{role}_answer"]
        hit = _first((v < -1) | (v >= 2 * T) | (mask & (v < 0)) | (~mask & (v != -1)))
        if hit:
            q, t = hit
            what = "an existing round" if mask[q, t] else "a padding round (-1)"
            return Problem(q, f"rounds[{t}].{role}.answer",
                           f"answer id {int(v[q, t])} outside [0, {2 * T}) on {what}")
    p = _contradiction(a, T, normalise)
    if p:
        return p
    n_rounds = mask.sum(axis=1)
    em = a["exit_mask"]
    r = a["exit_rounds"]
    hit = _first(em & ((r < 1) | (r > T)))
    if hit:
        q, j = hit
        return Problem(q, f"baselines.exit.{exit_models[j]}.rounds", exit_rounds_problem(r[q, j], T))
    c = a["exit_cost_cents"]
    hit = _first(~np.isfinite(c) | (em & ((c < 0) | (c > MAX_CENTS))))
    if hit:
        q, j = hit
        return Problem(q, f"baselines.exit.{exit_models[j]}.cost_cents", cents_problem(c[q, j]))
    acts = a["llm_policy_actions"]  # [Q, M2, T]
    present = acts >= 0
    length = present.sum(axis=2)
    last = np.take_along_axis(acts, np.maximum(length - 1, 0)[..., None], axis=2)[..., 0]
    steps = np.arange(T)[None, None, :] < (length - 1)[..., None]
    bad = ((acts < -1) | (acts > 2)).any(axis=2) \
        | (present[..., 1:] & ~present[..., :-1]).any(axis=2) \
        | (length > n_rounds[:, None]) \
        | ((length > 0) & (last == 2)) \
        | (steps & (acts != 2)).any(axis=2)
    hit = _first(bad)
    if hit:
        q, j = hit
        row = acts[q, j]
        field = f"baselines.llm_policy.{llm_policy_models[j]}"
        if (row[1:] >= 0).any() and not (row >= 0).all() and (np.diff((row >= 0).astype(int)) > 0).any():
            return Problem(q, field, "actions after a missing one (-1): the actions must be a prefix")
        suffix, msg = actions_problem([int(x) for x in row[row != -1]], int(n_rounds[q]))
        return Problem(q, field + suffix, msg)
    return None


#: What a guide-less cascade's guide arrays hold (docs/caches.md "Guide-less cascades"): the padding
#: values, i.e. no call, no tokens, no answer (id -1), no verdict, no uncertainty (NaN).
NO_GUIDE = {"guide_verdict": False, "guide_answer": -1, "guide_correct": False, "guide_tokens_in": 0.0,
            "guide_tokens_out": 0.0}
#: ... and with the uncertainty: one round's guide values.
NO_GUIDE_ROUND = {**NO_GUIDE, "guide_uncertainty": math.nan}
CASCADE_NO_GUIDE = "the manifest's models.guide is null: a cascade has no guide"


def _guide_present(a: dict[str, np.ndarray], llm_policy_models: Sequence[str]) -> Problem | None:
    """The first round of a guide-less cascade whose guide arrays are not :data:`NO_GUIDE`, or a
    cached LLM policy that takes the guide's answer (action 1)."""
    bad = ~np.isnan(a["guide_uncertainty"])
    for k, v in NO_GUIDE.items():
        bad = bad | (a[k] != v)
    hit = _first(bad)
    if hit:
        q, t = hit
        return Problem(q, f"rounds[{t}].guide", CASCADE_NO_GUIDE)
    hit = _first(a["llm_policy_actions"] == 1)
    if hit:
        q, j, t = hit
        return Problem(q, f"baselines.llm_policy.{llm_policy_models[j]}[{t}]", f"action 1 (guide): {CASCADE_NO_GUIDE}")
    return None


def _text_arrays_problem(v: np.ndarray, key: str) -> Problem | None:
    try:
        np.char.encode(v, "utf-8")
        return None
    except UnicodeEncodeError:
        pass
    for idx in np.ndindex(v.shape):
        p = text_problem(str(v[idx]))
        if p:
            field = {"question_ids": "id", "gold": "gold"}.get(key, f"answer[{idx[-1]}]")
            return Problem(int(idx[0]), field, p)
    return None


def _contradiction(a: dict[str, np.ndarray], T: int, normalise) -> Problem | None:
    """Within a question, one answer id with two ``correct`` flags; an answer equal to gold
    flagged incorrect. Slots in reading order: round 0 base, round 0 guide, round 1 base, ..."""
    ids = np.stack([a["base_answer"], a["guide_answer"]], axis=2).reshape(len(a["base_answer"]), 2 * T)
    ok = np.stack([a["base_correct"], a["guide_correct"]], axis=2).reshape(ids.shape)
    live = np.repeat(a["round_mask"], 2, axis=1) & (ids >= 0)  # a cascade's guide slots hold -1: no answer
    conflict = np.zeros(len(ids), bool)
    for k in range(2 * T):
        here = live & (ids == k)
        conflict |= (here & ok).any(axis=1) & (here & ~ok).any(axis=1)
    if conflict.any():
        q = int(np.argmax(conflict))
        seen: dict[int, tuple[bool, str]] = {}
        for s in range(2 * T):
            if not live[q, s]:  # a padding round, or a cascade's guide slot: the next rounds still count
                continue
            field = f"rounds[{s // 2}].{ROLES[s % 2]}"
            k, c = int(ids[q, s]), bool(ok[q, s])
            if k in seen and seen[k][0] != c:
                return Problem(q, f"{field}.correct",
                               f"{json.dumps(c)} contradicts {seen[k][1]}.correct = {json.dumps(seen[k][0])} "
                               f"for the same normalised answer {str(a['answer_text'][q, k])!r}")
            seen.setdefault(k, (c, field))
    if normalise is None:
        return None
    gold = a["gold"]
    has_gold = np.char.str_len(gold) > 0
    if not has_gold.any():
        return None
    gold_norm = np.array([normalise(str(g)) if h else "" for g, h in zip(gold, has_gold)], dtype=str)
    said = np.take_along_axis(a["answer_text"], np.clip(ids, 0, None), axis=1)  # [Q, 2T] text of each slot
    hit = _first(live & ~ok & has_gold[:, None] & (said == gold_norm[:, None]))
    if hit:
        q, s = hit
        return Problem(q, f"rounds[{s // 2}].{ROLES[s % 2]}.correct",
                       f"false, but the answer {str(said[q, s])!r} equals the gold answer "
                       f"{str(gold[q])!r} after normalisation")
    return None
