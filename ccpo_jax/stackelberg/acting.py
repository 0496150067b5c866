"""How a Stackelberg controller acts (paper §6-8): the trained :class:`Controller`, the leader's raw
output through the output margin, the follower's action with projection or tool repair, and one
``act(pp, x, state) -> (ell, a_raw, a_exec)`` per strategy mode, which training, the leader oracles
and evaluation all roll out.

``pp`` is a :class:`RolloutParams`, the parameters a rollout vmaps over: ``leader`` and ``fol``
(network parameters), and for the strategy program ``mode``, ``static`` and ``table``
(:mod:`ccpo_jax.stackelberg.strategies`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from envs.governance.session import SessionEnv

from .config import StackelbergConfig
from .nets import BoxPolicy
from .repair import project_box, repair_action

Params = Any
"""A flax parameter tree."""


class RolloutParams(NamedTuple):
    """What a rollout's ``act(pp, x, state)`` reads (a pytree; a field a mode does not use stays None)."""
    leader: Params = None
    """The leader policy's parameters."""
    fol: Params = None
    """The follower policy's parameters."""
    mode: Any = None
    """The strategy program's branch, an index into :data:`ccpo_jax.stackelberg.strategies.MODES` (int32)."""
    static: Any = None
    """A static strategy's action [3] (float32)."""
    table: Any = None
    """A leader table [K, M, 2]: raw l~ per task and model condition (the brute-force oracles)."""


class EpisodeParams(NamedTuple):
    """What the leader learner's episodes read: the session env's parameters and the follower's."""
    env: Any
    fol: Params


class Controller(NamedTuple):
    """One trained controller ('scalar' or 'task' state), what :func:`train_controller` returns.

    ``env`` is the training (surrogate) env; evaluation swaps it with ``_replace(env=...)``.
    ``leader_tables`` (reference-row name -> leader table [K, M, 2]) is set by
    :func:`_oracles_and_reference_tables` on the scalar controller only."""
    env: SessionEnv
    policy: BoxPolicy
    """The follower's policy (GAIL)."""
    leader: BoxPolicy
    """The leader's policy (the leader learner's, :mod:`ccpo_jax.stackelberg.leaders`)."""
    leader_params: Params
    follower_params: Params
    leader_init_params: Params | None = None
    bc_params: Params | None = None
    best_seed: int = 0
    report: dict = {}
    leader_tables: dict[str, np.ndarray] = {}


def leader_raw(cfg: StackelbergConfig, a):
    """The raw leader output l~ from the leader policy's action a in [0,1]^2: widened by
    ``LeaderPPOConfig.output_margin`` m and clipped, clip((1 + 2m) a - m, 0, 1), so the corners of the
    box are reached at finite logits of the squashed policy."""
    m = cfg.leader.output_margin
    return jnp.clip((1.0 + 2.0 * m) * a - m, 0.0, 1.0) if m else a


def make_follower(policy, cfg: StackelbergConfig, u_head, mode: str):
    """``follower(pp, obs, state) -> (a_raw, a_exec)``: the follower's mean action on ``obs`` = [x, l], then
    nothing ('raw'), the projection onto A_real ('proj') or the projection and tool repair ('repair')."""
    def follower(pp, obs, st):
        a_raw = policy.mean(pp.fol, obs)
        if mode == "raw":
            return a_raw, a_raw
        if mode == "proj":
            return a_raw, project_box(a_raw, cfg.repair.box_low, cfg.repair.box_high)
        return a_raw, repair_action(a_raw, u_head(st.task, st.model), cfg.repair)

    return follower


def make_act(ctrl: Controller | None, cfg: StackelbergConfig, u_head, mode: str, static=None):
    """``act(pp, x, state) -> (ell, a_raw, a_exec)`` for a static action or a learned controller.

    Mode 'table' plays the leader table ``pp.table`` [K, M, 2] (raw l~ per task and model
    condition: the brute-force oracles of :mod:`ccpo_jax.stackelberg.oracle`) instead of the
    learned leader, with the repaired follower."""
    ell0 = jnp.asarray(cfg.session.ell_init, jnp.float32)
    if static is not None:
        a = jnp.asarray(static, jnp.float32)
        return lambda pp, x, st: (ell0, a, a)
    env, policy, leader = ctrl.env, ctrl.policy, ctrl.leader
    follower = make_follower(policy, cfg, u_head, "repair" if mode == "table" else mode)

    def act(pp, x, st):
        raw = pp.table[st.task, st.model] if mode == "table" else leader_raw(cfg, leader.mean(pp.leader, x))
        ell = env.commit(st, raw)
        a_raw, a = follower(pp, jnp.concatenate([x, ell]), st)
        return ell, a_raw, a

    return act
