"""Do the learned rows reach the brute-force optimum? Train CPO and CCPO on the oracle caches.

    python -m experiments.oracle_check --preset default --seeds 10
    python -m experiments.oracle_check --preset paper --seeds 4 --caches uncertainty,two-extra-rounds

For every cache of :func:`envs.generators.oracle.builtin` (SYNTHETIC, hand-designed), this
trains the learned rows over ``--seeds`` seeds in one vmapped program
(recalibrate protocol), batch-calibrates each seed on ``--splits`` splits and
prints, per seed, CPO's pointwise success and every calibrated row's cost
relative to the brute-force optimum (on the same test questions) and coverage.
``--json FILE`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from ccpo_jax.ccpo.presets import get_preset
from ccpo_jax.ccpo.rows import RowsRun, RunData, train_seeds
from ccpo_jax.ccpo.splits import splits_for_protocol
from ccpo_jax.runtime.execution import QUIET
from envs.generators import oracle
from envs.replay.env import make_env_params


def check_cache(spec, cfg, seeds: int, n_splits: int, sizes=(600, 200, 200), lambdas=(), seed: int = 0,
                alpha: float = 0.1) -> dict:
    cache = oracle.build(spec, sum(sizes), seed=seed)
    params = make_env_params(cache)
    opt = oracle.optimum(spec, alpha)
    types = oracle.type_of(cache)
    key = jax.random.PRNGKey(seed)
    k_split, k_train = jax.random.split(key)
    splits = splits_for_protocol("recalibrate", k_split, cache.n_questions, *sizes, n_splits)
    t0 = time.perf_counter()
    trained = train_seeds(RowsRun(cfg, tuple(lambdas), seeds, alpha=alpha), RunData(cache, params, splits, k_train), QUIET)
    wall = time.perf_counter() - t0
    test = np.asarray(splits.test)
    opt_cost = np.array([opt.cost_of(types[t]) for t in test])  # [S]
    rows = {}
    for row, m in trained.rows.items():
        cost = np.asarray(m["cost_cents"])  # [N, S]
        rows[row] = {
            "cost_ratio": (cost / opt_cost[None, :]).mean(axis=1).tolist(),
            "coverage": np.asarray(m["coverage"]).mean(axis=1).tolist(),
            "set_size": np.asarray(m["set_size"]).mean(axis=1).tolist(),
        }
    cases = {}
    for var, curves in trained.curves.items():  # CPO step cases over the last 20 % of iterations
        c = np.asarray(curves["cpo_case"])
        tail = c[:, -max(1, c.shape[1] // 5):]
        cases[var] = {str(k): float(np.mean(tail == k)) for k in range(5)}
        cases[var]["final_batch_success"] = np.asarray(curves["batch_success"])[:, -1].tolist()
    return {"cache": spec.name, "optimum_cost_per_question": opt.cost_per_question, "cpo_cases": cases,
            "optimum_coverage": opt.coverage, "optimum_test_cost": float(opt_cost.mean()),
            "rows": rows, "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--caches", default=",".join(oracle.builtin()))
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    if args.iterations:
        cfg = cfg.replace(iterations=args.iterations)
    if args.set:
        from ccpo_jax.ccpo.presets import apply_overrides

        cfg = apply_overrides(cfg, args.set)
    specs = oracle.builtin()
    out = []
    for name in args.caches.split(","):
        r = check_cache(specs[name], cfg, args.seeds, args.splits)
        out.append(r)
        print(f"\n## {name}: optimum {r['optimum_cost_per_question']:.4f} c/question "
              f"(coverage {r['optimum_coverage']:.3f}); {args.seeds} seeds, {r['wall_s']:.0f} s")
        for row, m in r["rows"].items():
            ratios = " ".join(f"{x:.2f}" for x in m["cost_ratio"])
            covs = " ".join(f"{x:.3f}" for x in m["coverage"])
            print(f"  {row:18s} cost/opt [{ratios}]\n  {'':18s} coverage [{covs}]")
        for var, c in r["cpo_cases"].items():
            print(f"  CPO-step cases of {var} (last 20 %): " + ", ".join(f"{k}: {c[k]:.2f}" for k in "01234"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "config": repr(cfg), "seeds": args.seeds, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
