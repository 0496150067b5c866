"""Outputs of ``ccpo-jax reproduce``: results.json, table.md, box plots.

The schema of ``results.json`` (documented in docs/reproduce.md, "Outputs"; scripts read it)::

    {"setting", "alpha", "protocol", "splits",
     "cache": {"name", "provenance", "checksum", "n_questions"},
     "policies": {"<row>": {"cost_cents": {"mean", "median", "q05", "q95"}, "coverage": {...},
                            "avg_len": {...}, "set_size": {...},
                            "per_split": {"cost_cents": [...], ...}, "per_seed": {...}, "seeds",
                            "cost_vs_bound": {"mean", "per_seed": [...]},
                            "cost_over_best_observable": {"mean", "per_seed": [...]}},
                  "Clairvoyant bound": {..., "is_policy": false},
                  "Best observable": {..., "is_policy": false, "form", "models", ...}},
     "timing": {"total_s", "compile_s", "train_s", "eval_s"},
     "environment": {"jax", "backend", "devices"}}

Summary statistics over splits (as the CCPO paper's box plots over 100 random
evaluation splits, arXiv 2511.11828 §5, Figs. 2-9): mean, median and the
5 % / 95 % quantiles (``numpy.quantile``'s default linear interpolation).
Non-finite values are written as JSON ``null`` and left out of the statistics. Every file is written under a temporary name
and renamed into place.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from ccpo_jax.ccpo.observable import BEST_OBS_ROW, add_cost_over_best_observable
from ccpo_jax.ccpo.presets import PAPER, deviations_from_dict
from ccpo_jax.ccpo.settings import METRICS, Setting, row_key, row_order_key, twin_notes
from ccpo_jax.ccpo.summary import (COUNT_METRICS, _nanmean, exact_totals, policy_entry,  # noqa: F401 (report.X
                                   seed_stats, summary_stats)  # is where callers found them)
from envs.cache.atomic import atomic_path, atomic_write_json, atomic_write_text
from envs.replay.bound import BOUND_ROW
from envs.cache.values import md_cell, md_code, printable

METRIC_TITLES = {
    "cost_cents": "Cost (cents)",
    "coverage": "Coverage",
    "avg_len": "Avg. Len.",
    "set_size": "Set Size",
}
RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
COST_PNG = "boxplot_cost.png"
COVERAGE_PNG = "boxplot_coverage.png"
TIMING_KEYS = ("total_s", "compile_s", "train_s", "eval_s")


# -- results.json ---------------------------------------------------------------

def add_cost_vs_bound(policies: dict[str, dict[str, Any]]) -> None:
    """Mark the clairvoyant bound's row (``is_policy: false``) and give every other row its
    ``cost_vs_bound``: the row's mean cost over splits divided by the bound's mean over the same
    splits, per training seed (``per_seed``) and their ``mean``. Nothing when there is no bound."""
    if BOUND_ROW not in policies:
        return
    policies[BOUND_ROW]["is_policy"] = False
    bound = policies[BOUND_ROW]["cost_cents"]["mean"]
    for name, entry in policies.items():
        if name == BOUND_ROW:
            continue
        per_seed = [None if (x is None or not bound) else x / bound for x in entry["per_seed"]["cost_cents"]]
        finite = [x for x in per_seed if x is not None]
        entry["cost_vs_bound"] = {"mean": float(np.mean(finite)) if finite else None, "per_seed": per_seed}


def cache_info(cache) -> dict[str, Any]:
    """The ``cache`` block of results.json for an ``envs.cache.schema.ResponseCache``."""
    return {
        "name": cache.manifest.name,
        "provenance": dict(cache.manifest.provenance),
        "checksum": cache.manifest.checksum or cache.checksum(),
        "n_questions": int(cache.n_questions),
    }


def environment_info() -> dict[str, Any]:
    """jax version, default backend and the devices (``platform:id (kind)``)."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices()],
    }


def build_results(
    *,
    setting: str,
    alpha: float,
    protocol: str,
    n_splits: int,
    cache: Mapping[str, Any],
    rows: Mapping[str, Mapping[str, Any]],
    timing: Mapping[str, float],
    environment: Mapping[str, Any] | None = None,
    seeds: int = 1,
    preset: str = "default",
    train_config: Mapping[str, Any] | None = None,
    n_test: int | None = None,
) -> dict[str, Any]:
    """The results.json dict (module docstring; docs/reproduce.md). ``rows``: row -> metric -> array [S], in paper
    order; ``n_test``: the test questions of a split (the exact per-split values of :func:`policy_entry`)."""
    policies = {
        name: policy_entry(rows[name], n_splits, name, n_test) for name in sorted(rows, key=row_order_key)
    }
    add_cost_vs_bound(policies)
    add_cost_over_best_observable(policies, BOUND_ROW)
    return {
        "setting": str(setting),
        "alpha": float(alpha),
        "protocol": str(protocol),
        "splits": int(n_splits),
        "seeds": int(seeds),
        "preset": str(preset),
        "train_config": json.loads(json.dumps(dict(train_config or {}))),  # tuples as lists, as read back
        "cache": {k: cache[k] for k in ("name", "provenance", "checksum", "n_questions")},
        "policies": policies,
        "timing": {k: float(timing.get(k, 0.0)) for k in TIMING_KEYS},
        "environment": dict(environment if environment is not None else environment_info()),
    }


def write_results(out_dir: str | os.PathLike, results: Mapping[str, Any]) -> Path:
    """Write ``out_dir/results.json`` atomically (strict JSON: no NaN)."""
    return atomic_write_json(Path(out_dir) / RESULTS_FILE, results, indent=2, allow_nan=False)


# -- table.md -------------------------------------------------------------------

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


def format_table(
    results: Mapping[str, Any],
    setting: Setting | None = None,
    split_sizes: tuple[int, int, int] | None = None,
    compare_paper: bool = False,
) -> str:
    """Markdown table in the paper's layout (Policy | Cost (cents) | Coverage | Avg. Len. | Set Size).

    Each cell is ``mean [q05, q95]`` over splits; with ``compare_paper`` and a
    ``setting``, the paper's number follows as ``(paper x)``.
    """
    lines: list[str] = []
    cache = results["cache"]
    prov = cache["provenance"]
    lines.append(f"# {run_title(results, setting, compare_paper)}")
    lines.append("")
    if is_synthetic(results):
        gen = ", ".join(f"{printable(k)}={printable(v)}" for k, v in prov.items() if k != "kind")
        lines.append(
            "> **SYNTHETIC DATA.** These numbers come from a synthetic response cache "
            f"({md_code(cache['name'])}{'; ' + gen if gen else ''}), not from real LLM runs."
        )
        if compare_paper:
            lines.append("> The paper's values (in parentheses) are shown for side-by-side comparison only.")
        lines.append("")
    if compare_paper and setting is not None and split_sizes is not None and split_sizes[2] != setting.n_test:
        lines.append(
            f"Note: cost is summed over the test set; the paper's costs are for {setting.n_test} test "
            f"questions, these for {split_sizes[2]}."
        )
        lines.append("")
    sizes = f" (train/cal/test = {'/'.join(map(str, split_sizes))})" if split_sizes else ""
    lines.append(f"- alpha: {results['alpha']:g} (target coverage {1 - results['alpha']:g})")
    lines.append(f"- protocol: {results['protocol']}")
    lines.append(f"- splits: {results['splits']}{sizes}")
    lines.append(
        f"- cache: {md_code(cache['name'])} ({printable(prov.get('kind', '?'))}, {cache['n_questions']} questions, "
        f"{printable(cache['checksum'])})"
    )
    n_seeds = int(results.get("seeds", 1))
    tc = results.get("train_config") or {}
    if tc:
        dev = deviations_from_dict(tc, PAPER)
        if dev:
            lines.append(f"- learned rows go beyond the paper's published setting (preset `{results.get('preset')}`): "
                         + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(dev.items()))
                         + (" (estimator exact: replay-exact expected cost and coverage, not the paper's sampled J-bar)"
                            if tc.get("estimator") == "exact" else ""))
        else:
            lines.append("- learned rows: the paper's published trainer setting (preset `paper`)")
    if n_seeds > 1:
        lines.append(f"- learned rows: {n_seeds} training seeds, trainer preset `{results.get('preset', 'default')}`")
        lines.append(f"- cells: mean [5%, 95%] over seeds x splits; ±: standard deviation over the {n_seeds} "
                     "seeds of each seed's mean (learned rows)")
    else:
        lines.append("- cells: mean [5%, 95%] over splits")
    lines += twin_notes(results["policies"])
    lines.append("")
    with_bound = BOUND_ROW in results["policies"]
    if with_bound:
        lines.append(f"- {BOUND_ROW}: the cheapest cost at coverage >= {1 - results['alpha']:g} on each test split "
                     "when every answer is known (not a policy; no router can beat it). Cost / bound: each row's "
                     "mean cost over the bound's.")
        lines.append("")
    with_ref = BEST_OBS_ROW in results["policies"]
    if with_ref:
        ref = results["policies"][BEST_OBS_ROW]
        lines.append(f"- {BEST_OBS_ROW}: the cheapest policy of the router's observations alone (it stops when a "
                     f"correctness model says a collected answer is right; per-round thresholds chosen on each "
                     f"test split with its labels, so optimistic like the bound, and no router). Form: "
                     f"{md_cell(ref.get('form', '?'))}. Cost / best obs.: each row's mean cost over the reference's.")
        lines.append("")
    header = (["Policy"] + [METRIC_TITLES[m] for m in METRICS] + (["Cost / bound"] if with_bound else [])
              + (["Cost / best obs."] if with_ref else []))
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row, entry in results["policies"].items():
        paper = setting.paper_row(row) if (setting is not None and compare_paper) else None
        cells = [md_cell(row) + (" (not a policy)" if entry.get("is_policy") is False else "")]
        for m in METRICS:
            s = entry[m]
            cell = f"{_fmt(m, s['mean'])} [{_fmt(m, s['q05'])}, {_fmt(m, s['q95'])}]"
            if s.get("seed_sd") is not None:
                cell += f" ±{_fmt(m, s['seed_sd'])}"
            if paper is not None:
                cell += f" (paper {paper[m]:g})"
            cells.append(cell)
        if with_bound:
            cells.append(_fmt_ratio(entry.get("cost_vs_bound"), n_seeds))
        if with_ref:
            cells.append(_fmt_ratio(entry.get("cost_over_best_observable"), n_seeds))
        lines.append("| " + " | ".join(cells) + " |")
    if setting is not None and compare_paper:
        have = {row_key(x) for x in results["policies"]}
        absent = [r for r in setting.paper if row_key(r) not in have]
        if absent:
            lines.append("")
            lines.append(f"Paper rows absent here (the cache lacks their data or they were not run): {', '.join(absent)}.")
    t = results["timing"]
    lines.append("")
    lines.append(
        f"Timing: total {t['total_s']:.1f} s (compile {t['compile_s']:.1f} s, train {t['train_s']:.1f} s, "
        f"eval {t['eval_s']:.1f} s{_ref_time(t)}) on {results['environment']['backend']}."
    )
    return "\n".join(lines) + "\n"


def _ref_time(timing: Mapping[str, Any]) -> str:
    s = timing.get("best_observable_s")
    return "" if s is None else f", of which the best observable reference {s:.1f} s"


def write_table(
    out_dir: str | os.PathLike,
    results: Mapping[str, Any],
    setting: Setting | None = None,
    split_sizes: tuple[int, int, int] | None = None,
    compare_paper: bool = False,
) -> Path:
    """Write ``out_dir/table.md`` (see :func:`format_table`) atomically."""
    return atomic_write_text(Path(out_dir) / TABLE_FILE, format_table(results, setting, split_sizes, compare_paper))


# -- box plots ------------------------------------------------------------------

def _is_exit_row(row: str) -> bool:
    return row.endswith(" EXIT")


def cost_panels(rows: list[str]) -> list[tuple[list[str], bool]]:
    """The cost plot's panels as (rows, is_exit): the EXIT rows apart from the rest, if both exist."""
    exit_rows = [r for r in rows if _is_exit_row(r)]
    other = [r for r in rows if r not in exit_rows]
    if exit_rows and other:
        return [(exit_rows, True), (other, False)]
    return [(exit_rows or other, bool(exit_rows))]


def _box_panel(ax, rows: list[str], data: list[np.ndarray], annotate: bool = False) -> None:
    ax.boxplot(data, tick_labels=[printable(r) for r in rows], whis=(5, 95), showfliers=True)
    ax.tick_params(axis="x", labelrotation=45)
    for lab in ax.get_xticklabels():
        lab.set_horizontalalignment("right")
    if annotate:  # EXIT rows: say the mean, so a box sitting at 0 is read as 0, not as missing
        for k, d in enumerate(data, start=1):
            if np.isfinite(d).any():
                ax.annotate(f"mean {np.nanmean(d):.4g}", (k, float(np.nanmax(d))), textcoords="offset points",
                            xytext=(0, 4), ha="center", fontsize=7)


def write_boxplots(
    out_dir: str | os.PathLike,
    results: Mapping[str, Any],
    setting: Setting | None = None,
    own_cache: bool = False,
) -> list[Path]:
    """Box plots of cost and coverage over splits, one box per row (as the paper's Figs 2-9).

    The coverage plot has a dashed line at 1 - alpha; the cost plot draws the clairvoyant bound's
    mean cost as a red dashed line and the best observable reference's as a purple dotted one (they
    are not policies, so they get no box). The cost plot puts the EXIT rows
    (single-LLM runs, ~100x the others' cost) in a panel of their own, so every other row
    gets a readable linear axis; both axes are linear. Titles name the run as
    :func:`run_title` does. Uses the Agg canvas directly (no global pyplot state).
    Returns the two PNG paths.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    rows = [r for r in results["policies"] if results["policies"][r].get("is_policy", True)]
    bound = results["policies"].get(BOUND_ROW)
    synth = " [SYNTHETIC cache]" if is_synthetic(results) else ""
    title = run_title(results, setting, own_cache)
    paths = []
    for metric, fname in (("cost_cents", COST_PNG), ("coverage", COVERAGE_PNG)):
        data = {}
        for r in rows:
            v = np.asarray([x for x in results["policies"][r]["per_split"][metric] if x is not None], float)
            data[r] = v if v.size else np.array([np.nan])
        panels = cost_panels(rows) if metric == "cost_cents" else [(rows, False)]
        width = max(6.0, 0.8 * len(rows) + 2 + (1.0 if len(panels) > 1 else 0.0))
        fig = Figure(figsize=(width, 5.0))
        FigureCanvasAgg(fig)
        ratios = [max(len(p), 1) + 0.6 for p, _ in panels]
        axes = fig.subplots(1, len(panels), gridspec_kw={"width_ratios": ratios}, squeeze=False)[0]
        for ax, (prow, is_exit) in zip(axes, panels):
            if prow:
                _box_panel(ax, prow, [data[r] for r in prow], annotate=is_exit)
            ax.set_ylabel(METRIC_TITLES[metric] + (" (EXIT rows)" if is_exit and len(panels) > 1 else ""))
            if metric == "cost_cents":
                vals = np.concatenate([data[r] for r in prow]) if prow else np.array([])
                vals = vals[np.isfinite(vals)]
                top = float(vals.max()) if vals.size else 1.0
                top = top if top > 0 else 1.0
                # linear; start just below 0 so a row at 0 (a free model's EXIT run) shows as a box
                ax.set_ylim(-0.04 * top, top * (1.15 if is_exit else 1.05))
                if bound is not None and not is_exit and bound["cost_cents"]["mean"] is not None:
                    ax.axhline(bound["cost_cents"]["mean"], color="tab:red", linestyle="--", linewidth=1,
                               label=f"{BOUND_ROW} (mean {bound['cost_cents']['mean']:.4g}; not a policy)")
                    ax.legend(loc="upper right", fontsize=7)
                ref = results["policies"].get(BEST_OBS_ROW)
                if ref is not None and not is_exit and ref["cost_cents"]["mean"] is not None:
                    ax.axhline(ref["cost_cents"]["mean"], color="tab:purple", linestyle=":", linewidth=1.2,
                               label=f"{BEST_OBS_ROW} (mean {ref['cost_cents']['mean']:.4g}; not a policy)")
                    ax.legend(loc="upper right", fontsize=7)
        if metric == "coverage":
            ax = axes[0]
            ax.axhline(1 - results["alpha"], color="k", linestyle="--", linewidth=1,
                       label=f"1 - alpha = {1 - results['alpha']:g}")
            ax.legend(loc="lower right")
        fig.suptitle(
            f"{title}\n{METRIC_TITLES[metric].lower()} over {results['splits']} splits (whiskers 5-95%){synth}",
            fontsize=8,
        )
        fig.tight_layout()
        path = out_dir / fname
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        paths.append(path)
    return paths


# -- group-conditional coverage (--calibration mondrian) -------------------------------------

GROUP_PNG = "group_coverage.png"
#: A group counts as under-covered when its mean coverage is below 1 - alpha - this.
GROUP_SLACK = 0.05


def group_entry(coverage: np.ndarray, cost: np.ndarray, n_cal: np.ndarray, n_test: np.ndarray, own: np.ndarray,
                kappa: np.ndarray, names: list[str], alpha: float) -> tuple[dict, dict]:
    """One row's per-group outcome: ``{group: {coverage, cost_cents (summary_stats + seed spread),
    n_cal, n_test (mean over splits), own_share, kappa}}`` and the summary over groups of the
    mean coverages (min with its group, median, how many below ``1 - alpha - GROUP_SLACK``).
    Arrays are [N seeds, S splits, G] (``n_cal``/``n_test`` [S, G])."""
    groups: dict[str, Any] = {}
    means = []
    for g, name in enumerate(names):
        entry = {}
        for metric, v in (("coverage", coverage[..., g]), ("cost_cents", cost[..., g])):
            v = np.asarray(v, np.float64).reshape(coverage.shape[0], -1)
            entry[metric] = {**summary_stats(v), **seed_stats(_nanmean(v, axis=1))}
        entry["n_cal"] = float(np.mean(n_cal[:, g]))
        entry["n_test"] = float(np.mean(n_test[:, g]))
        entry["own_share"] = float(np.mean(own[..., g]))
        entry["kappa"] = summary_stats(kappa[..., g])["mean"]
        groups[name] = entry
        means.append(entry["coverage"]["mean"])
    m = np.asarray([np.nan if x is None else x for x in means], np.float64)
    ok = np.isfinite(m)
    worst = int(np.nanargmin(m)) if ok.any() else None
    summary = {
        "n_groups": len(names),
        "min": None if worst is None else float(m[worst]),
        "min_group": None if worst is None else names[worst],
        "median": float(np.median(m[ok])) if ok.any() else None,
        "below": int(np.sum(m[ok] < 1 - alpha - GROUP_SLACK)),
        "below_threshold": float(1 - alpha - GROUP_SLACK),
    }
    return groups, summary


def add_groups(results: dict, group_rows: Mapping[str, Any], alpha: float) -> None:
    """Add ``groups`` and ``group_summary`` to every calibrated row of ``results["policies"]``
    (and to its ``[Mondrian]`` twin), and to each twin ``mondrian_extra_cost``: its mean cost minus
    the marginal row's (cents summed over the test split; mean and sd over seeds)."""
    names = list(group_rows["names"])
    n_cal, n_test = np.asarray(group_rows["n_cal"]), np.asarray(group_rows["n_test"])
    pol = results["policies"]
    for row, d in group_rows["rows"].items():
        if row not in pol:
            continue
        pol[row]["groups"], pol[row]["group_summary"] = group_entry(
            np.asarray(d["coverage"]), np.asarray(d["cost_cents"]), n_cal, n_test, np.asarray(d["own"]),
            np.asarray(d["kappa"]), names, alpha)
    for row in list(pol):
        base = row[: -len(" [Mondrian]")] if row.endswith(" [Mondrian]") else None
        if base in pol:
            a = np.asarray([x for x in pol[row]["per_seed"]["cost_cents"]], np.float64)
            b = np.asarray([x for x in pol[base]["per_seed"]["cost_cents"]], np.float64)
            diff = a - b
            pol[row]["mondrian_extra_cost"] = {
                "mean": float(np.mean(diff)), "seed_sd": float(np.std(diff, ddof=1)) if diff.size > 1 else None,
                "ratio": float(np.mean(a) / np.mean(b)) if np.mean(b) > 0 else None}


def format_groups(results: Mapping[str, Any]) -> str:
    """table.md's section on group-conditional coverage: how the groups were pooled, then per
    calibrated row (marginal) and its Mondrian twin: coverage min (group) / median over groups,
    groups below 1 - alpha - 0.05, cost and what Mondrian costs extra."""
    cal = results["calibration"]
    lines = ["", "## Group-conditional coverage (--calibration mondrian)", "",
             f"- {cal['n_groups']} question groups; a group with at least {cal['group_min']} of the "
             f"{cal['n_cal']} calibration questions gets its own threshold: {cal['own_groups']['mean']:.1f} groups "
             f"on average over splits ({cal['own_groups']['min']}-{cal['own_groups']['max']}); "
             f"{cal['pooled_groups']['mean']:.2f} groups with {cal['pooled_questions']['mean']:.1f} calibration "
             "questions pooled into one 'rest' group (a rest without questions uses the marginal threshold).",
             "- coverage per group: the mean over seeds x splits of the group's test questions; min and "
             "median are over groups.", ""]
    rows = [r for r, e in results["policies"].items() if "group_summary" in e]
    if not rows:
        lines.append("No calibrated learned row in this run (nothing calibrated per group).")
        return "\n".join(lines) + "\n"
    thr = results["policies"][rows[0]]["group_summary"]["below_threshold"]
    lines.append(f"| Row | Cost (cents) | Coverage | Group coverage min (group) | median | groups < {thr:.2f} | "
                 "Mondrian extra cost |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        e = results["policies"][r]
        gs = e["group_summary"]
        extra = e.get("mondrian_extra_cost")
        ex = "-" if not extra else (f"{extra['mean']:+.4g}" + (f" ±{extra['seed_sd']:.2g}" if extra['seed_sd'] else "")
                                     + (f" ({extra['ratio']:.3f}x)" if extra.get("ratio") else ""))
        lines.append(f"| {md_cell(r)} | {_fmt('cost_cents', e['cost_cents']['mean'])} | "
                     f"{_fmt('coverage', e['coverage']['mean'])} | {_fmt('coverage', gs['min'])} ({md_cell(gs['min_group'])}) | {_fmt('coverage', gs['median'])} | "
                     f"{gs['below']} of {gs['n_groups']} | {ex} |")
    lines.append("")
    lines.append(f"Per-group coverage: `{GROUP_PNG}` and results.json (`policies.ROW.groups`).")
    return "\n".join(lines) + "\n"


def write_group_plot(out_dir: str | os.PathLike, results: Mapping[str, Any]) -> Path:
    """group_coverage.png: per calibrated row, each group's mean coverage under the marginal
    threshold and under Mondrian (groups sorted by the marginal coverage), 1 - alpha dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pol = results["policies"]
    bases = [r for r in pol if "groups" in pol[r] and not r.endswith(" [Mondrian]") and r + " [Mondrian]" in pol]
    n = max(len(bases), 1)
    G = results["calibration"]["n_groups"]
    fig = Figure(figsize=(max(6.0, 0.14 * G + 3), 2.6 * n + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, row in zip(axes, bases):
        names = list(pol[row]["groups"])
        marg = np.asarray([np.nan if pol[row]["groups"][g]["coverage"]["mean"] is None
                           else pol[row]["groups"][g]["coverage"]["mean"] for g in names])
        mond = np.asarray([np.nan if pol[row + " [Mondrian]"]["groups"][g]["coverage"]["mean"] is None
                           else pol[row + " [Mondrian]"]["groups"][g]["coverage"]["mean"] for g in names])
        order = np.argsort(np.where(np.isfinite(marg), marg, np.inf), kind="stable")
        x = np.arange(len(names))
        ax.plot(x, marg[order], "o", color="tab:orange", ms=4, label="marginal threshold")
        ax.plot(x, mond[order], "o", color="tab:blue", ms=4, mfc="none", label="Mondrian (per group)")
        ax.axhline(1 - results["alpha"], color="k", ls="--", lw=1, label=f"1 - alpha = {1 - results['alpha']:g}")
        ax.set_ylabel("coverage")
        both = np.concatenate([marg, mond])
        lo = float(np.nanmin(both)) if np.isfinite(both).any() else 0.0
        ax.set_ylim(min(lo - 0.02, 1 - results["alpha"] - 0.1), 1.005)  # the whole range above the worst group
        ax.set_title(printable(row), fontsize=8)
        if len(names) <= 12:
            ax.set_xticks(x, [names[i] for i in order], fontsize=7)
        else:
            ax.set_xticks([])
            ax.set_xlabel(f"{len(names)} groups, sorted by coverage under the marginal threshold", fontsize=7)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    synth = " [SYNTHETIC cache]" if is_synthetic(results) else ""
    fig.suptitle(f"{run_title(results)}\nper-group coverage over {results['splits']} splits{synth}", fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / GROUP_PNG
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path
