"""Phase 1: the follower pi_F(a | x, q, alpha) by GAIL (Ho & Ermon 2016, arXiv 1606.03476; arXiv 2606.23026 §4.2, §6.4).

Convention (our choice: the common equivalent of Ho & Ermon's form, which has
D = 1 on policy samples; the paper does not say which it uses): the discriminator
D(o, a) = sigmoid(logit) is trained by Adam on the binary cross-entropy with
expert pairs labelled 1 and policy pairs 0, and the policy's reward is
r = -log(1 - D(o, a)) = softplus(logit). A gradient penalty on the
discriminator input keeps the reward smooth.

The follower is stage-wise (paper §2.1: BR_F is a per-turn arg max), so
its episode is one turn: occupancy matching reduces to matching the expert's
conditional action distribution on the demonstration observations
o = (x, q, alpha). Each iteration draws a batch of demonstrations, samples
the policy's actions on the same observations, updates D, and takes
``ppo_epochs`` PPO-clip steps on the one-step advantage r - V(o).

The expert (:func:`expert_demos`) is documented: it maximises U_F (paper
Eq. 8) under the surrogate's mean tokens and quality over an
``action_levels``^3 grid of actions, plus Gaussian jitter (bounded
rationality), in sessions whose leader outputs are drawn uniformly
(q in [0.5, 1], alpha in [0, 1]) and smoothed by the commitment rule.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from envs.governance.session import N_TASKS, SessionEnv, SessionParams, surrogate_predict

from .config import ExpertConfig, GAILConfig
from .nets import BoxPolicy, clipped_surrogate_loss, linear_anneal, mlp


@struct.dataclass
class Demos:
    """Expert tuples (s, q, alpha, T_ratio, a) (paper §6.1). ``obs`` = [x, q, alpha]."""

    obs: jax.Array  # [N, D + 2]
    action: jax.Array  # [N, 3] the expert's action (arg max plus jitter): what the learners see
    t_ratio: jax.Array  # [N] T_t / T_0(x_t)
    task: jax.Array  # [N]
    clean_action: jax.Array  # [N, 3] the noise-free arg max (imitation errors are measured against it)


def action_candidates(levels: int) -> jax.Array:
    """All ``levels``^3 actions of a regular grid on [0,1]^3. ``[levels**3, 3]``."""
    g = jnp.linspace(0.0, 1.0, levels)
    return jnp.stack(jnp.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)


def candidate_table(env: SessionEnv, params: SessionParams, cand: jax.Array):
    """Surrogate mean tokens and quality of every candidate action, per (task, model, history flag).

    The surrogate depends on the turn only through the history flag, so the
    expert's search is a table look-up. Returns two ``[6, M, 2, A]`` arrays.
    """
    K, M = N_TASKS, env.n_models
    kk, mm, hh = jnp.meshgrid(jnp.arange(K), jnp.arange(M), jnp.arange(2), indexing="ij")
    return surrogate_predict(params.surrogate, kk[..., None], mm[..., None], cand, hh[..., None], M)


def expert_action(env: SessionEnv, state, ell, params: SessionParams, cand: jax.Array, table, key, noise: float):
    """argmax_a U_F(x, l, a) over ``cand`` [A, 3] with surrogate means: (with clipped Gaussian jitter, noise-free)."""
    h = jnp.minimum(state.turn, 1)
    tok, q = table[0][state.task, state.model, h], table[1][state.task, state.model, h]
    t0 = env.reference_tokens(state, params)
    _, u_f = env.utilities(tok, q, t0, ell[None, :], state.task)
    a = cand[jnp.argmax(u_f)]
    return jnp.clip(a + noise * jax.random.normal(key, (3,)), 0.0, 1.0), a


def expert_demos(key, env: SessionEnv, params: SessionParams, cfg: ExpertConfig) -> Demos:
    """``cfg.n_demos`` expert tuples from sessions in the surrogate (any ``env.cfg.mode`` works)."""
    H = env.cfg.horizon
    n_sessions = -(-cfg.n_demos // H)
    cand = action_candidates(cfg.action_levels)
    table = candidate_table(env, params, cand)

    def session(k):
        k0, kr = jax.random.split(k)
        x, st = env.reset(k0, params)

        def turn(carry, kt):
            x, st = carry
            k1, k1b, k2, k3 = jax.random.split(kt, 4)
            raw = jnp.stack([jax.random.uniform(k1, minval=0.5, maxval=1.0), jax.random.uniform(k1b)])
            ell = env.commit(st, raw)
            a, clean = expert_action(env, st, ell, params, cand, table, k2, cfg.noise)
            nx, nst, _, _, info = env.step(k3, st, ell, a, params)
            return (nx, nst), (jnp.concatenate([x, ell]), a, info["tokens"] / info["t0"], st.task, clean)

        _, out = jax.lax.scan(turn, (x, st), jax.random.split(kr, H))
        return out

    obs, act, ratio, task, clean = jax.vmap(session)(jax.random.split(key, n_sessions))
    flat = lambda v: v.reshape((-1,) + v.shape[2:])[: cfg.n_demos]
    return Demos(flat(obs), flat(act), flat(ratio), flat(task), flat(clean))


def imitation_error(policy: BoxPolicy, params, demos: Demos) -> jax.Array:
    """Mean absolute error of the policy's mean action against the noise-free expert action on ``demos``."""
    return jnp.abs(policy.mean(params, demos.obs) - demos.clean_action).mean()


def make_bc(obs_dim: int, act_dim: int, cfg: GAILConfig):
    """Behaviour cloning of the follower: ``(policy, init, run)``, ``run(params_opt_key, demos, n)`` takes ``n``
    Adam steps (``cfg.bc_lr``) on minibatches of ``cfg.bc_batch`` demonstrations, minimising the squared error
    of the policy's mean action, sigmoid(mu), against the expert's action. The same :class:`BoxPolicy` as GAIL,
    so its parameters can start GAIL (``GAILConfig.bc_init``)."""
    policy = BoxPolicy(act_dim, cfg.hidden, cfg.policy)
    tx = optax.adam(cfg.bc_lr)

    def init(key):
        k1, k2 = jax.random.split(key)
        p = policy.init(k1, obs_dim)
        return p, tx.init(p), k2

    def loss(p, obs, act):
        return jnp.mean((policy.mean(p, obs) - act) ** 2)

    def run(st, demos: Demos, n_iters: int):
        def body(carry, _):
            p, opt, key = carry
            key, k = jax.random.split(key)
            idx = jax.random.randint(k, (cfg.bc_batch,), 0, demos.obs.shape[0])
            l, g = jax.value_and_grad(loss)(p, demos.obs[idx], demos.action[idx])
            upd, opt = tx.update(g, opt, p)
            return (optax.apply_updates(p, upd), opt, key), {"bc_loss": l}

        return jax.lax.scan(body, st, None, length=n_iters)

    return policy, init, run


class Discriminator:
    """D(o, a) as a logit MLP on the concatenation [o, a]."""

    def __init__(self, hidden=(64, 64)):
        self.net = mlp(1, hidden, final_scale=1.0)

    def init(self, key, in_dim: int):
        return self.net.init(key, jnp.zeros((in_dim,)))

    def logit(self, params, obs, action):
        return self.net.apply(params, jnp.concatenate([obs, action], -1))[..., 0]


def discriminator_loss(disc: Discriminator, params, obs_e, act_e, obs_p, act_p, grad_penalty: float = 0.0):
    """BCE with expert = 1, policy = 0, plus ``grad_penalty`` * E||grad_{[o,a]} logit||^2 on expert pairs."""
    le = disc.logit(params, obs_e, act_e)
    lp = disc.logit(params, obs_p, act_p)
    bce = optax.sigmoid_binary_cross_entropy(le, jnp.ones_like(le)).mean() + \
        optax.sigmoid_binary_cross_entropy(lp, jnp.zeros_like(lp)).mean()
    g = jax.vmap(jax.grad(lambda o, a: disc.logit(params, o, a), argnums=(0, 1)))(obs_e, act_e)
    gp = jnp.mean(jnp.sum(g[0] ** 2, -1) + jnp.sum(g[1] ** 2, -1))
    acc = 0.5 * (jnp.mean(le > 0) + jnp.mean(lp < 0))
    return bce + grad_penalty * gp, acc


def gail_reward(disc: Discriminator, params, obs, action):
    """r = -log(1 - D(o, a)) = softplus(logit) (expert = 1 convention; see the module docstring)."""
    return jax.nn.softplus(disc.logit(params, obs, action))


@struct.dataclass
class GAILState:
    actor: Any
    critic: Any
    disc: Any
    opt_pi: Any
    opt_d: Any
    key: jax.Array


def make_gail(obs_dim: int, act_dim: int, cfg: GAILConfig):
    """Build (policy, disc, init, run): ``run(state, demos, n) -> (state, metrics [n])``, pure and vmap-able.

    ``demos`` is an argument (not a closure constant) so XLA does not fold it into the program.
    """
    policy = BoxPolicy(act_dim, cfg.hidden, cfg.policy)
    critic = mlp(1, cfg.hidden, final_scale=1.0)
    disc = Discriminator(cfg.hidden)
    # with anneal_lr: policy_lr x (1 - i / iterations) in iteration i, over its ppo_epochs updates
    policy_step = linear_anneal(cfg.policy_lr, cfg.iterations, cfg.ppo_epochs) if cfg.anneal_lr else cfg.policy_lr
    tx_pi = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(policy_step))
    tx_d = optax.adam(cfg.disc_lr)

    def init(key) -> GAILState:
        k1, k2, k3, k4 = jax.random.split(key, 4)
        a = policy.init(k1, obs_dim)
        c = critic.init(k2, jnp.zeros((obs_dim,)))
        d = disc.init(k3, obs_dim + act_dim)
        return GAILState(a, c, d, tx_pi.init((a, c)), tx_d.init(d), k4)

    def pi_loss(params, obs, act, logp_old, adv, ret, key):
        a_p, c_p = params
        logp = policy.log_prob(a_p, obs, act)
        pg = clipped_surrogate_loss(logp, logp_old, adv, cfg.clip_eps)
        v = critic.apply(c_p, obs)[..., 0]
        ent = jnp.mean(policy.entropy_estimate(a_p, obs, key))
        return pg + 0.5 * jnp.mean((v - ret) ** 2) - cfg.entropy_coef * ent

    def iteration(st: GAILState, demos: Demos):
        key, k_idx, k_act, k_ppo = jax.random.split(st.key, 4)
        idx = jax.random.randint(k_idx, (cfg.batch,), 0, demos.obs.shape[0])
        obs, act_e = demos.obs[idx], demos.action[idx]
        act_p = policy.sample(st.actor, obs, k_act)

        def d_step(carry, _):
            d, opt_d = carry
            (loss, acc), g = jax.value_and_grad(discriminator_loss, argnums=1, has_aux=True)(
                disc, d, obs, act_e, obs, act_p, cfg.grad_penalty)
            upd, opt_d = tx_d.update(g, opt_d, d)
            return (optax.apply_updates(d, upd), opt_d), (loss, acc)

        (d, opt_d), (d_loss, d_acc) = jax.lax.scan(d_step, (st.disc, st.opt_d), None, length=cfg.disc_steps)
        reward = gail_reward(disc, d, obs, act_p)
        logp_old = policy.log_prob(st.actor, obs, act_p)
        v = critic.apply(st.critic, obs)[..., 0]
        adv = reward - v
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

        def ppo_step(carry, k):
            params, opt = carry
            g = jax.grad(pi_loss)(params, obs, act_p, logp_old, adv, reward, k)
            upd, opt = tx_pi.update(g, opt, params)
            return (optax.apply_updates(params, upd), opt), None

        (params, opt_pi), _ = jax.lax.scan(ppo_step, ((st.actor, st.critic), st.opt_pi), jax.random.split(k_ppo, cfg.ppo_epochs))
        mean_a = policy.mean(params[0], obs)
        metrics = {"disc_loss": d_loss[-1], "disc_acc": d_acc[-1], "gail_reward": reward.mean(),
                   "action_mae_vs_expert": jnp.abs(mean_a - act_e).mean()}
        return GAILState(params[0], params[1], d, opt_pi, opt_d, key), metrics

    def run(st: GAILState, demos: Demos, n_iters: int):
        return jax.lax.scan(lambda s, _: iteration(s, demos), st, None, length=n_iters)

    return policy, disc, init, run
