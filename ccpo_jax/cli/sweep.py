"""``ccpo-jax sweep``: the cost-coverage frontier over an alpha (and lambda) grid (docs/reproduce.md, "Sweeps";
``ccpo_jax.ccpo.sweep``). The flags are the fields of :class:`ccpo_jax.ccpo.run_config.SweepConfig`:
reproduce's data, split, preset and execution options, plus ``--alphas`` and ``--lambdas``.
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ccpo_jax.ccpo.run_config import SweepConfig
    from ccpo_jax.runtime.options import add_flags

    p = sub.add_parser(
        "sweep",
        help="the cost-coverage frontier: every row at every alpha (and CCPO lambda), all learned rows x alphas "
        "x seeds trained as one program; write frontier.json, frontier.md, frontier.png",
        description="Sweep the miscoverage alpha (and the CCPO set-size penalty lambda) for every row of one "
        "setting's table. Default: Table 2's setting on the built-in SYNTHETIC cache, alphas 0.05-0.2, "
        "lambdas 0, 1e-4, 2e-4, 5 seeds, 100 splits.",
    )
    add_flags(p, SweepConfig)
    # reproduce's caps, accepted here only to refuse them with a reason (argparse would say "unrecognized")
    for flag in CAPS:
        p.add_argument(flag, dest="refused_" + flag[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_sweep)


#: reproduce's Learn-then-Test caps, which sweep refuses (docs/reproduce.md, "Sweeps").
CAPS = ("--guide-cap", "--cost-cap")


def _refuse_caps(args) -> None:
    """A frontier point is one threshold rule applied on every split; with a cap a split can have no threshold
    (infeasible), so the point would be a mean over a varying subset of splits and the frontier would not
    compare like with like: refused, naming the per-alpha reproduce run that does it."""
    from ccpo_jax.errors import UserError

    for flag in CAPS:
        if getattr(args, "refused_" + flag[2:].replace("-", "_"), None) is not None:
            raise UserError(f"{flag}: not in sweep: with a cap a split can have no threshold (the caps are "
                            "infeasible on that calibration draw), so a frontier point would average a different "
                            "subset of splits per row; run `ccpo-jax reproduce --guarantee pac --alpha A "
                            f"{flag} ...` per alpha instead, or sweep --guarantee pac without caps")


def _sweep(args) -> int:
    from ccpo_jax.runtime.progress import status

    status("sweep: starting (loading JAX and the library) ...", getattr(args, "progress", True) is not False)
    from ccpo_jax.ccpo.run_config import SWEEP_FLAGS, SweepConfig
    from ccpo_jax.ccpo.sweep import sweep
    from ccpo_jax.errors import UserError
    from ccpo_jax.runtime.options import given

    _refuse_caps(args)
    try:
        sweep(**given(SweepConfig, args))
    except UserError as e:
        raise e.for_cli(SWEEP_FLAGS) from None
    return 0
