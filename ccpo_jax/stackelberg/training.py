"""Training one Stackelberg controller (paper §6.4): phase 1, the follower by behaviour cloning and GAIL
on expert demonstrations; phase 2, the leader by its learner (:mod:`ccpo_jax.stackelberg.leaders`, PPO by
default) against that follower in the surrogate. Every phase runs as jitted chunks of a ``lax.scan``
vmapped over seeds through the shared host loop (TensorBoard, a verified checkpoint per chunk, resume).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.runtime import loop
from envs.governance.session import SessionEnv

from .acting import Controller, EpisodeParams, Params, RolloutParams, leader_raw, make_act
from .config import StackelbergConfig
from .evaluate import rollout_episodes
from .gail import expert_demos, imitation_error, make_bc, make_gail
from .leaders import leader_learner
from .nets import BoxPolicy
from .repair import trap_audit


def _train_chunks(name: str, init: Callable, run: Callable, args: tuple, in_axes: tuple, keys, iterations: int,
                  chunks: int, ckpt_root: Path, writer, progress: bool, meta: dict) -> tuple[Any, dict[str, np.ndarray]]:
    """jit(vmap(run)) over seeds, ``iterations`` in ``chunks`` pieces, through the shared host loop
    (:func:`ccpo_jax.runtime.loop.run_chunks`: TensorBoard, a checkpoint per chunk, resume after a
    configuration check). Metrics are [seeds, iterations, ...]."""
    st = jax.jit(jax.vmap(init))(*(keys if isinstance(keys, tuple) else (keys,)))
    f = jax.jit(jax.vmap(run, in_axes=(0, *in_axes, None)), static_argnums=len(args) + 1)

    def compile_chunk(n: int, placed):
        def step(s):
            s, m = f(s, *args, n)
            return s, {k: np.moveaxis(np.asarray(v), 1, -1) for k, v in m.items()}  # iterations last

        return step

    def scalars(m):  # [S, n] scalars: the seed mean
        return {f"{name}/{k}": v.mean(0) for k, v in m.items() if v.ndim == 2}

    res = loop.run_chunks(compile_chunk, st, iterations=iterations, chunk=math.ceil(iterations / chunks), desc=name,
                          ckpt_dir=ckpt_root / name, meta=dict(meta, phase=name, iterations=iterations, chunks=chunks),
                          tensorboard=writer, scalars=scalars, progress=progress)
    return res.state, {k: np.moveaxis(v, -1, 1) for k, v in res.metrics.items()}


def _take(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


class TrainedFollower(NamedTuple):
    """Phase 1's result: the follower's policy, the selected GAIL seed's parameters, the best BC
    seed's (reported beside it) and the imitation report."""
    policy: BoxPolicy
    params: Params
    bc_params: Params
    report: dict


def follower_data(env: SessionEnv, cfg: StackelbergConfig, params, key):
    """Phase 1's data and keys from the follower's key: ``(demos, held, k_bc, k_gail)``, the expert's
    demonstrations, held-out expert states (the imitation error's) and the BC and GAIL seeds' keys."""
    k_demo, k_bc, k_gail = jax.random.split(key, 3)
    demo_fn = jax.jit(lambda k, p: expert_demos(k, env, p, cfg.expert))
    demos = demo_fn(jax.random.fold_in(k_demo, cfg.expert.seed), params)
    held = demo_fn(jax.random.fold_in(k_demo, cfg.expert.seed + 7919), params)
    return demos, held, k_bc, k_gail


def _train_follower(kind: str, env: SessionEnv, cfg: StackelbergConfig, params, key, ckpt_root: Path, writer,
                    progress: bool, meta: dict) -> TrainedFollower:
    """Phase 1: behaviour cloning and GAIL on the same demonstrations, all seeds at once. The follower is
    the GAIL seed with the lowest imitation error on held-out expert states (against the noise-free
    expert action); BC's errors are reported beside it."""
    demos, held, k_bc, k_gail = follower_data(env, cfg, params, key)
    policy, bc_init, bc_run = make_bc(env.obs_dim + 2, 3, cfg.gail)
    bc_state, _ = _train_chunks(f"{kind}_follower_bc", bc_init, bc_run, (demos,), (None,),
                                jax.random.split(k_bc, cfg.seeds), cfg.gail.bc_steps, cfg.chunks, ckpt_root, writer,
                                progress, meta)
    _, _disc, g_init, g_run = make_gail(env.obs_dim + 2, 3, cfg.gail)
    g_keys = jax.random.split(k_gail, cfg.seeds)
    if cfg.gail.bc_init:  # GAIL starts from BC's policy (Adam's moments start at zero either way)
        init, g_keys = (lambda k, a: g_init(k).replace(actor=a)), (g_keys, bc_state[0])
    else:
        init = g_init
    g_state, g_metrics = _train_chunks(f"{kind}_follower_gail", init, g_run, (demos,), (None,), g_keys,
                                       cfg.gail.iterations, cfg.chunks, ckpt_root, writer, progress, meta)
    err = jax.jit(jax.vmap(lambda p: imitation_error(policy, p, held)))
    gail_err, bc_err = np.asarray(err(g_state.actor)), np.asarray(err(bc_state[0]))
    best = int(np.argmin(gail_err))
    demo_a = np.asarray(demos.action)
    report = {
        "n_demos": int(demo_a.shape[0]), "demo_mean_action": [round(float(x), 4) for x in demo_a.mean(0)],
        "demo_trap_rate": trap_audit(demo_a, cfg.repair.trap)["trap_rate"],
        "demo_mean_t_ratio": float(np.asarray(demos.t_ratio).mean()),
        "gail_final": {k: [float(x) for x in v[:, -1]] for k, v in g_metrics.items() if v.ndim == 2},
        "imitation_error": {"gail": gail_err.tolist(), "bc": bc_err.tolist(),
                            "label_noise": float(np.abs(np.asarray(held.action - held.clean_action)).mean()),
                            "constant_mean_action": float(np.abs(np.asarray(held.clean_action) - demo_a.mean(0)).mean()),
                            "n_held_out": int(held.obs.shape[0]), "bc_init": cfg.gail.bc_init},
        "follower_seed": best}
    return TrainedFollower(policy, _take(g_state.actor, best), _take(bc_state[0], int(np.argmin(bc_err))), report)


def train_controller(kind: str, cfg: StackelbergConfig, params, key, ckpt_root: Path, writer, progress: bool) -> Controller:
    """Phase 1 (follower, :func:`_train_follower`) and phase 2 (the leader learner ``cfg.leader_learner``, PPO by
    default, against that one follower) for the
    'scalar' or 'task' state; all seeds at once. The leader is the seed whose deterministic policy has the
    highest U_L on ``cfg.oracle.select_sessions`` surrogate sessions (not the scored ones)."""
    scfg = dataclasses.replace(cfg.session, state=kind, mode="surrogate")
    env = SessionEnv(scfg, n_models=int(params.grid_tokens.shape[1]))
    k_fol, k_lead, k_sel = jax.random.split(key, 3)
    meta = {"config": dataclasses.asdict(cfg), "state": kind}
    fol = _train_follower(kind, env, cfg, params, k_fol, ckpt_root, writer, progress, meta)
    policy = fol.policy

    def reset(k, ep):
        return env.reset(k, ep.env)

    def step(k, s, a_leader, ep):
        x = env.observe(s)
        ell = env.commit(s, leader_raw(cfg, a_leader))
        obs = jnp.concatenate([x, ell])
        a = policy.mean(ep.fol, obs) if cfg.leader.follower_deterministic else policy.sample(ep.fol, obs, k)
        return env.step(jax.random.fold_in(k, 1), s, ell, a, ep.env)

    learner = leader_learner(cfg.leader_learner)
    leader, l_init, l_run = learner(reset, step, env.obs_dim, 2, scfg.horizon, cfg.leader, cfg.leader.policy)
    ep = EpisodeParams(env=params, fol=fol.params)
    l_keys = jax.random.split(k_lead, cfg.seeds)
    l_state, l_metrics = _train_chunks(f"{kind}_leader_{cfg.leader_learner}", l_init, l_run, (ep,), (EpisodeParams(env=None, fol=None),),
                                       l_keys, cfg.leader.iterations, cfg.chunks, ckpt_root, writer, progress, meta)
    ctrl = Controller(env, policy, leader, leader_params=None, follower_params=fol.params)
    act = make_act(ctrl, cfg, None, "raw")
    sel_keys = jax.random.split(k_sel, cfg.oracle.select_sessions)
    values = jax.jit(jax.vmap(lambda lp: rollout_episodes(env, act, sel_keys, params, RolloutParams(leader=lp, fol=fol.params))
                              ["u_leader"].sum(-1).mean()))(l_state.actor)
    values = np.asarray(values)
    best = int(np.argmax(values))
    ret = l_metrics["episode_return"]  # [S, iters]
    tail = max(1, ret.shape[1] // 10)
    return ctrl._replace(
        best_seed=best, bc_params=fol.bc_params,
        leader_params=_take(l_state.actor, best), leader_init_params=jax.jit(l_init)(l_keys[best]).actor,
        report={
            "state_dim": env.obs_dim, **fol.report,
            "leader_return_per_seed": [float(x) for x in ret[:, -tail:].mean(1)],
            "leader_selection_value_per_seed": values.tolist(),
            "selected_seed": best,
        })
