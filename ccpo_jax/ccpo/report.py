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
from ccpo_jax.ccpo.rowid import Family, RowId, Twin
from ccpo_jax.ccpo.settings import METRICS, Setting
from ccpo_jax.ccpo.summary import (COUNT_METRICS, _nanmean, exact_totals, policy_entry,  # noqa: F401 (report.X
                                   seed_stats, summary_stats)  # is where callers found them)
from ccpo_jax.ccpo.table import (MISS_SE, METRIC_TITLES, _fmt, format_table, is_synthetic,  # noqa: F401 - table.md's
                                 misses_target, run_title)  # code moved to ccpo_jax.ccpo.table; read from here too
from envs.cache.atomic import atomic_path, atomic_write_json, atomic_write_text
from envs.replay.bound import BOUND_ROW
from envs.cache.values import md_cell, printable

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
        # no answer of any round is correct: such a question counts as covered (table.md says how many)
        "unsolvable_share": float(np.mean(np.asarray(cache.unsolvable))) if cache.n_questions else None,
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
    split_sizes: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """The results.json dict (module docstring; docs/reproduce.md). ``rows``: row -> metric -> array [S], in paper
    order; ``n_test``: the test questions of a split (the exact per-split values of :func:`policy_entry`)."""
    policies = {
        name: policy_entry(rows[name], n_splits, name, n_test) for name in sorted(rows, key=lambda n: RowId.parse(n).sort_key())
    }
    add_cost_vs_bound(policies)
    add_cost_over_best_observable(policies, BOUND_ROW)
    return {
        "setting": str(setting),
        "alpha": float(alpha),
        "protocol": str(protocol),
        "splits": int(n_splits),
        **({"split_sizes": [int(x) for x in split_sizes]} if split_sizes is not None else {}),
        "seeds": int(seeds),
        "preset": str(preset),
        "train_config": json.loads(json.dumps(dict(train_config or {}))),  # tuples as lists, as read back
        "cache": {k: cache[k] for k in ("name", "provenance", "checksum", "n_questions", "unsolvable_share")
                  if k in cache},
        "policies": policies,
        "timing": {k: float(timing.get(k, 0.0)) for k in TIMING_KEYS},
        "environment": dict(environment if environment is not None else environment_info()),
    }


def write_results(out_dir: str | os.PathLike, results: Mapping[str, Any]) -> Path:
    """Write ``out_dir/results.json`` atomically (strict JSON: no NaN)."""
    return atomic_write_json(Path(out_dir) / RESULTS_FILE, results, indent=2, allow_nan=False)


# -- table.md (ccpo_jax.ccpo.table) ----------------------------------------------------

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
    rid = RowId.parse(row)
    return rid.family is Family.EXIT and rid.twin is None


def cost_panels(rows: list[str]) -> list[tuple[list[str], bool]]:
    """The cost plot's panels as (rows, is_exit): the EXIT rows apart from the rest, if both exist."""
    exit_rows = [r for r in rows if _is_exit_row(r)]
    other = [r for r in rows if r not in exit_rows]
    if exit_rows and other:
        return [(exit_rows, True), (other, False)]
    return [(exit_rows or other, bool(exit_rows))]


MISS_FACE = "mistyrose"


def _box_panel(ax, rows: list[str], data: list[np.ndarray], annotate: bool = False,
               missed: frozenset[str] = frozenset()) -> None:
    """One panel of boxes; a row in ``missed`` (its coverage misses the target) gets a red box and a red
    tick label, so a cheap box that does not cover is not read as a good one."""
    bp = ax.boxplot(data, tick_labels=[printable(r) + (" (misses coverage)" if r in missed else "") for r in rows],
                    whis=(5, 95), showfliers=True, patch_artist=True)
    for r, box in zip(rows, bp["boxes"]):
        box.set_facecolor(MISS_FACE if r in missed else "white")
        box.set_edgecolor("tab:red" if r in missed else "black")
    ax.tick_params(axis="x", labelrotation=45)
    for r, lab in zip(rows, ax.get_xticklabels()):
        lab.set_horizontalalignment("right")
        if r in missed:
            lab.set_color("tab:red")
    if annotate:  # EXIT rows: say the mean, so a box sitting at 0 is read as 0, not as missing
        for k, d in enumerate(data, start=1):
            if np.isfinite(d).any():
                ax.annotate(f"mean {np.nanmean(d):.4g} cents", (k, float(np.nanmax(d))), textcoords="offset points",
                            xytext=(0, 4), ha="center", fontsize=7)


def preload_plotting() -> None:
    """Import what :func:`write_boxplots` draws with, so that a thread can pay for it while the main one waits
    on the training (``ccpo_jax.ccpo.reproduce``); importing changes nothing the plots show."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401


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
    missed = frozenset(r for r in rows if misses_target(results["policies"][r]["per_split"]["coverage"],
                                                        results["alpha"]))
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
                _box_panel(ax, prow, [data[r] for r in prow], annotate=is_exit, missed=missed)
            ax.set_ylabel(METRIC_TITLES[metric] + (" (EXIT rows)" if is_exit and len(panels) > 1 else ""))
            if metric == "cost_cents":
                vals = np.concatenate([data[r] for r in prow]) if prow else np.array([])
                vals = vals[np.isfinite(vals)]
                top = float(vals.max()) if vals.size else 1.0
                top = top if top > 0 else 1.0
                # linear; start just below 0 so a row at 0 (a free model's EXIT run) shows as a box
                ax.set_ylim(-0.04 * top, top * (1.15 if is_exit else 1.3))  # room for the legend
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
                       label=f"target 1 - alpha = {1 - results['alpha']:g}")
        if missed:  # say what a red box means, in the panel that has the legend
            from matplotlib.patches import Patch

            ax = axes[-1]
            handles, labels = ax.get_legend_handles_labels()
            handles.append(Patch(facecolor=MISS_FACE, edgecolor="tab:red"))
            labels.append(f"misses the coverage target (mean below {1 - results['alpha']:g} by more than "
                          f"{MISS_SE:g} standard errors)")
            ax.legend(handles, labels, loc="upper right" if metric == "cost_cents" else "lower right", fontsize=7)
        elif metric == "coverage":
            axes[0].legend(loc="lower right")
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
        rid = RowId.parse(row)
        base = rid.base.name if rid.twin is Twin.MONDRIAN else None
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
    twin = {r: RowId.parse(r).twin_of(Twin.MONDRIAN).name for r in pol}
    bases = [r for r in pol if "groups" in pol[r] and RowId.parse(r).twin is not Twin.MONDRIAN and twin[r] in pol]
    n = max(len(bases), 1)
    G = results["calibration"]["n_groups"]
    fig = Figure(figsize=(max(6.0, 0.14 * G + 3), 2.6 * n + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, row in zip(axes, bases):
        names = list(pol[row]["groups"])
        marg = np.asarray([np.nan if pol[row]["groups"][g]["coverage"]["mean"] is None
                           else pol[row]["groups"][g]["coverage"]["mean"] for g in names])
        mond = np.asarray([np.nan if pol[twin[row]]["groups"][g]["coverage"]["mean"] is None
                           else pol[twin[row]]["groups"][g]["coverage"]["mean"] for g in names])
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
