"""The cost-coverage frontier of a sweep: ``frontier.json``, ``frontier.md`` and ``frontier.png``.

A sweep (:mod:`ccpo_jax.ccpo.sweep`) gives every row of a results table at every alpha of its
grid: ``{alpha: {row: {metric: [N seeds, S splits]}}}``. :func:`build_frontier` turns that into
one point per (row, alpha) with ``alpha``, ``lambda``, the target coverage, and ``cost_cents``,
``coverage``, ``set_size`` and ``cost_vs_bound``, each ``{mean, seed_sd, q05, q95}`` over seeds and
splits; a point whose mean coverage is below the target by more than two standard errors of the
split means is marked ``meets_target: false``. Each row gets a one-number summary: its mean cost
over the grid and the ratio of that to the clairvoyant bound's (docs/reproduce.md, "Sweeps").
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ccpo_jax.ccpo.report import environment_info
from ccpo_jax.ccpo.rowid import RowId, Twin
from envs.cache.atomic import atomic_path, atomic_write_json, atomic_write_text
from ccpo_jax.ccpo.observable import BEST_OBS_ROW
from envs.replay.bound import BOUND_ROW
from envs.cache.values import md_cell, printable

FRONTIER_JSON = "frontier.json"
FRONTIER_MD = "frontier.md"
FRONTIER_PNG = "frontier.png"
POINT_METRICS = ("cost_cents", "coverage", "set_size")
#: A point misses its target when its mean coverage is below 1 - alpha by more than this many
#: standard errors of the mean over splits.
MISS_SE = 2.0


def _num(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _ns(v: Any) -> np.ndarray:
    """A metric as float [N seeds, S splits] ([S] is one seed)."""
    v = np.asarray(v, np.float64)
    return v.reshape(1, -1) if v.ndim <= 1 else v.reshape(v.shape[0], -1)


def point_stats(v: Any) -> dict[str, float | None]:
    """mean, seed_sd (sd of the per-seed means, ddof 1; None for one seed), q05, q95 of ``v`` [N, S]."""
    v = _ns(v)
    flat = v[np.isfinite(v)]
    if flat.size == 0:
        return {"mean": None, "seed_sd": None, "q05": None, "q95": None}
    per_seed = np.array([np.mean(r[np.isfinite(r)]) for r in v if np.isfinite(r).any()])
    return {"mean": float(flat.mean()), "seed_sd": float(np.std(per_seed, ddof=1)) if per_seed.size > 1 else None,
            "q05": float(np.quantile(flat, 0.05)), "q95": float(np.quantile(flat, 0.95))}


def row_lambda(row: str) -> float:
    """The set-size penalty of a row: a CCPO row's (or its twin's) lambda (``CCPO (lambda=2e-4)``), 0 otherwise."""
    return RowId.parse(row).lam


def build_frontier(grid: Mapping[float, Mapping[str, Mapping[str, Any]]], *, setting: str, cache: dict,
                   protocol: str, n_splits: int, seeds: int, lambdas: tuple[float, ...], preset: str,
                   train_config: dict | None, timing: dict, learned: tuple[str, ...]) -> dict[str, Any]:
    """frontier.json's content from ``grid`` = ``{alpha: {row: {metric: [N, S]}}}`` (every alpha
    holds the same rows; the bound's row is ``envs.replay.bound.BOUND_ROW``)."""
    alphas = sorted(float(a) for a in grid)
    names = list(grid[alphas[0]])
    rows: dict[str, Any] = {}
    for name in names:
        points = []
        for a in alphas:
            m = grid[a][name]
            cost, cov = _ns(m["cost_cents"]), _ns(m["coverage"])
            bound = _ns(grid[a][BOUND_ROW]["cost_cents"]).mean(0) if BOUND_ROW in grid[a] else np.ones(1)
            ref = _ns(grid[a][BEST_OBS_ROW]["cost_cents"]).mean(0) if BEST_OBS_ROW in grid[a] else None
            pt = {"alpha": a, "lambda": row_lambda(name), "target": 1.0 - a}
            for k in POINT_METRICS:
                pt[k] = point_stats(m[k])
            if name != BOUND_ROW:
                pt["cost_vs_bound"] = point_stats(cost.mean(axis=1, keepdims=True) / max(float(bound.mean()), 1e-12))
                if ref is not None and name != BEST_OBS_ROW:
                    pt["cost_over_best_observable"] = point_stats(cost.mean(axis=1, keepdims=True)
                                                                  / max(float(ref.mean()), 1e-12))
                split_cov = np.nanmean(cov, axis=0)
                se = float(np.std(split_cov, ddof=1) / math.sqrt(split_cov.size)) if split_cov.size > 1 else 0.0
                pt["meets_target"] = bool(float(np.nanmean(cov)) >= 1.0 - a - MISS_SE * se - 1e-9)
            points.append(pt)
        mean_cost = float(np.mean([p["cost_cents"]["mean"] for p in points]))
        entry: dict[str, Any] = {"is_policy": RowId.parse(name).is_policy, "learned": name in learned,
                                 "points": points,
                                 "summary": {"mean_cost_cents": mean_cost}}
        if name != BOUND_ROW:
            entry["misses_target_at"] = [p["alpha"] for p in points if not p["meets_target"]]
        rows[name] = entry
    if BOUND_ROW in rows:
        b = rows[BOUND_ROW]["summary"]["mean_cost_cents"]
        for name, entry in rows.items():
            if name != BOUND_ROW:
                entry["summary"]["mean_cost_vs_bound"] = _num(entry["summary"]["mean_cost_cents"] / b) if b else None
    if BEST_OBS_ROW in rows:
        r = rows[BEST_OBS_ROW]["summary"]["mean_cost_cents"]
        for name, entry in rows.items():
            if name not in (BOUND_ROW, BEST_OBS_ROW):
                entry["summary"]["mean_cost_over_best_observable"] = (
                    _num(entry["summary"]["mean_cost_cents"] / r) if r else None)
    return {
        "kind": "frontier",
        "setting": setting,
        "cache": cache,
        "synthetic": cache.get("provenance", {}).get("kind") == "synthetic",
        "protocol": protocol,
        "n_splits": int(n_splits),
        "seeds": int(seeds),
        "alphas": alphas,
        "lambdas": [float(x) for x in lambdas],
        "preset": preset,
        "train_config": train_config,
        "miss_rule": f"mean coverage below 1 - alpha by more than {MISS_SE:g} standard errors of the split means",
        "rows": rows,
        "timing": {k: float(v) for k, v in timing.items()},
        "environment": environment_info(),
    }


def _cell(p: Mapping[str, Any], seeds: int) -> str:
    c, cov = p["cost_cents"], p["coverage"]["mean"]
    sd = f" ±{c['seed_sd']:.2f}" if seeds > 1 and c.get("seed_sd") is not None else ""
    mark = "" if p.get("meets_target", True) else " **miss**"
    return f"{c['mean']:.2f}{sd} ({cov:.3f}{mark})"


def title(fr: Mapping[str, Any]) -> str:
    cache = fr["cache"]
    kind = "SYNTHETIC cache" if fr["synthetic"] else "cache"
    return f"Cost-coverage frontier: setting {fr['setting']}, {kind} {cache.get('name', '?')!r}"


def format_frontier(fr: Mapping[str, Any]) -> str:
    """frontier.md: rows x alphas, cost in cents ± sd over seeds (coverage), misses marked; summary columns."""
    alphas = fr["alphas"]
    lines = [f"# {title(fr)}", ""]
    if fr["synthetic"]:
        lines += ["The cache is SYNTHETIC (generated by envs.generators.synthetic); these are not the paper's numbers.", ""]
    lines += [f"Protocol {fr['protocol']}, {fr['n_splits']} splits, {fr['seeds']} training seed(s), preset "
              f"{fr['preset']}. Cell: mean cost in cents (summed over the test split, as in table.md) "
              f"± sd over seeds (mean coverage); **miss** = "
              f"{fr['miss_rule']}. Last columns: the mean cost over the alpha grid and its ratio to the "
              "clairvoyant bound's (and to the best observable reference's, when the sweep has it).", ""]
    ref = BEST_OBS_ROW in fr["rows"]
    if ref and fr["rows"][BEST_OBS_ROW].get("form"):
        lines += [f"{BEST_OBS_ROW} (not a policy): the cheapest stopping policy of the router's observations, "
                  f"thresholds chosen on each test split with its labels; form: "
                  f"{printable(fr['rows'][BEST_OBS_ROW]['form'])}.", ""]
    head = ("| row | " + " | ".join(f"alpha {a:g} (target {1 - a:.2f})" for a in alphas) + " | mean cost | / bound |"
            + (" / best obs. |" if ref else ""))
    lines += [head, "|" + "---|" * (len(alphas) + 3 + ref)]
    for name, e in fr["rows"].items():
        cells = [_cell(p, fr["seeds"]) if e["is_policy"] else f"{p['cost_cents']['mean']:.2f}" for p in e["points"]]
        ratios = [e["summary"].get("mean_cost_vs_bound")] + ([e["summary"].get("mean_cost_over_best_observable")]
                                                            if ref else [])
        lines.append(f"| {md_cell(name)} | " + " | ".join(cells) + f" | {e['summary']['mean_cost_cents']:.2f} | "
                     + " | ".join(f"{x:.2f}x" if x is not None else "-" for x in ratios) + " |")
    missed = {n: e["misses_target_at"] for n, e in fr["rows"].items() if e.get("misses_target_at")}
    lines.append("")
    if missed:
        lines.append("Rows that miss their coverage target: " + "; ".join(
            f"{printable(n)} at alpha {', '.join(f'{a:g}' for a in al)}" for n, al in missed.items()) + ".")
    else:
        lines.append("Every row meets its coverage target at every alpha.")
    t = fr["timing"]
    lines += ["", f"Timing: total {t.get('total_s', 0):.1f} s (compile {t.get('compile_s', 0):.1f} s, train "
              f"{t.get('train_s', 0):.1f} s, eval {t.get('eval_s', 0):.1f} s) on {fr['environment'].get('backend', '?')}.",
              ""]
    return "\n".join(lines)


def plotted_rows(fr: Mapping[str, Any], scale: float = 3.0) -> tuple[list[str], list[str]]:
    """(rows drawn, rows left off the cost panel): policies whose cost stays within ``scale`` x the
    bound's largest cost (an always-ask-the-guide row at 100x would flatten every other curve)."""
    if BOUND_ROW in fr["rows"]:
        top = scale * max(p["cost_cents"]["mean"] for p in fr["rows"][BOUND_ROW]["points"])
    else:
        top = math.inf
    drawn, off = [], []
    for name, e in fr["rows"].items():
        if not e["is_policy"]:
            continue
        (drawn if max(p["cost_cents"]["mean"] for p in e["points"]) <= top else off).append(name)
    return drawn, off


#: A family's rows share its colour; the twins of a learned row differ by line and marker.
TWIN_STYLES = {None: ("-", "o"), Twin.KEPT_SEED: ("--", "s"), Twin.ENSEMBLE: ("-.", "^"), Twin.MONDRIAN: (":", "D")}
#: Colours of the learned families (tab10 without its red and grey, which the bound and the diagonal use),
#: then of the non-learned rows (drawn dotted, with a down triangle).
LEARNED_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                   "tab:cyan", "navy", "darkgoldenrod")
OTHER_COLOURS = ("#7f7f7f", "#17becf", "#bcbd22", "#8c564b", "#e377c2", "#9467bd", "#2ca02c", "#1f77b4")


def row_styles(rows: list[str], learned: set[str]) -> dict[str, dict[str, Any]]:
    """Per drawn row: colour, line style, marker. A learned row and its twins (``ROW [kept seed]``,
    ``ROW [ensemble]``, ``ROW [Mondrian]``) share a colour no other family has; non-learned rows are
    dotted with their own colours."""
    ids = {r: RowId.parse(r) for r in rows}  # the names frontier.json holds, read once
    families = list(dict.fromkeys(ids[r].base.name for r in rows if r in learned or ids[r].base.name in learned))
    out = {}
    others = [r for r in rows if r not in learned and ids[r].base.name not in learned]
    for r in rows:
        fam = ids[r].base.name
        if fam in families:
            ls, mk = TWIN_STYLES.get(ids[r].twin, ("-", "o"))
            out[r] = {"color": LEARNED_COLOURS[families.index(fam) % len(LEARNED_COLOURS)], "ls": ls, "marker": mk}
        else:
            out[r] = {"color": OTHER_COLOURS[others.index(r) % len(OTHER_COLOURS)], "ls": ":", "marker": "v"}
    return out


def write_frontier_png(path: str | os.PathLike, fr: Mapping[str, Any]) -> None:
    """Cost against target coverage 1 - alpha per row (band: ± sd over seeds), the bound as a red
    dashed curve; achieved coverage against the target beside it, with the target diagonal drawn over
    the curves and in the legend; misses (the sweep's rule, stated on the plot) as x. A family's rows
    share a colour (:func:`row_styles`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, off = plotted_rows(fr)
    styles = row_styles(drawn, {n for n, e in fr["rows"].items() if e.get("learned")})
    fig, (ax_c, ax_v) = plt.subplots(1, 2, figsize=(13, 6.4))
    target = [1 - a for a in fr["alphas"]]
    for name in drawn:
        pts, st = fr["rows"][name]["points"], styles[name]
        mean = np.array([p["cost_cents"]["mean"] for p in pts])
        sd = np.array([p["cost_cents"]["seed_sd"] or 0.0 for p in pts])
        kw = dict(ls=st["ls"], marker=st["marker"], ms=4, color=st["color"], lw=1.4, label=printable(name))
        ax_c.plot(target, mean, **kw)
        ax_c.fill_between(target, mean - sd, mean + sd, color=st["color"], alpha=0.12, lw=0)
        cov = np.array([p["coverage"]["mean"] for p in pts])
        ax_v.plot(target, cov, **kw)
        miss = np.array([not p["meets_target"] for p in pts])
        if miss.any():
            ax_c.plot(np.array(target)[miss], mean[miss], "x", color="black", ms=8, mew=2, zorder=5)
            ax_v.plot(np.array(target)[miss], cov[miss], "x", color="black", ms=8, mew=2, zorder=5)
    if BOUND_ROW in fr["rows"]:
        b = [p["cost_cents"]["mean"] for p in fr["rows"][BOUND_ROW]["points"]]
        ax_c.plot(target, b, "--", color="red", lw=2.2, label=f"{BOUND_ROW} (not a policy)", zorder=4)
    if BEST_OBS_ROW in fr["rows"]:
        b = [p["cost_cents"]["mean"] for p in fr["rows"][BEST_OBS_ROW]["points"]]
        ax_c.plot(target, b, "-.", color="black", lw=1.5, label=f"{BEST_OBS_ROW} (not a policy)", zorder=4)
    lo, hi = min(target), max(target)
    pad = 0.01 if hi > lo else 0.05
    ax_v.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "--", color="black", lw=2, zorder=6,
              label="target: achieved coverage = 1 - alpha")
    ax_v.set_xlim(lo - pad, hi + pad)
    rule = fr.get("miss_rule", "mean coverage below 1 - alpha by more than 2 standard errors of the split means")
    miss_text = f"x: misses the target ({rule}); a point just below the diagonal, within that margin, meets it"
    ax_c.set_xlabel("target coverage 1 - alpha")
    ax_c.set_ylabel("cost (cents, summed over the test split)")
    ax_c.set_title("cost vs target coverage" + (f" ({len(off)} row(s) off scale)" if off else ""), fontsize=10)
    ax_v.set_xlabel("target coverage 1 - alpha\n" + miss_text.replace("; a point", ";\na point"), fontsize=8)
    ax_v.set_ylabel("achieved coverage (mean over splits x seeds)")
    ax_v.set_title("achieved vs target coverage", fontsize=10)
    handles, labels = ax_c.get_legend_handles_labels()
    h_v, l_v = ax_v.get_legend_handles_labels()
    handles, labels = handles + h_v[-1:], labels + l_v[-1:]  # the diagonal (drawn last on the right)
    ncol = 4 if len(labels) > 12 else 5
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.suptitle(title(fr) + "\ncoverage: the share of test questions whose answer set holds a correct answer "
                 "(unsolvable questions count as covered); a row and its twins share a colour", fontsize=9)
    rows_legend = math.ceil(len(labels) / ncol)
    fig.tight_layout(rect=(0, min(0.03 + 0.024 * rows_legend, 0.4), 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_frontier(out_dir: str | os.PathLike, fr: Mapping[str, Any]) -> str:
    """frontier.json, frontier.md and frontier.png in ``out_dir``; returns the markdown."""
    out = Path(out_dir)
    atomic_write_json(out / FRONTIER_JSON, fr)
    md = format_frontier(fr)
    atomic_write_text(out / FRONTIER_MD, md)
    write_frontier_png(out / FRONTIER_PNG, fr)
    return md
