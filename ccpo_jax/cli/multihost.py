"""``ccpo-jax multihost``: CCPO training and evaluation over one device mesh spanning every host
(``ccpo_jax.ccpo.multihost``; docs/performance.md, "Sharding and multi-host"). Run the same command on every
host with ``CCPO_JAX_DISTRIBUTED=1`` (``ccpo-jax`` joins the processes before any other JAX call)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ccpo_jax.ccpo.multihost import MultihostOptions
    from ccpo_jax.runtime.options import add_flags

    p = sub.add_parser(
        "multihost",
        help="train and evaluate over one device mesh spanning every host (run once per host with "
        "CCPO_JAX_DISTRIBUTED=1); process 0 writes per-split metrics and the trained state's digest",
        description="Multi-host CCPO training on a small SYNTHETIC cache under the retrain protocol: members "
        "sharded over every device of every host, the state gathered to each host, every split evaluated. "
        "With --member-block 1 the result is bit-identical to one device (docs/performance.md).",
    )
    add_flags(p, MultihostOptions)
    p.set_defaults(func=_multihost)


def _multihost(args) -> int:
    from ccpo_jax.ccpo.multihost import MULTIHOST_FLAGS, MultihostOptions, run_multihost
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.options import given

    try:
        run_multihost(MultihostOptions(**given(MultihostOptions, args)))
    except UserError as e:
        raise e.for_cli(MULTIHOST_FLAGS) from None
    return 0
