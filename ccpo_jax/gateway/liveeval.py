"""``ccpo-jax live-eval``: questions with gold through the gateway's code, realised vs replay-predicted.

Each question runs :meth:`~ccpo_jax.gateway.service.Gateway.complete` in-process (the
code behind ``POST /v1/chat/completions``, without HTTP) and is labelled at once
with its gold (the ``/v1/feedback`` code), so the journal is a cache.

Coverage. The replay's coverage (results.json) is the paper's matched coverage:
an answer of the set correct, or the question unsolvable (no answer of any of
the T rounds correct). Live, the rounds not run are never seen, so matched
coverage lies between two realised counts: *set* (an answer of the set is
correct; unsolvable questions count as missed) and *set or none seen* (also
counting questions where no answer of the rounds run was correct). Each gets a
Clopper-Pearson 95% interval; the prediction is checked against both.

Empty sets. A question whose final set is empty is answered by ``--on-empty`` (docs/gateway.md#empty-sets);
the report gives the share of empty sets and the accuracy of the reply (its content correct; an empty
reply is wrong) under each choice of ``--on-empty``, all read from the same rounds, since a fallback
makes no call.

Two predictions (docs/gateway.md, "live-eval"). *This router over the cache*: the exported router's own
replay over every question of the cache it was trained on (:func:`ccpo_jax.gateway.prediction.router_replay`;
training and calibration questions included), at the prices the gateway charges: one policy, one threshold,
the deployed router's prediction; cost and rounds differences are against it. *The row's mean over
splits* (results.json): the training run's test-split figure of the row, a mean over splits x seeds each
recalibrated with its own threshold, so not one deployed router's; kept as before (``prediction``,
``prediction_inside``, ``coverage_diff``, ``cost_diff_cents``).

Budget: before a question starts, the worst case of its T rounds (the engine's
per-round reservation, completions at max_tokens) is reserved; a question whose
reservation would cross ``--budget-cents`` is not started.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ccpo_jax.ccpo import settings
from ccpo_jax.errors import UserError
from ccpo_jax.gateway.service import Gateway, GatewayConfig
from ccpo_jax.gateway.engine import ON_EMPTY, Caps, fallback_answer, per_round, round_reserve
from ccpo_jax.gateway.prediction import clopper_pearson, find_cache, router_replay
from ccpo_jax.llm import paper as P
from ccpo_jax.llm.questions import load_questions
from ccpo_jax.serving import Router


def served_row(manifest: dict) -> str:
    """The results.json row whose figures are the exported policy's: ``ROW [kept seed]`` when the artefact is
    a row's kept seed (``seed_rule``), else the row itself (an ensemble row, a one-seed run, an older run)."""
    return settings.served_row(manifest["policy"]["row"], manifest.get("seed_rule"))


def replay_prediction(results: str | Path, row: str) -> dict:
    """The training run's test-split prediction of ``row`` per question (results.json; cost is summed
    over the test split there)."""
    p = Path(results)
    try:
        r = json.loads(p.read_text())
        pol = r["policies"][row]
        run = json.loads((p.parent / "run.json").read_text()) if (p.parent / "run.json").is_file() else {}
        n_test = int(run.get("split_sizes", [0, 0, 0])[2]) or None
    except FileNotFoundError:
        raise UserError(f"{p}: no such file (the training run's results.json)", field="results") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{p}: no prediction for row {row!r} ({e!r})", field="results") from None
    out = {"row": row, "coverage": pol["coverage"]["mean"], "avg_len": pol["avg_len"]["mean"], "n_test": n_test,
           "source": str(p)}
    out["cost_cents_per_question"] = pol["cost_cents"]["mean"] / n_test if n_test else None
    return out


def _find_results(artefact: str | Path, given: str | None) -> Path | None:
    if given is not None:
        return Path(given)
    m = json.loads((Path(artefact) / "manifest.json").read_text())
    pdir = m.get("source", {}).get("policy_dir")
    cand = Path(pdir).parent.parent / "results.json" if pdir else None
    return cand if cand is not None and cand.is_file() else None


def live_eval(artefact: str | Path, cfg: GatewayConfig, questions: str | Path, *, results: str | None = None,
              budget_cents: float | None = None, concurrency: int = 4, cache: str | None = None,
              echo: Callable[[str], Any] = print) -> dict:
    """``questions`` through the gateway's code; the report against the router's own replay over its
    training ``cache`` (given, or the one the training run's run.json names) and the row's mean of the
    training run's ``results`` (given, or found beside the artefact's run)."""
    qs, _ = load_questions(questions)
    if budget_cents is not None and not budget_cents > 0:
        raise UserError(f"budget_cents: expected a number > 0, got {budget_cents}", field="budget_cents")
    if cfg.journal is None or Path(cfg.journal).exists():
        raise UserError(f"{cfg.journal}: already exists; live-eval writes a new journal", field="journal")
    res_path = _find_results(artefact, results)
    router = Router.load(artefact)
    pred = replay_prediction(res_path, served_row(router.manifest)) if res_path else None
    own, note = find_cache(router, cache)  # before the journal and the first call: a bad --cache leaves nothing
    gw = Gateway(router, cfg)
    gw.warm_up()  # (as load_gateway)
    if own is not None:
        echo(f"live-eval: replaying the router over its cache ({own.n_questions} questions) for its own prediction")
        own = router_replay(gw.router, own, gw.prices)
    rows = asyncio.run(_run_all(gw, qs, budget_cents, concurrency))
    report = summarise(rows, pred, len(qs), 1.0 - gw.router.alpha, own)
    report["prediction_router_note"] = note
    report["journal"] = str(cfg.journal)
    for line in format_report(report):
        echo(line)
    return report


async def _run_all(gw, qs, budget_cents, concurrency) -> list[dict]:
    await gw.start()
    sem = asyncio.Semaphore(concurrency)
    state = {"spent": 0.0, "reserved": 0.0, "stopped": False, "outcomes": 0}
    p, T = gw.cfg.protocol, gw.router.T
    worst_hist = [("x" * (4 * p.base_max_tokens), "x" * (4 * p.guide_max_tokens))]
    prices, has_guide = per_round(gw.prices, T), gw.rungs["guide"] is not None  # (a cascade's base: no history)

    async def one(q) -> dict | None:
        async with sem:
            need = sum(round_reserve(q.question, worst_hist * t if has_guide else [], p, prices, t)
                       for t in range(T))
            if state["stopped"] or (budget_cents is not None and state["spent"] + state["reserved"] + need > budget_cents):
                state["stopped"] = True
                return None
            state["reserved"] += need
            try:
                cid, out = await gw.complete(q.question, q.group, Caps(), cid=q.id)
            finally:
                state["reserved"] -= need
            cost = sum(t["cost_cents"] for t in out.tokens.values())
            state["spent"] += cost
            fb = await gw.feedback({"id": cid, "gold": q.golds[0], "gold_aliases": list(q.golds[1:])})
            state["outcomes"] += 1  # the drift alarm after each outcome, in the order they were recorded
            alarm = {"after": state["outcomes"], "on": fb["drift_alarm"], "rolling": fb["rolling_coverage"]}
            judge = lambda a: P.is_correct(a, q.golds)  # noqa: E731
            seen = any(judge(rd[r]["answer"]) for rd in out.rounds for r in ("base", "guide") if r in rd)
            covered = any(judge(a["answer"]) for a in out.answer_set)
            reply = {}  # the reply's correctness under each --on-empty choice (the same rounds)
            for choice in ON_EMPTY:
                fb = fallback_answer(out.rounds, choice) if out.answer is None else None
                text = out.answer if out.answer is not None else (fb["answer"] if fb else "")
                reply[choice] = judge(text)
            return {"id": q.id, "cost_cents": cost, "rounds": len(out.rounds), "covered": covered,
                    "none_seen": not seen, "empty_set": out.answer is None, "reply_correct": reply, "alarm": alarm}

    try:
        rows = await asyncio.gather(*(one(q) for q in qs))
    finally:
        await gw.stop()
    return [r for r in rows if r is not None]


def summarise(rows: list[dict], pred: dict | None, n_questions: int, target: float, own: dict | None = None) -> dict:
    """The report: realised figures with their intervals, against ``own`` (the router's replay over its
    cache, :func:`router_replay`) and ``pred`` (the row's mean over splits, results.json)."""
    n = len(rows)
    k_set = sum(r["covered"] for r in rows)
    k_upper = sum(r["covered"] or r["none_seen"] for r in rows)
    out: dict[str, Any] = {
        "questions": n, "not_started_budget": n_questions - n, "target": target,
        "cost_cents_per_question": float(np.mean([r["cost_cents"] for r in rows])) if rows else None,
        "rounds_mean": float(np.mean([r["rounds"] for r in rows])) if rows else None,
        "coverage_set": k_set / n if n else None, "coverage_set_ci95": clopper_pearson(k_set, n),
        "coverage_set_or_none_seen": k_upper / n if n else None,
        "coverage_set_or_none_seen_ci95": clopper_pearson(k_upper, n),
        "prediction": pred,
        "empty_sets": sum(r["empty_set"] for r in rows),
        "reply_accuracy": {c: {"value": sum(r["reply_correct"][c] for r in rows) / n if n else None,
                               "ci95": clopper_pearson(sum(r["reply_correct"][c] for r in rows), n)}
                           for c in ON_EMPTY},
    }
    if rows and "alarm" in rows[0]:
        seq = sorted((r["alarm"] for r in rows), key=lambda a: a["after"])
        first = next((a["after"] for a in seq if a["on"]), None)
        out["drift_alarm"] = {"on_at_end": seq[-1]["on"], "first_on_after": first,
                              "rolling_coverage_at_end": seq[-1]["rolling"]}
    if pred is not None and n:
        lo, hi = out["coverage_set_ci95"][0], out["coverage_set_or_none_seen_ci95"][1]
        out["prediction_inside"] = lo <= pred["coverage"] <= hi
        out["coverage_diff"] = [k_set / n - pred["coverage"], k_upper / n - pred["coverage"]]
        if pred.get("cost_cents_per_question") is not None:
            out["cost_diff_cents"] = out["cost_cents_per_question"] - pred["cost_cents_per_question"]
    out["prediction_router"] = own
    out["empty_set_share"] = out["empty_sets"] / n if n else None
    if own is not None and n:
        lo, hi = out["coverage_set_ci95"][0], out["coverage_set_or_none_seen_ci95"][1]
        out["prediction_router_inside"] = lo <= own["coverage"] <= hi
        out["coverage_diff_router"] = [k_set / n - own["coverage_set"], k_upper / n - own["coverage_set_or_none_seen"]]
        out["cost_diff_cents_router"] = out["cost_cents_per_question"] - own["cost_cents_per_question"]
        out["rounds_diff_router"] = out["rounds_mean"] - own["rounds_mean"]
    return out


def _table(r: dict, f) -> list[str]:
    """The table: realised, this router over its cache (and the difference), the row's mean (and the difference)."""
    p, o = r["prediction"] or {}, r.get("prediction_router") or {}
    ci_a, ci_b = r["coverage_set_ci95"], r["coverage_set_or_none_seen_ci95"]
    d = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
    n_own = f"{o['questions']} questions" if o else "not computed"
    lines = [f"| measure | realised | this router over the cache ({n_own}) | difference | the row's mean over "
             "splits (results.json) | difference |", "|---|---|---|---|---|---|"]
    for name, live, own, row in (
            ("cost per question (cents)", r["cost_cents_per_question"], o.get("cost_cents_per_question"),
             p.get("cost_cents_per_question")),
            ("rounds per question", r["rounds_mean"], o.get("rounds_mean"), p.get("avg_len")),
            (f"coverage: set (CP 95%) | {f(r['coverage_set'])} [{ci_a[0]:.3f}, {ci_a[1]:.3f}]", r["coverage_set"],
             o.get("coverage_set"), p.get("coverage")),
            (f"coverage: set or none seen (CP 95%) | {f(r['coverage_set_or_none_seen'])} [{ci_b[0]:.3f}, "
             f"{ci_b[1]:.3f}]", r["coverage_set_or_none_seen"], o.get("coverage_set_or_none_seen"), p.get("coverage")),
            ("empty final sets (share)", r.get("empty_set_share"), o.get("empty_set_share"), None)):
        shown = name if "|" in name else f"{name} | {f(live)}"
        lines.append(f"| {shown} | {f(own)} | {f(d(live, own))} | {f(row)} | {f(d(live, row))} |")
    if o:
        oc = o["coverage_ci95"]
        lines.append(f"| coverage: matched (the replay's rule) | between set and set or none seen | {f(o['coverage'])} "
                     f"[{oc[0]:.3f}, {oc[1]:.3f}] | | {f(p.get('coverage'))} | |")
    return lines


def format_report(r: dict) -> list[str]:
    f = lambda v, d=4: "n/a" if v is None else f"{v:.{d}g}"  # noqa: E731
    p = r["prediction"] or {}
    ci_a, ci_b = r["coverage_set_ci95"], r["coverage_set_or_none_seen_ci95"]
    lines = [f"live-eval: {r['questions']} question(s) answered"
             + (f", {r['not_started_budget']} not started (--budget-cents)" if r["not_started_budget"] else ""),
             *_table(r, f)]
    lines.append(f"empty final sets: {r['empty_sets']} of {r['questions']}; reply accuracy (content correct, "
                 "CP 95%) by --on-empty: " + "; ".join(
                     f"{c} {f(a['value'], 3)} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]"
                     for c, a in r["reply_accuracy"].items()))
    if "drift_alarm" in r:
        a = r["drift_alarm"]
        lines.append(f"drift alarm (gold feedback after each question): "
                     + (f"on after {a['first_on_after']} outcome(s)" if a["first_on_after"] else "never on")
                     + f"; at the end {'on' if a['on_at_end'] else 'off'}, rolling coverage "
                     f"{f(a['rolling_coverage_at_end'], 3)}")
    o = r.get("prediction_router")
    if o:
        lines.append(f"prediction of this router (its replay over the cache {o['cache']!r}, {o['questions']} "
                     f"questions, training and calibration questions included; {r.get('prediction_router_note')}): "
                     f"matched coverage {f(o['coverage'])} inside [{ci_a[0]:.3f}, {ci_b[1]:.3f}]: "
                     f"{'yes' if r.get('prediction_router_inside') else 'no'}")
    else:
        lines.append(r.get("prediction_router_note") or "the router's own replay prediction skipped (pass --cache)")
    if p:
        lines.append(f"the row's mean over splits ({p['row']}, {p['source']}; splits x seeds, each recalibrated: "
                     f"not one deployed router's) inside [{ci_a[0]:.3f}, {ci_b[1]:.3f}]: "
                     f"{'yes' if r.get('prediction_inside') else 'no'}")
    else:
        lines.append("no row mean over splits (no results.json found; pass --results)")
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    lines.append(f"coverage: {COVERAGE_RULE}; 'set': an answer of the set matches the gold; 'set or none seen' "
                 "also counts a question no answer of which matched (the replay counts such an unsolvable "
                 "question as covered); costs at the router's trained prices (or --price)")
    lines.append(f"journal (a cache): {r.get('journal', '')}")
    return lines
