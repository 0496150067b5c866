"""Multi-host CCPO training and evaluation on one global device mesh (docs/performance.md, "Sharding and multi-host").

Run the SAME command once per host (process); JAX joins them into one program
whose mesh spans every host's devices::

    CCPO_JAX_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=host0:12345 \\
    JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0 or 1> \\
        python -m experiments.multihost --out result.json

(On SLURM, Open MPI, Cloud TPU or Kubernetes ``jax.distributed.initialize``
finds the coordinator itself; set only ``CCPO_JAX_DISTRIBUTED=1``.) Without
``CCPO_JAX_DISTRIBUTED`` it runs on the local devices, which is the one-host
reference the multi-host test compares against.

What it does, under the ``retrain`` protocol (every split trains its own
policies): the variant x split members of :func:`ccpo_jax.ccpo.members.train_many`
are sharded over all devices of all hosts (padded to a multiple of
devices x ``--member-block``); each device trains its block with no
communication; the trained state is gathered to every host
(``process_allgather``) and each host evaluates every split (cheap, the same
on every host). Process 0 writes ``--out``: per-split metrics of every row,
the calibrated kappas and a SHA-256 digest of the trained state. With
``--member-block B`` (default 1) every device runs the one-device program
(``ccpo_jax.runtime.sharding.PerDevice``) and the output is bit-identical to a run on
ONE device with the same block (2 hosts x 2 devices = 1 host x 1 device);
``--member-block 0`` runs one SPMD program (one compilation), equal across
layouts with the same number of devices (2 hosts x 2 = 1 host x 4).
``--member-block 1,0 --out result-{block}.json`` runs both layouts in turn in
the same processes (one start-up and one cache for both). See
``tests/test_multihost.py``.

Defaults are small (a 600-question SYNTHETIC cache, 4 splits, 20 iterations)
so that a smoke run takes seconds; ``ccpo-jax reproduce`` is the single-host
front door for full tables.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True,
                   help="JSON file written by process 0; with several --member-block values it must contain "
                        "'{block}', replaced by each value")
    p.add_argument("--profile", default="hotpotqa-llama2", help="SYNTHETIC cache profile (envs.generators.synthetic)")
    p.add_argument("--questions", type=int, default=600, help="questions in the synthetic cache")
    p.add_argument("--splits", type=int, default=4, help="splits, each trains its own policies")
    p.add_argument("--split-sizes", default="300,100,100", metavar="TRAIN,CAL,TEST")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--member-block", default="1",
                   help="members per block (default 1: bit-identical to one device; 0: one SPMD program, one vmap "
                        "per device); a comma-separated list (e.g. 1,0) runs each layout in turn in the same processes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from ccpo_jax.errors import USER_ERRORS
    from ccpo_jax.runtime.sharding import init_distributed

    init_distributed()  # reads CCPO_JAX_DISTRIBUTED; must come before any other JAX call
    try:
        return _run(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import jax

    from ccpo_jax.ccpo.config import TrainConfig
    from ccpo_jax.ccpo.splits import check_split_sizes, make_splits
    from ccpo_jax.errors import UserError
    from envs.replay.env import make_env_params
    from envs.generators.synthetic import generate

    try:
        sizes = tuple(int(x) for x in args.split_sizes.split(","))
        assert len(sizes) == 3
    except (ValueError, AssertionError):
        raise UserError(f"--split-sizes: expected TRAIN,CAL,TEST, got {args.split_sizes!r}") from None
    try:
        blocks = [int(x) for x in str(args.member_block).split(",")]
        assert blocks and all(b >= 0 for b in blocks)
    except (ValueError, AssertionError):
        raise UserError(f"--member-block: expected integers >= 0 separated by commas, got {args.member_block!r}") from None
    if len(blocks) > 1 and "{block}" not in args.out:
        raise UserError(f"--out: with several --member-block values it must contain '{{block}}', got {args.out!r}")
    cache = generate(args.profile, args.questions, args.seed)
    check_split_sizes(cache.n_questions, *sizes, args.splits, where="the synthetic cache")
    params = make_env_params(cache)
    key = jax.random.PRNGKey(args.seed)
    k_split, k_train, k_eval = jax.random.split(key, 3)
    splits = make_splits(k_split, cache.n_questions, *sizes, args.splits)
    cfg = TrainConfig(iterations=args.iterations, chunk=args.iterations)
    for block in blocks:
        _run_layout(args, cache, params, splits, cfg, k_train, k_eval, block or None)
    return 0


def _run_layout(args, cache, params, splits, cfg, k_train, k_eval, block: int | None) -> None:
    """Train and evaluate with one member layout (``block`` None: one SPMD program); process 0 writes the result."""
    import jax
    import numpy as np

    from ccpo_jax.ccpo.evaluation import evaluate_trained
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.runtime.execution import Execution
    from ccpo_jax.ccpo.rows import row_variants
    from ccpo_jax.runtime import sharding
    from envs.cache.atomic import atomic_write_text

    variants = row_variants((), cfg, args.alpha)
    mesh = sharding.make_mesh()
    state, metrics, timing = train_many(cfg, params, variants, np.asarray(splits.train), k_train,
                                        Execution(progress=False, mesh=mesh, member_block=block))
    state = sharding.to_host(state)  # every host gets the whole trained state
    seeded = jax.tree.map(lambda x: x[:, :, None], state)  # one seed: [V, S, N=1]
    rows, kappas = evaluate_trained(cfg, params, variants, seeded, np.asarray(splits.cal),
                                    np.asarray(splits.test), k_eval, retrain=True)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(state))).hexdigest()
    result = {
        "note": "SYNTHETIC cache (envs.generators.synthetic), retrain protocol",
        "cache": {"name": cache.manifest.name, "checksum": cache.manifest.checksum},
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "member_block": block,
        "iterations": args.iterations,
        "splits": args.splits,
        "state_sha256": digest,
        "timing": timing,
        "rows": {r: {m: np.asarray(v)[0].tolist() for m, v in ms.items()} for r, ms in rows.items()},  # seed 0
        "kappa_hat": {r: np.asarray(v)[0].tolist() for r, v in kappas.items()},
        "kappa_online_curve_mean": np.asarray(metrics["kappa"]).mean(axis=(0, 1)).tolist(),
    }
    if jax.process_index() == 0:
        out = Path(args.out.replace("{block}", str(block or 0)))
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1) + "\n")
        print(f"process 0 of {jax.process_count()}: {jax.device_count()} devices, state sha256 {digest[:16]}, "
              f"train {timing['train_s']:.1f} s (compile {timing['compile_s']:.1f} s); wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
