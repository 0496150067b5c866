"""``ccpo-jax stackelberg --out DIR``: the Stackelberg resource-governance pipeline (arXiv 2606.23026).

Response grid (SYNTHETIC by default, or ``--grid PATH``) -> surrogate payoff
oracle -> GAIL follower -> PPO leader -> repair -> evaluation of the five
strategies on grid replay. See docs/stackelberg.md.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from ccpo_jax.runtime.options import add_flags
    from ccpo_jax.stackelberg.options import StackelbergOptions

    p = sub.add_parser("stackelberg", help="Stackelberg resource governance: train follower (GAIL) and leader (PPO), repair, evaluate")
    add_flags(p, StackelbergOptions)  # one flag per field of the typed options
    p.set_defaults(func=_run)


def _run(args) -> int:
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.options import given
    from ccpo_jax.stackelberg.options import STACKELBERG_FLAGS, StackelbergOptions

    try:
        opts = StackelbergOptions(**given(StackelbergOptions, args))
    except UserError as e:  # the options name their fields; say which flag that is
        raise e.for_cli(STACKELBERG_FLAGS) from None
    cfg = opts.config()
    from ccpo_jax.stackelberg.pipeline import load_or_generate_grid

    if opts.write_grid:
        from envs.governance.grid import save_grid

        print(f"wrote grid to {save_grid(load_or_generate_grid(cfg), opts.write_grid)}")
    if opts.seed_list is not None:
        return _run_seed_list(opts, cfg)
    return _run_one(opts, cfg, opts.out_dir)


def _run_seed_list(opts, cfg) -> int:
    import json

    from ccpo_jax.stackelberg.spread import seed_spread, write_spread_table
    from envs.cache.atomic import atomic_write_text

    seeds = list(opts.seed_list)
    r = dataclasses.replace
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.workdir import work_dir

    out = opts.out_dir
    if opts.resume is not None and not out.is_dir():
        raise UserError(f"--resume: no interrupted run for {out} (not a directory)")
    results = []
    for s in seeds:
        c = r(cfg, seed=s, eval=r(cfg.eval, seed=s))
        d = out / f"seed_{s}"
        if opts.resume is not None and (d / "results.json").is_file():  # a finished seed: kept, not recomputed
            print(f"seed {s}: finished before, kept ({d})")
        else:
            _run_one(opts, c, d, resume=opts.resume is not None and work_dir(d).is_dir())
        results.append(json.loads((d / "results.json").read_text()))
    spread = {size: seed_spread(results, size) for size in ("large", "paper_size")}
    atomic_write_text(out / "spread.json", json.dumps({"seeds": seeds, **spread}, indent=2) + "\n")
    syn = results[0]["data"]["synthetic"]
    lp = results[0].get("leader_profile") or {}
    write_spread_table(out / "spread.md", spread["large"], seeds, results[0]["evaluation"]["large"]["episodes"], syn,
                       lp.get("name") if lp.get("synthetic") else None)
    print(f"wrote {out}/spread.md and spread.json (seeds {seeds})")
    return 0


def _run_one(opts, cfg, out: Path, resume: bool | None = None) -> int:
    from ccpo_jax.stackelberg.pipeline import run_pipeline

    from ccpo_jax.errors import UserError

    resume = opts.resume is not None if resume is None else resume
    try:
        res = run_pipeline(cfg, out, progress=opts.progress, resume=resume)
    except UserError as e:
        raise e.for_cli({"out_dir": "--out", "resume": "--resume"}) from None
    syn = " (SYNTHETIC grid)" if res["data"]["synthetic"] else ""
    ev = res["evaluation"]["large"]
    print(f"five strategies on grid replay{syn}, {ev['episodes']} episodes x {ev['turns']} turns:")
    print(f"  {'policy':16s} {'tok/turn':>9s} {'Q':>6s} {'eff':>6s} {'p_tok':>9s} {'p_Q':>9s} {'trap':>6s}")
    for name, row in ev["strategies"].items():
        fmt = lambda p: "-" if p is None else f"{p:.2e}"
        print(f"  {name:16s} {row['tokens_per_turn']:9.1f} {row['quality']:6.3f} {row['efficiency']:6.3f} "
              f"{fmt(row['p_tokens_vs_conservative']):>9s} {fmt(row['p_quality_vs_conservative']):>9s} "
              f"{100 * row['trap_audit_executed']['trap_rate']:5.1f}%")
    print(f"wall time {res['timing']['total_s']:.1f} s; wrote {out}/results.json, table.md, pareto_*.png")
    return 0
