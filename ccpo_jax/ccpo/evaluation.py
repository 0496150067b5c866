"""Evaluation of trained policies over many splits: the calibrated, online and pointwise rows.

For a trained policy pi, :func:`policy_tables` computes pi on every question and round
and each question's largest covering kappa; a row's metrics on a split then come from
the set-valued policy C_{pi,kappa} (arXiv 2511.11828, Eq. 2) with kappa calibrated on
the split's calibration questions (``CPO batch``, the CCPO rows), with the online
kappa of training (``CPO online``), or from pi's sampled actions (``CPO``).
:func:`evaluate_trained` does every variant, seed and split in one jitted call.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.ccpo.blocked import blocked_policy_probs
from ccpo_jax.ccpo.calibration import GroupSpec, variant_ranks  # GroupSpec: also importable from here
from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.ccpo.rowid import CPO_BATCH, Twin
from ccpo_jax.core import conformal
from ccpo_jax.core.guarantee import LTT_GRID, Guarantee
from ccpo_jax.runtime import executables
from envs.replay.env import EnvParams, evaluate_actions, evaluate_sets, reached_rounds, summarise

#: A router is degenerate when its set holds every available action on (at least) this
#: share of the calibration questions' reached rounds, or when kappa-hat is (about) 0.
DEGENERATE_FULL_SET = 0.9
DEGENERATE_KAPPA = 1e-6


def policy_tables(policy, params: EnvParams, hidden=None, ensemble: bool = False):
    """Probabilities of every question and round [Q,T,3] and each question's largest covering kappa [Q].

    The forward pass runs in fixed-size row blocks (:mod:`ccpo_jax.ccpo.blocked`), exactly as the
    exported router computes it, so the router's sets equal the trainer's bit for bit. ``ensemble``:
    ``policy``'s leaves carry a leading member axis and the probabilities are the members' mean.
    """
    probs = blocked_policy_probs(policy, params.obs, params.available, hidden, ensemble)
    kappa_i = jax.vmap(conformal.largest_covering_kappa)(
        probs, params.base_correct, params.guide_correct, params.round_mask, params.unsolvable
    )
    return probs, kappa_i


def eval_conformal(probs, kappa, params: EnvParams, idx):
    """Metrics of the set-valued policy C_{pi,kappa} on questions ``idx`` [N]."""
    sets = conformal.conformal_set(probs[idx], kappa, params.available[idx])
    return evaluate_sets(sets, params, idx)


def eval_batch_calibrated(probs, kappa_i, params: EnvParams, cal_idx, test_idx, alpha, rank=None):
    """C_{pi,kappa-hat} on ``test_idx``, kappa-hat calibrated exactly on ``cal_idx``; and kappa-hat.
    ``rank``: the order statistic to take (a PAC rank), else the marginal ceil((n+1)(1-alpha))."""
    kappa_hat = conformal.calibrate_kappa(kappa_i[cal_idx], alpha, rank)
    return eval_conformal(probs, kappa_hat, params, test_idx), kappa_hat


def eval_pointwise(key, probs, params: EnvParams, idx):
    """The stochastic pointwise policy pi (rows 'CPO'): one sampled action per round."""
    p = probs[idx]
    a = jax.random.categorical(key, jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    return evaluate_actions(a.astype(jnp.int32), params, idx)


class GroupEval(NamedTuple):
    """Per-group outcome of the calibrated rows, leaves [V, N, S, G] (``n_cal``, ``own``: [S, G]
    and [V, N, S, G]): the Mondrian-calibrated sets' metrics (``summarise``'s dict, [V, N, S]),
    their thresholds [V, N, S, G + 1] (the rest last), which groups had their own threshold, the
    calibration and test counts of each group, and per group the coverage and summed cost of the
    marginal (batch) and the Mondrian sets on the test split (coverage NaN where a split has no
    test question of the group)."""

    mondrian: dict
    kappa: np.ndarray
    own: np.ndarray
    n_cal: np.ndarray
    n_test: np.ndarray
    marginal_groups: dict
    mondrian_groups: dict


class MemberEval(NamedTuple):
    """What :func:`evaluate_members` returns, every leaf [V, N, S] (metrics: ``summarise``'s dicts):
    the batch-calibrated sets, the online sets, the pointwise policy, the calibrated kappa-hat,
    the online kappa of training [V, N] (recalibrate) or [V, N, S] (retrain), and with groups the
    Mondrian calibration (:class:`GroupEval`, else None)."""

    batch: dict
    online: dict
    pointwise: dict
    kappa_hat: np.ndarray
    kappa_online: np.ndarray
    groups: GroupEval | None = None
    ltt: dict | None = None
    """With a guide cap (Learn then Test): ``feasible`` (a threshold passed both tests), ``guide_rate``
    (test share of questions that call the guide) and ``cal_guide_rate`` (calibration share at the
    coverage-only threshold), leaves [V, N, S]."""


def per_group(m, group, n_groups: int) -> dict:
    """Coverage (NaN for a group without questions) and summed cost of each group ``[G]``."""
    seg = lambda x: jax.ops.segment_sum(x, group, num_segments=n_groups)  # noqa: E731 - [G], no [n, G] one-hot
    n = seg(jnp.ones(group.shape, jnp.float32))
    covered = seg(m.covered.astype(jnp.float32))
    return {"coverage": jnp.where(n > 0, covered / jnp.maximum(n, 1.0), jnp.nan), "cost_cents": seg(m.cost_cents)}


def eval_mondrian(probs, kappa_i, params: EnvParams, cal_idx, test_idx, alpha, codes, n_groups: int, group_min: int,
                  ranks=None):
    """C_{pi,kappa_g} on ``test_idx`` with kappa_g calibrated per group on ``cal_idx``
    (:func:`ccpo_jax.core.conformal.mondrian_kappa`; ``ranks`` [n_cal + 1]: a PAC rank table):
    (metrics, kappa [G+1], own [G], n_cal [G])."""
    kap, own, n_cal = conformal.mondrian_kappa(kappa_i[cal_idx], codes[cal_idx], n_groups, alpha, group_min, ranks)
    thr = conformal.group_thresholds(kap, own, codes[test_idx])
    sets = conformal.conformal_set(probs[test_idx], thr[:, None], params.available[test_idx])
    return evaluate_sets(sets, params, test_idx), kap, own, n_cal


def question_cost_max(params: EnvParams) -> float:
    """The most the replay env can charge one question of the cache (cents): every round reached, i.e. the
    largest sum of a question's round costs J_t (0 on padding rounds). The cost cap's losses are
    cost / this, in [0, 1]."""
    return float(np.max(np.sum(np.asarray(params.cost, np.float64), axis=-1)))


def cost_critical_sum(guarantee: Guarantee, n: int, cost_max: float) -> float:
    """The largest summed calibration cost (cents) whose mean passes the cost cap's Hoeffding-Bentkus test
    (:meth:`Guarantee.cost_critical`): +inf without a cost cap, negative when no outcome passes. Lowered by
    1e-5 relative so that the float32 sum's rounding cannot pass a mean just above the critical one."""
    r = guarantee.cost_critical(n, cost_max)
    return r if not np.isfinite(r) or r < 0 else r * n * (1.0 - 1e-5)


class CalibrationInputs(NamedTuple):
    """The host side of a calibration, one row per variant (each at its own alpha): ``ranks``
    [V, n_cal + 1] the guarantee's rank of every calibration count (zeros [V, 1] when the program
    computes the marginal rank itself, :attr:`Guarantee.jit_ranks`), ``counts`` [V, 2] Learn then
    Test's critical counts of miscoverage and guide calls, ``crit_sums`` [V] the cost cap's critical
    summed cost (+inf without one). The rank tables and critical values are float64 scipy, chosen
    before the jitted program (:mod:`ccpo_jax.core.guarantee`)."""

    ranks: np.ndarray
    counts: np.ndarray
    crit_sums: np.ndarray

    @classmethod
    def of(cls, guarantee: Guarantee | None, alphas: list[float], n_cal: int,
           cost_max: float | None) -> "CalibrationInputs":
        """``cost_max``: :func:`question_cost_max` of the cache (read only under a cap)."""
        traced = guarantee is not None and guarantee.jit_ranks
        ltt = traced and guarantee.capped
        ranks = variant_ranks(guarantee, alphas, n_cal) if traced else np.zeros((len(alphas), 1), np.int32)
        counts = np.asarray([guarantee.ltt_counts(n_cal, a) if ltt else (0, 0) for a in alphas], np.int32)
        crit = cost_critical_sum(guarantee, n_cal, cost_max) if ltt else np.inf
        return cls(ranks, counts, np.full(len(alphas), crit, np.float32))


class MondrianOut(NamedTuple):
    """One member on one split, calibrated per group (:class:`GroupEval`'s fields, before the axes)."""

    metrics: dict
    kappa: jax.Array
    own: jax.Array
    n_cal: jax.Array
    n_test: jax.Array
    marginal_groups: dict
    mondrian_groups: dict


class SplitOut(NamedTuple):
    """One member on one split, named (:class:`MemberEval`'s fields, before the axes): the summarised
    batch-calibrated, online and pointwise metrics, kappa-hat, Learn then Test's extras ({} without a
    cap) and the Mondrian calibration (None without groups). The leaves flatten in this order, the
    order of the program's outputs."""

    batch: dict
    online: dict
    pointwise: dict
    kappa_hat: jax.Array
    ltt: dict
    mondrian: MondrianOut | None = None


def ltt_split(params: EnvParams, probs, kappa_i, cal, test, counts, crit_sum, rank, grid):
    """Learn then Test over ``grid`` (coverage, the guide-call rate and/or the mean cost): kappa-hat and
    its extras, with the test cost of the coverage-only PAC threshold (``rank``) beside it: what the caps
    cost. At the coverage-only grid choice kcov: which cap fails there (the one that made a split
    infeasible) and the calibration guide rate and mean cost (what the caps are up against)."""
    g_i = jax.vmap(conformal.largest_guide_kappa)(probs, params.available, params.round_mask)
    reach = jax.vmap(conformal.round_reach_kappa)(probs[cal], params.available[cal])
    cost_grid = conformal.cost_on_grid(reach, params.cost[cal], grid)
    khat, feasible, kcov = conformal.ltt_threshold(kappa_i[cal], g_i[cal], counts[0], counts[1], grid,
                                                   cost_grid, crit_sum)
    pac_m, _ = eval_batch_calibrated(probs, kappa_i, params, cal, test, None, rank)
    cal_cost = conformal.cost_on_grid(reach, params.cost[cal], kcov[None])[0]
    return khat, {"feasible": feasible, "guide_rate": jnp.mean((khat <= g_i[test]).astype(jnp.float32)),
                  "cal_guide_rate": jnp.mean((kcov <= g_i[cal]).astype(jnp.float32)),
                  "cal_cost": cal_cost / cal.shape[0],
                  "coverage_ok": jnp.sum(kappa_i[cal] < grid[0]) <= counts[0],
                  "guide_ok": jnp.sum(kcov <= g_i[cal]) <= counts[1], "cost_ok": cal_cost <= crit_sum,
                  "cost_coverage_only": jnp.sum(pac_m.cost_cents)}


def calibrate_split(params: EnvParams, probs, kappa_i, cal, test, alpha, rank, ltt=None):
    """The batch-calibrated sets of one member on one split (traced): (test metrics, kappa-hat, Learn
    then Test's extras). ``rank``: the guarantee's rank at the calibration count (None: the marginal
    float32 rank in the program); ``ltt``: ``(counts, crit_sum, grid)`` under a cap, else None."""
    if ltt is not None:
        counts, crit_sum, grid = ltt
        khat, extra = ltt_split(params, probs, kappa_i, cal, test, counts, crit_sum, rank, grid)
        return eval_conformal(probs, khat, params, test), khat, extra
    batch_m, khat = eval_batch_calibrated(probs, kappa_i, params, cal, test, alpha, rank)
    return batch_m, khat, {}


def mondrian_split(params: EnvParams, probs, kappa_i, batch_m, cal, test, alpha, groups: GroupSpec, codes,
                   ranks) -> MondrianOut:
    """One member on one split calibrated per group (traced), and the per-group outcome of its batch
    (``batch_m``) and Mondrian sets on the test split."""
    G = len(groups.names)
    mond_m, kap, own, n_cal = eval_mondrian(probs, kappa_i, params, cal, test, alpha, codes, G, groups.group_min,
                                            ranks)
    g_test = codes[test]
    n_test = jax.ops.segment_sum(jnp.ones(g_test.shape, jnp.int32), g_test, num_segments=G)
    return MondrianOut(summarise(mond_m), kap, own, n_cal, n_test, per_group(batch_m, g_test, G),
                       per_group(mond_m, g_test, G))


def over_members(one, retrain: bool):
    """``one`` (a member on a split) over splits, seeds and variants, in ONE jit: the policy and its online
    kappa carry a split axis under ``retrain``; every variant has its own alpha and calibration inputs."""
    split_axes = 0 if retrain else None
    per_split = jax.vmap(one, in_axes=(split_axes, split_axes, 0, 0, 0, None, None, None, None))
    per_seed = jax.vmap(per_split, in_axes=(0, 0, None, None, 0, None, None, None, None))
    return jax.jit(jax.vmap(per_seed, in_axes=(0, 0, None, None, None, 0, 0, 0, 0)))


def member_axes(state, retrain: bool, ensemble: bool):
    """The trained policies and online kappas in the axes :func:`over_members` maps: [V, N, S_t, ...]
    (retrain) or [V, N, ...] (recalibrate), from ``state`` leaves [V, S_t, N, ...]; ``ensemble``: the N
    seeds as one member, [V, 1, S_t, N, ...] or [V, 1, N, ...], its online kappa the seeds' mean."""
    if ensemble:
        pol = jax.tree.map(lambda x: x[:, None] if retrain else x, state.policy)
        kap = jnp.mean(state.kappa, axis=-1)[:, None] if retrain else jnp.mean(state.kappa[:, 0], axis=-1)[:, None]
    elif retrain:
        pol = jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2), state.policy)
        kap = jnp.swapaxes(state.kappa, 1, 2)
    else:
        pol = jax.tree.map(lambda x: x[:, 0], state.policy)
        kap = state.kappa[:, 0]
    return pol, kap


def evaluate_members(config: TrainConfig, params: EnvParams, variants: list[Variant], state, cal_idx, test_idx, key,
                     retrain: bool, groups: GroupSpec | None = None, guarantee: Guarantee | None = None,
                     ensemble: bool = False) -> MemberEval:
    """Every trained variant, seed and split in one jitted, vmapped call: see :func:`evaluate_trained`.
    With ``groups`` the calibrated rows are also calibrated per group (:class:`GroupEval`). With a
    ``guarantee`` whose ranks are traced (:attr:`Guarantee.jit_ranks`: ``pac``, not ``marginal``) every calibrated
    threshold (marginal and per group) takes the guarantee's rank of its calibration count at the variant's
    alpha (:func:`ccpo_jax.ccpo.calibration.variant_ranks`); a capped one is chosen by Learn then Test.
    ``ensemble``: each variant's N seeds (of a training split) are one policy, the mean of their
    probabilities (:func:`ccpo_jax.ccpo.blocked.block_probs`), calibrated as any: leaves [V, 1, S]; its
    online kappa is the seeds' mean (its CPO online figures are not a row).

    What varies with what: the host prepares the per-variant calibration inputs
    (:class:`CalibrationInputs`) and the member axes (:func:`member_axes`); :func:`over_members` maps
    ``one`` member on one split (:class:`SplitOut`: :func:`calibrate_split`, the online and pointwise sets,
    then :func:`mondrian_split`) over splits, seeds and variants in one program, in this order."""
    S = cal_idx.shape[0]
    traced_ranks = guarantee is not None and guarantee.jit_ranks  # the guarantee's own ranks go into the program
    ltt = traced_ranks and guarantee.capped
    n_cal_all = int(np.shape(cal_idx)[1])
    grid = jnp.asarray(LTT_GRID)
    codes = None if groups is None else jnp.asarray(groups.codes, jnp.int32)

    def one(policy, kappa_online, cal, test, k, alpha, ranks, counts, crit_sum):
        ranks = ranks if traced_ranks else None  # marginal: the float32 rank of conformal_rank, as always
        probs, kappa_i = policy_tables(policy, params, config.hidden, ensemble)
        batch_m, khat, extra = calibrate_split(params, probs, kappa_i, cal, test, alpha,
                                               None if ranks is None else ranks[n_cal_all],
                                               (counts, crit_sum, grid) if ltt else None)
        online_m = eval_conformal(probs, kappa_online, params, test)
        point_m = eval_pointwise(k, probs, params, test)
        out = SplitOut(summarise(batch_m), summarise(online_m), summarise(point_m), khat, extra)
        if groups is None:
            return out
        return out._replace(mondrian=mondrian_split(params, probs, kappa_i, batch_m, cal, test, alpha, groups, codes,
                                                    ranks))

    pol, kap = member_axes(state, retrain, ensemble)
    N = kap.shape[1]
    keys = jax.random.split(key, N * S).reshape(N, S, -1)
    alpha_list = [float(var.alpha) for var in variants]
    alphas = jnp.asarray(alpha_list, jnp.float32)  # each at its own alpha
    host = CalibrationInputs.of(guarantee, alpha_list, n_cal_all, question_cost_max(params) if ltt else None)
    args = (pol, kap, jnp.asarray(cal_idx), jnp.asarray(test_idx), keys, alphas, *map(jnp.asarray, host))
    # ``one`` closes over these (and the code): with the arguments' shapes, the program's key on disk
    closed = (config, params, retrain, ensemble, guarantee, traced_ranks, ltt, n_cal_all, LTT_GRID, groups)
    got = jax.device_get(executables.compile("evaluate-members", over_members(one, retrain), args, closed)(*args))
    group_ev = None
    if got.mondrian is not None:
        m = got.mondrian
        group_ev = GroupEval(m.metrics, np.asarray(m.kappa), np.asarray(m.own), np.asarray(m.n_cal)[0, 0],
                             np.asarray(m.n_test)[0, 0], m.marginal_groups, m.mondrian_groups)
    return MemberEval(got.batch, got.online, got.pointwise, np.asarray(got.kappa_hat), np.asarray(jax.device_get(kap)),
                      group_ev, {k: np.asarray(x) for k, x in got.ltt.items()} if ltt else None)


#: Suffix of a calibrated row's group-conditional (Mondrian) twin, e.g. ``CPO batch [Mondrian]``.
MONDRIAN = Twin.MONDRIAN.value


def calibrated_rows(var: Variant) -> list[str]:
    """The rows of ``var`` whose sets are batch-calibrated (CPO batch, the CCPO rows)."""
    return [row for row in var.table_rows() if var.conformal or row == CPO_BATCH.name]


def variant_group_rows(var: Variant, ev: MemberEval, v: int) -> tuple[dict, dict]:
    """With groups: the Mondrian twin of each calibrated row of ``var`` (``{row [Mondrian]: {metric:
    [N, S]}}``) and the per-group outcome of the calibrated rows and their twins (``{row:
    {"coverage", "cost_cents": [N, S, G], "kappa": [N, S, G] (Mondrian: the group's threshold, own
    or rest), "own": [N, S, G]}}``; ``ev.groups.n_cal``/``n_test`` [S, G] are shared)."""
    ge = ev.groups
    if ge is None:
        return {}, {}
    rows, per = {}, {}
    G = ge.n_cal.shape[-1]
    own = np.asarray(ge.own[v])
    kap = np.asarray(ge.kappa[v])
    for row in calibrated_rows(var):
        rows[row + MONDRIAN] = {k: np.asarray(x[v]) for k, x in ge.mondrian.items()}
        per[row] = {**{k: np.asarray(x[v]) for k, x in ge.marginal_groups.items()},
                    "kappa": np.broadcast_to(np.asarray(ev.kappa_hat[v])[..., None], own.shape).copy(), "own": own}
        per[row + MONDRIAN] = {**{k: np.asarray(x[v]) for k, x in ge.mondrian_groups.items()},
                               "kappa": np.where(own, kap[..., :G], kap[..., G:]), "own": own}
    return rows, per


def variant_ltt(var: Variant, ev: MemberEval, v: int) -> dict[str, dict[str, np.ndarray]]:
    """With a guide cap: ``{row: {"feasible", "guide_rate", "cal_guide_rate": [N, S]}}`` for each
    calibrated row of ``var`` (:attr:`MemberEval.ltt`); else {}."""
    if ev.ltt is None:
        return {}
    return {row: {k: np.asarray(x[v]) for k, x in ev.ltt.items()} for row in calibrated_rows(var)}


def variant_rows(var: Variant, ev: MemberEval, v: int) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """The table rows of variant ``var`` (index ``v`` of ``ev``): ``{row: {metric: [N, S]}}`` and
    ``{row: kappa [N, S]}`` (the calibrated kappa-hat, or the online kappa for CPO online)."""
    N, S = ev.kappa_hat.shape[1:]
    rows: dict[str, dict[str, np.ndarray]] = {}
    kappas: dict[str, np.ndarray] = {}

    def take(m):
        return {k: np.asarray(x[v]) for k, x in m.items()}

    for row in var.table_rows():
        if var.conformal or row == "CPO batch":
            rows[row] = take(ev.batch)
            kappas[row] = np.asarray(ev.kappa_hat[v])
            if ev.ltt is not None:  # no threshold passed both tests: the split has no result, not a best effort
                bad = ~np.asarray(ev.ltt["feasible"][v], bool)
                rows[row] = {k: np.where(bad, np.nan, x) for k, x in rows[row].items()}
        elif row == "CPO":
            rows[row] = take(ev.pointwise)
        elif row == "CPO online":
            rows[row] = take(ev.online)
            online = np.asarray(ev.kappa_online[v])  # [N] or [N, S]
            kappas[row] = np.broadcast_to(online.reshape(N, -1), (N, S)).copy()
        else:
            raise ValueError(f"variant {var.name}: unknown row {row!r}")
    return rows, kappas


def evaluate_trained(config: TrainConfig, params: EnvParams, variants: list[Variant], state, cal_idx, test_idx, key,
                     retrain: bool):
    """Evaluate every trained variant, seed and split in one jitted, vmapped call.

    ``state`` leaves are [V, S_train, N, ...] (N seeds; S_train = 1 under ``recalibrate``,
    whose one policy per seed is recalibrated on every split); ``cal_idx``/``test_idx``
    are [S, n]. Each variant is calibrated at its own alpha (``Variant.alpha``). Returns
    ``{row: {metric: np.ndarray [N, S]}}`` and the calibrated kappas ``{row: np.ndarray [N, S]}``.
    """
    ev = evaluate_members(config, params, variants, state, cal_idx, test_idx, key, retrain)
    rows: dict[str, dict[str, np.ndarray]] = {}
    kappas: dict[str, np.ndarray] = {}
    for v, var in enumerate(variants):
        r, k = variant_rows(var, ev, v)
        rows.update(r)
        kappas.update(k)
    return rows, kappas


def calibration_diagnostics(policy, params: EnvParams, kappa_hat: float, cal_idx, alpha: float, hidden=None,
                            ensemble: bool = False) -> dict:
    """How the calibrated router of one policy behaves on its calibration questions.

    ``coverage`` of C_{pi,kappa-hat} (target ``1 - alpha``), ``full_set_fraction`` = share of
    calibration questions whose set holds every available action at every round it reaches
    ("always continue and collect everything"), ``degenerate`` when that share is at least
    :data:`DEGENERATE_FULL_SET` or kappa-hat is below :data:`DEGENERATE_KAPPA`, and the
    distribution of the set size over the calibration questions.
    """
    cal = jnp.asarray(cal_idx)
    full_frac, coverage, set_size = _diagnostic_arrays(policy, params, jnp.float32(kappa_hat), cal,
                                                       None if hidden is None else tuple(hidden), ensemble)
    full_frac = float(full_frac)
    sizes = np.bincount(np.asarray(set_size), minlength=1)
    return {
        "n": int(cal.shape[0]),
        "kappa": float(kappa_hat),
        "coverage": float(coverage),
        "target": float(1.0 - alpha),
        "full_set_fraction": full_frac,
        "degenerate": bool(full_frac >= DEGENERATE_FULL_SET or float(kappa_hat) < DEGENERATE_KAPPA),
        "set_size_counts": {str(k): int(c) for k, c in enumerate(sizes) if c},
    }


@functools.partial(jax.jit, static_argnames=("hidden", "ensemble"))
def _diagnostic_arrays(policy, params: EnvParams, kappa_hat, cal, hidden, ensemble: bool):
    """(full-set share, coverage, set size [n]) of :func:`calibration_diagnostics`, in one compiled program per
    network and kind (run eagerly, the forward pass and the set evaluation were ~180 operations compiled one by
    one, and the scan over row blocks compiled again for every policy;
    docs/performance.md#figures-behind-code-comments)."""
    probs = blocked_policy_probs(policy, params.obs, params.available, hidden, ensemble)
    avail = params.available[cal]
    in_set = conformal.conformal_set(probs[cal], kappa_hat, avail)
    m = evaluate_sets(in_set, params, cal)
    reached = reached_rounds(in_set & avail, avail) & params.round_mask[cal]
    full = jnp.all(jnp.where(reached[..., None], in_set == avail, True), axis=(1, 2))
    return jnp.mean(full.astype(jnp.float32)), jnp.mean(m.covered.astype(jnp.float32)), m.set_size
