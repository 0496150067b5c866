"""The PAC (training-conditional) threshold against an exact binomial sum and a Monte Carlo over
calibration draws; the below-target fraction's interval against beta quantiles."""
from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ccpo_jax.core import conformal as C
from ccpo_jax.core import guarantee as G


def _exact_pac_rank(n: int, alpha: Fraction, delta: Fraction) -> int | None:
    """Smallest k <= n with sum_{j < k} C(n, j) p^j (1-p)^(n-j) >= 1 - delta, p = 1 - alpha, in
    exact rational arithmetic (math.comb): the binomial tail written out by hand."""
    p = 1 - alpha
    acc = Fraction(0)
    for k in range(1, n + 1):
        j = k - 1
        acc += math.comb(n, j) * p ** j * (1 - p) ** (n - j)
        if acc >= 1 - delta:
            return k
    return None


@pytest.mark.parametrize("seed", range(8))
def test_pac_rank_equals_the_exact_binomial_sum(seed):
    rng = np.random.default_rng(seed)
    for _ in range(6):
        n = int(rng.integers(1, 160))
        alpha = Fraction(int(rng.integers(1, 40)), 200)  # 0.005 .. 0.195
        delta = Fraction(int(rng.integers(1, 50)), 200)
        assert G.pac_rank(n, float(alpha), float(delta)) == _exact_pac_rank(n, alpha, delta), (n, alpha, delta)


@pytest.mark.parametrize("alpha,delta", [(0.1, 0.1), (0.05, 0.1), (0.1, 0.05), (0.2, 0.01), (0.01, 0.5)])
def test_pac_min_n_is_the_first_feasible_size(alpha, delta):
    n_min = G.pac_min_n(alpha, delta)
    exact = [_exact_pac_rank(n, Fraction(alpha).limit_denominator(1000), Fraction(delta).limit_denominator(1000))
             for n in (n_min - 1, n_min)]
    assert exact[0] is None and exact[1] == n_min  # the lowest score is the first threshold that works
    assert G.pac_rank(n_min - 1, alpha, delta) is None and G.pac_rank(n_min, alpha, delta) == n_min
    if (alpha, delta) == (0.1, 0.1):
        assert n_min == 22  # 0.9^21 = 0.109 > 0.1 >= 0.9^22 = 0.098


def test_pac_rank_is_more_conservative_than_the_marginal_one():
    for n in (30, 100, 200, 1000):
        assert G.pac_rank(n, 0.1, 0.1) >= G.marginal_rank(n, 0.1)
    # delta = 0.5 is about the median: close to the marginal rank
    assert abs(G.pac_rank(1000, 0.1, 0.5) - G.marginal_rank(1000, 0.1)) <= 1


def _coverage_of_draws(n: int, draws: int, alpha: float, rank: int | None, seed: int = 0) -> np.ndarray:
    """Coverage of kappa-hat over ``draws`` calibration sets of n uniform scores: a fresh score
    U ~ U(0, 1) is covered iff kappa-hat <= U, so the coverage of kappa-hat is exactly 1 - kappa-hat."""
    s = jax.random.uniform(jax.random.PRNGKey(seed), (draws, n))
    khat = jax.vmap(lambda x: C.calibrate_kappa(x, alpha, rank))(s)
    return 1.0 - np.asarray(khat, np.float64)


@pytest.mark.parametrize("n", [40, 100, 300])
def test_pac_threshold_falls_short_in_at_most_delta_of_the_draws(n):
    alpha, delta, draws = 0.1, 0.1, 20_000
    pac = _coverage_of_draws(n, draws, alpha, G.pac_rank(n, alpha, delta))
    marg = _coverage_of_draws(n, draws, alpha, None)
    short_pac = float(np.mean(pac < 1 - alpha))
    short_marg = float(np.mean(marg < 1 - alpha))
    # the exact shortfall probability of rank k is binom.sf(k - 1; n, 1 - alpha) <= delta
    k = G.pac_rank(n, alpha, delta)
    exact = float(stats.binom.sf(k - 1, n, 1 - alpha))
    assert exact <= delta
    se = math.sqrt(delta * (1 - delta) / draws)
    assert short_pac <= delta + 4 * se, short_pac
    assert abs(short_pac - exact) <= 4 * se + 1e-3
    assert short_marg > 0.3, short_marg  # the marginal threshold falls short far more often than delta
    assert np.mean(marg) >= 1 - alpha - 0.005  # ... while its mean coverage holds (the marginal guarantee)


def test_rank_table_marks_too_small_sizes_with_n_plus_one():
    t = G.rank_table(40, 0.1, G.PAC(0.1))
    assert [int(t[n]) for n in range(22)] == [n + 1 for n in range(22)]
    assert all(int(t[n]) == G.pac_rank(n, 0.1, 0.1) for n in range(22, 41))
    m = G.rank_table(40, 0.1, G.Marginal())
    assert all(int(m[n]) == int(C.conformal_rank(n, 0.1)) for n in range(41))


def test_mondrian_pac_uses_each_groups_pac_rank():
    rng = np.random.default_rng(3)
    n, groups_n = 160, 3
    groups = rng.integers(0, groups_n, n)
    scores = rng.random(n).astype(np.float32)
    table = G.rank_table(n, 0.1, G.PAC(0.1))
    kap, own, n_cal = C.mondrian_kappa(jnp.asarray(scores), jnp.asarray(groups), groups_n, 0.1, 22, jnp.asarray(table))
    for g in range(groups_n):
        s = np.sort(scores[groups == g])[::-1]
        k = G.pac_rank(len(s), 0.1, 0.1)
        assert float(kap[g]) == float(s[k - 1])


def test_below_target_interval_is_clopper_pearson():
    cov = np.array([0.85, 0.95, 0.9, np.float32(90 / 100), 0.91, 0.7, np.nan])
    got = G.below_target(cov, 0.1)
    assert (got["count"], got["n"]) == (2, 6)  # 0.9 and float32(0.9) are on target, not below
    x, n = 2, 6
    lo, hi = stats.beta.ppf(0.025, x, n - x + 1), stats.beta.ppf(0.975, x + 1, n - x)
    np.testing.assert_allclose(got["ci"], [lo, hi], rtol=1e-6)
