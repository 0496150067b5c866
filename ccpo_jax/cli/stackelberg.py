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
    p = sub.add_parser("stackelberg", help="Stackelberg resource governance: train follower (GAIL) and leader (PPO), repair, evaluate")
    p.add_argument("--out", default=None, help="output directory, must not exist (results.json, table.md, pareto PNGs, tb/, "
                   "checkpoints/, run.json); built in .OUT.partial and renamed when complete")
    p.add_argument("--resume", default=None, metavar="OUT",
                   help="continue the killed run of OUT (its .OUT.partial work directory) from its last checkpoint; pass "
                        "the options of that run (a different configuration is refused). With --seed-list: finished "
                        "seeds are kept, the interrupted one continues, the rest run")
    p.add_argument("--episodes", type=int, default=None, help="episodes of the large evaluation (default 10000; --quick: 1000)")
    p.add_argument("--turns", type=int, default=None, help="turns per evaluated session (default 3, as in the paper)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of training and evaluation")
    p.add_argument("--seed-list", default=None, metavar="S,S,...",
                   help="run once per seed into OUT/seed_S and write the seed spread to OUT/spread.md and spread.json")
    p.add_argument("--seeds", type=int, default=None, help="training seeds vmapped in one program (default 2)")
    p.add_argument("--grid", default=None, help="a response grid (.jsonl human format or fast-format directory); default: SYNTHETIC")
    p.add_argument("--write-grid", default=None, metavar="PATH", help="also write the grid used to PATH (.jsonl or directory)")
    p.add_argument("--leader-profile", default="paper", metavar="NAME",
                   help="the leader's utility: 'paper' (default) or the SYNTHETIC 'state-feedback' (the leader gains from "
                        "tokens on chat, QA and writing and pays them on the other three task types, so its best policy "
                        "depends on the task; docs/stackelberg.md)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (same code paths)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from ccpo_jax.errors import UserError
    from ccpo_jax.stackelberg.config import StackelbergConfig

    if args.resume is not None and args.out is not None and Path(args.out) != Path(args.resume):
        raise UserError("--resume: do not combine with a different --out (the run resumes into its own)")
    if args.resume is None and args.out is None:
        raise UserError("--out: the output directory is required (or --resume OUT to continue a killed run)")
    args.out = args.out or args.resume
    from envs.governance.session import LEADER_PROFILES

    if args.leader_profile not in LEADER_PROFILES:
        raise UserError(f"--leader-profile: must be one of {', '.join(sorted(LEADER_PROFILES))}, got {args.leader_profile!r}")
    cfg = StackelbergConfig().with_leader_profile(args.leader_profile)
    if args.quick:
        cfg = cfg.quick()
    r = dataclasses.replace
    if args.episodes is not None:
        if args.episodes < 2:
            raise UserError(f"--episodes: need at least 2 episodes, got {args.episodes}")
        cfg = r(cfg, eval=r(cfg.eval, episodes=args.episodes))
    if args.turns is not None:
        if not 1 <= args.turns <= 64:
            raise UserError(f"--turns: must be between 1 and 64, got {args.turns}")
        cfg = r(cfg, eval=r(cfg.eval, turns=args.turns))
    if args.seeds is not None:
        if args.seeds < 1:
            raise UserError(f"--seeds: must be >= 1, got {args.seeds}")
        cfg = r(cfg, seeds=args.seeds)
    cfg = r(cfg, seed=args.seed, eval=r(cfg.eval, seed=args.seed), grid=r(cfg.grid, path=args.grid))
    if args.seed_list is not None:
        _parse_seed_list(args.seed_list)  # refuse a bad list before any work

    from ccpo_jax.stackelberg.pipeline import load_or_generate_grid

    if args.write_grid:
        from envs.governance.grid import save_grid

        print(f"wrote grid to {save_grid(load_or_generate_grid(cfg), args.write_grid)}")
    if args.seed_list is not None:
        return _run_seed_list(args, cfg)
    return _run_one(args, cfg, Path(args.out))


def _parse_seed_list(text: str) -> list[int]:
    from ccpo_jax.errors import UserError

    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--seed-list: expected integers separated by commas, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"--seed-list: expected distinct non-negative seeds, got {text!r}")
    return seeds


def _run_seed_list(args, cfg) -> int:
    import json

    from ccpo_jax.stackelberg.spread import seed_spread, write_spread_table
    from envs.atomic import atomic_write_text

    seeds = _parse_seed_list(args.seed_list)
    r = dataclasses.replace
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.workdir import work_dir

    out = Path(args.out)
    if args.resume is not None and not out.is_dir():
        raise UserError(f"--resume: no interrupted run for {out} (not a directory)")
    results = []
    for s in seeds:
        c = r(cfg, seed=s, eval=r(cfg.eval, seed=s))
        d = out / f"seed_{s}"
        if args.resume is not None and (d / "results.json").is_file():  # a finished seed: kept, not recomputed
            print(f"seed {s}: finished before, kept ({d})")
        else:
            _run_one(args, c, d, resume=args.resume is not None and work_dir(d).is_dir())
        results.append(json.loads((d / "results.json").read_text()))
    spread = {size: seed_spread(results, size) for size in ("large", "paper_size")}
    atomic_write_text(out / "spread.json", json.dumps({"seeds": seeds, **spread}, indent=2) + "\n")
    syn = results[0]["data"]["synthetic"]
    lp = results[0].get("leader_profile") or {}
    write_spread_table(out / "spread.md", spread["large"], seeds, results[0]["evaluation"]["large"]["episodes"], syn,
                       lp.get("name") if lp.get("synthetic") else None)
    print(f"wrote {out}/spread.md and spread.json (seeds {seeds})")
    return 0


def _run_one(args, cfg, out: Path, resume: bool | None = None) -> int:
    from ccpo_jax.stackelberg.pipeline import run_pipeline

    from ccpo_jax.errors import UserError

    resume = args.resume is not None if resume is None else resume
    try:
        res = run_pipeline(cfg, out, progress=not args.no_progress, resume=resume)
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
