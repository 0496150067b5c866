"""The leader learners (paper §6.4, phase 2), one table: a learner is a function with the signature of
:class:`LeaderLearner` and one row of :data:`LEADER_LEARNERS`; ``StackelbergConfig.leader_learner``
names the row that :func:`ccpo_jax.stackelberg.training.train_controller` uses. A second learner is one
module plus one row here.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from .config import LeaderPPOConfig
from .nets import BoxPolicy
from .ppo import make_ppo


class LeaderLearner(Protocol):
    """``learner(reset, step, obs_dim, act_dim, n_steps, cfg, policy_kind) -> (policy, init, run)``.

    ``reset(key, env_params) -> (obs, env_state)`` and ``step(key, env_state, action, env_params) ->
    (obs, env_state, reward, done, info)`` are a fixed-horizon functional env with ``n_steps`` steps per
    episode and box actions in [0,1]^``act_dim``; ``policy`` is the leader's :class:`BoxPolicy` of
    ``policy_kind``; ``init(key)`` is a training state with the policy parameters in ``.actor``; ``run(state,
    env_params, n)`` runs ``n`` iterations and returns ``(state, metrics)``, metrics [n] with at least
    ``episode_return``. Pure functions: the pipeline trains several seeds as ``jax.jit(jax.vmap(run))``."""

    def __call__(self, reset: Callable, step: Callable, obs_dim: int, act_dim: int, n_steps: int,
                 cfg: LeaderPPOConfig, policy_kind: str) -> tuple[BoxPolicy, Callable[[Any], Any], Callable]: ...


LEADER_LEARNERS: dict[str, LeaderLearner] = {
    "ppo": make_ppo,  # PPO-clip with GAE (Schulman et al. 2017), the paper's leader
}


def leader_learner(name: str) -> LeaderLearner:
    """The learner named ``name``; an unknown name is a ValueError naming the field and the choices."""
    if name not in LEADER_LEARNERS:
        raise ValueError(f"StackelbergConfig.leader_learner must be one of {sorted(LEADER_LEARNERS)}, got {name!r}")
    return LEADER_LEARNERS[name]
