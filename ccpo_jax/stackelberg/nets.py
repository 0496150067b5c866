"""The networks and losses that the Stackelberg leader and follower share (neutral ground: the leader's
PPO, :mod:`ccpo_jax.stackelberg.ppo`, and the follower's BC/GAIL, :mod:`ccpo_jax.stackelberg.gail`,
both import from here, neither from the other).

The policy on [0,1]^A is a distrax distribution (:class:`BoxPolicy`): an independent Beta per
coordinate (default) or a sigmoid-squashed Gaussian; the networks are tanh MLPs (:func:`mlp`); the
clipped surrogate (Schulman et al. 2017) is the policy loss of PPO and of GAIL's generator step.
"""
from __future__ import annotations

from typing import Sequence

import distrax
import jax
import jax.numpy as jnp

from ccpo_jax.core.networks import MLP

_EPS = 1e-5


def mlp(out: int, hidden: Sequence[int] = (64, 64), final_scale: float = 0.01) -> MLP:
    """The Stackelberg networks' tanh MLP: :class:`ccpo_jax.core.networks.MLP` with He-style
    truncated-normal weights (variance scaling 2.0, fan_in; the head at ``final_scale**2``)."""
    return MLP(out=out, hidden=tuple(hidden), final_scale=final_scale,
               hidden_scale=2.0, mode="fan_in", distribution="truncated_normal")


class BoxPolicy:
    """A policy on [0,1]^A from an MLP: ``dist(params, obs)`` is a distrax distribution with event ``[A]``."""

    def __init__(self, act_dim: int, hidden: Sequence[int] = (64, 64), kind: str = "beta"):
        if kind not in ("beta", "squashed"):
            raise ValueError(f"policy kind must be 'beta' or 'squashed', got {kind!r}")
        self.act_dim, self.kind = act_dim, kind
        self.net = mlp(2 * act_dim, hidden, final_scale=0.01)

    def init(self, key, obs_dim: int):
        return self.net.init(key, jnp.zeros((obs_dim,)))

    @staticmethod
    def _concentrations(a, b):
        # in [1, 1e3]: unimodal, finite log-density on the closed box; a NaN would make the
        # gamma rejection sampler loop forever, so it is mapped to 1
        f = lambda z: jnp.clip(jnp.nan_to_num(1.0 + 2.0 * jax.nn.softplus(z), nan=1.0), 1.0, 1e3)
        return f(a), f(b)

    def dist(self, params, obs) -> distrax.Distribution:
        out = self.net.apply(params, obs)
        a, b = out[..., : self.act_dim], out[..., self.act_dim :]
        if self.kind == "beta":
            return distrax.Independent(distrax.Beta(*self._concentrations(a, b)), 1)
        base = distrax.Normal(a, jnp.exp(jnp.clip(b - 0.5, -5.0, 2.0)))
        return distrax.Independent(distrax.Transformed(base, distrax.Sigmoid()), 1)

    def log_prob(self, params, obs, action):
        return self.dist(params, obs).log_prob(jnp.clip(action, _EPS, 1.0 - _EPS))

    def mean(self, params, obs):
        """Deterministic action: the Beta mean, or the sigmoid of the Gaussian mean."""
        out = self.net.apply(params, obs)
        a, b = out[..., : self.act_dim], out[..., self.act_dim :]
        if self.kind == "beta":
            ca, cb = self._concentrations(a, b)
            return ca / (ca + cb)
        return jax.nn.sigmoid(a)

    def sample(self, params, obs, key):
        return jnp.clip(self.dist(params, obs).sample(seed=key), _EPS, 1.0 - _EPS)

    def entropy_estimate(self, params, obs, key):
        """Entropy (exact for Beta; one-sample estimate for the squashed Gaussian)."""
        d = self.dist(params, obs)
        if self.kind == "beta":
            return d.entropy()
        a, logp = d.sample_and_log_prob(seed=key)
        return -logp


def clipped_surrogate_loss(logp_new, logp_old, adv, clip_eps: float):
    """PPO-clip: -E[min(r A, clip(r, 1 -/+ eps) A)], r = exp(logp_new - logp_old). ``[N]`` -> []."""
    ratio = jnp.exp(logp_new - logp_old)
    return -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv))


def linear_anneal(lr: float, iterations: int, updates_per_iteration: int):
    """An optax step schedule: lr x (1 - i / iterations) in iteration i (0-based), constant over its
    ``updates_per_iteration`` updates, 0 from iteration ``iterations`` on. Optax counts updates in the
    optimiser state, so the schedule carries across the pipeline's chunks and a resumed run."""
    def schedule(count):
        frac = 1.0 - (count // updates_per_iteration).astype(jnp.float32) / iterations
        return lr * jnp.maximum(frac, 0.0)

    return schedule
