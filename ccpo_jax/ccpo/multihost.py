"""Multi-host CCPO training and evaluation on one global device mesh (docs/performance.md, "Sharding and
multi-host"): ``ccpo-jax multihost``.

Run the SAME command once per host (process); JAX joins them into one program whose mesh spans every
host's devices::

    CCPO_JAX_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=host0:12345 \\
    JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0 or 1> \\
        ccpo-jax multihost --out result.json

(On SLURM, Open MPI, Cloud TPU or Kubernetes ``jax.distributed.initialize`` finds the coordinator itself;
set only ``CCPO_JAX_DISTRIBUTED=1``; ``ccpo-jax`` calls it before any other JAX call.) Without
``CCPO_JAX_DISTRIBUTED`` it runs on the local devices, which is the one-host reference the multi-host test
compares against.

What it does, under the ``retrain`` protocol (every split trains its own policies): the variant x split
members of :func:`ccpo_jax.ccpo.members.train_many` are sharded over all devices of all hosts (padded to a
multiple of devices x ``--member-block``); each device trains its block with no communication; the trained
state is gathered to every host (``process_allgather``) and each host evaluates every split (cheap, the
same on every host). Process 0 writes ``--out``: per-split metrics of every row, the calibrated kappas and
a SHA-256 digest of the trained state. With ``--member-block B`` (default 1) every device runs the
one-device program (``ccpo_jax.runtime.sharding.PerDevice``) and the output is bit-identical to a run on
ONE device with the same block (2 hosts x 2 devices = 1 host x 1 device); ``--member-block 0`` runs one
SPMD program (one compilation), equal across layouts with the same number of devices (2 hosts x 2 = 1
host x 4). ``--member-block 1,0 --out result-{block}.json`` runs both layouts in turn in the same
processes (one start-up and one cache for both). ``tests/end_to_end/test_multihost.py`` checks both.

Defaults are small (a 600-question SYNTHETIC cache, 4 splits, 20 iterations) so that a smoke run takes
seconds; ``ccpo-jax reproduce`` is the single-host front door for full tables.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import check_int, option


def _split_sizes(name: str, v: Any, cfg: "MultihostOptions") -> tuple[int, int, int]:
    try:
        sizes = tuple(int(x) for x in (v.split(",") if isinstance(v, str) else v))
        assert len(sizes) == 3
    except (ValueError, AssertionError, TypeError):
        raise UserError(f"split_sizes: expected TRAIN,CAL,TEST, got {v!r}", field=name) from None
    return sizes


def _member_blocks(name: str, v: Any, cfg: "MultihostOptions") -> tuple[int, ...]:
    try:
        blocks = tuple(int(x) for x in (str(v).split(",") if isinstance(v, (str, int)) else v))
        assert blocks and all(b >= 0 for b in blocks)
    except (ValueError, AssertionError, TypeError):
        raise UserError(f"member_block: expected integers >= 0 separated by commas, got {v!r}", field=name) from None
    return blocks


def _alpha(name: str, v: Any, cfg: "MultihostOptions") -> float:
    if not 0.0 < float(v) < 1.0:
        raise UserError(f"alpha: must be in (0, 1) (target coverage 1 - alpha), got {v!r}", field=name)
    return float(v)


def _out(name: str, v: Any, cfg: "MultihostOptions") -> str:
    if v is None:
        raise UserError(f"{name}: required", field=name)
    if len(cfg.member_block) > 1 and "{block}" not in str(v):
        raise UserError(f"{name}: with several --member-block values it must contain '{{block}}', got {str(v)!r}",
                        field=name)
    return str(v)


@dataclasses.dataclass(frozen=True)
class MultihostOptions:
    """``ccpo-jax multihost``: the synthetic cache, the splits, the trainer and the member layouts."""

    profile: str = option("--profile", help="SYNTHETIC cache profile (envs.generators.synthetic)", metavar="NAME",
                          default="hotpotqa-llama2")
    questions: int = option("--questions", help="questions in the synthetic cache", metavar="N", type=int,
                            default=600, check=check_int("the number of questions", 1))
    n_splits: int = option("--splits", help="splits, each trains its own policies", metavar="N", type=int, default=4,
                           check=check_int("the number of splits", 1))
    split_sizes: tuple[int, int, int] = option("--split-sizes", help="questions per split part", metavar="TRAIN,CAL,TEST",
                                               default="300,100,100", check=_split_sizes)
    iterations: int = option("--iterations", help="training iterations", metavar="K", type=int, default=20,
                             check=check_int("the number of iterations", 1))
    alpha: float = option("--alpha", help="miscoverage in (0, 1)", metavar="A", type=float, default=0.1,
                          check=_alpha)
    member_block: tuple[int, ...] = option(
        "--member-block", help="members per block (1: bit-identical to one device; 0: one SPMD program, one vmap per "
        "device); a comma-separated list (e.g. 1,0) runs each layout in turn in the same processes", metavar="B[,B]",
        default="1", check=_member_blocks)
    seed: int = option("--seed", help="PRNG seed of the cache, splits and training", metavar="S", type=int, default=0,
                       check=check_int("the seed", 0))
    out: str = option("--out", help="JSON file written by process 0; with several --member-block values it must "
                      "contain '{block}', replaced by each value", metavar="FILE", required=True, check=_out)

    def __post_init__(self) -> None:
        options.resolve(self)


MULTIHOST_FLAGS = options.flag_names(MultihostOptions)


def run_multihost(opts: MultihostOptions) -> dict[int, dict]:
    """Train and evaluate under every ``--member-block`` layout; process 0 writes each result. Returns
    ``{block: result}`` (every process computes it)."""
    import jax

    from ccpo_jax.ccpo.config import TrainConfig
    from ccpo_jax.ccpo.splits import check_split_sizes, make_splits
    from envs.generators.synthetic import generate
    from envs.replay.env import make_env_params

    cache = generate(opts.profile, opts.questions, opts.seed)
    check_split_sizes(cache.n_questions, *opts.split_sizes, opts.n_splits, where="the synthetic cache")
    params = make_env_params(cache)
    k_split, k_train, k_eval = jax.random.split(jax.random.PRNGKey(opts.seed), 3)
    splits = make_splits(k_split, cache.n_questions, *opts.split_sizes, opts.n_splits)
    cfg = TrainConfig(iterations=opts.iterations, chunk=opts.iterations)
    return {block: _run_layout(opts, cache, params, splits, cfg, k_train, k_eval, block or None)
            for block in opts.member_block}


def _run_layout(opts: MultihostOptions, cache, params, splits, cfg, k_train, k_eval, block: int | None) -> dict:
    """Train and evaluate with one member layout (``block`` None: one SPMD program); process 0 writes the result."""
    import jax
    import numpy as np

    from ccpo_jax.ccpo.evaluation import evaluate_trained
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.ccpo.rows import row_variants
    from ccpo_jax.runtime import sharding
    from ccpo_jax.runtime.execution import Execution
    from envs.cache.atomic import atomic_write_text

    variants = row_variants((), cfg, opts.alpha)
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
        "iterations": opts.iterations,
        "splits": opts.n_splits,
        "state_sha256": digest,
        "timing": timing,
        "rows": {r: {m: np.asarray(v)[0].tolist() for m, v in ms.items()} for r, ms in rows.items()},  # seed 0
        "kappa_hat": {r: np.asarray(v)[0].tolist() for r, v in kappas.items()},
        "kappa_online_curve_mean": np.asarray(metrics["kappa"]).mean(axis=(0, 1)).tolist(),
    }
    if jax.process_index() == 0:
        out = Path(opts.out.replace("{block}", str(block or 0)))
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1) + "\n")
        print(f"process 0 of {jax.process_count()}: {jax.device_count()} devices, state sha256 {digest[:16]}, "
              f"train {timing['train_s']:.1f} s (compile {timing['compile_s']:.1f} s); wrote {out}")
    return result
