"""The CCPO trainer and its CPO baseline: Algorithm 1 of arXiv 2511.11828, nothing else.

:func:`make_train` returns a :class:`Trainer` of pure functions (PureJaxRL style):
``init(key) -> TrainState`` and ``run_chunk(state, train_idx, variant, n)``, a
``lax.scan`` over :func:`iteration`. One iteration is

1. estimate (:func:`sampled_problem` or :func:`exact_problem`): what the CPO step
   needs, from ``batch_size`` sampled episodes of pi in the replay chain (V-trace
   critics, Eq. 5-6; the paper's J-bar coverage estimate, Eq. 8) or replay-exactly
   over ``exact_batch`` questions' whole cached chains (``ccpo_jax.core.exact``);
2. a CPO trust-region step (Eq. 7; Achiam et al. 2017) on the policy parameters:
   maximise the objective of the target policy (the softmasked stochastic
   conformal policy S~_{pi,kappa} of Eq. 2-3 for CCPO, pi itself for CPO) subject
   to coverage J_C >= 1 - alpha and KL(S~_k || S~) <= delta;
3. kappa <- clip(kappa + eta_k (alpha - err_k), 0, 1) after each episode (Eq. 9),
   err_k measured on the set C_{pi_{k+1}, kappa}.

The per-variant switches (``conformal``, ``lam``, the margin ``z``, ``alpha``) are traced data, so CPO and the
CCPO rows train side by side in one vmapped program. The host loop (chunks,
checkpoints, TensorBoard) is :mod:`ccpo_jax.runtime.loop`; the member layout and sharding
:mod:`ccpo_jax.ccpo.members`; evaluation :mod:`ccpo_jax.ccpo.evaluation`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.core import conformal, exact, trust_region
from ccpo_jax.core.constraint import coverage_surrogate
from ccpo_jax.core.networks import critic_net, masked_probs, policy_net
from ccpo_jax.core.vtrace import vtrace
from envs.replay.env import EnvParams, evaluate_sets, trajectories


class TrainState(struct.PyTreeNode):
    policy: Any
    critic_r: Any
    critic_c: Any
    opt_r: Any
    opt_c: Any
    kappa: jax.Array  # online conformal threshold
    episodes: jax.Array  # episodes seen so far (the k of eta_k)
    iteration: jax.Array
    key: jax.Array


class VariantArrays(struct.PyTreeNode):
    """Traced per-variant switches (a batch axis for vmap)."""

    conformal: jax.Array  # bool []
    lam: jax.Array  # float []
    z: jax.Array  # float [], coverage margin in standard errors (Variant.margin)
    alpha: jax.Array  # float [], target miscoverage (Variant.alpha)


def variant_arrays(variants: list[Variant], config: TrainConfig) -> VariantArrays:
    return VariantArrays(
        conformal=jnp.asarray([v.conformal for v in variants]),
        lam=jnp.asarray([v.lam for v in variants], jnp.float32),
        z=jnp.asarray([v.margin(config) for v in variants], jnp.float32),
        alpha=jnp.asarray([v.alpha for v in variants], jnp.float32),
    )


class Critics(NamedTuple):
    """The two V-trace critics (reward, constraint) and their Adam states."""

    critic_r: Any
    critic_c: Any
    opt_r: Any
    opt_c: Any


class ExactTerms(NamedTuple):
    """What the replay-exact estimator computes for one policy over a batch of questions [N, ...]:
    the target policy's log-probabilities and probabilities [N, T, 3], and per question the
    expected cost, the success (or set coverage) and the expected set size [N]."""

    log_target: jax.Array
    probs: jax.Array
    cost: jax.Array
    success: jax.Array
    size: jax.Array


class CPOProblem(NamedTuple):
    """What an estimator hands to the CPO step (Eq. 7) for one iteration.

    ``objective(theta)`` is maximised; ``constraint(theta)`` is the coverage surrogate in
    CPO's "c + b'x <= 0" form (minus the coverage estimate); ``kl(theta)`` the mean KL of
    the target policy from theta_k; ``c = (1 - alpha) - coverage(theta_k)``. ``critics`` are
    the updated :class:`Critics`; ``metrics`` scalars for the curves. ``fisher`` =
    ``(log_target(theta), weights)`` with ``kl(theta) = sum(weights * KL(S~_k || S~_theta))``, for
    the CPO step's Fisher-vector product (``TrainConfig.hvp``).
    """

    objective: Callable
    constraint: Callable
    kl: Callable
    c: jax.Array
    critics: Critics
    metrics: dict
    fisher: tuple[Callable, jax.Array]


class Model(NamedTuple):
    """What every step of the trainer closes over: the configuration, the replay env, the networks."""

    cfg: TrainConfig
    params: EnvParams  # the replay env over all questions
    pi_net: nn.Module
    v_net: nn.Module
    critic_opt: optax.GradientTransformation
    reward_scale: float  # costs are ~0.02 cents a round: rewards scaled to O(1) for the critics

    def probs(self, pol, obs, avail):
        """pi(.|o) with unavailable actions masked out."""
        return masked_probs(self.pi_net.apply(pol, obs), avail)


class Trainer(NamedTuple):
    """What :func:`make_train` returns (the model is optax's ``GradientTransformation``).

    init:      ``init(key) -> TrainState``;
    run_chunk: ``run_chunk(state, train_idx [n_train], variant, n) -> (state, metrics)``,
               ``n`` iterations of Algorithm 1, metrics ``name -> [n]``;
    probs:     ``probs(policy_params, obs [..., F], available [..., 3]) -> pi [..., 3]``.
    """

    init: Callable[[jax.Array], TrainState]
    run_chunk: Callable[..., tuple[TrainState, dict]]
    probs: Callable[..., jax.Array]


def make_model(config: TrainConfig, params: EnvParams) -> Model:
    round_cost = params.cost[params.round_mask]
    # The CPO step is invariant to a positive scale of the objective.
    reward_scale = float(1.0 / max(float(np.mean(np.asarray(round_cost))), 1e-8))
    return Model(cfg=config, params=params, pi_net=policy_net(config.hidden), v_net=critic_net(config.hidden),
                 critic_opt=optax.adam(config.critic_lr), reward_scale=reward_scale)


def init_state(m: Model, key: jax.Array) -> TrainState:
    k_pi, k_r, k_c, k_state = jax.random.split(key, 4)
    dummy = jnp.zeros((m.params.F,), jnp.float32)
    pol = m.pi_net.init(k_pi, dummy)
    cr = m.v_net.init(k_r, dummy)
    cc = m.v_net.init(k_c, dummy)
    return TrainState(policy=pol, critic_r=cr, critic_c=cc, opt_r=m.critic_opt.init(cr), opt_c=m.critic_opt.init(cc),
                      kappa=jnp.float32(m.cfg.kappa0), episodes=jnp.int32(0), iteration=jnp.int32(0), key=k_state)


def target_fns(m: Model, conf, kappa, avail):
    """(log S~, hard S) as functions of the policy probabilities: the softmasked stochastic
    conformal policy (Eq. 2-3, softmask temperature eps) for CCPO, pi itself for vanilla CPO."""

    def log_soft(p):
        log_pi = jnp.where(avail, jnp.log(jnp.maximum(p, 1e-30)), -jnp.inf)
        return jnp.where(conf, conformal.soft_conformal_log_policy(p, kappa, avail, m.cfg.softmask_eps), log_pi)

    def hard(p):
        return jnp.where(conf, conformal.stochastic_conformal_policy(p, kappa, avail), p)

    return log_soft, hard


def lower_bound(mean, per_item, z):
    """The coverage estimate minus ``z`` standard errors of the mean of ``per_item`` (the
    variant's margin, ``Variant.margin``; ``z = 0`` gives ``mean`` exactly)."""
    n = per_item.shape[0]
    se = jnp.std(per_item) / jnp.sqrt(jnp.maximum(n - 1, 1))
    return mean - z * jax.lax.stop_gradient(se)


def _critic_update(m: Model, cp, opt, values, targets_of, valid):
    """``critic_steps`` Adam steps of one critic on the L2 loss to its V-trace targets (Eq. 5-6)."""
    tgt = jax.lax.stop_gradient(targets_of(values(cp)))

    def loss(p):
        err = jnp.where(valid, values(p) - tgt, 0.0)
        return jnp.sum(err**2) / jnp.sum(valid)

    def body(carry, _):
        p, o = carry
        l, g = jax.value_and_grad(loss)(p)
        upd, o = m.critic_opt.update(g, o, p)
        return (optax.apply_updates(p, upd), o), l

    (cp, opt), losses = jax.lax.scan(body, (cp, opt), None, length=m.cfg.critic_steps)
    return cp, opt, (losses[-1] if m.cfg.critic_steps else jnp.float32(0.0))


def sampled_problem(m: Model, state: TrainState, q: jax.Array, k_a: jax.Array, var: VariantArrays) -> CPOProblem:
    """Step 1 from ``batch_size`` sampled episodes: rollout of pi, V-trace critics, and the CPO
    surrogates (estimator ``jbar``, the paper's Eq. 8, or ``vtrace``)."""
    cfg, params = m.cfg, m.params
    B, T = q.shape[0], params.T
    obs, avail = params.obs[q], params.available[q]  # [B,T,F], [B,T,3]
    unsolv = params.unsolvable[q]

    # rollout of the behaviour policy pi (all rounds drawn at once; the episode ends
    # at the first answer action, so later draws are unused).
    probs = m.probs(state.policy, obs, avail)  # [B,T,3]
    a = jax.random.categorical(k_a, jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [B,T]
    traj = trajectories(a, params, q)
    valid, final = traj.valid, traj.done  # [B,T]
    t_f = jnp.argmax(final, axis=1)
    steps = jnp.arange(T)[None, :]
    success = jnp.any(traj.constraint > 0, axis=1)  # answer correct or unsolvable
    answered_correct = jnp.any(traj.correct, axis=1)

    log_soft_fn, hard_fn = target_fns(m, var.conformal, state.kappa, avail)
    s_hard = hard_fn(probs)
    pi_a = jnp.take_along_axis(probs, a[..., None], -1)[..., 0]
    s_a = jnp.take_along_axis(s_hard, a[..., None], -1)[..., 0]
    rho = jnp.where(valid, s_a / jnp.maximum(pi_a, 1e-8), 0.0)  # Eq. 6 (unclipped here)

    # Set size of C_{pi,kappa} for the lambda penalty (pointwise CPO: 1).
    in_set = conformal.conformal_set(probs, state.kappa, avail)
    set_size = jnp.where(var.conformal, evaluate_sets(in_set, params, q).set_size, 1)

    cost = params.cost[q]  # [B,T] cents
    r = traj.reward - jnp.where(final, var.lam * set_size[:, None], 0.0)  # Eq. 4
    r = r * m.reward_scale
    c = traj.constraint  # Eq. 5
    discount = jnp.where(steps < t_f[:, None], 1.0, 0.0)

    # critics on V-trace targets.
    def values(cp):
        return m.v_net.apply(cp, obs)[..., 0]  # [B,T]

    def vtrace_batch(v, rew):
        v_next = jnp.concatenate([v[:, 1:], jnp.zeros((B, 1))], axis=1) * discount
        return jax.vmap(lambda *x: vtrace(*x[:5], mask=x[5]))(v, v_next, rew, discount, rho, valid)

    critic_r, opt_r, loss_r = _critic_update(m, state.critic_r, state.opt_r, values,
                                             lambda v: vtrace_batch(v, r).targets, valid)
    critic_c, opt_c, loss_c = _critic_update(m, state.critic_c, state.opt_c, values,
                                             lambda v: vtrace_batch(v, c).targets, valid)
    vt_r = vtrace_batch(values(critic_r), r)
    vt_c = vtrace_batch(values(critic_c), c)
    adv_r = jnp.where(valid, vt_r.advantages_clipped, 0.0)
    adv_c = jnp.where(valid, vt_c.advantages_unclipped, 0.0)
    n_valid = jnp.sum(valid)

    # the surrogates of the CPO step on the softmasked target S~ (Eq. 7).
    logs_old = jax.lax.stop_gradient(log_soft_fn(probs))  # [B,T,3]
    logs_old_a = jnp.take_along_axis(logs_old, a[..., None], -1)[..., 0]
    log_pi_a = jnp.log(jnp.maximum(pi_a, 1e-30))

    def log_target(pol):
        return log_soft_fn(m.probs(pol, obs, avail))

    def log_target_a(pol):
        return jnp.take_along_axis(log_target(pol), a[..., None], -1)[..., 0]

    def ratio(pol):
        return jnp.exp(jnp.where(valid, log_target_a(pol) - logs_old_a, 0.0))

    def objective(pol):
        # Reward surrogate with the clipped V-trace advantage (paper section 6, "Clipping").
        return jnp.sum(jnp.where(valid, ratio(pol) * adv_r, 0.0)) / n_valid

    if cfg.estimator == "jbar":
        # Eq. 8: J-bar = mean(1[unsolvable] + prod_t (S~/pi)(a_t|o_t) 1[correct]),
        # unclipped ratios (ccpo_jax.core.constraint), differentiable through S~_theta.
        def coverage(pol):
            return coverage_surrogate(log_target_a(pol), log_pi_a, answered_correct, unsolv, valid)

        j_c = coverage(state.policy)
        per_episode = jnp.where(unsolv, 1.0, jnp.exp(jnp.sum(jnp.where(valid, logs_old_a - log_pi_a, 0.0), -1))
                                * answered_correct)
    else:
        # V-trace estimate of J_C under the target policy from the first round
        # (the constraint signal already counts unsolvable questions as covered).
        j_c = jnp.mean(vt_c.targets[:, 0])
        per_episode = vt_c.targets[:, 0]

        def coverage(pol):
            # Linearised J_C(theta) ~= j_c + sum_t E[(ratio - 1) A_C] per episode, unclipped
            # advantage (clipping would bias the constraint gradient).
            return jnp.sum(jnp.where(valid, (ratio(pol) - 1.0) * adv_c, 0.0)) / B

    def kl(pol):
        kl_t = conformal.soft_policy_kl(logs_old, log_target(pol))
        return jnp.sum(jnp.where(valid, kl_t, 0.0)) / n_valid

    metrics = {
        "batch_cost_cents": jnp.mean(jnp.sum(jnp.where(valid, cost, 0.0), axis=1)),
        "batch_success": jnp.mean(success.astype(jnp.float32)),
        "batch_len": jnp.mean(t_f.astype(jnp.float32) + 1.0),
        "j_c_estimate": j_c,
        "critic_loss_r": loss_r,
        "critic_loss_c": loss_c,
    }
    return CPOProblem(
        objective=objective, constraint=lambda pol: -coverage(pol), kl=kl,
        c=(1.0 - var.alpha) - lower_bound(j_c, per_episode, var.z), critics=Critics(critic_r, critic_c, opt_r, opt_c),
        metrics=metrics, fisher=(log_target, jnp.where(valid, 1.0, 0.0) / n_valid),
    )


def exact_problem(m: Model, state: TrainState, qx: jax.Array, var: VariantArrays) -> CPOProblem:
    """Step 1 replay-exactly (``estimator="exact"``, beyond the paper): expected cost and success
    of the target policy over the whole chains of questions ``qx`` (:mod:`ccpo_jax.core.exact`), the
    KL weighted by the target's reach probabilities. No critics."""
    cfg, params = m.cfg, m.params
    obs, avail = params.obs[qx], params.available[qx]
    mask = params.round_mask[qx]
    bc, gc, unsolv = params.base_correct[qx], params.guide_correct[qx], params.unsolvable[qx]
    cost = params.cost[qx]
    log_soft_fn, _ = target_fns(m, var.conformal, state.kappa, avail)

    def terms(pol) -> ExactTerms:
        pi = m.probs(pol, obs, avail)
        logs = log_soft_fn(pi)
        P = jnp.where(avail, jnp.exp(logs), 0.0)
        cst, succ = exact.expected_cost(P, cost), exact.success_probability(P, bc, gc, unsolv)
        if cfg.ccpo_target == "set":  # CCPO rows: the soft set rollout itself
            s_cost, s_cov, s_size = exact.soft_set_outcomes(pi, state.kappa, avail, bc, gc, unsolv, cost,
                                                            cfg.softmask_eps)
            return ExactTerms(logs, P, jnp.where(var.conformal, s_cost, cst), jnp.where(var.conformal, s_cov, succ),
                              jnp.where(var.conformal, s_size, 1.0))
        size = jnp.where(var.conformal, exact.soft_set_size(pi, state.kappa, avail, cfg.softmask_eps), 1.0)
        return ExactTerms(logs, P, cst, succ, size)

    old = terms(state.policy)
    logs_old, P_old, cost_old, succ_old = jax.lax.stop_gradient(old.log_target), old.probs, old.cost, old.success
    w = exact.occupancy_weights(P_old, mask)
    kl_w = jnp.where(mask, w, 0.0) / jnp.maximum(jnp.sum(w), 1e-8)  # kl's weight per (question, round): the Fisher's

    def log_target(pol):
        return log_soft_fn(m.probs(pol, obs, avail))

    def objective(pol):  # maximise -(E[cost] + lambda E|C|), scaled like the sampled rewards
        t = terms(pol)
        return -jnp.mean(t.cost + var.lam * t.size) * m.reward_scale

    def constraint(pol):  # "<= 0" form of Pr[success] >= 1 - alpha
        return -jnp.mean(terms(pol).success)

    def kl(pol):
        kl_t = conformal.soft_policy_kl(logs_old, log_target(pol))
        return jnp.sum(w * jnp.where(mask, kl_t, 0.0)) / jnp.maximum(jnp.sum(w), 1e-8)

    j_c = jnp.mean(succ_old)
    metrics = {
        "batch_cost_cents": jnp.mean(cost_old),
        "batch_success": j_c,
        "batch_len": jnp.mean(exact.expected_length(P_old)),
        "j_c_estimate": j_c,
        "critic_loss_r": jnp.float32(0.0),
        "critic_loss_c": jnp.float32(0.0),
    }
    return CPOProblem(
        objective=objective, constraint=constraint, kl=kl, c=(1.0 - var.alpha) - lower_bound(j_c, succ_old, var.z),
        critics=Critics(state.critic_r, state.critic_c, state.opt_r, state.opt_c), metrics=metrics,
        fisher=(log_target, kl_w),
    )


def online_kappa(m: Model, kappa, episodes, policy, q: jax.Array, alpha):
    """Eq. 9, one step per episode of questions ``q``: err_k = 1[the set C_{pi,kappa} misses q_k]."""
    params = m.params
    new_probs = m.probs(policy, params.obs[q], params.available[q])
    k_i = jax.vmap(conformal.largest_covering_kappa)(
        new_probs, params.base_correct[q], params.guide_correct[q], params.round_mask[q], params.unsolvable[q]
    )

    def body(carry, kappa_i):
        kap, k = carry
        err = (kap > kappa_i).astype(jnp.float32)
        kap = conformal.kappa_step(kap, err, k + 1, alpha, m.cfg.eta0, m.cfg.xi)
        return (kap, k + 1), err

    (kappa, episodes), errs = jax.lax.scan(body, (kappa, episodes), k_i)
    return kappa, episodes, errs


def iteration(m: Model, state: TrainState, train_idx: jax.Array, var: VariantArrays) -> tuple[TrainState, dict]:
    """One pass of Algorithm 1: estimate (step 1), CPO step (step 2), online kappa (step 3)."""
    cfg = m.cfg
    key, k_q, k_a, k_x = jax.random.split(state.key, 4)
    q = train_idx[jax.random.randint(k_q, (cfg.batch_size,), 0, train_idx.shape[0])]
    # 1. estimate
    if cfg.estimator == "exact":
        n_pool = train_idx.shape[0]
        qx = jax.random.choice(k_x, train_idx, (cfg.exact_batch,), replace=False) \
            if 0 < cfg.exact_batch < n_pool else train_idx
        prob = exact_problem(m, state, qx, var)
    else:
        prob = sampled_problem(m, state, q, k_a, var)
    # 2. CPO step (Eq. 7)
    policy, info = trust_region.cpo_update(
        state.policy, prob.objective, prob.constraint, prob.kl, prob.c, cfg.delta, cg_iters=cfg.cg_iters,
        damping=cfg.damping, backtrack_steps=cfg.backtrack_steps, backtrack_decay=cfg.backtrack_decay,
        fisher=prob.fisher if cfg.hvp == "fisher" else None,
    )
    # 3. online kappa on C_{pi_{k+1}, kappa} (Eq. 9)
    kappa, episodes, errs = online_kappa(m, state.kappa, state.episodes, policy, q, var.alpha)

    critic_r, critic_c, opt_r, opt_c = prob.critics
    new_state = TrainState(policy=policy, critic_r=critic_r, critic_c=critic_c, opt_r=opt_r, opt_c=opt_c,
                           kappa=kappa, episodes=episodes, iteration=state.iteration + 1, key=key)
    metrics = {
        "kappa": kappa,
        "coverage_err_online": jnp.mean(errs),
        **prob.metrics,
        "cpo_case": info.direction.case.astype(jnp.float32),
        "step_accepted": info.accepted.astype(jnp.float32),
        "kl": info.kl,
    }
    return new_state, metrics


def make_train(config: TrainConfig, params: EnvParams) -> Trainer:
    """The trainer of ``config`` on the replay env ``params`` (closed over: all questions).

    ``train_idx`` of ``run_chunk`` is the [n_train] question pool of one member (a split
    and seed); ``metrics`` are per-iteration arrays ``[n]``.
    """
    m = make_model(config, params)

    def run_chunk(state: TrainState, train_idx: jax.Array, var: VariantArrays, n: int):
        return jax.lax.scan(lambda s, _: iteration(m, s, train_idx, var), state, None, length=n)

    return Trainer(init=lambda key: init_state(m, key), run_chunk=run_chunk, probs=m.probs)
