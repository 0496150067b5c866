"""Many trainers in one program: every (variant, split, seed) member of a run, vmapped and sharded.

:func:`train_many` lays the members of a run out on one flat batch axis
(variant-major), vmaps :func:`ccpo_jax.ccpo.train.make_train`'s ``run_chunk`` over it,
places it on the devices (``ccpo_jax.runtime.sharding``) and hands the chunks to the host
loop :func:`ccpo_jax.runtime.loop.run_chunks` (progress, TensorBoard, checkpoints).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.ccpo.train import make_train, variant_arrays
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import executables, loop, sharding
from ccpo_jax.runtime.execution import Execution
from envs.replay.env import EnvParams


class Trained(NamedTuple):
    """What :func:`train_many` returns: ``state`` leaves [V, S, ...]; ``metrics[name]`` [V, S, iterations];
    ``timing`` compile_s and train_s."""

    state: Any
    metrics: dict[str, np.ndarray]
    timing: dict[str, float]


def progress_fields(m: dict, variants: list[Variant], S: int) -> str:
    """Labelled progress: per variant kind, the mean over its members of the last iteration's
    online kappa (conformal rows only) and the target policy's batch success."""
    parts = []
    last = {k: np.asarray(v)[..., -1].reshape(len(variants), S) for k, v in m.items() if k in ("kappa", "batch_success")}
    for label, conf in (("CPO", False), ("CCPO", True)):
        rows = [i for i, v in enumerate(variants) if v.conformal == conf]
        if not rows:
            continue
        bit = f"{label} success {np.mean(last['batch_success'][rows]):.2f}"
        if conf:
            bit += f" kappa {np.mean(last['kappa'][rows]):.3f}"
        parts.append(bit)
    return "mean over members: " + ", ".join(parts)


def variant_scalars(variants: list[Variant], S: int):
    """TensorBoard tags ``<variant name>/<metric>``: the mean over the variant's S members."""

    def scalars(m: dict) -> dict[str, np.ndarray]:
        out = {}
        for k, v in m.items():
            v = np.asarray(v, np.float64).reshape(len(variants), S, -1)
            for i, var in enumerate(variants):
                out[f"{var.name}/{k}"] = v[i].mean(0)
        return out

    return scalars


#: Compiled programs of recent :func:`train_many` calls, so that another call on the same env
#: and configuration in this process (a resumed run, a second run of the same shapes) skips
#: tracing and lowering (several seconds of CPU each for the default networks). Keyed by the
#: env's identity and by everything else the program depends on: configuration, chunk length,
#: member block, devices, and the inputs' structure, shapes, dtypes and shardings. An entry holds
#: its env, so the identity stays that env's; an env with a leaf that is not a ``jax.Array``
#: (which could be changed in place) is never cached.
_PROGRAMS: OrderedDict = OrderedDict()
_MAX_PROGRAMS = 8


def clear_program_cache() -> None:
    """Drop the compiled programs kept by :func:`train_many` (``jax.clear_caches`` does not)."""
    _PROGRAMS.clear()


def _signature(tree) -> tuple:
    """Structure, shapes, dtypes and, of arrays committed to devices, shardings: what lowering
    reads (host arrays and uncommitted device arrays lower alike; tests/ccpo/test_loop.py)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                           x.sharding if getattr(x, "committed", False) else None) for x in leaves)


def _cached(params: EnvParams, key: tuple, build):
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
        return build()
    key = (id(params),) + key
    hit = _PROGRAMS.get(key)
    if hit is not None and hit[0] is params:
        _PROGRAMS.move_to_end(key)
        return hit[1]
    value = build()
    _PROGRAMS[key] = (params, value)
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return value


def train_many(config: TrainConfig, params: EnvParams, variants: list[Variant], train_idx: np.ndarray, key: jax.Array,
               execution: Execution = Execution()) -> Trained:
    """Train every variant on every row of ``train_idx`` [S, n_train] in one vmapped program.

    ``key`` is one key (split into V * S member keys) or member keys [V, S, 2]. ``execution``
    (:class:`ccpo_jax.runtime.execution.Execution`) says where and how: its ``ckpt_dir`` enables
    checkpoints after every chunk and resumption from the latest one; its ``tb_dir`` gets each
    variant's curves, the mean over its members, after every chunk; its ``mesh`` (a 1-D
    ``ccpo_jax.runtime.sharding.make_mesh``) shards the flat V * S member axis over its devices
    (padded to a multiple of the device count, padding stripped from results and checkpoints);
    its ``member_block`` computes the members that many at a time (``sharding.blocked_vmap``).
    With a mesh and a block every device runs its own single-device program
    (``sharding.PerDevice``; across hosts the results are all-gathered), and the run is
    bit-identical to the one-device run with the same block, on any number of devices and
    hosts. Without a block a sharded run (one SPMD program) matches one device's only up to
    rounding, which the CPO step amplifies over long runs (``sharding.MemberLayout``).
    """
    member_block, mesh = execution.member_block, execution.mesh
    if member_block is not None and int(member_block) < 1:
        raise UserError(f"member_block={member_block}: must be >= 1")
    trainer = make_train(config, params)
    V, S = len(variants), int(train_idx.shape[0])
    keys = jax.random.split(key, V * S).reshape(V, S, -1) if key.ndim == 1 else key

    # One flat batch axis of V * S members (variant-major): simpler to shard than nested vmaps.
    flat_var = jax.tree.map(lambda x: jnp.repeat(x, S, axis=0), variant_arrays(variants, config))
    flat_idx = jnp.tile(jnp.asarray(train_idx, jnp.int32), (V, 1))
    # One compiled program: run eagerly, the initialisers' random draws and reshapes are
    # compiled one operation at a time. Jitted, the state was the same bit for bit (checked on
    # jax 0.10.2 when this changed). One flat member axis.
    # The trainer's programs close over the configuration and the env (``make_train``): with their
    # arguments' shapes that is their whole key in the executables kept on disk.
    member_keys = keys.reshape(V * S, -1)
    init = _cached(params, ("init", config, _signature(member_keys)), lambda: executables.compile(
        "train-init", jax.jit(jax.vmap(trainer.init)), (member_keys,), (config, params)))
    state = init(member_keys)
    n_members = V * S
    layout = sharding.MemberLayout(n_members, mesh, member_block)
    flat_idx, flat_var = layout.place((flat_idx, flat_var))

    def compile_chunk(n: int, placed_state):
        key = ("chunk", config, n, member_block, layout.devices(), _signature((placed_state, flat_idx, flat_var)))
        fn = sharding.blocked_vmap(lambda s, idx, v: trainer.run_chunk(s, idx, v, n), member_block)
        args = (placed_state, flat_idx, flat_var)
        build = (lambda: layout.compile(fn, *args)) if mesh is not None else (
            lambda: executables.compile("train-chunk", jax.jit(fn), args, (config, params, n, member_block)))
        program = _cached(params, key, build)

        def step(s):
            s, m = program(s, flat_idx, flat_var)
            return s, sharding.unpad(sharding.to_host(m), n_members)

        return step

    meta = {"config": repr(config), "variants": [repr(v) for v in variants], "S": S}
    with execution.scalar_writer() as writer:
        out = loop.run_chunks(
            compile_chunk, state, iterations=config.iterations, chunk=config.chunk,
            desc=f"train {V} variant(s) x {S} member(s) each", ckpt_dir=execution.ckpt_dir, meta=meta,
            place=layout.place, unplace=layout.unplace, tensorboard=writer, scalars=variant_scalars(variants, S),
            postfix=lambda m: progress_fields(m, variants, S), progress=execution.progress,
            stop_after_chunks=execution.stop_after_chunks,
        )
    state = jax.tree.map(lambda x: x.reshape((V, S) + x.shape[1:]), out.state)
    metrics = {k: v.reshape(V, S, -1) for k, v in out.metrics.items()}
    return Trained(state=state, metrics=metrics, timing={"compile_s": out.compile_s, "train_s": out.train_s})
