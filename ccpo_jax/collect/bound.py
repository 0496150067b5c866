"""The cost bound printed before the first call: every completion at ``max_tokens``, every round."""
from __future__ import annotations

from ccpo_jax.collect.settings import Settings
from ccpo_jax.llm import paper as P
from ccpo_jax.llm.calls import PROMPT_TOKENS_PER_CHAR, reserve_tokens
from ccpo_jax.llm.questions import Question


def cost_bound(s: Settings, questions: list[Question]) -> dict[str, dict[str, float]]:
    """Per role: calls and the worst-case tokens and USD of collecting ``questions`` (every
    completion at max_tokens, prompts at :data:`PROMPT_TOKENS_PER_CHAR`; no replays counted)."""
    out = {r: {"calls": 0, "tokens_in": 0, "tokens_out": 0, "usd": 0.0} for r in s.roles()}

    def add(role, prompt_text_chars, n_msgs, extra_tokens, max_out):
        o = out[role]
        t_in = reserve_tokens(prompt_text_chars, n_msgs) + extra_tokens
        o["calls"] += 1
        o["tokens_in"] += t_in
        o["tokens_out"] += max_out
        p_in, p_out = s.prices[role]
        o["usd"] += (t_in * p_in + max_out * p_out) / 1e6

    B, G, D = s.base_max_tokens, s.guide_max_tokens, s.decision_max_tokens
    prompts = s.proto.prompts()
    for q in questions:
        qc = len(q.question)
        base0 = len(prompts["base"]) + qc
        for t in range(s.T):
            if s.cascade:  # round 1's prompt every round, no guide call (rounds.collect_question)
                add(s.base_role(t), base0, 1, 0, B)
                continue
            add(s.base_role(t), base0 + t * len(prompts["base_retry"]), 1 + 2 * t, t * (B + G), B)
            add("guide", s.proto.guide_prompt_chars() + qc, 1, B, G)
        for role in dict.fromkeys(s.exit_roles):
            for t in range(s.T):
                if not (role == "base" and t == 0):  # the same request as the protocol's first base call
                    add(role, base0 + t * len(P.EXIT_RETRY), 1 + 2 * t, t * B, B)
                if t < s.T - 1:
                    add(role, len(P.EXIT_PROMPT) + qc, 1, (t + 1) * B, D)
        for role in dict.fromkeys(s.policy_roles):
            for t in range(s.T):
                # each round shown: a line of ~200 characters around the base answer (<= B tokens) and the
                # guide's answer (<= G tokens)
                add(role, len(P.POLICY_PROMPT) + len(P.POLICY_NEXT) + qc + 200 * (t + 1), 1, (t + 1) * (B + G), D)
    return out


def format_bound(s: Settings, bound: dict, n: int, cap: float | None, paid: float) -> str:
    lines = [f"cost bound for {n} question(s), T={s.T} (every completion at max_tokens, prompts at "
             f"{PROMPT_TOKENS_PER_CHAR:g} token per character; a real run costs less):"]
    total = 0.0
    for r in s.roles():
        b = bound[r]
        p_in, p_out = s.prices[r]
        src = s.price_sources[r].split(":")[0]
        lines.append(f"  {r:5s} {s.endpoint(r).model} (${p_in:g} in / ${p_out:g} out per M tokens, from {src}): "
                     f"{b['calls']:,} calls, <= {b['tokens_in']:,} in + {b['tokens_out']:,} out tokens, "
                     f"<= ${b['usd']:.4f}")
        total += b["usd"]
    tail = f"  at most ${total:.4f}"
    if paid:
        tail += f" more (already paid ${paid:.4f}, in the call log)"
    tail += f"; budget cap: ${cap:.4f}" if cap is not None else "; no budget cap (--max-cost-usd)"
    lines.append(tail)
    return "\n".join(lines)
