"""What results.json, frontier.json and table.md say of a calibrated row: its guarantee, how often a
split's test coverage fell below 1 - alpha (``below_target``), per question group under Mondrian, and
Learn then Test's entries (``ltt``: feasibility, the binding constraint, the splits breaking a cap); and
the refusal of a capped request no row met.

The vocabulary, groups and rank tables are :mod:`ccpo_jax.ccpo.calibration`; the maths (order
statistics, Clopper-Pearson intervals) is :mod:`ccpo_jax.core.guarantee`. docs/calibration.md describes
what each field means.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ccpo_jax.ccpo.rowid import RowId
from ccpo_jax.core.guarantee import Guarantee, Marginal, below_target
from ccpo_jax.errors import UserError


def is_calibrated_row(row: str) -> bool:
    """A row whose sets are batch-calibrated: CPO batch, the CCPO rows, and their twins (kept seed, ensemble,
    Mondrian): ``RowId.calibrated`` of a name read from results.json / frontier.json."""
    return RowId.parse(row).calibrated


def add_group_guarantees(results: dict, group_rows: Mapping[str, Any] | None, alpha: float,
                         guarantee: Guarantee) -> None:
    """With per-group outcomes (``--calibration mondrian``): under every group of every calibrated row
    its ``below_target`` (splits whose test coverage of the group is below 1 - alpha; splits without a
    test question of the group are skipped), and per row ``group_below_target``: the groups whose fraction
    is within delta (pac) and the largest fraction with its group."""
    if not group_rows:
        return
    names = group_rows["names"]
    for row, per in group_rows["rows"].items():
        entry = results["policies"].get(row)
        if entry is None or "groups" not in entry:
            continue
        cov = np.asarray(per["coverage"], np.float64)  # [N, S, G]
        fr = {}
        for g, name in enumerate(names):
            bt = below_target(cov[..., g], alpha)
            entry["groups"][name]["below_target"] = bt
            if bt["fraction"] is not None:
                fr[name] = bt["fraction"]
        if fr:
            worst = max(fr, key=fr.get)
            summ = {"max": fr[worst], "max_group": worst, "median": float(np.median(list(fr.values())))}
            if guarantee.uses_delta:  # PAC: how many groups' fractions are within delta
                summ["within_delta"] = int(sum(f <= guarantee.delta for f in fr.values()))
            summ["n_groups"] = len(fr)
            entry["group_below_target"] = summ


def caps_text(alpha: float, guarantee: Guarantee) -> str:
    """The caps of a two- or three-risk request, for messages: ``coverage >= 0.9, guide-call rate <= 0.3,
    mean cost <= 0.02 cents a question, delta 0.1``."""
    caps = [f"coverage >= {1 - alpha:g}"]
    if guarantee.guide_cap is not None:
        caps.append(f"guide-call rate <= {guarantee.guide_cap:g}")
    if guarantee.cost_cap is not None:
        caps.append(f"mean cost <= {guarantee.cost_cap:g} cents a question")
    return ", ".join(caps) + f", delta {guarantee.delta:g}"


def cap_flags(guarantee: Guarantee) -> str:
    """The flags of the caps given, for messages: ``--guide-cap``, ``--cost-cap`` or both."""
    return " and ".join(f for f, v in (("--guide-cap", guarantee.guide_cap), ("--cost-cap", guarantee.cost_cap))
                        if v is not None)


def cap_field(guarantee: Guarantee) -> str:
    """The field an infeasible request's error names: the guide cap's, else the cost cap's."""
    return "guide_cap" if guarantee.guide_cap is not None else "cost_cap"


def check_feasible(ltt: Mapping[str, Mapping[str, Any]] | None, alpha: float, guarantee: Guarantee) -> None:
    """Refuse a capped request that no calibrated row met on any split (not a silent best effort): the
    message names the caps and, per row, the guide-call rate and mean cost at its coverage threshold."""
    if not ltt or any(np.asarray(x["feasible"]).any() for x in ltt.values()):
        return
    at = ", ".join(f"{row}: " + "/".join(
        ([f"guide rate {float(np.mean(x['cal_guide_rate'])):.3f}"] if guarantee.guide_cap is not None else [])
        + ([f"mean cost {float(np.mean(x['cal_cost'])):.4g} cents"] if guarantee.cost_cap is not None else []))
        for row, x in ltt.items() if RowId.parse(row).twin is None)
    raise UserError(f"{cap_field(guarantee)}: infeasible request ({caps_text(alpha, guarantee)}): on no split did a "
                    f"threshold of any calibrated row pass all {guarantee.families} tests; at the thresholds where "
                    f"coverage holds the calibration questions show (mean over splits): {at}; loosen "
                    f"{cap_flags(guarantee)} or raise --delta", field=cap_field(guarantee))


def _binding(x: Mapping[str, Any], guarantee: Guarantee, feas: np.ndarray) -> dict:
    """Per split, which constraint decided: coverage (a threshold passed every test: the cheapest one
    passing coverage, the caps being met there), or the cap(s) failing at the coverage threshold."""
    out = {"coverage": int(feas.sum())}
    cov_ok = np.asarray(x.get("coverage_ok", np.ones_like(feas)), bool)
    g_bad = ~np.asarray(x.get("guide_ok", np.ones_like(feas)), bool) & ~feas & cov_ok
    c_bad = ~np.asarray(x.get("cost_ok", np.ones_like(feas)), bool) & ~feas & cov_ok
    if guarantee.guide_cap is not None and guarantee.cost_cap is not None:
        out["guide_cap (infeasible)"] = int((g_bad & ~c_bad).sum())
        out["cost_cap (infeasible)"] = int((c_bad & ~g_bad).sum())
        out["both caps (infeasible)"] = int((g_bad & c_bad).sum())
    elif guarantee.guide_cap is not None:
        out["guide_cap (infeasible)"] = int((~feas & cov_ok).sum())
    else:
        out["cost_cap (infeasible)"] = int((~feas & cov_ok).sum())
    if (~cov_ok & ~feas).any():
        out["no coverage threshold (infeasible)"] = int((~cov_ok & ~feas).sum())
    return out


def ltt_entry(x: Mapping[str, Any], guarantee: Guarantee, coverage: Any, alpha: float, n_test: int = 0) -> dict:
    """results.json's ``ltt`` of one row: on how many splits a threshold passed every test (there coverage
    binds: the cheapest threshold passing the coverage test also passes the caps' tests, the guide rate and
    the cost being non-increasing in kappa), on how many a cap made the request infeasible (``binding``),
    the test guide rate and mean cost; ``violations``: the splits (of all, an infeasible one returns no
    threshold and so breaks no cap) whose threshold broke a cap on the test split (``n_test`` questions),
    with its Clopper-Pearson interval; Learn then Test bounds that probability by delta (up to the test
    split's sampling noise); ``cost_coverage_only_cents``: the test cost of the coverage-only PAC threshold
    at the full delta on the same splits, and ``cap_cost_cents``: the capped threshold's cost minus it,
    mean over the feasible splits (what adding the caps costs where they are met: delta split, the grid)."""
    feas = np.asarray(x["feasible"], bool)
    all_rate = np.asarray(x["guide_rate"], np.float64)
    rate = all_rate[feas]
    cov = np.asarray(coverage, np.float64)
    broke = feas & (np.nan_to_num(cov, nan=1.0) < 1.0 - alpha - 1e-6)
    cost = np.asarray(x["cost"], np.float64) if "cost" in x else None
    out: dict = {"splits": int(feas.size), "feasible": int(feas.sum())}
    if guarantee.guide_cap is not None:
        out["guide_cap"] = float(guarantee.guide_cap)
        out["guide_rate_above_cap"] = {"count": int(np.sum(rate > guarantee.guide_cap + 1e-6)), "n": int(rate.size)}
        broke |= feas & (all_rate > guarantee.guide_cap + 1e-6)
    if guarantee.cost_cap is not None:
        out["cost_cap"] = float(guarantee.cost_cap)
        if cost is not None and n_test:
            per_q = np.nan_to_num(cost, nan=0.0) / n_test
            out["cost_per_question_cents"] = float(per_q[feas].mean()) if feas.any() else None
            out["cost_above_cap"] = {"count": int(np.sum(per_q[feas] > guarantee.cost_cap * (1 + 1e-6))),
                                     "n": int(feas.sum())}
            broke |= feas & (per_q > guarantee.cost_cap * (1 + 1e-6))
        out["cal_cost_at_coverage_threshold"] = float(np.mean(np.asarray(x["cal_cost"])))
    viol = below_target(np.where(broke, 0.0, 1.0), 0.5)  # the share of splits that broke a cap
    viol["within_delta"] = bool(viol["fraction"] <= guarantee.delta)
    only = np.asarray(x["cost_coverage_only"], np.float64)
    if cost is not None:
        out["cap_cost_cents"] = float(np.mean(cost[feas] - only[feas])) if feas.any() else None
    out.update({"cost_coverage_only_cents": float(only.mean()), "binding": _binding(x, guarantee, feas),
                "guide_rate": float(rate.mean()) if rate.size else None, "violations": viol,
                "cal_guide_rate_at_coverage_threshold": float(np.mean(np.asarray(x["cal_guide_rate"])))})
    return out


def add_guarantees(results: dict, rows: Mapping[str, Mapping[str, Any]], alpha: float, guarantee: Guarantee,
                   ltt: Mapping[str, Mapping[str, Any]] | None = None, n_test: int = 0) -> None:
    """Put the run's ``guarantee`` in ``results`` and, under every calibrated row, its ``guarantee``
    and ``below_target``: how many of the seeds x splits had a test coverage below 1 - alpha, the
    fraction and its Clopper-Pearson 95% interval; under ``pac`` also ``within_delta`` (fraction <= delta)."""
    desc = guarantee.describe(alpha)
    results["guarantee"] = desc
    for row, entry in results["policies"].items():
        if not is_calibrated_row(row) or row not in rows:
            continue
        bt = guarantee.below_target(np.asarray(rows[row]["coverage"]), alpha)  # PAC: within_delta too
        entry["guarantee"] = dict(desc)
        entry["below_target"] = bt
        if ltt and row in ltt:
            entry["ltt"] = ltt_entry({**ltt[row], "cost": rows[row]["cost_cents"]}, guarantee, rows[row]["coverage"],
                                     alpha, n_test)


def add_frontier_guarantees(frontier: dict, grid: Mapping[float, Mapping[str, Mapping[str, Any]]],
                            guarantee: Guarantee) -> None:
    """A sweep's frontier.json: ``guarantee`` (kind, delta) and, at every point of a calibrated row,
    ``below_target`` (as in results.json) at that point's alpha."""
    frontier["guarantee"] = {"kind": guarantee.kind, "delta": guarantee.delta}
    for row, entry in frontier["rows"].items():
        if not is_calibrated_row(row):
            continue
        for pt in entry["points"]:
            m = grid[pt["alpha"]].get(row)
            if m is not None:
                pt["below_target"] = below_target(np.asarray(m["coverage"]), pt["alpha"])


def format_guarantees(results: Mapping[str, Any]) -> str:
    """table.md's section: the guarantee and, per calibrated row, the splits whose test coverage fell
    below 1 - alpha (a PAC row's fraction should be <= delta, up to the test split's own sampling noise)."""
    g = results.get("guarantee")
    if not g:
        return ""
    target = 1.0 - g["alpha"]
    delta = g.get("delta") is not None  # a guarantee with a failure probability (pac, or a registered kind)
    lines = ["", f"## Guarantee: {g['kind']}" + (f" (delta {g['delta']:g})" if delta else ""), "",
             g["statement"] + ".", "",
             f"| row | splits below {target:g} | fraction (95% CI) |" + (" <= delta |" if delta else ""),
             "|---|---|---|" + ("---|" if delta else "")]
    for row, entry in results["policies"].items():
        bt = entry.get("below_target")
        if not bt or bt["fraction"] is None:
            continue
        cell = f"{bt['fraction']:.3f} ({bt['ci'][0]:.3f}-{bt['ci'][1]:.3f})"
        extra = (" yes |" if bt["within_delta"] else " no |") if "within_delta" in bt else ""
        lines.append(f"| {row} | {bt['count']} of {bt['n']} | {cell} |{extra}")
    ltt_rows = [(row, e["ltt"]) for row, e in results["policies"].items() if "ltt" in e]
    if ltt_rows:
        lines += _format_ltt(g, ltt_rows)
    if delta:
        lines += ["", "A split's test coverage is a finite-sample estimate of its threshold's coverage, so the "
                      "fraction below target also counts test-sampling noise (docs/calibration.md)."]
    elif g["kind"] == Marginal.kind:  # what marginal promises, in words (another kind states itself above)
        lines += ["", f"This is what a marginal guarantee gives: coverage >= {target:g} on average over "
                      "calibration draws, not for each one, so one deployed threshold falls short of the target in "
                      "a large share of draws (the fraction above; its coverage is random around the target). "
                      f"`--guarantee pac --delta 0.1` chooses a threshold whose own coverage is >= {target:g} with "
                      "probability 0.9, at some extra cost (docs/calibration.md)."]
    return "\n".join(lines) + "\n"


def _format_ltt(g: Mapping[str, Any], ltt_rows: list) -> list[str]:
    """table.md's Learn-then-Test lines: per row the binding constraint, the test guide rate / mean cost,
    what the caps are up against at the coverage threshold, and the splits that broke a cap."""
    caps = [f"guide-call rate <= {g['guide_cap']:g}"] if g.get("guide_cap") is not None else []
    caps += [f"mean cost <= {g['cost_cap']:g} cents a question"] if g.get("cost_cap") is not None else []
    keys = [k for k in ltt_rows[0][1]["binding"] if k != "coverage"]
    head = ["row", "coverage binds", *keys]
    if g.get("guide_cap") is not None:
        head += ["test guide rate", "cal. guide rate at the coverage threshold"]
    if g.get("cost_cap") is not None:
        head += ["test cost a question", "cal. cost a question at the coverage threshold"]
    head += ["cap cost (cents)", "splits breaking a cap (95% CI)"]
    lines = ["", f"Learn then Test, {' and '.join(caps)}: the binding constraint per split (coverage, or a cap "
                 "making the request infeasible; splits without a threshold have no result):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for row, e in ltt_rows:
        cells = [row, f"{e['feasible']} of {e['splits']}", *(str(e["binding"].get(k, 0)) for k in keys)]
        if g.get("guide_cap") is not None:
            cells += [num(e["guide_rate"], ".3f"), f"{e['cal_guide_rate_at_coverage_threshold']:.3f}"]
        if g.get("cost_cap") is not None:
            cells += [num(e.get("cost_per_question_cents"), ".4g"), f"{e['cal_cost_at_coverage_threshold']:.4g}"]
        v = e["violations"]
        cells += [num(e.get("cap_cost_cents"), ".3g"),
                  f"{v['count']} = {v['fraction']:.3f} ({v['ci'][0]:.3f}-{v['ci'][1]:.3f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
