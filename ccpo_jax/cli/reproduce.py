"""``ccpo-jax reproduce``: reproduce one of the paper's tables (docs/reproduce.md; ``ccpo_jax.ccpo.reproduce``).

The flags are the fields of :class:`ccpo_jax.ccpo.run_config.ReproduceConfig`
(:func:`ccpo_jax.runtime.options.add_flags`); only the two listings are this module's own.
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ccpo_jax.ccpo.run_config import ReproduceConfig
    from ccpo_jax.runtime.options import add_flags

    p = sub.add_parser(
        "reproduce",
        help="train and evaluate every row of a paper table over many splits; write results.json, table.md, plots",
        description="Reproduce one table of the CCPO paper. Default: Table 2's setting "
        "(hotpotqa-llama2-a0.1) on the built-in SYNTHETIC cache with 100 splits.",
    )
    add_flags(p, ReproduceConfig)
    p.add_argument("--list-presets", action="store_true", help="list the trainer presets and every field, and exit")
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
    from ccpo_jax.runtime.progress import status

    status("reproduce: starting (loading JAX and the library) ...", getattr(args, "progress", True) is not False)
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.ccpo.run_config import REPRODUCE_FLAGS, ReproduceConfig
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.options import given

    try:
        reproduce(**given(ReproduceConfig, args))
    except UserError as e:  # the library names its fields; say which flag that is
        raise e.for_cli(REPRODUCE_FLAGS) from None
    return 0
