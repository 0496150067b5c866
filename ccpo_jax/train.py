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

import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ccpo_jax import conformal, sharding, trust_region
from ccpo_jax.config import TrainConfig, Variant
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

    def iteration(state: TrainState, train_idx: jax.Array, var: VariantArrays):
        key, k_q, k_a = jax.random.split(state.key, 3)
        B = cfg.batch_size
        q = train_idx[jax.random.randint(k_q, (B,), 0, train_idx.shape[0])]
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
            return cp, opt, losses[-1]

        critic_r, opt_r, loss_r = critic_update(state.critic_r, state.opt_r, r)
        critic_c, opt_c, loss_c = critic_update(state.critic_c, state.opt_c, c)
        vt_r = vtrace_batch(values(critic_r), r)
        vt_c = vtrace_batch(values(critic_c), c)
        adv_r = jnp.where(valid, vt_r.advantages_clipped, 0.0)
        adv_c = jnp.where(valid, vt_c.advantages_unclipped, 0.0)
        n_valid = jnp.sum(valid)
        # V-trace estimate of J_C under the target policy from the first round
        # (the constraint signal already counts unsolvable questions as covered).
        j_c = jnp.mean(vt_c.targets[:, 0])

        # 3. CPO step on the softmasked target S~ (Eq. 7).
        logs_old = jax.lax.stop_gradient(log_soft_fn(probs))  # [B,T,3]
        logs_old_a = jnp.take_along_axis(logs_old, a[..., None], -1)[..., 0]

        def log_target(pol):
            return log_soft_fn(probs_fn(pol, obs, avail))

        def ratio(pol):
            logs_new_a = jnp.take_along_axis(log_target(pol), a[..., None], -1)[..., 0]
            return jnp.exp(jnp.where(valid, logs_new_a - logs_old_a, 0.0))

        def objective(pol):
            # Reward surrogate with the clipped V-trace advantage (paper section 6).
            return jnp.sum(jnp.where(valid, ratio(pol) * adv_r, 0.0)) / n_valid

        def constraint(pol):
            # Linearised coverage J_C(theta) ~= j_c + sum_t E[(ratio - 1) A_C] per episode,
            # unclipped advantage (clipping would bias the constraint gradient). CPO's
            # "c + b'x <= 0" form takes its negation (trust_region module docstring).
            return -jnp.sum(jnp.where(valid, (ratio(pol) - 1.0) * adv_c, 0.0)) / B

        def kl(pol):
            kl_t = conformal.soft_policy_kl(logs_old, log_target(pol))
            return jnp.sum(jnp.where(valid, kl_t, 0.0)) / n_valid

        c_val = (1.0 - cfg.alpha) - j_c
        policy, info = trust_region.cpo_update(
            state.policy,
            objective,
            constraint,
            kl,
            c_val,
            cfg.delta,
            cg_iters=cfg.cg_iters,
            damping=cfg.damping,
            backtrack_steps=cfg.backtrack_steps,
            backtrack_decay=cfg.backtrack_decay,
        )

        # 4. online kappa, one step per episode, on C_{pi_{k+1}, kappa}.
        new_probs = probs_fn(policy, obs, avail)
        k_i = jax.vmap(conformal.largest_covering_kappa)(
            new_probs, params.base_correct[q], params.guide_correct[q], params.round_mask[q], unsolv
        )

        def kappa_body(carry, kappa_i):
            kap, k = carry
            err = (kap > kappa_i).astype(jnp.float32)
            kap = conformal.kappa_step(kap, err, k + 1, cfg.alpha, cfg.eta0, cfg.xi)
            return (kap, k + 1), err

        (kappa, episodes), errs = jax.lax.scan(kappa_body, (state.kappa, state.episodes), k_i)

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
            "batch_cost_cents": jnp.mean(jnp.sum(jnp.where(valid, cost, 0.0), axis=1)),
            "batch_success": jnp.mean(success.astype(jnp.float32)),
            "batch_len": jnp.mean(t_f.astype(jnp.float32) + 1.0),
            "j_c_estimate": j_c,
            "critic_loss_r": loss_r,
            "critic_loss_c": loss_c,
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
    bar = tqdm(
        total=config.iterations,
        initial=sum(sizes[:start_chunk]),
        desc=f"train {V} variant(s) x {S} split(s)",
        unit="it",
        disable=not progress,
        leave=False,
    )
    done_chunks = 0
    for ci in range(start_chunk, n_chunks):
        n = sizes[ci]
        if n not in compiled:
            t0 = time.perf_counter()
            if per_device:
                compiled[n] = chunk_fn(n)
                compiled[n].compile(state, flat_idx, flat_var)
            else:
                compiled[n] = chunk_fn(n).lower(state, flat_idx, flat_var).compile()
            compile_s += time.perf_counter() - t0
        state, m = compiled[n](state, flat_idx, flat_var)
        m = sharding.unpad(sharding.to_host(m), n_members)
        history.append({k: v.tolist() for k, v in m.items()})
        bar.update(n)
        bar.set_postfix(kappa=float(np.mean(m["kappa"][..., -1])))
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
    from experiments.settings import lambda_row_name

    out = [Variant("CPO", conformal=False, lam=0.0), Variant(lambda_row_name(0.0), conformal=True, lam=0.0)]
    out += [Variant(lambda_row_name(lam), conformal=True, lam=float(lam)) for lam in lambdas if lam != 0.0]
    return out


def evaluate_trained(config: TrainConfig, params: EnvParams, variants, state, cal_idx, test_idx, key, retrain: bool):
    """Evaluate every trained variant on every split in one jitted, vmapped call.

    ``state`` leaves are [V, S_train, ...] (S_train = 1 under ``recalibrate``);
    ``cal_idx``/``test_idx`` are [S, n]. Returns ``{row: {metric: np.ndarray [S]}}``
    and the calibrated kappas ``{row: np.ndarray [S]}``.
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
    per_variant = jax.jit(jax.vmap(per_split, in_axes=(0, 0, None, None, None)))
    pol = state.policy if retrain else jax.tree.map(lambda x: x[:, 0], state.policy)
    kap = state.kappa if retrain else state.kappa[:, 0]
    keys = jax.random.split(key, S)
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
            kappas["CPO online"] = np.broadcast_to(np.asarray(kap[v]), (S,)).copy()
    return rows, kappas


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
    mesh=None,
    member_block: int | None = None,
):
    """The trainer entry point of :func:`ccpo_jax.pipeline.reproduce`.

    Trains CPO and the CCPO rows (one vmapped program; under ``retrain`` also
    vmapped over splits), evaluates them on every split, and returns a
    :class:`ccpo_jax.pipeline.LearnedRows`. ``mesh`` and ``member_block`` go to
    :func:`train_many` (shard the variant x split members over devices).
    """
    from ccpo_jax.pipeline import LearnedRows

    cfg = (config or TrainConfig()).replace(alpha=float(alpha))
    if iterations is not None:
        cfg = cfg.replace(iterations=int(iterations))
    variants = row_variants(tuple(lambdas))
    retrain = protocol == "retrain"
    train_idx = np.asarray(splits.train) if retrain else np.asarray(splits.train)[:1]
    k_train, k_eval = jax.random.split(key)
    state, metrics, timing = train_many(
        cfg, params, variants, train_idx, k_train, ckpt_dir=Path(ckpt_dir), progress=progress,
        mesh=mesh, member_block=member_block,
    )
    t0 = time.perf_counter()
    rows, kappas = evaluate_trained(
        cfg, params, variants, state, np.asarray(splits.cal), np.asarray(splits.test), k_eval, retrain
    )
    timing["eval_s"] = time.perf_counter() - t0
    save_policies(Path(ckpt_dir).parent / POLICIES_DIR, cfg, variants, state, kappas, cache, protocol)
    curves = {var.name: {k: v[i] for k, v in metrics.items()} for i, var in enumerate(variants)}
    return LearnedRows(rows=rows, curves=curves, timing=timing)


POLICIES_DIR = "policies"
POLICY_PARAMS = "params.msgpack"
POLICY_META = "policy.json"


def policy_slug(row: str) -> str:
    """Directory name of a row's policy: 'CCPO (lambda=2e-4)' -> 'ccpo-lambda-2e-4'."""
    import re

    return re.sub(r"[^a-z0-9.]+", "-", row.lower().replace("=", "-")).strip("-").replace(".", "p")


def save_policies(out: Path, cfg: TrainConfig, variants, state, kappas, cache, protocol: str) -> None:
    """Write every trained policy of split 0 to ``out/<slug>/`` for ``ccpo-jax export``.

    ``params.msgpack`` holds the flax-serialised policy parameters, ``policy.json`` the
    row name, alpha, the batch-calibrated kappa of split 0 (the kappa of the row's
    conformal sets on split 0), the final online kappa, T, the network shape, the
    feature names and the cache's provenance and checksum.
    """
    import dataclasses

    from flax import serialization

    from envs.features import feature_names

    out.mkdir(parents=True, exist_ok=True)
    for v, var in enumerate(variants):
        row = var.name if var.conformal else "CPO batch"
        pol = jax.tree.map(lambda x: np.asarray(x[v, 0]), state.policy)
        d = out / policy_slug(row)
        d.mkdir(parents=True, exist_ok=True)
        (d / POLICY_PARAMS).write_bytes(serialization.to_bytes(pol))
        m = cache.manifest
        meta = {
            "row": row,
            "conformal_training": bool(var.conformal),
            "lambda": float(var.lam),
            "alpha": float(cfg.alpha),
            "kappa": float(np.asarray(kappas[row])[0]),
            "kappa_online": float(np.asarray(state.kappa[v, 0])),
            "kappa_note": "kappa is the batch-calibrated threshold of split 0; kappa_online the online one",
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
