"""The CCPO trainer and its CPO baselines (paper Algorithm 1; BRIEF 1.5-1.11).

PureJaxRL style: :func:`make_train` returns pure functions; one iteration is

1. sample ``batch_size`` training questions and roll out the behaviour policy
   pi in the replay chain (every round's action is drawn at once; the episode
   ends at the first answer action, so no scan is needed);
2. V-trace targets for the reward critic V and the constraint critic V_C with
   importance weights rho = S(a|o) / pi(a|o), S the target policy (the hard
   stochastic conformal policy S_{pi,kappa} for CCPO, pi itself for CPO);
   both critics take ``critic_steps`` Adam steps on the L2 loss (Eq. 5-6);
3. a CPO trust-region step (Eq. 7) on the policy parameters: maximise the
   clipped-ratio reward surrogate of the softmasked target S~_{pi,kappa}
   subject to the linearised coverage constraint J_C >= 1 - alpha (unclipped
   ratio, paper section 6) and KL(S~_k || S~) <= delta;
4. kappa <- clip(kappa + eta_k (alpha - err_k), 0, 1) after each episode
   (Eq. 9 with the sign of BRIEF 1.10), err_k measured on the set
   C_{pi_{k+1}, kappa}.

Per-variant switches (``conformal``, ``lam``) are traced data, so CPO and the
CCPO rows train side by side in one vmapped program, and with
``--protocol retrain`` every split does too. Training runs in compiled chunks
of ``config.chunk`` iterations; between chunks the host updates the progress
bar, writes TensorBoard scalars and an orbax checkpoint, so a killed run
resumes from the last chunk and ends bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ccpo_jax import conformal, exact, sharding, trust_region
from ccpo_jax.config import TrainConfig, Variant
from ccpo_jax.constraint import coverage_surrogate
from ccpo_jax.errors import UserError
from ccpo_jax.networks import critic_net, masked_probs, policy_net
from ccpo_jax.vtrace import vtrace
from envs.orchestration import EnvParams, evaluate_actions, evaluate_sets, trajectories


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


class CPOProblem(NamedTuple):
    """What an estimator hands to the CPO step (paper Eq. 7) for one iteration.

    ``objective(theta)`` is maximised; ``constraint(theta)`` is the coverage surrogate in
    CPO's "c + b'x <= 0" form (minus the coverage estimate); ``kl(theta)`` the mean KL of
    the target policy from theta_k; ``c = (1 - alpha) - coverage(theta_k)``. ``critics`` are
    the updated (critic_r, critic_c, opt_r, opt_c); ``metrics`` scalars for the curves.
    """

    objective: Callable
    constraint: Callable
    kl: Callable
    c: jax.Array
    critics: tuple
    metrics: dict


class VariantArrays(struct.PyTreeNode):
    """Traced per-variant switches (a batch axis for vmap)."""

    conformal: jax.Array  # bool []
    lam: jax.Array  # float []


def variant_arrays(variants: list[Variant]) -> VariantArrays:
    return VariantArrays(
        conformal=jnp.asarray([v.conformal for v in variants]),
        lam=jnp.asarray([v.lam for v in variants], jnp.float32),
    )


def make_train(config: TrainConfig, params: EnvParams):
    """Build ``init(key) -> TrainState`` and ``run_chunk(state, train_idx, variant, n) -> (state, metrics)``.

    ``params`` (the replay env, all questions) is closed over; ``train_idx`` is
    the [n_train] question pool of one split. ``metrics`` are per-iteration
    arrays ``[n]``.
    """
    cfg = config
    T, F = params.T, params.F
    pi_net = policy_net(cfg.hidden)
    v_net = critic_net(cfg.hidden)
    critic_opt = optax.adam(cfg.critic_lr)
    # Costs are ~0.02 cents a round: scale rewards to O(1) for the critic. The CPO
    # step is invariant to a positive scale of the objective.
    round_cost = params.cost[params.round_mask]
    reward_scale = float(1.0 / max(float(np.mean(np.asarray(round_cost))), 1e-8))

    def init(key: jax.Array) -> TrainState:
        k_pi, k_r, k_c, k_state = jax.random.split(key, 4)
        dummy = jnp.zeros((F,), jnp.float32)
        pol = pi_net.init(k_pi, dummy)
        cr = v_net.init(k_r, dummy)
        cc = v_net.init(k_c, dummy)
        return TrainState(
            policy=pol,
            critic_r=cr,
            critic_c=cc,
            opt_r=critic_opt.init(cr),
            opt_c=critic_opt.init(cc),
            kappa=jnp.float32(cfg.kappa0),
            episodes=jnp.int32(0),
            iteration=jnp.int32(0),
            key=k_state,
        )

    def probs_fn(pol, obs, avail):
        return masked_probs(pi_net.apply(pol, obs), avail)

    def target_fns(conf, kappa, avail):
        """(log S~, hard S) as functions of the policy probabilities: the softmasked
        stochastic conformal policy for CCPO, pi itself for vanilla CPO."""

        def log_soft(p):
            log_pi = jnp.where(avail, jnp.log(jnp.maximum(p, 1e-30)), -jnp.inf)
            return jnp.where(conf, conformal.soft_conformal_log_policy(p, kappa, avail, cfg.softmask_eps), log_pi)

        def hard(p):
            return jnp.where(conf, conformal.stochastic_conformal_policy(p, kappa, avail), p)

        return log_soft, hard

    def lower_bound(mean, per_item):
        """The coverage estimate minus ``constraint_z`` standard errors of the mean of ``per_item``."""
        if cfg.constraint_z == 0.0:
            return mean
        n = per_item.shape[0]
        se = jnp.std(per_item) / jnp.sqrt(jnp.maximum(n - 1, 1))
        return mean - cfg.constraint_z * jax.lax.stop_gradient(se)

    def sampled_problem(state: TrainState, q: jax.Array, k_a: jax.Array, var: VariantArrays) -> CPOProblem:
        """Steps 1-2 of Algorithm 1 from ``batch_size`` sampled episodes: rollout of pi,
        V-trace critics, and the CPO surrogates (estimator ``jbar`` or ``vtrace``)."""
        B = q.shape[0]
        obs, avail = params.obs[q], params.available[q]  # [B,T,F], [B,T,3]
        unsolv = params.unsolvable[q]

        # 1. rollout of the behaviour policy pi (all rounds drawn at once; the
        # episode ends at the first answer action, so later draws are unused).
        probs = probs_fn(state.policy, obs, avail)  # [B,T,3]
        a = jax.random.categorical(k_a, jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [B,T]
        traj = trajectories(a, params, q)
        valid, final = traj.valid, traj.done  # [B,T]
        t_f = jnp.argmax(final, axis=1)
        steps = jnp.arange(T)[None, :]
        success = jnp.any(traj.constraint > 0, axis=1)  # answer correct or unsolvable
        answered_correct = jnp.any(traj.correct, axis=1)

        log_soft_fn, hard_fn = target_fns(var.conformal, state.kappa, avail)
        s_hard = hard_fn(probs)
        pi_a = jnp.take_along_axis(probs, a[..., None], -1)[..., 0]
        s_a = jnp.take_along_axis(s_hard, a[..., None], -1)[..., 0]
        rho = jnp.where(valid, s_a / jnp.maximum(pi_a, 1e-8), 0.0)  # Eq. 6 (unclipped here)

        # Set size of C_{pi,kappa} for the lambda penalty (pointwise CPO: 1).
        in_set = conformal.conformal_set(probs, state.kappa, avail)
        set_size = jnp.where(var.conformal, evaluate_sets(in_set, params, q).set_size, 1)

        cost = params.cost[q]  # [B,T] cents
        r = traj.reward - jnp.where(final, var.lam * set_size[:, None], 0.0)  # Eq. 4
        r = r * reward_scale
        c = traj.constraint  # Eq. 5
        discount = jnp.where(steps < t_f[:, None], 1.0, 0.0)

        # 2. critics on V-trace targets.
        def values(cp):
            return v_net.apply(cp, obs)[..., 0]  # [B,T]

        def vtrace_batch(v, rew):
            v_next = jnp.concatenate([v[:, 1:], jnp.zeros((B, 1))], axis=1) * discount
            return jax.vmap(lambda *x: vtrace(*x[:5], mask=x[5]))(v, v_next, rew, discount, rho, valid)

        def critic_update(cp, opt, rew):
            tgt = vtrace_batch(values(cp), rew).targets
            tgt = jax.lax.stop_gradient(tgt)

            def loss(p):
                err = jnp.where(valid, values(p) - tgt, 0.0)
                return jnp.sum(err**2) / jnp.sum(valid)

            def body(carry, _):
                p, o = carry
                l, g = jax.value_and_grad(loss)(p)
                upd, o = critic_opt.update(g, o, p)
                return (optax.apply_updates(p, upd), o), l

            (cp, opt), losses = jax.lax.scan(body, (cp, opt), None, length=cfg.critic_steps)
            return cp, opt, (losses[-1] if cfg.critic_steps else jnp.float32(0.0))

        critic_r, opt_r, loss_r = critic_update(state.critic_r, state.opt_r, r)
        critic_c, opt_c, loss_c = critic_update(state.critic_c, state.opt_c, c)
        vt_r = vtrace_batch(values(critic_r), r)
        vt_c = vtrace_batch(values(critic_c), c)
        adv_r = jnp.where(valid, vt_r.advantages_clipped, 0.0)
        adv_c = jnp.where(valid, vt_c.advantages_unclipped, 0.0)
        n_valid = jnp.sum(valid)

        # 3. the surrogates of the CPO step on the softmasked target S~ (Eq. 7).
        logs_old = jax.lax.stop_gradient(log_soft_fn(probs))  # [B,T,3]
        logs_old_a = jnp.take_along_axis(logs_old, a[..., None], -1)[..., 0]
        log_pi_a = jnp.log(jnp.maximum(pi_a, 1e-30))

        def log_target(pol):
            return log_soft_fn(probs_fn(pol, obs, avail))

        def log_target_a(pol):
            return jnp.take_along_axis(log_target(pol), a[..., None], -1)[..., 0]

        def ratio(pol):
            return jnp.exp(jnp.where(valid, log_target_a(pol) - logs_old_a, 0.0))

        def objective(pol):
            # Reward surrogate with the clipped V-trace advantage (paper section 6).
            return jnp.sum(jnp.where(valid, ratio(pol) * adv_r, 0.0)) / n_valid

        if cfg.estimator == "jbar":
            # Paper Eq. 8: J-bar = mean(1[unsolvable] + prod_t (S~/pi)(a_t|o_t) 1[correct]),
            # unclipped ratios (ccpo_jax.constraint), differentiable through S~_theta.
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
            c=(1.0 - cfg.alpha) - lower_bound(j_c, per_episode), critics=(critic_r, critic_c, opt_r, opt_c),
            metrics=metrics,
        )

    def exact_problem(state: TrainState, qx: jax.Array, var: VariantArrays) -> CPOProblem:
        """Steps 1-2 of Algorithm 1, replay-exact (``estimator="exact"``, beyond the paper):
        expected cost and success of the target policy over the whole chains of questions
        ``qx`` (:mod:`ccpo_jax.exact`), the KL weighted by the target's reach probabilities."""
        obs, avail = params.obs[qx], params.available[qx]
        mask = params.round_mask[qx]
        bc, gc, unsolv = params.base_correct[qx], params.guide_correct[qx], params.unsolvable[qx]
        cost = params.cost[qx]
        log_soft_fn, _ = target_fns(var.conformal, state.kappa, avail)

        def terms(pol):
            pi = probs_fn(pol, obs, avail)
            logs = log_soft_fn(pi)
            P = jnp.where(avail, jnp.exp(logs), 0.0)
            cst, succ = exact.expected_cost(P, cost), exact.success_probability(P, bc, gc, unsolv)
            if cfg.ccpo_target == "set":  # CCPO rows: the soft set rollout itself
                s_cost, s_cov, s_size = exact.soft_set_outcomes(pi, state.kappa, avail, bc, gc, unsolv, cost,
                                                                cfg.softmask_eps)
                return (logs, P, jnp.where(var.conformal, s_cost, cst), jnp.where(var.conformal, s_cov, succ),
                        jnp.where(var.conformal, s_size, 1.0))
            size = jnp.where(var.conformal, exact.soft_set_size(pi, state.kappa, avail, cfg.softmask_eps), 1.0)
            return logs, P, cst, succ, size

        logs_old, P_old, cost_old, succ_old, _ = terms(state.policy)
        logs_old = jax.lax.stop_gradient(logs_old)
        w = exact.occupancy_weights(P_old, mask)

        def objective(pol):  # maximise -(E[cost] + lambda E|C|), scaled like the sampled rewards
            _, _, cst, _, size = terms(pol)
            return -jnp.mean(cst + var.lam * size) * reward_scale

        def constraint(pol):  # "<= 0" form of Pr[success] >= 1 - alpha
            return -jnp.mean(terms(pol)[3])

        def kl(pol):
            kl_t = conformal.soft_policy_kl(logs_old, log_soft_fn(probs_fn(pol, obs, avail)))
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
            objective=objective, constraint=constraint, kl=kl, c=(1.0 - cfg.alpha) - lower_bound(j_c, succ_old),
            critics=(state.critic_r, state.critic_c, state.opt_r, state.opt_c), metrics=metrics,
        )

    def iteration(state: TrainState, train_idx: jax.Array, var: VariantArrays):
        """One pass of Algorithm 1: estimate (steps 1-2), CPO step (3), online kappa (4)."""
        key, k_q, k_a, k_x = jax.random.split(state.key, 4)
        q = train_idx[jax.random.randint(k_q, (cfg.batch_size,), 0, train_idx.shape[0])]
        if cfg.estimator == "exact":
            n_pool = train_idx.shape[0]
            if 0 < cfg.exact_batch < n_pool:
                qx = jax.random.choice(k_x, train_idx, (cfg.exact_batch,), replace=False)
            else:
                qx = train_idx
            prob = exact_problem(state, qx, var)
        else:
            prob = sampled_problem(state, q, k_a, var)

        # 3. CPO step (Eq. 7).
        policy, info = trust_region.cpo_update(
            state.policy,
            prob.objective,
            prob.constraint,
            prob.kl,
            prob.c,
            cfg.delta,
            cg_iters=cfg.cg_iters,
            damping=cfg.damping,
            backtrack_steps=cfg.backtrack_steps,
            backtrack_decay=cfg.backtrack_decay,
        )

        # 4. online kappa, one step per sampled episode, on C_{pi_{k+1}, kappa} (Eq. 9).
        avail = params.available[q]
        new_probs = probs_fn(policy, params.obs[q], avail)
        k_i = jax.vmap(conformal.largest_covering_kappa)(
            new_probs, params.base_correct[q], params.guide_correct[q], params.round_mask[q], params.unsolvable[q]
        )

        def kappa_body(carry, kappa_i):
            kap, k = carry
            err = (kap > kappa_i).astype(jnp.float32)
            kap = conformal.kappa_step(kap, err, k + 1, cfg.alpha, cfg.eta0, cfg.xi)
            return (kap, k + 1), err

        (kappa, episodes), errs = jax.lax.scan(kappa_body, (state.kappa, state.episodes), k_i)

        critic_r, critic_c, opt_r, opt_c = prob.critics
        new_state = TrainState(
            policy=policy,
            critic_r=critic_r,
            critic_c=critic_c,
            opt_r=opt_r,
            opt_c=opt_c,
            kappa=kappa,
            episodes=episodes,
            iteration=state.iteration + 1,
            key=key,
        )
        metrics = {
            "kappa": kappa,
            "coverage_err_online": jnp.mean(errs),
            **prob.metrics,
            "cpo_case": info.direction.case.astype(jnp.float32),
            "step_accepted": info.accepted.astype(jnp.float32),
            "kl": info.kl,
        }
        return new_state, metrics

    def run_chunk(state: TrainState, train_idx: jax.Array, var: VariantArrays, n: int):
        def body(s, _):
            return iteration(s, train_idx, var)

        return jax.lax.scan(body, state, None, length=n)

    return init, run_chunk, probs_fn


# ---------------------------------------------------------------------------
# Evaluation of trained policies over many splits (DESIGN 5).


def policy_tables(policy, params: EnvParams, hidden=None):
    """Probabilities of every question and round [Q,T,3] and each question's largest covering kappa [Q].

    The forward pass runs in fixed-size row blocks (:func:`ccpo_jax.export.blocked_policy_probs`),
    exactly as the exported router computes it: XLA's CPU matmul rounds differently for
    different batch sizes, and kappa-hat equals one calibration probability, so a 1-ulp
    difference could flip a set. With blocks, the router's sets equal the trainer's bit for bit.
    """
    from ccpo_jax.export import blocked_policy_probs

    probs = blocked_policy_probs(policy, params.obs, params.available, hidden)
    kappa_i = jax.vmap(conformal.largest_covering_kappa)(
        probs, params.base_correct, params.guide_correct, params.round_mask, params.unsolvable
    )
    return probs, kappa_i


def eval_conformal(probs, kappa, params: EnvParams, idx):
    """Metrics of the set-valued policy C_{pi,kappa} on questions ``idx`` [N]."""
    sets = conformal.conformal_set(probs[idx], kappa, params.available[idx])
    return evaluate_sets(sets, params, idx)


def eval_batch_calibrated(probs, kappa_i, params: EnvParams, cal_idx, test_idx, alpha):
    kappa_hat = conformal.calibrate_kappa(kappa_i[cal_idx], alpha)
    return eval_conformal(probs, kappa_hat, params, test_idx), kappa_hat


def eval_pointwise(key, probs, params: EnvParams, idx):
    """The stochastic pointwise policy pi (rows 'CPO'): one sampled action per round."""
    p = probs[idx]
    a = jax.random.categorical(key, jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    return evaluate_actions(a.astype(jnp.int32), params, idx)


# ---------------------------------------------------------------------------
# Host driver: chunks, progress, TensorBoard, checkpoints.


def _checkpoint_manager(ckpt_dir: Path):
    # orbax CheckpointManager + a digest per step, checked before restore; damaged steps
    # are refused (one line naming the file) and the previous good one used (ccpo_jax/checkpoints.py).
    from ccpo_jax.checkpoints import VerifiedCheckpoints

    return VerifiedCheckpoints(ckpt_dir, max_to_keep=2)


def _progress_fields(m: dict, variants, S: int) -> str:
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


def train_many(
    config: TrainConfig,
    params: EnvParams,
    variants: list[Variant],
    train_idx: np.ndarray,
    key: jax.Array,
    *,
    ckpt_dir: Path | None = None,
    progress: bool = True,
    on_chunk: Callable[[int, dict], None] | None = None,
    stop_after_chunks: int | None = None,
    mesh=None,
    member_block: int | None = None,
):
    """Train every variant on every row of ``train_idx`` [S, n_train] in one vmapped program.

    Returns ``(state, metrics, timing)``: ``state`` leaves have leading axes [V, S];
    ``metrics[name]`` is [V, S, iterations]. ``ckpt_dir`` enables orbax checkpoints
    after every chunk and resumption from the latest one. ``stop_after_chunks``
    simulates a kill (tests). ``mesh`` (a 1-D ``ccpo_jax.sharding.make_mesh``) shards the
    flat V * S member axis over its devices (padded to a multiple of the device
    count, padding stripped from results and checkpoints). ``member_block`` computes the
    members ``member_block`` at a time (``sharding.blocked_vmap``); with a mesh every
    device then runs its own single-device program (``sharding.PerDevice``, one
    compilation per device; across hosts the results are all-gathered), and the run is
    bit-identical to the one-device run with the same block, on any number of devices
    and hosts. Without a block a sharded run (one SPMD program) matches one device's
    only up to rounding, which the CPO step amplifies over long runs.
    """
    from tqdm.auto import tqdm

    init, run_chunk, _ = make_train(config, params)
    V, S = len(variants), int(train_idx.shape[0])
    var = variant_arrays(variants)
    keys = jax.random.split(key, V * S).reshape(V, S, -1) if key.ndim == 1 else key
    train_idx = jnp.asarray(train_idx, jnp.int32)

    # One flat batch axis of V * S members (variant-major): simpler to shard than
    # nested vmaps (see the note on init below).
    flat_var = jax.tree.map(lambda x: jnp.repeat(x, S, axis=0), var)
    flat_idx = jnp.tile(train_idx, (V, 1))
    # Not jitted, and one flat member axis: with flax's orthogonal initialiser (a
    # batched LAPACK QR) a jitted, nested-vmapped init froze XLA:CPU (jaxlib 0.10.2).
    # networks.py now uses variance scaling; this path stays the conservative one.
    state = jax.vmap(init)(keys.reshape(V * S, -1))
    if member_block is not None and int(member_block) < 1:
        raise UserError(f"member_block={member_block}: must be >= 1")
    block = 1 if member_block is None else int(member_block)
    n_members = V * S
    padded = mesh is not None or n_members % block != 0
    # member_block: one single-device program per device (sharding.PerDevice), so the
    # run equals the one-device run bitwise; no block: one SPMD program (shard_map).
    per_device = mesh is not None and member_block is not None
    spmd = mesh is not None and not per_device

    def chunk_fn(n):
        fn = sharding.blocked_vmap(lambda s, idx, v: run_chunk(s, idx, v, n), member_block)
        if per_device:
            return sharding.PerDevice(fn, mesh.devices.flat)
        return jax.jit(sharding.member_map(fn, mesh) if spmd else fn)

    def place(tree):  # pad the member axis for the devices x block; shard it for SPMD
        if spmd:
            return sharding.shard_leading(tree, mesh, block)[0]
        if padded:
            return sharding.pad_leading(tree, sharding.padded_size(n_members, mesh, block))
        return tree

    flat_idx, flat_var = place((flat_idx, flat_var))

    n_chunks = -(-config.iterations // config.chunk)
    sizes = [min(config.chunk, config.iterations - i * config.chunk) for i in range(n_chunks)]
    manager = None
    start_chunk = 0
    history: list[dict] = []
    if ckpt_dir is not None:
        ckpt_dir = Path(ckpt_dir)
        meta = {"config": repr(config), "variants": [repr(v) for v in variants], "S": S}
        meta_path = ckpt_dir / "train_meta.json"
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            if old != meta:
                raise UserError(
                    f"{ckpt_dir}: checkpoint was written by a different configuration; "
                    "resume with the same flags or start a new --out"
                )
        else:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(meta))
        manager = _checkpoint_manager(ckpt_dir / "orbax")
        latest = manager.latest_step()
        if latest is not None:
            import orbax.checkpoint as ocp

            restored = manager.restore(
                latest,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(state),
                    metrics=ocp.args.JsonRestore(),
                ),
            )
            state = restored["state"]
            history = restored["metrics"]["history"]
            start_chunk = latest
    state = place(state)

    compiled: dict[int, Any] = {}
    compile_s = 0.0
    t_train = time.perf_counter()
    desc = f"train {V} variant(s) x {S} member(s) each"
    bar = tqdm(
        total=config.iterations,
        initial=sum(sizes[:start_chunk]),
        desc=desc,
        unit="it",
        disable=not progress,
        leave=False,
    )
    done_chunks = 0
    for ci in range(start_chunk, n_chunks):
        n = sizes[ci]
        if n not in compiled:
            bar.set_description_str(f"{desc} (compiling a {n}-iteration chunk)")
            bar.refresh()
            t0 = time.perf_counter()
            if per_device:
                compiled[n] = chunk_fn(n)
                compiled[n].compile(state, flat_idx, flat_var)
            else:
                compiled[n] = chunk_fn(n).lower(state, flat_idx, flat_var).compile()
            compile_s += time.perf_counter() - t0
            bar.set_description_str(desc)
        state, m = compiled[n](state, flat_idx, flat_var)
        m = sharding.unpad(sharding.to_host(m), n_members)
        history.append({k: v.tolist() for k, v in m.items()})
        bar.update(n)
        bar.set_postfix_str(_progress_fields(m, variants, S))
        if on_chunk is not None:
            on_chunk(ci, m)
        if manager is not None:
            import orbax.checkpoint as ocp

            manager.save(
                ci + 1,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(sharding.unpad(state, n_members) if padded else state),
                    metrics=ocp.args.JsonSave({"history": history}),
                ),
            )
            manager.wait_until_finished()
        done_chunks += 1
        if stop_after_chunks is not None and done_chunks >= stop_after_chunks:
            break
    bar.close()
    jax.block_until_ready(state)
    train_s = time.perf_counter() - t_train - compile_s
    if padded:
        state = sharding.unpad(state, n_members)
    state = jax.tree.map(lambda x: x.reshape((V, S) + x.shape[1:]), state)
    metrics = {
        k: np.concatenate([np.asarray(h[k]) for h in history], axis=-1).reshape(V, S, -1)
        for k in (history[0] if history else {})
    }
    return state, metrics, {"compile_s": compile_s, "train_s": train_s}


# ---------------------------------------------------------------------------
# The learned rows of the paper's tables.


def row_variants(lambdas: tuple[float, ...]) -> list[Variant]:
    """CPO (gives rows CPO, CPO batch, CPO online), CCPO (lambda=0) and CCPO (lambda=l) for each l."""
    from ccpo_jax.settings import lambda_row_name

    out = [Variant("CPO", conformal=False, lam=0.0), Variant(lambda_row_name(0.0), conformal=True, lam=0.0)]
    out += [Variant(lambda_row_name(lam), conformal=True, lam=float(lam)) for lam in lambdas if lam != 0.0]
    return out


def evaluate_trained(config: TrainConfig, params: EnvParams, variants, state, cal_idx, test_idx, key, retrain: bool):
    """Evaluate every trained variant, seed and split in one jitted, vmapped call.

    ``state`` leaves are [V, S_train, N, ...] (N seeds; S_train = 1 under ``recalibrate``,
    whose one policy per seed is recalibrated on every split); ``cal_idx``/``test_idx``
    are [S, n]. Returns ``{row: {metric: np.ndarray [N, S]}}`` and the calibrated kappas
    ``{row: np.ndarray [N, S]}``.
    """
    from envs.orchestration import summarise

    S = cal_idx.shape[0]

    def one(policy, kappa_online, cal, test, k):
        probs, kappa_i = policy_tables(policy, params, config.hidden)
        batch_m, khat = eval_batch_calibrated(probs, kappa_i, params, cal, test, config.alpha)
        online_m = eval_conformal(probs, kappa_online, params, test)
        point_m = eval_pointwise(k, probs, params, test)
        return summarise(batch_m), summarise(online_m), summarise(point_m), khat

    split_axes = 0 if retrain else None
    per_split = jax.vmap(one, in_axes=(split_axes, split_axes, 0, 0, 0))
    per_seed = jax.vmap(per_split, in_axes=(0, 0, None, None, 0))
    per_variant = jax.jit(jax.vmap(per_seed, in_axes=(0, 0, None, None, None)))
    # [V, S_t, N, ...] -> [V, N, S_t, ...] (retrain) or [V, N, ...] (recalibrate)
    if retrain:
        pol = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), state.policy)
        kap = jnp.swapaxes(state.kappa, 1, 2)
    else:
        pol = jax.tree.map(lambda x: x[:, 0], state.policy)
        kap = state.kappa[:, 0]
    N = kap.shape[1]
    keys = jax.random.split(key, N * S).reshape(N, S, -1)
    batch_m, online_m, point_m, khat = jax.device_get(
        per_variant(pol, kap, jnp.asarray(cal_idx), jnp.asarray(test_idx), keys)
    )
    rows: dict[str, dict[str, np.ndarray]] = {}
    kappas: dict[str, np.ndarray] = {}

    def take(m, v):
        return {k: np.asarray(x[v]) for k, x in m.items()}

    for v, var in enumerate(variants):
        if var.conformal:
            rows[var.name] = take(batch_m, v)
            kappas[var.name] = np.asarray(khat[v])
        else:
            rows["CPO"] = take(point_m, v)
            rows["CPO batch"] = take(batch_m, v)
            rows["CPO online"] = take(online_m, v)
            kappas["CPO batch"] = np.asarray(khat[v])
            online = np.asarray(kap[v])  # [N] or [N, S]
            kappas["CPO online"] = np.broadcast_to(online.reshape(N, -1), (N, S)).copy()
    return rows, kappas


@dataclasses.dataclass
class TrainedRows:
    """What :func:`train_seeds` returns.

    rows:    row name -> metric -> np.ndarray [N seeds, S splits]
    kappas:  row name -> calibrated (or online) kappa [N, S]
    state:   the trained TrainState, leaves [V, S_train, N, ...]
    curves:  variant name -> metric -> np.ndarray [S_train * N, iterations]
    timing:  compile_s, train_s, eval_s
    """

    rows: dict
    kappas: dict
    state: Any
    variants: list
    curves: dict
    timing: dict


def train_seeds(
    config: TrainConfig,
    params: EnvParams,
    splits,
    key: jax.Array,
    *,
    lambdas: tuple[float, ...] = (),
    seeds: int = 1,
    protocol: str = "recalibrate",
    ckpt_dir: Path | None = None,
    progress: bool = True,
    mesh=None,
    member_block: int | None = None,
) -> TrainedRows:
    """Train the learned rows (:func:`row_variants`) for ``seeds`` seeds and evaluate them on every split.

    All variants x training splits x seeds are members of one vmapped program
    (:func:`train_many`); seed n of every member starts from its own key. Under
    ``recalibrate`` each seed trains once on ``splits.train[0]`` and is recalibrated on
    every split; under ``retrain`` every (split, seed) pair trains its own policy.
    """
    if int(seeds) < 1:
        raise UserError(f"seeds={seeds}: must be >= 1")
    N = int(seeds)
    variants = row_variants(tuple(lambdas))
    retrain = protocol == "retrain"
    train_idx = np.asarray(splits.train) if retrain else np.asarray(splits.train)[:1]
    S_t = train_idx.shape[0]
    k_train, k_eval = jax.random.split(key)
    state, metrics, timing = train_many(
        config, params, variants, np.repeat(train_idx, N, axis=0), k_train, ckpt_dir=ckpt_dir,
        progress=progress, mesh=mesh, member_block=member_block,
    )
    state = jax.tree.map(lambda x: x.reshape((x.shape[0], S_t, N) + x.shape[2:]), state)
    t0 = time.perf_counter()
    rows, kappas = evaluate_trained(
        config, params, variants, state, np.asarray(splits.cal), np.asarray(splits.test), k_eval, retrain
    )
    timing["eval_s"] = time.perf_counter() - t0
    curves = {var.name: {k: v[i] for k, v in metrics.items()} for i, var in enumerate(variants)}
    return TrainedRows(rows=rows, kappas=kappas, state=state, variants=variants, curves=curves, timing=timing)


def learned_rows(
    *,
    cache,
    params: EnvParams,
    splits,
    key: jax.Array,
    alpha: float,
    lambdas: tuple[float, ...],
    protocol: str,
    iterations: int | None,
    ckpt_dir: Path,
    resume: bool,
    progress: bool,
    config: TrainConfig | None = None,
    seeds: int = 1,
    mesh=None,
    member_block: int | None = None,
):
    """The trainer entry point of :func:`ccpo_jax.pipeline.reproduce`.

    Trains CPO and the CCPO rows for ``seeds`` seeds (one vmapped program; under
    ``retrain`` also vmapped over splits), evaluates them on every split, saves the
    policies of seed 0, split 0 for ``ccpo-jax export``, and returns a
    :class:`ccpo_jax.pipeline.LearnedRows` whose rows hold [N seeds, S splits] arrays.
    """
    from ccpo_jax.pipeline import LearnedRows

    cfg = (config or TrainConfig()).replace(alpha=float(alpha))
    if iterations is not None:
        cfg = cfg.replace(iterations=int(iterations))
    trained = train_seeds(
        cfg, params, splits, key, lambdas=tuple(lambdas), seeds=seeds, protocol=protocol,
        ckpt_dir=Path(ckpt_dir), progress=progress, mesh=mesh, member_block=member_block,
    )
    diagnostics = {}
    for v, var in enumerate(trained.variants):
        row = var.name if var.conformal else "CPO batch"
        pol = jax.tree.map(lambda x: x[v, 0, 0], trained.state.policy)
        d = calibration_diagnostics(pol, params, float(np.asarray(trained.kappas[row])[0, 0]),
                                    np.asarray(splits.cal)[0], cfg.alpha, cfg.hidden)
        d["test_cost_cents_mean"] = float(np.mean(trained.rows[row]["cost_cents"]))
        d["test_coverage_mean"] = float(np.mean(trained.rows[row]["coverage"]))
        diagnostics[row] = d
    save_policies(Path(ckpt_dir).parent / POLICIES_DIR, cfg, trained.variants, trained.state, trained.kappas,
                  cache, protocol, diagnostics)
    return LearnedRows(rows=trained.rows, curves=trained.curves, timing=trained.timing)



POLICIES_DIR = "policies"
POLICY_PARAMS = "params.msgpack"
POLICY_META = "policy.json"


def policy_slug(row: str) -> str:
    """Directory name of a row's policy: 'CCPO (lambda=2e-4)' -> 'ccpo-lambda-2e-4'."""
    import re

    return re.sub(r"[^a-z0-9.]+", "-", row.lower().replace("=", "-")).strip("-").replace(".", "p")


#: A router is degenerate when its set holds every available action on (at least) this
#: share of the calibration questions' reached rounds, or when kappa-hat is (about) 0.
DEGENERATE_FULL_SET = 0.9
DEGENERATE_KAPPA = 1e-6


def calibration_diagnostics(policy, params: EnvParams, kappa_hat: float, cal_idx, alpha: float, hidden=None) -> dict:
    """How the calibrated router of one policy behaves on its calibration questions.

    ``coverage`` of C_{pi,kappa-hat} (target ``1 - alpha``), ``full_set_fraction`` = share of
    calibration questions whose set holds every available action at every round it reaches
    ("always continue and collect everything"), ``degenerate`` when that share is at least
    :data:`DEGENERATE_FULL_SET` or kappa-hat is below :data:`DEGENERATE_KAPPA`, and the
    distribution of the set size over the calibration questions.
    """
    from envs.orchestration import reached_rounds

    cal = jnp.asarray(cal_idx)
    probs, _ = policy_tables(policy, params, hidden)
    avail = params.available[cal]
    in_set = conformal.conformal_set(probs[cal], kappa_hat, avail)
    m = evaluate_sets(in_set, params, cal)
    reached = reached_rounds(in_set & avail, avail) & params.round_mask[cal]
    full = jnp.all(jnp.where(reached[..., None], in_set == avail, True), axis=(1, 2))
    full_frac = float(jnp.mean(full.astype(jnp.float32)))
    sizes = np.bincount(np.asarray(m.set_size), minlength=1)
    return {
        "n": int(cal.shape[0]),
        "kappa": float(kappa_hat),
        "coverage": float(jnp.mean(m.covered.astype(jnp.float32))),
        "target": float(1.0 - alpha),
        "full_set_fraction": full_frac,
        "degenerate": bool(full_frac >= DEGENERATE_FULL_SET or float(kappa_hat) < DEGENERATE_KAPPA),
        "set_size_counts": {str(k): int(c) for k, c in enumerate(sizes) if c},
    }


def save_policies(out: Path, cfg: TrainConfig, variants, state, kappas, cache, protocol: str,
                  diagnostics: dict | None = None) -> None:
    """Write every trained policy of split 0 to ``out/<slug>/`` for ``ccpo-jax export``.

    ``params.msgpack`` holds the flax-serialised policy parameters, ``policy.json`` the
    row name, alpha, the batch-calibrated kappa of split 0 (the kappa of the row's
    conformal sets on split 0), the final online kappa, T, the network shape, the
    feature names and the cache's provenance and checksum; ``diagnostics[row]`` (optional)
    goes to ``calibration`` (:func:`calibration_diagnostics` plus the row's mean test cost
    and coverage over seeds x splits), which ``ccpo-jax export`` reads to refuse a
    degenerate router and to pick its default row.
    """
    from flax import serialization

    from envs.features import feature_names

    out.mkdir(parents=True, exist_ok=True)
    for v, var in enumerate(variants):
        row = var.name if var.conformal else "CPO batch"
        pol = jax.tree.map(lambda x: np.asarray(x[v, 0, 0]), state.policy)  # split 0, seed 0
        d = out / policy_slug(row)
        d.mkdir(parents=True, exist_ok=True)
        (d / POLICY_PARAMS).write_bytes(serialization.to_bytes(pol))
        m = cache.manifest
        meta = {
            "row": row,
            "conformal_training": bool(var.conformal),
            "lambda": float(var.lam),
            "alpha": float(cfg.alpha),
            "kappa": float(np.asarray(kappas[row])[0, 0]),
            "kappa_online": float(np.asarray(state.kappa[v, 0, 0])),
            "kappa_note": "kappa is the batch-calibrated threshold of seed 0 on split 0; kappa_online the online one",
            "seed": 0,
            "protocol": protocol,
            "split": 0,
            "T": int(m.T),
            "hidden": list(cfg.hidden),
            "actions": ["base", "guide", "next"],
            "feature_names": list(feature_names(m.T)),
            "cache": {"name": m.name, "provenance": m.provenance, "checksum": m.checksum or cache.checksum()},
            "models": {"base": m.base.to_dict(), "guide": m.guide.to_dict()},
            "train_config": dataclasses.asdict(cfg),
            "jax": jax.__version__,
        }
        if diagnostics and row in diagnostics:
            meta["calibration"] = diagnostics[row]
        (d / POLICY_META).write_text(json.dumps(meta, indent=2, default=str) + "\n")


def load_policy(path: Path):
    """(params, meta) of a policy saved by :func:`save_policies`."""
    from flax import serialization

    path = Path(path)
    meta = json.loads((path / POLICY_META).read_text())
    net = policy_net(tuple(meta["hidden"]))
    from envs.features import n_features

    template = net.init(jax.random.PRNGKey(0), jnp.zeros((n_features(meta["T"]),), jnp.float32))
    params = serialization.from_bytes(template, (path / POLICY_PARAMS).read_bytes())
    return params, meta
