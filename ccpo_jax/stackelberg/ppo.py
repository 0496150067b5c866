"""PPO on box actions [0,1]^A (Schulman et al. 2017), PureJaxRL style; the leader's trainer (paper §6.4, phase 2).

:func:`make_ppo` builds ``init(key) -> PPOState`` and ``run(state, n) ->
(state, metrics [n])`` for any fixed-horizon functional env given as
``reset(key, env_params) -> (obs, env_state)`` and ``step(key, env_state, action, env_params) ->
(obs, env_state, reward, done, info)``. Each iteration rolls out
``n_envs`` fresh episodes of exactly ``n_steps`` steps (sessions have a fixed
length H), computes GAE, and runs ``epochs`` x ``minibatches`` clipped-surrogate
updates. Everything is a pure function: ``jax.jit(jax.vmap(run))`` trains
several seeds in one program.

The policy on [0,1]^A and the networks are :mod:`ccpo_jax.stackelberg.nets`' (shared with the
follower): an independent Beta per coordinate (default) or a sigmoid-squashed Gaussian.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from .config import LeaderPPOConfig
from .nets import BoxPolicy, clipped_surrogate_loss, linear_anneal, mlp


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


def leader_lr(cfg: LeaderPPOConfig):
    """Adam's step: ``cfg.lr``, or with ``cfg.anneal_lr`` lr x (1 - i / iterations) in iteration i, constant
    within an iteration's epochs x minibatches updates (:func:`~ccpo_jax.stackelberg.nets.linear_anneal`)."""
    return linear_anneal(cfg.lr, cfg.iterations, cfg.epochs * cfg.minibatches) if cfg.anneal_lr else cfg.lr


def make_ppo(reset: Callable, step: Callable, obs_dim: int, act_dim: int, n_steps: int, cfg: LeaderPPOConfig,
             policy_kind: str = "beta"):
    """Build (policy, init, run) for a fixed-horizon env; see the module docstring."""
    policy = BoxPolicy(act_dim, cfg.hidden, policy_kind)
    critic = mlp(1, cfg.hidden, final_scale=1.0)
    N = cfg.n_envs
    mb = N * n_steps // cfg.minibatches
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(leader_lr(cfg), eps=1e-5))

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
