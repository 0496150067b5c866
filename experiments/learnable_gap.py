"""How far CCPO is from the best observable reference (issue 40, item 3), and why.

    python -m experiments.learnable_gap --out DIR [--splits N] [--seeds 5] [--cases a,b,...]
        [--uala ../shared/data/uala]

For each of the four SYNTHETIC profiles of Tables 2-9 (their Table 2-5 settings fix the split
sizes, 1000/200/200 HotpotQA and 560/200/200 MMLU; Tables 6-9 are the same caches at alpha 0.2 /
0.05) and for UALA's real HotpotQA cache (300/100/100), one ``sweep`` at alphas 0.05, 0.1, 0.2,
lambda 0, ``--seeds`` seeds, the default preset. Per (cache, alpha): CCPO (lambda=0) and CPO batch
cost / best observable (mean, sd over seeds) and cost / bound, coverage against the target, the same
for CCPO (lambda=0)'s kept seed (the one seed chosen on its training questions) and its ensemble (the
seeds' mean policy), the reference's own cost / bound, n_cal and the conformal rank.

Then the causes, measured: a second sweep without training (same seed, so the same splits)
puts the reference at two more coverages: (a) the conformal rank's coverage
ceil((n_cal + 1)(1 - alpha)) / n_cal, what the finite calibration set asks for, and (b) the mean
coverage CCPO reached. ``ref_at_ccpo_cov / ref`` is then the share of the ratio that is coverage
CCPO buys above the target; ``ccpo / ref_at_ccpo_cov`` is what remains at equal coverage (the
learner and the out-of-sample threshold; the reference picks its thresholds on each test
split's own labels). Writes DIR/learnable_gap.json and DIR/learnable_gap.md, prints the table.
The record quoted in docs/: experiments/results/learnable_gap/learnable_gap.json
(its command: experiments/results/INDEX.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

CASES = {  # label: (setting, cache source or None for the setting's SYNTHETIC profile, split sizes or None)
    "hotpotqa-llama2": ("hotpotqa-llama2-a0.1", None, None),
    "hotpotqa-llama3": ("hotpotqa-llama3-a0.1", None, None),
    "mmlu-llama2": ("mmlu-llama2-a0.1", None, None),
    "mmlu-llama3": ("mmlu-llama3-a0.1", None, None),
    "uala-hotpotqa": ("hotpotqa-llama2-a0.1", "uala", (300, 100, 100)),
}
#: CCPO (lambda=0), CPO batch, and CCPO (lambda=0)'s two seed twins: the kept seed and the seeds' ensemble
ROWS = ("CCPO (lambda=0)", "CPO batch", "CCPO (lambda=0) [kept seed]", "CCPO (lambda=0) [ensemble]")
ALPHAS = (0.05, 0.1, 0.2)
LIMIT = 1.10  # the issue's target: cost / best observable at most this


def rank_coverage(n_cal: int, alpha: float) -> float:
    """The coverage the conformal quantile asks of the calibration set: ceil((n+1)(1-alpha)) / n."""
    from ccpo_jax.core.conformal import conformal_rank_f64

    return conformal_rank_f64(n_cal, alpha) / n_cal


def _point(fr: dict, row: str, alpha: float) -> dict:
    return next(p for p in fr["rows"][row]["points"] if abs(p["alpha"] - alpha) < 1e-12)


def _ref_cost(fr: dict, alpha: float) -> float:
    return _point(fr, "Best observable", alpha)["cost_cents"]["mean"]


def _kwargs(label: str, a: argparse.Namespace) -> dict:
    setting, src, sizes = CASES[label]
    kw = {"setting": setting, "n_splits": a.splits, "seeds": a.seeds, "progress": False}
    if src == "uala":
        from envs.importers import import_cache

        kw["cache"] = import_cache("uala-hotpotqa", a.uala)
    if sizes:
        kw["split_sizes"] = sizes
    return kw


def run_case(label: str, a: argparse.Namespace, out: Path) -> dict:
    """The trained sweep, then the reference at the extra coverages; the case's JSON entry."""
    from ccpo_jax.ccpo.sweep import sweep

    kw = _kwargs(label, a)
    t0 = time.perf_counter()
    fr = sweep(echo=None, alphas=ALPHAS, lambdas=(0.0,), out_dir=out / label, **kw).frontier
    wall = time.perf_counter() - t0
    n_cal = int(kw.get("split_sizes", (0, 200))[1])
    extra = {}
    for alpha in ALPHAS:
        cov = _point(fr, ROWS[0], alpha)["coverage"]["mean"]
        extra[alpha] = {"rank": round(1.0 - rank_coverage(n_cal, alpha), 6), "ccpo_cov": round(1.0 - cov, 6)}
    grid = sorted({x for e in extra.values() for x in e.values()} - set(ALPHAS))
    t1 = time.perf_counter()
    ref = sweep(echo=None, train=False, alphas=tuple(grid), lambdas=(0.0,), out_dir=out / f"{label}-ref",
                **{k: v for k, v in kw.items() if k != "seeds"}).frontier if grid else {"rows": {}}
    ref_wall = time.perf_counter() - t1

    def ref_at(x: float) -> float:
        return _ref_cost(fr if x in ALPHAS else ref, x)

    points = []
    for alpha in ALPHAS:
        r = _ref_cost(fr, alpha)
        pt = {"alpha": alpha, "target": 1.0 - alpha, "n_cal": n_cal,
              "rank_coverage": rank_coverage(n_cal, alpha),
              "best_observable_cents": r,
              "best_observable_vs_bound": _point(fr, "Best observable", alpha)["cost_vs_bound"]["mean"],
              "best_observable_at_rank_coverage_over_ref": ref_at(extra[alpha]["rank"]) / r}
        for row in (r for r in ROWS if r in fr["rows"]):  # the twins need several seeds
            p = _point(fr, row, alpha)
            at_cov = ref_at(extra[alpha]["ccpo_cov"]) if row == ROWS[0] else None
            pt[row] = {"cost_cents": p["cost_cents"], "coverage": p["coverage"]["mean"],
                       "meets_target": p["meets_target"],
                       "cost_over_best_observable": p["cost_over_best_observable"],
                       "cost_vs_bound": p["cost_vs_bound"]}
            if at_cov is not None:
                pt[row]["best_observable_at_its_coverage_over_ref"] = at_cov / r
                pt[row]["cost_over_best_observable_at_its_coverage"] = p["cost_cents"]["mean"] / at_cov
        points.append(pt)
    return {"case": label, "setting": kw["setting"], "synthetic": fr["synthetic"],
            "cache": fr["cache"].get("name"), "split_sizes": list(kw.get("split_sizes") or ()),
            "n_splits": a.splits, "seeds": a.seeds, "wall_s": round(wall, 1), "ref_wall_s": round(ref_wall, 1),
            "timing": fr["timing"], "points": points}


def train_fit_reference(label: str, a: argparse.Namespace) -> dict[float, dict]:
    """The reference's policy family with thresholds chosen on each split's *training* questions
    (in-sample there, at coverage >= 1 - alpha), applied to the split's test questions: what a
    learner that found the best thresholds of this family on its training data would get out of
    sample, before any calibration. Same splits as the sweep (``prepare`` draws them from the seed);
    ``in_sample_cents`` recomputes the sweep's reference on them as a check."""
    import numpy as np

    from ccpo_jax.ccpo import observable as ob
    from ccpo_jax.ccpo.prepare import prepare
    from ccpo_jax.ccpo.run_config import SweepConfig

    kw = {k: v for k, v in _kwargs(label, a).items() if k != "seeds"}
    run = prepare(dict(kw, alphas=ALPHAS, lambdas=(0.0,), out_dir=Path(a.out) / f"{label}-unused"), SweepConfig,
                  command="sweep", trains=False)  # nothing is written before run.committed()
    p, sp = run.data.params, run.data.splits
    scores, info = ob.fit_scores(p)
    keys = ob.order_keys(scores, p.obs)
    keys = np.where(np.isfinite(keys), keys, np.inf)
    cost = np.where(np.asarray(p.round_mask), np.asarray(p.cost, np.float64), 0.0)
    nxt, cov = np.asarray(p.available)[..., 2], ob.covered_by(p)
    train, test = np.asarray(sp.train), np.asarray(sp.test)
    got = {}
    for alpha in ALPHAS:
        tau = ob.choose_thresholds(keys[train], cost[train], cov[train], nxt[train], alpha)
        on_train = ob._metrics(p, train, ob._reach(keys[train], tau, nxt[train]))
        m = ob._metrics(p, test, ob._reach(keys[test], tau, nxt[test]))
        ins, _ = ob.best_observable_row(p, test, alpha, scores, info)
        got[alpha] = {"test_cents": float(m["cost_cents"].mean()), "test_coverage": float(m["coverage"].mean()),
                      "train_coverage": float(on_train["coverage"].mean()),
                      "in_sample_cents": float(ins["cost_cents"].mean())}
    return got


def _r(s: dict) -> str:
    sd = s.get("seed_sd")
    return f"{s['mean']:.3f}" + (f" ±{sd:.3f}" if sd is not None else "")


def _twin_cells(t: dict | None) -> str:
    """A twin row's three cells (cost / best obs., cost / bound, coverage), ``-`` for a run without it."""
    if not t:
        return "- | - | - | "
    flag = " **>1.10**" if t["cost_over_best_observable"]["mean"] > LIMIT else ""
    return (f"{_r(t['cost_over_best_observable'])}{flag} | {_r(t['cost_vs_bound'])} | "
            f"{t['coverage']:.3f}{'' if t['meets_target'] else ' (miss)'} | ")


def table(cases: list[dict]) -> str:
    head = ("| cache | alpha | n_cal: rank cov. | CCPO / best obs. | CCPO / bound | CCPO cov. | CPO batch / best obs. "
            "| CPO batch / bound | CPO batch cov. | CCPO kept seed / best obs. | kept seed / bound | kept seed cov. "
            "| CCPO ensemble / best obs. | ensemble / bound | ensemble cov. "
            "| best obs. / bound | ref. at rank cov. | ref. at CCPO cov. "
            "| CCPO / ref. at its cov. | train-fit ref. / ref. (its test cov.) | CCPO / train-fit ref. |")
    lines = [head, "|" + "---|" * 21]
    for c in cases:
        name = c["case"] + (" (SYNTHETIC)" if c["synthetic"] else " (real)")
        for p in c["points"]:
            cc, cb, tf = p[ROWS[0]], p[ROWS[1]], p["train_fit_reference"]
            flag = " **>1.10**" if cc["cost_over_best_observable"]["mean"] > LIMIT else ""
            lines.append(
                f"| {name} | {p['alpha']:g} | {p['n_cal']}: {p['rank_coverage']:.3f} | "
                f"{_r(cc['cost_over_best_observable'])}{flag} | {_r(cc['cost_vs_bound'])} | "
                f"{cc['coverage']:.3f}{'' if cc['meets_target'] else ' (miss)'} | "
                f"{_r(cb['cost_over_best_observable'])} | {_r(cb['cost_vs_bound'])} | "
                f"{cb['coverage']:.3f}{'' if cb['meets_target'] else ' (miss)'} | "
                + "".join(_twin_cells(p.get(r)) for r in ROWS[2:])
                + f"{p['best_observable_vs_bound']:.3f} | {p['best_observable_at_rank_coverage_over_ref']:.3f} | "
                f"{cc['best_observable_at_its_coverage_over_ref']:.3f} | "
                f"{cc['cost_over_best_observable_at_its_coverage']:.3f} | "
                f"{tf['over_ref']:.3f} ({tf['test_coverage']:.3f}) | {cc['cost_over_train_fit_reference']:.3f} |")
    return "\n".join(lines) + "\n"


def add_train_fit(case: dict, a: argparse.Namespace) -> None:
    """Put the train-fit reference (:func:`train_fit_reference`) into every point of ``case``."""
    t0 = time.perf_counter()
    tf = train_fit_reference(case["case"], a)
    for p in case["points"]:
        t = tf[p["alpha"]]
        if abs(t["in_sample_cents"] / p["best_observable_cents"] - 1.0) > 1e-9:
            raise SystemExit(f"{case['case']}: the splits differ from the sweep's (reference "
                             f"{t['in_sample_cents']} vs {p['best_observable_cents']})")
        p["train_fit_reference"] = dict(t, over_ref=t["test_cents"] / p["best_observable_cents"])
        cc = p[ROWS[0]]
        cc["cost_over_train_fit_reference"] = cc["cost_cents"]["mean"] / t["test_cents"]
    case["train_fit_s"] = round(time.perf_counter() - t0, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (must not exist)")
    ap.add_argument("--splits", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--uala", default=None, help="UALA's data folder (docs/caches.md, Real data; default "
                    "$CCPO_SHARED_DATA/uala, else ../shared/data/uala)")
    ap.add_argument("--reuse", default=None, metavar="DIR",
                    help="take the sweeps' figures from DIR/learnable_gap.json of an earlier run (same --splits)")
    a = ap.parse_args(argv)
    if a.uala is None:
        a.uala = str(Path(os.environ.get("CCPO_SHARED_DATA", "../shared/data")) / "uala")
    labels = [x for x in a.cases.split(",") if x]
    bad = [x for x in labels if x not in CASES]
    if bad:
        ap.error(f"--cases: unknown case {bad[0]!r}; choose from {', '.join(CASES)}")
    out = Path(a.out)
    if out.exists():
        ap.error(f"--out: {out} exists; give a new directory")
    old = {}
    if a.reuse:
        old = {c["case"]: c for c in json.loads((Path(a.reuse) / "learnable_gap.json").read_text())["cases"]}
        for label in labels:
            if label in old and old[label]["n_splits"] != a.splits:
                ap.error(f"--reuse: {label} ran with {old[label]['n_splits']} splits, not --splits {a.splits}")
    out.mkdir(parents=True)
    try:
        cases = _run(labels, old, a, out)
    except ValueError as e:  # UserError / CacheError: a bad input (e.g. no UALA data at --uala), no traceback
        print(f"error: {e}", file=sys.stderr)
        shutil.rmtree(out)  # nothing half-written
        return 2
    md = table(cases)
    (out / "learnable_gap.md").write_text(md)
    print(md)
    return 0


def _run(labels: list[str], old: dict, a: argparse.Namespace, out: Path) -> list[dict]:
    cases = []
    for label in labels:
        case = old.get(label) or run_case(label, a, out)
        add_train_fit(case, a)
        cases.append(case)
        print(f"{label}: sweep {case['wall_s']} s, reference at extra coverages {case['ref_wall_s']} s, "
              f"train-fit reference {case['train_fit_s']} s", flush=True)
        (out / "learnable_gap.json").write_text(json.dumps({"cases": cases, "limit": LIMIT}, indent=1) + "\n")
    return cases


if __name__ == "__main__":
    raise SystemExit(main())
