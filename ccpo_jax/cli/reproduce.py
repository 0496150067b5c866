"""``ccpo-jax reproduce``: reproduce one of the paper's tables (docs/reproduce.md; ``ccpo_jax.ccpo.reproduce``)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce",
        help="train and evaluate every row of a paper table over many splits; write results.json, table.md, plots",
        description="Reproduce one table of the CCPO paper. Default: Table 2's setting "
        "(hotpotqa-llama2-a0.1) on the built-in SYNTHETIC cache with 100 splits.",
    )
    p.add_argument("--setting", default=None, help="setting name (default: hotpotqa-llama2-a0.1; see --list-settings)")
    p.add_argument("--cache", default=None, help="response cache: a human-format .jsonl file or a fast-format directory "
                   "(default: the setting's built-in SYNTHETIC cache)")
    p.add_argument("--splits", type=int, default=None, help="number of evaluation splits (default: 100)")
    p.add_argument("--iterations", type=int, default=None, help="training iterations (default: the trainer's, paper 1500)")
    p.add_argument("--alpha", type=float, default=None, help="miscoverage in (0, 1) (default: the setting's)")
    p.add_argument("--protocol", choices=("recalibrate", "retrain"), default=None,
                   help="recalibrate (default): one policy per row, calibration/test redrawn per split; "
                   "retrain: every split trains its own policy")
    p.add_argument("--split-sizes", default=None, metavar="TRAIN,CAL,TEST",
                   help="questions per split part, e.g. 60,20,20 (default: the setting's, 1000,200,200 HotpotQA / 560,200,200 MMLU)")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed of splits, baselines and training (default: 0)")
    p.add_argument("--out", default=None, help="output directory, must not exist (default: runs/<setting>-<timestamp>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the killed run whose --out was DIR, with its saved configuration")
    p.add_argument("--devices", default=None, metavar="N|all",
                   help="shard the training's variant x split members over N devices (default 1); on a CPU "
                   "host N devices are forced with XLA_FLAGS=--xla_force_host_platform_device_count=N")
    p.add_argument("--member-block", type=int, default=None, metavar="B",
                   help="train members B at a time, one single-device program per device: bit-identical to a "
                   "one-device run with the same B (default: one SPMD program, a vmap per device, fastest)")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="training seeds of every learned row, trained in one vmapped program (default: 5); "
                   "table.md shows the mean over seeds x splits and the spread over seeds")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="trainer preset: default (the configuration that learns) or paper (the paper's published "
                   "values: batch 10, 1500 iterations, the J-bar estimator of Eq. 8); see --list-presets")
    p.add_argument("--set", action="append", default=None, dest="overrides", metavar="FIELD=VALUE",
                   help="set one trainer field on top of the preset, e.g. --set batch_size=100 --set estimator=vtrace "
                   "(repeatable; fields and values: --list-presets)")
    p.add_argument("--list-presets", action="store_true", help="list the trainer presets and every field, and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list-settings", action="store_true", help="list the settings (one per paper table) and exit")
    p.set_defaults(func=_reproduce)


def _reproduce(args) -> int:
    from ccpo_jax.ccpo.settings import settings_table

    if args.list_settings:
        print(settings_table())
        return 0
    if args.list_presets:
        from ccpo_jax.ccpo.presets import presets_table

        print(presets_table())
        return 0
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.errors import UserError

    try:
        _run(reproduce, args)
    except UserError as e:  # the library names its arguments; say which flag that is
        raise e.for_cli(FLAGS) from None
    return 0


#: reproduce()'s arguments -> this command's flags (for error messages).
FLAGS = {"setting": "--setting", "cache": "--cache", "n_splits": "--splits", "protocol": "--protocol",
         "alpha": "--alpha", "iterations": "--iterations", "split_sizes": "--split-sizes", "out_dir": "--out",
         "seed": "--seed", "resume": "--resume", "devices": "--devices", "member_block": "--member-block",
         "seeds": "--seeds", "preset": "--preset", "overrides": "--set"}


def _run(reproduce, args) -> None:
    reproduce(
        args.setting,
        cache=args.cache,
        n_splits=args.splits,
        protocol=args.protocol,
        alpha=args.alpha,
        iterations=args.iterations,
        split_sizes=args.split_sizes,
        out_dir=args.out,
        seed=args.seed,
        resume=args.resume,
        progress=not args.no_progress,
        devices=args.devices,
        member_block=args.member_block,
        seeds=args.seeds,
        preset=args.preset,
        overrides=args.overrides,
    )
