"""``table.md`` of ``ccpo-jax reproduce``: the paper's layout, with what a newcomer needs to read it.

Every column says its unit; the cost is the sum over the test split (as the paper's tables) and the
cost per question stands beside it; under the table, one line each defines coverage (with the
cache's share of unsolvable questions, which count as covered), Avg. Len. and Set Size. The row that
``ccpo-jax export`` serves by default is marked (results.json ``export_default``), and the header
says in words what the trainer preset changes from the paper's setting.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ccpo_jax.ccpo.observable import BEST_OBS_ROW
from ccpo_jax.ccpo.presets import PAPER, PRESETS_LINK, deviations_from_dict, deviations_in_words
from ccpo_jax.ccpo.rowid import Family, RowId, row_key
from ccpo_jax.ccpo.settings import METRICS, Setting, twin_notes
from envs.cache.values import md_cell, md_code, printable
from envs.replay.bound import BOUND_ROW

#: Column titles of the metrics (the box plots' axes too), each with its unit.
METRIC_TITLES = {
    "cost_cents": "Cost (cents per test split)",
    "coverage": "Coverage",
    "avg_len": "Avg. Len. (rounds)",
    "set_size": "Set Size (answers)",
}
#: The marker of the row ``ccpo-jax export`` serves by default.
EXPORT_MARK = "(export's default)"
#: One definition of coverage, said the same way by table.md, route, serve, the gateway and live-eval.
COVERAGE_RULE = "the share of questions whose answer set holds a correct answer"


#: A row misses its coverage target when its mean coverage is below 1 - alpha by more than this many
#: standard errors of the split means (the sweep's rule, ``ccpo_jax.ccpo.frontier.MISS_SE``).
MISS_SE = 2.0


def misses_target(per_split_coverage, alpha: float) -> bool:
    """Whether a row's mean coverage over splits is below ``1 - alpha`` by more than :data:`MISS_SE`
    standard errors of the split means (box plots and frontier mark such rows)."""
    v = np.asarray([np.nan if x is None else x for x in per_split_coverage], np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return False
    se = float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0
    return bool(v.mean() < 1.0 - alpha - MISS_SE * se - 1e-9)


def is_synthetic(results: Mapping[str, Any]) -> bool:
    return results["cache"]["provenance"].get("kind") == "synthetic"


def _fmt(metric: str, x: float | None) -> str:
    if x is None:
        return "n/a"
    if metric == "cost_cents":
        return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    if metric == "coverage":
        return f"{x:.3f}"
    return f"{x:.2f}"


def _fmt_ratio(ratio: Mapping[str, Any] | None, n_seeds: int) -> str:
    """``1.23x`` (``±`` the sd over seeds when there are several), ``-`` for the bound itself."""
    if not ratio:
        return "-"
    if ratio["mean"] is None:
        return "n/a"
    vals = [x for x in ratio["per_seed"] if x is not None]
    sd = f" ±{np.std(vals, ddof=1):.2f}" if len(vals) > 1 else ""
    return f"{ratio['mean']:.2f}x{sd}"


def run_title(results: Mapping[str, Any], setting: Setting | None = None, own_cache: bool = False) -> str:
    """``<setting>: <what was run>`` (:meth:`Setting.run_title`): the paper's table only when
    ``own_cache`` (the setting's synthetic profile), else the custom cache by name."""
    if setting is None:
        return f"{results['setting']} on cache {md_code(results['cache']['name'])}"
    return f"{results['setting']}: {setting.run_title(results['cache']['name'], own_cache, results['alpha'])}"


def n_test(results: Mapping[str, Any], split_sizes: tuple[int, int, int] | None = None) -> int | None:
    """Questions per test split: ``split_sizes`` or results.json's ``split_sizes`` (None for older runs)."""
    sizes = split_sizes or results.get("split_sizes")
    return int(sizes[2]) if sizes else None


def _is_learned(row: str) -> bool:
    """A learned row (CPO, CPO batch, CPO online, the CCPO rows, their twins): one a trainer can make cheaper."""
    return RowId.parse(row).family in (Family.CPO, Family.CCPO)


def _header(results: Mapping[str, Any], setting: Setting | None, split_sizes, compare_paper: bool) -> list[str]:
    """The lines above the table: data warning, run parameters, what the rows are."""
    cache, lines = results["cache"], []
    prov = cache["provenance"]
    if is_synthetic(results):
        gen = ", ".join(f"{printable(k)}={printable(v)}" for k, v in prov.items() if k != "kind")
        lines.append("> **SYNTHETIC DATA.** These numbers come from a synthetic response cache "
                     f"({md_code(cache['name'])}{'; ' + gen if gen else ''}), not from real LLM runs.")
        if compare_paper:
            lines.append("> The paper's values (in parentheses) are shown for side-by-side comparison only.")
        lines.append("")
    if compare_paper and setting is not None and split_sizes is not None and split_sizes[2] != setting.n_test:
        lines += [f"Note: cost is summed over the test set; the paper's costs are for {setting.n_test} test "
                  f"questions, these for {split_sizes[2]}.", ""]
    sizes = f" (train/cal/test = {'/'.join(map(str, split_sizes))})" if split_sizes else ""
    unsolv = cache.get("unsolvable_share")
    lines += [f"- alpha: {results['alpha']:g} (target coverage {1 - results['alpha']:g})",
              f"- protocol: {results['protocol']}", f"- splits: {results['splits']}{sizes}",
              f"- cache: {md_code(cache['name'])} ({printable(prov.get('kind', '?'))}, {cache['n_questions']} "
              f"questions, {printable(cache['checksum'])})"
              + ("" if unsolv is None else f"; unsolvable (no model answers correctly): {100 * unsolv:.1f}%")]
    n_seeds = int(results.get("seeds", 1))
    tc = results.get("train_config") or {}
    if tc:
        dev = deviations_from_dict(tc, PAPER)
        preset = results.get("preset", "default")
        lines.append(f"- learned rows: trainer preset `{preset}`, {n_seeds} training seed{'s' if n_seeds != 1 else ''}; "
                     + (f"it changes the paper's published setting: {deviations_in_words(dev)} (why, with "
                        f"measurements: {PRESETS_LINK})" if dev else "the paper's published trainer setting"))
    if n_seeds > 1:
        lines.append(f"- cells: mean [5%, 95%] over seeds x splits; ±: standard deviation over the {n_seeds} "
                     "seeds of each seed's mean (learned rows)")
    else:
        lines.append("- cells: mean [5%, 95%] over splits")
    lines += twin_notes(results["policies"])
    pick = results.get("export_default")
    if pick:
        lines.append(f"- {EXPORT_MARK}: the row `ccpo-jax export RUN_DIR` serves when no `--row` is given: "
                     f"{pick['why']}")
    lines.append("")
    if BOUND_ROW in results["policies"]:
        lines += [f"- {BOUND_ROW}: the cheapest cost at coverage >= {1 - results['alpha']:g} on each test split "
                  "when every answer is known (not a policy; no router can beat it). Cost / bound: each row's "
                  "mean cost over the bound's.", ""]
    if BEST_OBS_ROW in results["policies"]:
        ref = results["policies"][BEST_OBS_ROW]
        lines += [f"- {BEST_OBS_ROW}: the cheapest policy of the router's observations alone (it stops when a "
                  f"correctness model says a collected answer is right; per-round thresholds chosen on each "
                  f"test split with its labels, so optimistic like the bound, and no router). Form: "
                  f"{md_cell(ref.get('form', '?'))}. Cost / best obs.: each row's mean cost over the reference's.",
                  ""]
    return lines


def _row_cells(row: str, entry: Mapping[str, Any], paper, per_q: int | None, n_seeds: int, with_bound: bool,
               with_ref: bool, pick: str | None) -> list[str]:
    name = md_cell(row) + (" (not a policy)" if entry.get("is_policy") is False else "")
    cells = [f"**{name}** {EXPORT_MARK}" if row == pick else name]
    for m in METRICS:
        s = entry[m]
        cell = f"{_fmt(m, s['mean'])} [{_fmt(m, s['q05'])}, {_fmt(m, s['q95'])}]"
        if s.get("seed_sd") is not None:
            cell += f" ±{_fmt(m, s['seed_sd'])}"
        if paper is not None:
            cell += f" (paper {paper[m]:g})"
        cells.append(cell)
        if m == "cost_cents" and per_q:
            mean = s["mean"]
            cells.append("n/a" if mean is None else _fmt(m, mean / per_q))
    if with_bound:
        cells.append(_fmt_ratio(entry.get("cost_vs_bound"), n_seeds))
    if with_ref:
        cells.append(_fmt_ratio(entry.get("cost_over_best_observable"), n_seeds))
    return cells


def _footer(results: Mapping[str, Any], per_q: int | None) -> list[str]:
    """The lines under the table: what coverage, cost, Avg. Len. and Set Size mean; nothing to save."""
    unsolv = results["cache"].get("unsolvable_share")
    split = f"the {per_q} questions of a test split" if per_q else "a test split's questions"
    lines = ["", f"- Coverage: {COVERAGE_RULE}; a question no model answers correctly (unsolvable"
             + ("" if unsolv is None else f": {100 * unsolv:.1f}% of this cache") + ") counts as covered, as in "
             "the paper, so a row can meet the target while abstaining on such questions.",
             f"- Cost: cents summed over {split} (as the paper's tables)"
             + (", and per question beside it" if per_q else "") + ".",
             "- Avg. Len.: rounds run per question (the deepest round reached; a round is the base's answer and "
             "the guide's judgment). Set Size: distinct answers collected in the answer set (0: abstained)."]
    ratios = [e["cost_vs_bound"]["mean"] for r, e in results["policies"].items()
              if _is_learned(r) and (e.get("cost_vs_bound") or {}).get("mean") is not None]
    floor, bound = results.get("cost_floor_cents"), (results["policies"].get(BOUND_ROW) or {}).get("cost_cents", {})
    if bound.get("mean") is not None and floor is not None and bound["mean"] <= floor * (1 + 1e-6) + 1e-9:
        lines.append(f"- Nothing to save here: the clairvoyant bound ({_fmt('cost_cents', bound['mean'])} cents) is "
                     "what answering every test question at round 1 costs, the least any policy pays; a row at "
                     "1.00x has saved all there was, and a row above it paid for rounds it did not need.")
    elif ratios and all(abs(x - 1.0) < 5e-3 for x in ratios):
        lines.append("- Nothing to save here: every learned row already costs what the clairvoyant bound costs "
                     "(1.00x, the cheapest any router could reach at the target), so the rows differ in coverage "
                     "only.")
    return lines


def format_table(
    results: Mapping[str, Any],
    setting: Setting | None = None,
    split_sizes: tuple[int, int, int] | None = None,
    compare_paper: bool = False,
) -> str:
    """Markdown table in the paper's layout (Policy | Cost | Coverage | Avg. Len. | Set Size), with the
    cost per question after the cost (when the test split's size is known).

    Each cell is ``mean [q05, q95]`` over splits; with ``compare_paper`` and a
    ``setting``, the paper's number follows as ``(paper x)``.
    """
    lines = [f"# {run_title(results, setting, compare_paper)}", ""]
    lines += _header(results, setting, split_sizes, compare_paper)
    per_q = n_test(results, split_sizes)
    n_seeds = int(results.get("seeds", 1))
    with_bound, with_ref = BOUND_ROW in results["policies"], BEST_OBS_ROW in results["policies"]
    titles = [METRIC_TITLES[m] for m in METRICS]
    if per_q:
        titles.insert(1, "Cost (cents per question)")
    header = ["Policy"] + titles + (["Cost / bound"] if with_bound else []) + (["Cost / best obs."] if with_ref else [])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    pick = (results.get("export_default") or {}).get("row")
    for row, entry in results["policies"].items():
        paper = setting.paper_row(row) if (setting is not None and compare_paper) else None
        cells = _row_cells(row, entry, paper, per_q, n_seeds, with_bound, with_ref, pick)
        lines.append("| " + " | ".join(cells) + " |")
    lines += _footer(results, per_q)
    if setting is not None and compare_paper:
        have = {row_key(x) for x in results["policies"]}
        absent = [r for r in setting.paper if row_key(r) not in have]
        if absent:
            lines += ["", f"Paper rows absent here (the cache lacks their data or they were not run): "
                          f"{', '.join(absent)}."]
    t = results["timing"]
    lines += ["", f"Timing: total {t['total_s']:.1f} s (compile {t['compile_s']:.1f} s, train {t['train_s']:.1f} s, "
                  f"eval {t['eval_s']:.1f} s{_ref_time(t)}) on {results['environment']['backend']}."]
    return "\n".join(lines) + "\n"


def _ref_time(timing: Mapping[str, Any]) -> str:
    s = timing.get("best_observable_s")
    return "" if s is None else f", of which the best observable reference {s:.1f} s"
