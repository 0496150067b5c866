"""Two risks at once (Learn then Test): the guide score against a brute-force rollout, the threshold
against fixed-sequence tests written out with exact binomial p-values, and its family-wise validity."""
from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as C
from tests.helpers import random_rounds
from ccpo_jax.core.guarantee import PAC, ltt_critical_count
from envs.replay.env import reached_rounds


@pytest.mark.parametrize("seed", range(5))
def test_guide_score_equals_a_brute_force_rollout(seed):
    Q, T = 60, 4
    rng, probs, avail, n_rounds, round_mask = random_rounds(seed, Q, T, 0.8)
    g = np.asarray(jax.vmap(C.largest_guide_kappa)(jnp.asarray(probs), jnp.asarray(avail), jnp.asarray(round_mask)))
    for kappa in [0.0, 0.05, 0.2, 0.3, 0.34, 0.5, 0.7, 1.0, *np.unique(probs)[::7]]:
        s = np.asarray(C.conformal_set(jnp.asarray(probs), kappa, jnp.asarray(avail)))
        reached = np.asarray(reached_rounds(jnp.asarray(s), jnp.asarray(avail))) & round_mask
        called = np.any(reached & s[..., 1], axis=-1)
        np.testing.assert_array_equal(called, np.float32(kappa) <= g, err_msg=f"kappa {kappa}")


def _binom_cdf(c: int, n: int, p: Fraction) -> Fraction:
    return sum((math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(c + 1)), Fraction(0))


def _brute_ltt(kappa_i, guide_i, grid, alpha, cap, delta):
    """Fixed-sequence testing written out: coverage from the smallest threshold up, the guide rate from
    the largest down, each at delta/2 with the exact binomial p-value P(Bin(n, cap) <= observed count)."""
    n = len(kappa_i)
    cov = set()
    for j, lam in enumerate(grid):
        if _binom_cdf(int(np.sum(kappa_i < lam)), n, alpha) <= delta / 2:
            cov.add(j)
        else:
            break
    gd = set()
    for j in reversed(range(len(grid))):
        if _binom_cdf(int(np.sum(guide_i >= grid[j])), n, cap) <= delta / 2:
            gd.add(j)
        else:
            break
    both = cov & gd
    return (float(grid[max(both)]), True) if both else (float(grid[max(cov)]) if cov else 0.0, False)


@pytest.mark.parametrize("seed", range(6))
def test_ltt_threshold_equals_fixed_sequence_tests_written_out(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(30, 120))
    alpha, cap, delta = Fraction(int(rng.integers(2, 6)), 20), Fraction(int(rng.integers(8, 19)), 20), Fraction(1, 10)
    kappa_i = np.float32(rng.beta(2, 5, n))
    guide_i = np.float32(rng.beta(2, 8, n))
    grid = np.linspace(0, 1, 101, dtype=np.float32)
    c_cov, c_guide = PAC(float(delta), float(cap)).ltt_counts(n, float(alpha))
    got = C.ltt_threshold(jnp.asarray(kappa_i), jnp.asarray(guide_i), c_cov, c_guide, jnp.asarray(grid))
    want, feasible = _brute_ltt(kappa_i, guide_i, grid, alpha, cap, delta)
    assert bool(got[1]) == feasible
    assert float(got[0]) == pytest.approx(want, abs=0)


def test_critical_count_is_the_largest_rejected_count():
    for n, cap, d in [(100, 0.1, 0.05), (60, 0.3, 0.05), (20, 0.01, 0.05), (500, 0.2, 0.005)]:
        c = ltt_critical_count(n, cap, d)
        fc = Fraction(cap).limit_denominator(1000)
        if c >= 0:
            assert _binom_cdf(c, n, fc) <= Fraction(d).limit_denominator(1000)
        assert _binom_cdf(c + 1, n, fc) > Fraction(d).limit_denominator(1000)


def test_both_caps_hold_with_probability_one_minus_delta():
    """Scores with known risks: kappa_i ~ U(0,1) (miscoverage at kappa is kappa) and guide_i ~ U(0,1)
    (guide-call rate 1 - kappa). At alpha 0.2, cap 0.9 the thresholds meeting both are [0.1, 0.2]."""
    alpha, cap, delta, n, draws = 0.2, 0.9, 0.1, 400, 4000
    c_cov, c_guide = PAC(delta, cap).ltt_counts(n, alpha)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    kap = jax.random.uniform(k1, (draws, n))
    gui = jax.random.uniform(k2, (draws, n))
    grid = jnp.linspace(0.0, 1.0, 1001)
    lam, feas, _ = jax.vmap(lambda a, b: C.ltt_threshold(a, b, c_cov, c_guide, grid))(kap, gui)
    lam, feas = np.asarray(lam, np.float64), np.asarray(feas)
    violated = feas & ((lam > alpha + 1e-6) | (1 - lam > cap + 1e-6))
    assert feas.mean() > 0.5  # the request is feasible on most draws ...
    assert violated.mean() <= delta  # ... and the chosen threshold breaks a cap on at most delta of them
    # the cheapest threshold passing both is the one the coverage test allows: just below alpha
    assert 0.15 < np.median(lam[feas]) <= alpha
