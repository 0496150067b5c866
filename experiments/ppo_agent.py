"""PPO with a Lagrange multiplier for one episodic constraint, in PureJaxRL's style: one
``make_train(config, env, env_params)`` returns a jittable ``train(rng)`` (nested ``lax.scan``s:
updates, rollout steps, epochs, minibatches), so seeds are a ``vmap`` axis.

The agent knows nothing of CCPO or of the replay env: it sees an environment only through gymnax's
API (``reset``, ``step`` with auto-reset, ``observation_space``, ``action_space``; an ``info`` key
for the constraint). It runs unchanged on gymnax's ``CartPole-v1`` (``constraint_key=None``: plain
PPO) and on ``envs.replay.gymnax`` (docs/gym_api.md).

The constrained problem (Altman's CMDP; the PPO-Lagrangian of Ray, Achiam & Amodei 2019,
"Benchmarking Safe Exploration in Deep RL", §5):

    max_pi E[sum_t r_t]   s.t.   E[c] >= target,     c = info[constraint_key] summed over an episode

solved on the Lagrangian L(pi, lam) = E[sum r] + lam (E[c] - target), lam >= 0: the policy takes PPO's
clipped step (Schulman et al. 2017, Eq. 7) on the advantage ``(A_r + lam A_c) / (1 + lam)`` (two
critics, GAE each, Schulman et al. 2016, Eq. 16), and lam takes a projected dual step
``lam <- max(0, lam + lr_lam (target - c_hat))`` with c_hat the mean constraint of the episodes
that ended in the update's rollout. Our code; PureJaxRL's ``ppo.py`` was read for its structure.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of :func:`make_train` (one run; seeds are the vmap axis of ``train``)."""

    num_envs: int = 64
    """Parallel environments."""
    num_steps: int = 16
    """Rollout steps per environment and update."""
    total_timesteps: int = 400_000
    """Environment steps in all: ``num_updates = total_timesteps // (num_envs * num_steps)``."""
    update_epochs: int = 4
    """Passes over each rollout."""
    num_minibatches: int = 4
    """Minibatches per pass."""
    lr: float = 3e-4
    """Adam step size (linearly annealed to 0 if ``anneal_lr``)."""
    anneal_lr: bool = True
    """Anneal the step size linearly over the updates."""
    gamma: float = 1.0
    """Discount (1: the episodes are short and the objective is the undiscounted sum)."""
    gae_lambda: float = 0.95
    """GAE's lambda, for both critics."""
    clip_eps: float = 0.2
    """PPO's ratio clip."""
    ent_coef: float = 0.01
    """Entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the two critics' squared errors."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    hidden: int = 64
    """Width of the two tanh hidden layers of the actor and of the critics."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before learning (returns of order 1 suit the defaults)."""
    constraint_key: str | None = None
    """``info`` key of the constraint signal c_t (None: plain PPO, no multiplier)."""
    target: float = 0.9
    """The constraint's level: E[sum_t c_t] >= target per episode."""
    lagrange_lr: float = 0.05
    """Step size of the multiplier's projected dual ascent."""
    lagrange_init: float = 0.0
    """Initial multiplier."""

    @property
    def num_updates(self) -> int:
        return max(1, self.total_timesteps // (self.num_envs * self.num_steps))

    @property
    def minibatch_size(self) -> int:
        return self.num_envs * self.num_steps // self.num_minibatches


class ActorCritic(nn.Module):
    """Categorical actor and two critics (reward, constraint), each a 2 x ``hidden`` tanh MLP."""

    n_actions: int
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        def mlp(y, out, scale):
            for _ in range(2):
                y = nn.tanh(nn.Dense(self.hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(y))
            return nn.Dense(out, kernel_init=nn.initializers.orthogonal(scale))(y)

        logits = mlp(x, self.n_actions, 0.01)
        values = mlp(x, 2, 1.0)  # [..., 2]: reward value, constraint value
        return logits, values[..., 0], values[..., 1]


class Transition(NamedTuple):
    done: jax.Array
    action: jax.Array
    value: jax.Array
    cvalue: jax.Array
    reward: jax.Array
    constraint: jax.Array
    log_prob: jax.Array
    obs: jax.Array


def gae(values, rewards, dones, last_value, gamma: float, lam: float):
    """Generalised advantage estimates and returns of one time-major rollout ``[S, E]``
    (Schulman et al. 2016, Eq. 16; ``dones[t]``: step t ended its episode, so t+1 is a fresh one)."""
    def body(carry, x):
        adv, next_value = carry
        value, reward, done = x
        delta = reward + gamma * next_value * (1.0 - done) - value
        adv = delta + gamma * lam * (1.0 - done) * adv
        return (adv, value), adv

    _, advs = jax.lax.scan(body, (jnp.zeros_like(last_value), last_value), (values, rewards, dones), reverse=True)
    return advs, advs + values


def make_train(config: PPOConfig, env, env_params):
    """``train(rng) -> (params, metrics)`` for ``env`` (any gymnax environment with a discrete action
    space); jit it, vmap it over rngs for seeds. ``metrics`` [num_updates]: ``episode_return`` and
    ``episode_constraint`` (means over the episodes that ended in the update's rollout, NaN if none),
    ``lagrange`` (the multiplier after the update)."""
    c = config
    n_actions = env.action_space(env_params).n
    obs_shape = env.observation_space(env_params).shape
    net = ActorCritic(n_actions, c.hidden)
    constrained = c.constraint_key is not None

    def schedule(count):
        frac = 1.0 - (count // (c.num_minibatches * c.update_epochs)) / c.num_updates
        return c.lr * frac

    tx = optax.chain(optax.clip_by_global_norm(c.max_grad_norm),
                     optax.adam(schedule if c.anneal_lr else c.lr, eps=1e-5))

    def env_step(runner, _):
        params, opt_state, lam, env_state, obs, ep_ret, ep_con, rng = runner
        rng, k_act, k_step = jax.random.split(rng, 3)
        logits, value, cvalue = net.apply(params, obs)
        action = jax.random.categorical(k_act, logits)
        log_prob = jax.nn.log_softmax(logits)[jnp.arange(c.num_envs), action]
        obs2, env_state, reward, term, trunc, info = jax.vmap(env.step, (0, 0, 0, None))(
            jax.random.split(k_step, c.num_envs), env_state, action, env_params)
        done = jnp.logical_or(term, trunc)
        con = info[c.constraint_key].astype(jnp.float32) if constrained else jnp.zeros_like(reward)
        reward = reward.astype(jnp.float32)
        ep_ret, ep_con = ep_ret + reward, ep_con + con
        tr = Transition(done.astype(jnp.float32), action, value, cvalue, reward * c.reward_scale, con, log_prob, obs)
        ended = (done, ep_ret, ep_con)
        keep = 1.0 - done.astype(jnp.float32)
        return (params, opt_state, lam, env_state, obs2, ep_ret * keep, ep_con * keep, rng), (tr, ended)

    def loss_fn(params, batch, adv, ret, cret):
        tr = batch
        logits, value, cvalue = net.apply(params, tr.obs)
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, tr.action[:, None], -1)[:, 0]
        ratio = jnp.exp(logp - tr.log_prob)
        actor = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - c.clip_eps, 1 + c.clip_eps) * adv))
        critic = 0.5 * jnp.mean((value - ret) ** 2) + 0.5 * jnp.mean((cvalue - cret) ** 2)
        entropy = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, -1))
        return actor + c.vf_coef * critic - c.ent_coef * entropy

    def update_minibatch(carry, mb):
        params, opt_state = carry
        grads = jax.grad(loss_fn)(params, *mb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    def update_epoch(carry, _):
        params, opt_state, data, rng = carry
        rng, k = jax.random.split(rng)
        n = c.num_envs * c.num_steps
        perm = jax.random.permutation(k, n)
        mbs = jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:])[perm].reshape(
            (c.num_minibatches, c.minibatch_size) + x.shape[2:]), data)
        (params, opt_state), _ = jax.lax.scan(update_minibatch, (params, opt_state), mbs)
        return (params, opt_state, data, rng), None

    def update(runner, _):
        runner, (traj, (done, ep_ret, ep_con)) = jax.lax.scan(env_step, runner, None, c.num_steps)
        params, opt_state, lam, env_state, obs, ep_r, ep_c, rng = runner
        _, last_v, last_cv = net.apply(params, obs)
        adv_r, ret = gae(traj.value, traj.reward, traj.done, last_v, c.gamma, c.gae_lambda)
        adv_c, cret = gae(traj.cvalue, traj.constraint, traj.done, last_cv, c.gamma, c.gae_lambda)
        adv = (adv_r + lam * adv_c) / (1.0 + lam) if constrained else adv_r
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        rng, k = jax.random.split(rng)
        (params, opt_state, _, _), _ = jax.lax.scan(
            update_epoch, (params, opt_state, (traj, adv, ret, cret), k), None, c.update_epochs)
        n_done = jnp.sum(done)
        mean_of = lambda x: jnp.where(n_done > 0, jnp.sum(x * done) / jnp.maximum(n_done, 1), jnp.nan)  # noqa: E731
        c_hat = mean_of(ep_con)
        if constrained:  # projected dual ascent; no step when no episode ended
            lam = jnp.maximum(0.0, lam + jnp.where(n_done > 0, c.lagrange_lr * (c.target - c_hat), 0.0))
        metrics = {"episode_return": mean_of(ep_ret), "episode_constraint": c_hat, "lagrange": lam}
        return (params, opt_state, lam, env_state, obs, ep_r, ep_c, rng), metrics

    def train(rng):
        rng, k_init, k_reset = jax.random.split(rng, 3)
        params = net.init(k_init, jnp.zeros(obs_shape, jnp.float32))
        opt_state = tx.init(params)
        obs, env_state = jax.vmap(env.reset, (0, None))(jax.random.split(k_reset, c.num_envs), env_params)
        zeros = jnp.zeros(c.num_envs, jnp.float32)
        runner = (params, opt_state, jnp.float32(c.lagrange_init), env_state, obs, zeros, zeros, rng)
        runner, metrics = jax.lax.scan(update, runner, None, c.num_updates)
        return runner[0], metrics

    return train


def policy_probs(config: PPOConfig, n_actions: int, params: Any, obs: jax.Array) -> jax.Array:
    """The trained actor's probabilities ``[..., n_actions]`` on observations ``[..., obs_dim]``."""
    logits, _, _ = ActorCritic(n_actions, config.hidden).apply(params, obs)
    return jax.nn.softmax(logits, -1)
