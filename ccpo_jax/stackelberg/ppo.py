"""PPO on box actions [0,1]^A (Schulman et al. 2017), PureJaxRL style; the leader's trainer (paper §6.4, phase 2).

:func:`make_ppo` builds ``init(key) -> PPOState`` and ``run(state, n) ->
(state, metrics [n])`` for any fixed-horizon functional env given as
``reset(key, env_params) -> (obs, env_state)`` and ``step(key, env_state, action, env_params) ->
(obs, env_state, reward, done, info)``. Each iteration rolls out
``n_envs`` fresh episodes of exactly ``n_steps`` steps (sessions have a fixed
length H), computes GAE, and runs ``epochs`` x ``minibatches`` clipped-surrogate
updates. Everything is a pure function: ``jax.jit(jax.vmap(run))`` trains
several seeds in one program.

The policy on [0,1]^A is a distrax distribution (:class:`BoxPolicy`): an
independent Beta per coordinate (default) or a sigmoid-squashed Gaussian.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import distrax
import jax
import jax.numpy as jnp
import optax
from flax import struct

from ccpo_jax.core.networks import MLP

from .config import LeaderPPOConfig

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


def gae(rewards, values, dones, last_value, gamma: float, lam: float):
    """Generalised advantage estimation, time-major. ``rewards, values, dones`` [T, N]; ``last_value`` [N].

    Returns (advantages [T, N], returns [T, N]); ``dones[t]`` = episode ended after step t.
    """
    def body(carry, xs):
        next_adv, next_value = carry
        r, v, d = xs
        nonterm = 1.0 - d.astype(jnp.float32)
        delta = r + gamma * next_value * nonterm - v
        adv = delta + gamma * lam * nonterm * next_adv
        return (adv, v), adv

    _, adv = jax.lax.scan(body, (jnp.zeros_like(last_value), last_value), (rewards, values, dones), reverse=True)
    return adv, adv + values


@struct.dataclass
class PPOState:
    actor: Any
    critic: Any
    opt: Any
    key: jax.Array
    step: jax.Array


def make_ppo(reset: Callable, step: Callable, obs_dim: int, act_dim: int, n_steps: int, cfg: LeaderPPOConfig,
             policy_kind: str = "beta"):
    """Build (policy, init, run) for a fixed-horizon env; see the module docstring."""
    policy = BoxPolicy(act_dim, cfg.hidden, policy_kind)
    critic = mlp(1, cfg.hidden, final_scale=1.0)
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(cfg.lr, eps=1e-5))
    N = cfg.n_envs
    mb = N * n_steps // cfg.minibatches

    def init(key) -> PPOState:
        k1, k2, k3 = jax.random.split(key, 3)
        actor_p = policy.init(k1, obs_dim)
        critic_p = critic.init(k2, jnp.zeros((obs_dim,)))
        return PPOState(actor_p, critic_p, tx.init((actor_p, critic_p)), k3, jnp.int32(0))

    def value(cp, obs):
        return critic.apply(cp, obs)[..., 0]

    def rollout(actor_p, key, env_params):
        k_reset, k_run = jax.random.split(key)
        obs, env_state = jax.vmap(reset, in_axes=(0, None))(jax.random.split(k_reset, N), env_params)

        def body(carry, k):
            obs, env_state = carry
            ka, ks = jax.random.split(k)
            action = policy.sample(actor_p, obs, ka)
            logp = policy.log_prob(actor_p, obs, action)
            nobs, nstate, r, done, info = jax.vmap(step, in_axes=(0, 0, 0, None))(
                jax.random.split(ks, N), env_state, action, env_params)
            return (nobs, nstate), (obs, action, logp, r, done)

        (last_obs, _), traj = jax.lax.scan(body, (obs, env_state), jax.random.split(k_run, n_steps))
        return traj, last_obs

    def loss_fn(params, batch):
        actor_p, critic_p = params
        obs, action, logp_old, adv, ret, key = batch
        logp = policy.log_prob(actor_p, obs, action)
        pg = clipped_surrogate_loss(logp, logp_old, adv, cfg.clip_eps)
        v_loss = jnp.mean((value(critic_p, obs) - ret) ** 2)
        ent = jnp.mean(policy.entropy_estimate(actor_p, obs, key))
        return pg + cfg.value_coef * v_loss - cfg.entropy_coef * ent, (pg, v_loss, ent)

    def iteration(st: PPOState, env_params):
        key, k_roll, k_epochs = jax.random.split(st.key, 3)
        (obs, action, logp, rew, done), last_obs = rollout(st.actor, k_roll, env_params)
        values = value(st.critic, obs)  # [T, N]
        last_v = value(st.critic, last_obs)
        adv, ret = gae(rew, values, done, last_v, cfg.gamma, cfg.gae_lambda)
        flat = lambda x: x.reshape((N * n_steps,) + x.shape[2:])
        data = tuple(flat(x) for x in (obs, action, logp, adv, ret))

        def epoch(carry, k):
            params, opt = carry
            kp, ke = jax.random.split(k)
            perm = jax.random.permutation(kp, N * n_steps)
            shuffled = tuple(x[perm].reshape((cfg.minibatches, mb) + x.shape[1:]) for x in data)

            def minibatch(carry, xs):
                params, opt = carry
                o, a, lp, ad, rt, kk = xs
                ad = (ad - ad.mean()) / (ad.std() + 1e-8)
                (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, (o, a, lp, ad, rt, kk))
                updates, opt = tx.update(grads, opt, params)
                return (optax.apply_updates(params, updates), opt), (loss, *aux)

            keys = jax.random.split(ke, cfg.minibatches)
            (params, opt), stats = jax.lax.scan(minibatch, (params, opt), (*shuffled, keys))
            return (params, opt), stats

        (params, opt), stats = jax.lax.scan(epoch, ((st.actor, st.critic), st.opt), jax.random.split(k_epochs, cfg.epochs))
        metrics = {
            "episode_return": rew.sum(0).mean(),
            "loss": stats[0].mean(), "policy_loss": stats[1].mean(), "value_loss": stats[2].mean(),
            "entropy": stats[3].mean(), "action_mean": action.mean((0, 1)),
        }
        return PPOState(params[0], params[1], opt, key, st.step + 1), metrics

    def run(st: PPOState, env_params, n_iters: int):
        return jax.lax.scan(lambda s, _: iteration(s, env_params), st, None, length=n_iters)

    return policy, init, run
