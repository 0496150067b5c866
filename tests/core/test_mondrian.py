"""Group-conditional (Mondrian) calibration against a brute-force count, and its guarantee."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as C


def _brute_threshold(scores: np.ndarray, alpha: float) -> float:
    """The largest t in {0} u {clipped scores} with #{s >= t} >= ceil((n+1)(1-alpha)); 0 if that rank > n.

    Counts, no sorting: an independent reading of the split-conformal quantile."""
    n = len(scores)
    k = math.ceil((n + 1) * (1 - alpha) - 1e-9)
    if k > n:
        return 0.0
    s = np.clip(scores, 0.0, 1.0)
    return float(max(t for t in [0.0, *s] if np.sum(s >= t) >= k))


def _brute_mondrian(scores, groups, G, alpha, group_min):
    n_cal = np.bincount(groups, minlength=G)
    own = n_cal >= group_min
    kap = np.zeros(G + 1)
    for g in range(G):
        if own[g]:
            kap[g] = _brute_threshold(scores[groups == g], alpha)
    rest = ~own[groups]
    kap[G] = _brute_threshold(scores[rest], alpha) if rest.any() else _brute_threshold(scores, alpha)
    return kap, own, n_cal


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_per_group_threshold_equals_a_brute_force_count(seed, alpha):
    rng = np.random.default_rng(seed)
    n, G = int(rng.integers(20, 120)), int(rng.integers(1, 7))
    groups = rng.integers(0, G, n)
    scores = rng.choice([0.0, 0.2, 0.35, 0.5, 0.8, 1.0], n) + rng.normal(0, 0.05, n) * (rng.random(n) < 0.5)
    scores[rng.random(n) < 0.1] = np.inf  # unsolvable: covered at every kappa
    scores[rng.random(n) < 0.05] = -np.inf  # uncoverable
    group_min = int(rng.integers(1, 25))
    got_k, got_own, got_n = C.mondrian_kappa(jnp.asarray(scores, jnp.float32), jnp.asarray(groups), G, alpha,
                                             group_min)
    want_k, want_own, want_n = _brute_mondrian(np.float32(scores), groups, G, alpha, group_min)
    np.testing.assert_array_equal(np.asarray(got_own), want_own)
    np.testing.assert_array_equal(np.asarray(got_n), want_n)
    np.testing.assert_allclose(np.asarray(got_k), want_k, rtol=0, atol=0)


def test_one_group_is_the_marginal_threshold():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.random(200), jnp.float32)
    k, own, _ = C.mondrian_kappa(s, jnp.zeros(200, jnp.int32), 1, 0.1, 10)
    assert bool(own[0]) and float(k[0]) == float(C.calibrate_kappa(s, 0.1)) == float(k[1])


def test_thresholds_map_small_groups_to_the_rest():
    kap = jnp.asarray([0.3, 0.6, 0.9, 0.1], jnp.float32)  # G = 3, rest = 0.1
    own = jnp.asarray([True, False, True])
    got = C.group_thresholds(kap, own, jnp.asarray([0, 1, 2, 1, 0]))
    np.testing.assert_array_equal(np.asarray(got), np.float32([0.3, 0.1, 0.9, 0.1, 0.3]))


def test_mondrian_covers_a_hard_group_that_marginal_calibration_misses():
    """Scores: an easy group (covered up to a high kappa) and a hard one (low kappa_i). One
    marginal threshold, set by the easy majority, under-covers the hard group; Mondrian gives each
    group 1 - alpha (over many random calibration/test splits)."""
    rng = np.random.default_rng(1)
    alpha, n_cal, n_test, reps = 0.1, 200, 2000, 200
    cov_m, cov_g = [], []
    cal_fn = jax.jit(lambda s, g: C.mondrian_kappa(s, g, 2, alpha, 20))
    for _ in range(reps):
        def draw(n):
            g = (rng.random(n) < 0.2).astype(np.int32)  # 20% hard
            s = np.where(g == 1, rng.beta(2, 5, n), rng.beta(5, 2, n)).astype(np.float32)
            return s, g
        s_c, g_c = draw(n_cal)
        s_t, g_t = draw(n_test)
        marg = float(C.calibrate_kappa(jnp.asarray(s_c), alpha))
        kap, own, _ = cal_fn(jnp.asarray(s_c), jnp.asarray(g_c))
        thr = np.asarray(C.group_thresholds(kap, own, jnp.asarray(g_t)))
        hard = g_t == 1
        cov_m.append(np.mean(s_t[hard] >= marg))
        cov_g.append([np.mean((s_t >= thr)[g_t == g]) for g in (0, 1)])
    cov_g = np.asarray(cov_g)
    assert np.mean(cov_m) < 1 - alpha - 0.15  # marginal: the hard group far below 0.9
    assert np.all(cov_g.mean(axis=0) >= 1 - alpha - 0.005)  # Mondrian: every group at 1 - alpha
    assert np.all(cov_g.mean(axis=0) <= 1 - alpha + 0.03)  # and not by including everything


def test_on_a_cache_mondrian_covers_the_hard_group_that_the_marginal_threshold_misses():
    """Through the replay env: a fixed random policy with pi(base|o_t) in [0.5, 0.8] and pi(guide),
    pi(next) below 0.5. A question whose base is right at round 1 is covered up to kappa >= 0.5; the
    others need the guide or a later round (kappa_i < 0.5). Grouped that way, the marginal
    threshold covers the hard group far below 1 - alpha; the Mondrian thresholds cover both
    (counted on the test questions over 100 random splits, against the oracle 1 - alpha)."""
    from ccpo_jax.ccpo.evaluation import eval_batch_calibrated, eval_mondrian, per_group
    from envs.replay.env import make_env_params
    from envs.replay.reference import random_cache

    cache = random_cache(3000, T=3, seed=5)
    params = make_env_params(cache)
    hard = ~np.asarray(params.base_correct[:, 0]) & ~np.asarray(params.unsolvable)
    codes = jnp.asarray(hard.astype(np.int32))
    Q, T = params.base_correct.shape
    rng = np.random.default_rng(0)
    base, guide = rng.uniform(0.5, 0.8, (Q, T)), rng.uniform(0.02, 0.25, (Q, T))
    probs = jnp.asarray(np.stack([base, guide, 1.0 - base - guide], -1), jnp.float32)
    probs = jnp.where(params.available, probs, 0.0)
    probs = probs / jnp.sum(probs, -1, keepdims=True)
    kappa_i = jax.vmap(C.largest_covering_kappa)(probs, params.base_correct, params.guide_correct,
                                                 params.round_mask, params.unsolvable)
    alpha = 0.1

    @jax.jit
    def split(key):
        perm = jax.random.permutation(key, Q)
        cal, test = perm[:500], perm[500:1500]
        m_marg, _ = eval_batch_calibrated(probs, kappa_i, params, cal, test, alpha)
        m_mond, _, own, _ = eval_mondrian(probs, kappa_i, params, cal, test, alpha, codes, 2, 20)
        return per_group(m_marg, codes[test], 2)["coverage"], per_group(m_mond, codes[test], 2)["coverage"], own

    marg, mond, own = jax.vmap(split)(jax.random.split(jax.random.PRNGKey(0), 100))
    assert bool(np.all(own))
    marg, mond = np.asarray(marg).mean(0), np.asarray(mond).mean(0)
    assert hard.mean() > 0.15
    assert marg[1] < 1 - alpha - 0.1, marg  # the hard group under-covered by one marginal threshold
    assert np.all(mond >= 1 - alpha - 0.01), mond  # Mondrian: each group at its 1 - alpha
