"""One question's calls in the protocol's order and its cache line (human JSONL format, docs/caches.md).

The T base-guide rounds, then the baselines asked for: an LLM-EXIT run per
model and an LLM-as-policy run per model over the collected chain
(:mod:`ccpo_jax.llm.paper` holds the prompts, parsers and measures).
"""
from __future__ import annotations

from typing import Any, Callable

from ccpo_jax.collect.caller import Answer, Caller
from ccpo_jax.collect.settings import Settings
from ccpo_jax.llm import paper as P
from ccpo_jax.llm.questions import Question


def _tokens(rec: dict, a: Answer) -> None:
    rec["tokens_in"] = a.tokens_in
    rec["tokens_out"] = a.tokens_out
    if a.estimated:
        rec["tokens_estimated"] = True


def collect_question(q: Question, s: Settings, c: Caller) -> dict:
    """The cache line of question ``q``: T base-guide rounds (base calls alone in a cascade), then the
    baselines."""
    correct = lambda ans: P.is_correct(ans, q.golds, s.f1_threshold)  # noqa: E731
    rounds: list[dict] = []
    history: list[tuple[str, str]] = []
    seen: list[dict] = []  # what the LLM-as-policy is shown, per round
    pr = s.proto
    for t in range(s.T):
        # a cascade's round is its rung's own first answer (as the ladder importers' rounds are)
        temp = P.base_temperature(s.base_temperature, t, s.cascade)
        b = c.call(q.id, f"r{t}.base", s.base_role(t), pr.base_messages(q.question, history), s.base_max_tokens, temp,
                   pr.base_format(q.question))
        br = pr.read_base(q.question, b.text, b.logprobs)
        c.meter.cut_reply("base answer", b.finish_reason, not br.parsed)
        ans = br.answer
        base = {"answer": ans, "correct": correct(ans)}
        _tokens(base, b)
        if br.confidence is not None:
            base["confidence"] = br.confidence
        c.meter.signal("confidence", br.confidence is not None)
        if not br.parsed:
            base["answer_parsed"] = False
            c.meter.bump("base answer")
        if s.cascade:  # no guide call; the round has no guide object (docs/caches.md)
            rounds.append({"base": base})
            continue
        g = c.call(q.id, f"r{t}.guide", "guide", pr.guide_messages(q.question, br.shown), s.guide_max_tokens,
                   s.guide_temperature, pr.guide_format(q.question))
        gr = pr.read_guide(q.question, g.text, g.logprobs, ans)
        c.meter.cut_reply("guide verdict", g.finish_reason, gr.verdict is None)
        g_ans = gr.answer
        guide = {"verdict": gr.verdict is True, "answer": g_ans, "correct": correct(g_ans)}
        _tokens(guide, g)
        unc = gr.uncertainty
        if unc is not None:
            guide["uncertainty"] = unc
        c.meter.signal("uncertainty", unc is not None)
        if gr.verdict is None:
            guide["verdict_parsed"] = False
            guide["raw"] = g.text
            c.meter.bump("guide verdict")
        elif gr.verdict is False and gr.correction is None:
            guide["correction_given"] = False
        rounds.append({"base": base, "guide": guide})
        history.append((b.text, g.text))
        seen.append({"base": ans, "verdict": gr.verdict, "guide": g_ans, "uncertainty": unc})

    rec: dict[str, Any] = {"id": q.id, "gold": q.golds[0]}
    if q.group is not None:
        rec["group"] = q.group
    if len(q.golds) > 1:
        rec["gold_aliases"] = list(q.golds[1:])
    rec["question"] = q.question
    rec["rounds"] = rounds
    baselines = _baselines(q, s, c, correct, seen)
    if baselines:
        rec["baselines"] = baselines
    return rec


def _baselines(q: Question, s: Settings, c: Caller, correct: Callable[[str], bool], seen: list[dict]) -> dict:
    """The ``baselines`` object: LLM-EXIT runs and LLM-as-policy actions, one per model."""
    baselines: dict[str, Any] = {}
    exits = {}
    for role in s.exit_roles:
        m = s.endpoint(role).model
        if m not in exits:
            exits[m] = _exit_run(q, s, c, role, correct)
    if exits:
        baselines["exit"] = exits
    pols, calls = {}, {}
    for role in s.policy_roles:
        m = s.endpoint(role).model
        if m in calls:
            continue
        acts, info = _policy_run(q, s, c, role, seen)
        calls[m] = info
        if acts is not None:
            pols[m] = acts
    if pols:
        baselines["llm_policy"] = pols
    if calls:
        baselines["llm_policy_calls"] = calls
    return baselines


def _cents(c: Caller, role: str, a: Answer) -> float:
    return c.usd(role, a.tokens_in, a.tokens_out) * 100.0


def _exit_run(q: Question, s: Settings, c: Caller, role: str, correct: Callable[[str], bool]) -> dict:
    """LLM-EXIT of one model (protocol module doc): rounds until it exits or T."""
    answers: list[str] = []
    history: list[tuple[str, str]] = []
    cents = 0.0
    unreadable = 0
    for t in range(s.T):
        temp = s.base_temperature[0] if t == 0 else s.base_temperature[1]
        a = c.call(q.id, f"exit.{role}.r{t}", role, P.base_messages(q.question, history, retry="exit"),
                   s.base_max_tokens, temp)
        cents += _cents(c, role, a)
        parsed = P.parse_base_answer(a.text)
        c.meter.cut_reply("base answer", a.finish_reason, parsed is None)
        answers.append(parsed[0] if parsed else "")
        history.append((a.text, ""))
        if t == s.T - 1:
            break
        d = c.call(q.id, f"exit.{role}.d{t}", role, P.exit_messages(q.question, answers), s.decision_max_tokens, 0.0)
        cents += _cents(c, role, d)
        dec = P.parse_exit(d.text)
        c.meter.cut_reply("decision", d.finish_reason, dec is None)
        if dec is None:
            unreadable += 1  # not an exit request: the run goes on (recorded)
            c.meter.bump("EXIT decision")
        if dec is True:
            break
    out = {"correct": correct(answers[-1]), "rounds": len(answers), "cost_cents": round(cents, 9),
           "answer": answers[-1]}
    if unreadable:
        out["unreadable_decisions"] = unreadable
    return out


def _policy_run(q: Question, s: Settings, c: Caller, role: str, seen: list[dict]) -> tuple[list[int] | None, dict]:
    """LLM-as-policy of one model over the collected chain: actions until it answers."""
    acts: list[int] = []
    cents = 0.0
    info: dict[str, Any] = {}
    for t in range(s.T):
        msgs = P.policy_messages(q.question, seen[: t + 1], s.T, s.policy_coverage)
        a = c.call(q.id, f"policy.{role}.r{t}", role, msgs, s.decision_max_tokens, 0.0)
        cents += _cents(c, role, a)
        act = P.parse_policy_action(a.text, last_round=t == s.T - 1)
        c.meter.cut_reply("decision", a.finish_reason, act is None)
        if act is None:
            info["unreadable"] = {"round": t, "reply": a.text}
            c.meter.bump("policy reply")
            acts = []
            break
        acts.append(act)
        if act != 2:
            break
    info["cost_cents"] = round(cents, 9)
    return (acts or None), info
