"""Conformal policy, online threshold and exact batch calibration (CCPO paper, arXiv 2511.11828, Eqs. 2-3 and 9).

Actions are (base, guide, next) = (0, 1, 2). ``probs`` are pi(.|o) from
:func:`ccpo_jax.core.networks.masked_probs`; ``available`` is the action mask
("next" is False at a question's last round, envs.replay.features.available_actions).

Sets are nested in kappa: C_{pi,kappa}(o) = {a : pi(a|o) >= kappa} shrinks as
kappa grows, so a question's coverage is monotone in kappa. That makes the
batch calibration exact (no grid, :func:`largest_covering_kappa`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from envs.cache.schema import A_BASE as BASE, A_GUIDE as GUIDE, A_NEXT as NEXT  # the one definition of the action ids

Array = jax.Array

#: Score of an unsolvable question (covered at every kappa). Any value > 1 works
#: because kappa lives in [0, 1]; +inf keeps the order exact.
UNSOLVABLE_SCORE = jnp.inf
#: Score of a question that no kappa covers (no correct answer is ever reached).
UNCOVERABLE_SCORE = -jnp.inf


def _available(probs: Array, available: Array | None) -> Array:
    return jnp.ones(probs.shape, bool) if available is None else available.astype(bool)


def conformal_set(probs: Array, kappa: Array | float, available: Array | None = None) -> Array:
    """C_{pi,kappa}(o) = {a available : pi(a|o) >= kappa} (paper Eq. 2).

    Args:
      probs: ``[..., A]`` pi(a|o).
      kappa: scalar or broadcastable to ``[...]`` (a trailing axis is added).
      available: ``[..., A]`` bool; unavailable actions are never in the set.

    Returns:
      ``[..., A]`` bool. The set MAY BE EMPTY (every pi(a|o) < kappa, possible
      only when kappa > 1/|available|); :func:`stochastic_conformal_policy`
      documents what the policy does then.
    """
    kappa = jnp.asarray(kappa, probs.dtype)[..., None]
    return (probs >= kappa) & _available(probs, available)


def stochastic_conformal_policy(probs: Array, kappa: Array | float, available: Array | None = None) -> Array:
    """S_{pi,kappa}(a|o): uniform over the conformal set (paper Eq. 3).

    Empty-set rule (the paper leaves this open; our choice): when C_{pi,kappa}(o) is
    empty, S is a point mass on argmax_a pi(a|o) over the available actions
    (the set {argmax pi}, as in the follow-up RLCP paper). This keeps S a
    distribution and equals the limit of the set as kappa decreases to max pi.

    Returns ``[..., A]``, rows sum to 1 (if any action is available).
    """
    avail = _available(probs, available)
    in_set = conformal_set(probs, kappa, avail)
    n = jnp.sum(in_set, axis=-1, keepdims=True)
    arg = jnp.argmax(jnp.where(avail, probs, -jnp.inf), axis=-1)
    fallback = jax.nn.one_hot(arg, probs.shape[-1], dtype=probs.dtype)
    uniform = in_set.astype(probs.dtype) / jnp.maximum(n, 1).astype(probs.dtype)
    return jnp.where(n > 0, uniform, fallback)


def softmask(probs: Array, kappa: Array | float, eps: float = 0.01) -> Array:
    """softmask(a, o; kappa) = sigmoid((pi(a|o) - kappa) / eps), eps = 0.01 (arXiv 2511.11828 §5.1). ``[..., A]``."""
    kappa = jnp.asarray(kappa, probs.dtype)[..., None]
    return jax.nn.sigmoid((probs - kappa) / eps)


def _soft_logits(probs, kappa, available, eps):
    avail = _available(probs, available)
    kappa = jnp.asarray(kappa, probs.dtype)[..., None]
    logits = jax.nn.log_sigmoid((probs - kappa) / eps)
    any_avail = jnp.any(avail, axis=-1, keepdims=True)
    use = avail | ~any_avail
    return jax.nn.log_softmax(jnp.where(use, logits, -jnp.inf), axis=-1), use


def soft_conformal_log_policy(
    probs: Array, kappa: Array | float, available: Array | None = None, eps: float = 0.01
) -> Array:
    """log S~(a|o), ``[..., A]``, with S~(a|o) = softmask(a) / sum_{a' available} softmask(a')
    (the paper leaves the normalisation open; our choice).

    Computed as a log-softmax of log-sigmoids over the available actions, so S~ is exactly
    normalised and finite (no 0/0) even when every softmask underflows (all pi(a|o) << kappa:
    then S~ tends to a point mass on argmax pi, the same rule as the hard policy's empty set).
    Finite (>= about -1/eps - log A) on available actions even where S~ underflows to 0,
    ``-inf`` on unavailable ones; a row with no available action at all (padding) gives the
    uniform distribution, so logs stay finite (mask such steps out downstream). Use it for
    ratios and KLs (gradients stay finite); ``exp`` of it is S~. Differentiable in ``probs``
    and ``kappa``."""
    logp, use = _soft_logits(probs, kappa, available, eps)
    return jnp.where(use, logp, -jnp.inf)


def soft_policy_kl(logp_old: Array, logp_new: Array) -> Array:
    """KL(S~_old || S~_new) over the last axis from log-policies (``-inf`` = unavailable in both). ``[...]``."""
    p_old = jnp.exp(logp_old)
    diff = jnp.where(jnp.isfinite(logp_old), logp_old - jnp.where(jnp.isfinite(logp_new), logp_new, 0.0), 0.0)
    return jnp.sum(p_old * diff, axis=-1)


# ----------------------------------------------------------------------------- online kappa


def kappa_step(
    kappa: Array | float, err: Array | float, k: Array | int, alpha: float, eta0: float, xi: float = 0.1
) -> Array:
    """One online conformal step (arXiv 2511.11828 Eq. 9 with the sign of Angelopoulos,
    Barber and Bates, ICML 2024; the sign is our choice):

        kappa_{k+1} = clip(kappa_k + eta_k (alpha - err_k), 0, 1),  eta_k = eta0 k^-(1/2 + xi).

    A miss (err = 1) LOWERS kappa, i.e. enlarges the sets C = {pi >= kappa}.
    (The Chinese summary's sign is the opposite and is wrong.)

    Args:
      kappa: current threshold.
      err: 1 - 1[Y* in C_{pi_{k+1},kappa_k}(Q) or unsolvable] for one question,
        or the batch mean of that over a batch of questions (one step per batch;
        the long-run bound |mean err - alpha| <= range(kappa) / (K eta_K) holds for
        any err in [0, 1]).
      k: the 1-based step counter (values < 1 are treated as 1).
      alpha: target miscoverage. eta0: initial step. xi: decay exponent (paper 0.1).
    """
    k = jnp.maximum(jnp.asarray(k, jnp.float32), 1.0)
    eta = eta0 * k ** (-(0.5 + xi))
    return jnp.clip(kappa + eta * (alpha - jnp.asarray(err, jnp.float32)), 0.0, 1.0)


# ----------------------------------------------------------------------------- batch calibration


def largest_covering_kappa(
    probs: Array, base_correct: Array, guide_correct: Array, round_mask: Array, unsolvable: Array
) -> Array:
    """Largest kappa at which the set-valued rollout of C_{pi,kappa} covers one question.

    Set-valued rollout (docs/environment.md): round t is reached iff "next" is in the set at
    every earlier round; at a reached round the base (guide) answer is collected
    iff "base" ("guide") is in the set. Because C = {a : pi(a|o) >= kappa} is
    nested, the question is covered at kappa iff for some existing round t

        pi(next|o_s) >= kappa for all s < t  and  pi(a*|o_t) >= kappa for a correct a* at t,

    so  kappa_i = max_t min( min_{s<t} pi(next|o_s), max_{correct a at t} pi(a|o_t) ),
    and the question is covered at kappa iff kappa <= kappa_i.

    Args:
      probs: ``[T, 3]`` pi(.|o_t) along the question's fixed chain of observations.
      base_correct, guide_correct, round_mask: ``[T]`` bool.
      unsolvable: scalar bool.

    Returns:
      scalar: kappa_i in [0, 1]; ``+inf`` (UNSOLVABLE_SCORE) if unsolvable
      (covered for every kappa, even by an empty set); ``-inf``
      (UNCOVERABLE_SCORE) if no existing round has a correct answer.
    """
    p_next = probs[:, NEXT]
    # reach[t] = min_{s<t} pi(next|o_s)  (1 at t = 0): an exclusive cumulative min.
    reach = jnp.concatenate([jnp.ones((1,), probs.dtype), jax.lax.cummin(p_next)[:-1]])
    ans = jnp.maximum(
        jnp.where(base_correct, probs[:, BASE], -jnp.inf),
        jnp.where(guide_correct, probs[:, GUIDE], -jnp.inf),
    )
    per_round = jnp.where(round_mask, jnp.minimum(reach, ans), -jnp.inf)
    score = jnp.max(per_round)
    return jnp.where(unsolvable, UNSOLVABLE_SCORE, score)


def conformal_rank(n: int | Array, alpha: Array | float) -> Array:
    """k = ceil((n + 1)(1 - alpha)) as int32 (``n`` may be an array) (a 1e-4 slack absorbs float32 rounding,
    e.g. 100 * (1 - 0.2) = 80.0000012 in float32 must give 80, not 81)."""
    return jnp.ceil((n + 1) * (1.0 - jnp.asarray(alpha, jnp.float32)) - 1e-4).astype(jnp.int32)


def conformal_rank_host(n: int, alpha: float) -> int:
    """:func:`conformal_rank` on the host, in the same float32 arithmetic."""
    return int(np.ceil(np.float32(n + 1) * (np.float32(1.0) - np.float32(alpha)) - np.float32(1e-4)))


#: The slack of :func:`conformal_rank`: k = ceil((n + 1)(1 - alpha) - RANK_SLACK).
RANK_SLACK = 1e-4


def min_calibration_size(alpha: float, below: int = 1) -> int:
    """The fewest calibration questions n whose conformal rank k = ceil((n+1)(1-alpha) - 1e-4)
    (:func:`conformal_rank`'s rule) is at most ``n + 1 - below``: ``below`` 1 = a threshold at all
    (k <= n; below it kappa-hat = 0), 2 = not the single lowest score (k < n).

    Closed form, in float64 (not a search: alpha 1e-9 needs about 2e9 questions): k - n =
    ceil(1 - alpha (n + 1) - 1e-4), so k <= n + 1 - b iff alpha (n + 1) >= b - 1e-4, i.e.
    n >= (b - 1e-4) / alpha - 1. The float32 rank of the calibration agrees with it wherever
    float32 is exact enough (tests/core/test_calibration.py checks it against a search with
    :func:`conformal_rank_host` for alphas down to 0.005)."""
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    n = max(1, math.ceil((below - RANK_SLACK) / a) - 1)

    def ok(m: int) -> bool:  # the rank's own float64 expression, so that the two agree at the boundary
        return conformal_rank_f64(m, a) <= m + 1 - below

    # the division rounds: step to the boundary (a step or two; k - n is monotone in n)
    while n > 1 and ok(n - 1):
        n -= 1
    while not ok(n):
        n += 1
    return n


def conformal_rank_f64(n: int, alpha: float) -> int:
    """:func:`conformal_rank` in float64 on the host: n + ceil(1 - alpha (n + 1) - 1e-4) (the same
    value as ceil((n+1)(1-alpha) - 1e-4), without float32's rounding of 1 - alpha)."""
    return int(n) + math.ceil(1.0 - float(alpha) * (int(n) + 1) - RANK_SLACK)


def calibration_size_warning(n: int, alpha: float) -> str | None:
    """A warning when ``n`` calibration questions are too few for a useful threshold at ``alpha``.

    The rank k = ceil((n+1)(1-alpha)) exceeds n: kappa-hat = 0, every available action is in
    every set and coverage is 1 by construction; k = n: kappa-hat is the single lowest
    calibration score. None otherwise. Closed forms (:func:`min_calibration_size`), so it
    answers at once for any alpha.
    """
    k = conformal_rank_f64(n, alpha)
    if k < n:
        return None
    n_min = min_calibration_size(alpha, below=2)
    what = ("so kappa-hat = 0: every set holds every available action and coverage is 1 by construction"
            if k > n else "so kappa-hat is the single lowest calibration score (a very noisy threshold)")
    return (f"{n} calibration questions are too few for alpha={alpha:g}: the conformal rank "
            f"ceil((n+1)(1-alpha)) = {k} {'exceeds' if k > n else 'equals'} n = {n}, {what}; "
            f"use at least {n_min} (the middle number of --split-sizes)")


def calibrate_kappa(kappa_i: Array, alpha: Array | float, rank: Array | int | None = None) -> Array:
    """Exact split-conformal threshold (docs/algorithms.md): kappa-hat = the
    ceil((n+1)(1-alpha))-th LARGEST kappa_i, clipped to [0, 1].

    Then at least ceil((n+1)(1-alpha)) calibration questions have kappa_i >=
    kappa-hat, i.e. are covered, and by exchangeability a fresh test question
    is covered with probability in [1-alpha, 1-alpha+1/(n+1)] (upper end for
    distinct scores). When that rank exceeds n the guarantee needs "include
    everything", so kappa-hat = 0.0. Clipping +inf (unsolvable) to 1 and -inf
    to 0 only enlarges sets, so coverage stays valid.

    Args:
      kappa_i: ``[n]`` scores from :func:`largest_covering_kappa` (n static).
      alpha: miscoverage level (may be traced, e.g. vmapped over alpha).
      rank: the rank k to use instead (may be traced), e.g. the PAC rank of
        :func:`ccpo_jax.core.guarantee.pac_rank`; k > n gives 0.0 as above.
    Returns: scalar kappa-hat in [0, 1].
    """
    n = kappa_i.shape[0]
    k = conformal_rank(n, alpha) if rank is None else jnp.asarray(rank, jnp.int32)
    desc = -jnp.sort(-kappa_i)
    val = desc[jnp.clip(k - 1, 0, n - 1)]
    return jnp.where(k > n, 0.0, jnp.clip(val, 0.0, 1.0)).astype(jnp.float32)


def covered_at(kappa: Array | float, kappa_i: Array) -> Array:
    """Coverage of each question at threshold kappa: ``kappa <= kappa_i`` (same shape as kappa_i).
    Use it for the online err_k = 1 - covered_at(kappa_k, kappa_i) of the questions just seen."""
    return jnp.asarray(kappa) <= kappa_i


# ----------------------------------------------------------------------------- group-conditional (Mondrian)


def mondrian_kappa(
    kappa_i: Array, group: Array, n_groups: int, alpha: Array | float, group_min: int,
    ranks: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Group-conditional (Mondrian) split-conformal thresholds (Vovk et al. 2003; as in MAPIE / crepes).

    Every group with at least ``group_min`` calibration questions gets its own threshold, the
    :func:`calibrate_kappa` rule applied to its own scores: the ceil((n_g+1)(1-alpha))-th largest
    of its n_g scores (0 when that rank exceeds n_g). The smaller groups are pooled into one
    "rest" group (index ``n_groups``) calibrated the same way on their pooled scores; if no
    calibration question is pooled, the rest threshold is the marginal one (:func:`calibrate_kappa`
    on every score), which is what a test question of a group absent from the calibration split
    gets. By exchangeability within each group, a fresh test question of group g is covered with
    probability >= 1 - alpha, conditionally on g (for the rest group: on being in the rest).

    Args:
      kappa_i: ``[n]`` calibration scores (:func:`largest_covering_kappa`).
      group: ``[n]`` int group ids in ``[0, n_groups)``.
      n_groups: G, static. alpha: may be traced. group_min: static minimum size of an own group.
      ranks: ``[n + 1]`` int, the rank to use for a group of each size 0..n instead of
        ceil((n_g+1)(1-alpha)) (a PAC guarantee: :func:`ccpo_jax.core.guarantee.rank_table`).

    Returns:
      ``(kappa_hat [G + 1], own [G] bool, n_cal [G] int32)``: the threshold of every group and of
      the rest (last), which groups have their own, and each group's calibration count.
    """
    g = jnp.asarray(group, jnp.int32)
    n = kappa_i.shape[0]
    n_cal = jnp.zeros((n_groups,), jnp.int32).at[g].add(1)
    own = n_cal >= group_min
    eff = jnp.where(own[g], g, n_groups)  # [n]: own group, or the rest
    n_j = jnp.zeros((n_groups + 1,), jnp.int32).at[eff].add(1)
    # One sort by (group, descending score): each group's scores are then contiguous and in
    # descending order, so its k-th largest sits at start_j + k - 1 (memory O(n), not O(G n)).
    # Clipping first is monotone: the k-th largest of the clipped scores is the clipped k-th largest.
    s = jnp.clip(kappa_i, 0.0, 1.0)
    _, neg_sorted = jax.lax.sort((eff, -s), num_keys=2)
    start = jnp.cumsum(n_j) - n_j
    k = conformal_rank(n_j, alpha) if ranks is None else jnp.asarray(ranks, jnp.int32)[n_j]  # each group's rank
    val = -neg_sorted[jnp.clip(start + k - 1, 0, n - 1)]
    kap = jnp.where(k > n_j, 0.0, val).astype(jnp.float32)
    rest_empty = n_j[n_groups] == 0
    marginal = calibrate_kappa(kappa_i, alpha, None if ranks is None else jnp.asarray(ranks, jnp.int32)[n])
    kap = kap.at[n_groups].set(jnp.where(rest_empty, marginal, kap[n_groups]))
    return kap, own, n_cal


def group_thresholds(kappa_hat: Array, own: Array, group: Array) -> Array:
    """Each question's Mondrian threshold ``[m]``: its group's own kappa-hat, else the rest's."""
    g = jnp.asarray(group, jnp.int32)
    n_groups = own.shape[0]
    return kappa_hat[jnp.where(own[g], g, n_groups)]


# ----------------------------------------------------------------------------- two risks (Learn then Test)


def largest_guide_kappa(probs: Array, available: Array, round_mask: Array) -> Array:
    """Largest kappa at which the set-valued rollout of C_{pi,kappa} calls the guide on one question.

    As in :func:`largest_covering_kappa`: round t is reached at kappa iff pi(next|o_s) >= kappa for
    every s < t, and the guide's answer is collected there iff "guide" is available and
    pi(guide|o_t) >= kappa; so the guide is called at kappa iff kappa <= g_i with

        g_i = max_t min( min_{s<t} pi(next|o_s), pi(guide|o_t) )  over existing rounds with the guide available.

    Args: probs ``[T, 3]``, available ``[T, 3]`` bool, round_mask ``[T]`` bool.
    Returns: scalar g_i; ``-inf`` when the guide is available at no existing round.
    """
    p_next = jnp.where(available[:, NEXT], probs[:, NEXT], -jnp.inf)
    reach = jnp.concatenate([jnp.ones((1,), probs.dtype), jax.lax.cummin(p_next)[:-1]])
    ok = round_mask & available[:, GUIDE]
    return jnp.max(jnp.where(ok, jnp.minimum(reach, probs[:, GUIDE]), -jnp.inf))


def round_reach_kappa(probs: Array, available: Array) -> Array:
    """``[T]``: the largest kappa at which the set-valued rollout of C_{pi,kappa} reaches each round of one
    question (+inf for the first: always reached). Round t is reached iff pi(next|o_s) >= kappa and "next"
    is available at every s < t, i.e. iff kappa <= min_{s<t} pi(next|o_s) (as in :func:`largest_guide_kappa`)."""
    p_next = jnp.where(available[:, NEXT], probs[:, NEXT], -jnp.inf)
    return jnp.concatenate([jnp.full((1,), jnp.inf, probs.dtype), jax.lax.cummin(p_next)[:-1]])


def cost_on_grid(reach: Array, cost: Array, grid: Array) -> Array:
    """``[len(grid)]``: the summed cost of n questions at every threshold of ``grid``, from each round's
    reach kappa ``reach`` [n, T] (:func:`round_reach_kappa`) and cost ``cost`` [n, T] (cents, 0 on padding
    rounds): sum_{i,t} cost_it [kappa <= reach_it], non-increasing in kappa. One sort of the n*T pairs
    and a cumulative sum, so memory is O(n T + grid), not O(n T grid)."""
    r, c = reach.reshape(-1), cost.reshape(-1).astype(jnp.float32)
    r_sorted, c_sorted = jax.lax.sort((r, c), num_keys=1)
    before = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(c_sorted)])  # cost of the first j pairs
    j = jnp.searchsorted(r_sorted, grid, side="left")  # pairs with reach < kappa: not reached
    return before[-1] - before[j]


def ltt_threshold(kappa_i: Array, guide_i: Array, c_cov: Array | int, c_guide: Array | int, grid: Array,
                  cost_grid: Array | None = None, c_cost: Array | float = jnp.inf):
    """Learn-then-Test choice of kappa over a fixed ``grid`` (increasing) for two risks at once
    (Angelopoulos, Bates, Candes, Jordan and Lei 2021, "Learn then Test").

    Miscoverage at kappa counts #{kappa_i < kappa} (non-decreasing in kappa), guide calls
    #{guide_i >= kappa} (non-increasing). Each null "risk above its cap" at grid point kappa is
    rejected when its count is at most its critical count ``c_cov`` / ``c_guide`` (the largest count
    whose exact binomial p-value is <= the family's share of delta; -1: never,
    :func:`ccpo_jax.core.guarantee.ltt_critical_count`). Coverage is tested in fixed sequence from the
    smallest kappa up and the guide rate from the largest down, each stopping at its first
    non-rejection; by the counts' monotonicity these are the prefix {#miss <= c_cov} and the suffix
    {#guide <= c_guide} of the grid. The choice is the largest kappa in both (the smallest sets: the
    cheapest), valid for both caps with probability >= 1 - delta (Bonferroni over the two families).
    With ``cost_grid`` (the summed calibration cost at every grid point, :func:`cost_on_grid`, non-increasing)
    a third risk is tested the same way, from the largest kappa down: rejected where the sum is <= ``c_cost``
    (the critical sum of :meth:`ccpo_jax.core.guarantee.Guarantee.cost_critical`, Hoeffding-Bentkus).

    Returns ``(kappa, feasible, kappa_cov)``: the choice (``kappa_cov`` where infeasible), whether any
    grid point passes both tests, and the largest kappa passing the coverage test alone (0.0 if none).
    """
    n_miss = jnp.searchsorted(jnp.sort(kappa_i), grid, side="left")  # #{kappa_i < kappa}
    n_guide = guide_i.shape[0] - jnp.searchsorted(jnp.sort(guide_i), grid, side="left")  # #{guide_i >= kappa}
    cov_ok = n_miss <= c_cov
    both = cov_ok & (n_guide <= c_guide)
    if cost_grid is not None:
        both = both & (cost_grid <= c_cost)
    idx = jnp.arange(grid.shape[0])
    last_cov = jnp.max(jnp.where(cov_ok, idx, -1))
    last_both = jnp.max(jnp.where(both, idx, -1))
    kappa_cov = jnp.where(last_cov >= 0, grid[jnp.maximum(last_cov, 0)], 0.0)
    feasible = last_both >= 0
    kappa = jnp.where(feasible, grid[jnp.maximum(last_both, 0)], kappa_cov)
    return kappa.astype(jnp.float32), feasible, kappa_cov.astype(jnp.float32)
