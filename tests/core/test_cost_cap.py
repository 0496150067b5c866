"""The cost cap (a third risk of Learn then Test, a bounded loss): the Hoeffding-Bentkus p-value against
its closed form and exact binomial sums, its critical mean against a scan, the summed cost on the grid
against a brute-force rollout, the threshold against fixed-sequence tests written out, and validity by
Monte Carlo."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as C
from tests.helpers import random_rounds
from ccpo_jax.core.guarantee import PAC, hb_critical_mean, hb_pvalue
from envs.replay.env import reached_rounds


def _binom_cdf(c: int, n: int, p: float) -> float:
    """P(Bin(n, p) <= c), summed term by term (math.comb, float64; n <= 1000 keeps comb below 1e308)."""
    return math.fsum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(max(c, -1) + 1))


def _hb(mean: float, n: int, cap: float) -> float:
    """Bates et al. 2021, Prop. 5, written out: Hoeffding's exp(-n KL(min(mean, cap) || cap)) and
    Bentkus's e * P(Bin(n, cap) <= ceil(n mean)) summed exactly."""
    a = min(mean, cap)
    kl = (a * math.log(a / cap) if a else 0.0) + (1 - a) * math.log((1 - a) / (1 - cap))
    return min(math.exp(-n * kl), math.e * _binom_cdf(math.ceil(round(n * mean, 9)), n, cap))


@pytest.mark.parametrize("seed", range(4))
def test_hb_pvalue_equals_its_closed_form(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n = int(rng.integers(5, 300))
        cap = float(rng.uniform(0.05, 0.95))
        mean = float(rng.choice([rng.uniform(0, 1), rng.integers(0, n + 1) / n]))
        assert hb_pvalue(mean, n, cap) == pytest.approx(_hb(mean, n, cap), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("n,cap,d", [(100, 0.5, 0.05), (100, 0.3, 1 / 30), (300, 0.6, 0.05), (40, 0.9, 0.1),
                                     (500, 0.2, 0.01), (20, 0.1, 0.05)])
def test_critical_mean_is_the_edge_of_the_rejection_set(n, cap, d):
    r = hb_critical_mean(n, cap, d)
    scan = np.linspace(0.0, cap, 801)
    rejected = [m for m in scan if _hb(float(m), n, cap) <= d]
    if r < 0:
        assert not rejected and _hb(0.0, n, cap) > d
        return
    assert _hb(r, n, cap) <= d  # the critical mean is rejected ...
    assert _hb(r + 1e-7, n, cap) > d  # ... and nothing above it
    assert max(rejected) <= r + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_cost_on_grid_equals_a_brute_force_rollout(seed):
    Q, T = 50, 4
    rng, probs, avail, n_rounds, round_mask = random_rounds(seed, Q, T, 0.85)
    avail &= round_mask[..., None]
    cost = np.where(round_mask, rng.uniform(0.1, 2.0, (Q, T)), 0.0).astype(np.float32)
    reach = jax.vmap(C.round_reach_kappa)(jnp.asarray(probs), jnp.asarray(avail))
    kappas = np.array([0.0, 0.05, 0.2, 0.33, 0.5, 0.8, 1.0, *np.unique(probs)[::9]], np.float32)
    got = np.asarray(C.cost_on_grid(reach, jnp.asarray(cost), jnp.asarray(kappas)))
    for kappa, g in zip(kappas, got):
        s = np.asarray(C.conformal_set(jnp.asarray(probs), kappa, jnp.asarray(avail)))
        reached = np.asarray(reached_rounds(jnp.asarray(s), jnp.asarray(avail)))
        assert g == pytest.approx(float(np.sum(np.where(reached, cost, 0.0), dtype=np.float64)), rel=1e-5), kappa


def _brute_ltt_cost(kappa_i, cost_fn, grid, alpha, cap, delta, n, B):
    """Coverage from the smallest threshold up (exact binomial p-value), the mean cost from the largest
    down (Hoeffding-Bentkus on cost / B), each at delta/2; the largest threshold passing both."""
    cov = set()
    for j, lam in enumerate(grid):
        if _binom_cdf(int(np.sum(kappa_i < lam)), n, alpha) <= delta / 2:
            cov.add(j)
        else:
            break
    cst = set()
    for j in reversed(range(len(grid))):
        if _hb(cost_fn(grid[j]) / n / B, n, cap / B) <= delta / 2:
            cst.add(j)
        else:
            break
    both = cov & cst
    return (float(grid[max(both)]), True) if both else (None, False)


@pytest.mark.parametrize("seed", range(6))
def test_ltt_threshold_with_a_cost_cap_equals_fixed_sequence_tests_written_out(seed):
    rng = np.random.default_rng(seed)
    n, T = int(rng.integers(60, 200)), 3
    alpha, delta = float(rng.choice([0.1, 0.2, 0.3])), 0.1
    kappa_i = np.float32(rng.beta(2, 5, n))
    reach = np.concatenate([np.full((n, 1), np.inf), np.sort(rng.uniform(0, 1, (n, T - 1)), axis=1)[:, ::-1]], 1)
    reach = reach.astype(np.float32)
    cost = rng.uniform(0.5, 1.5, (n, T)).astype(np.float32)
    B = float(cost.sum(1).max())
    cap = float(rng.uniform(0.55, 0.9)) * B
    grid = np.linspace(0, 1, 101, dtype=np.float32)
    g = PAC(delta, None, cap)
    c_cov, c_guide = g.ltt_counts(n, alpha)
    crit = g.cost_critical(n, B) * n * (1 - 1e-5)
    cost_grid = C.cost_on_grid(jnp.asarray(reach), jnp.asarray(cost), jnp.asarray(grid))
    got = C.ltt_threshold(jnp.asarray(kappa_i), jnp.zeros(n), c_cov, c_guide, jnp.asarray(grid), cost_grid, crit)
    cost_fn = lambda lam: float(np.sum(np.where(reach >= lam, cost, 0.0), dtype=np.float64))  # noqa: E731
    want, feasible = _brute_ltt_cost(kappa_i, cost_fn, grid, alpha, cap, delta, n, B)
    assert bool(got[1]) == feasible
    if feasible:
        assert float(got[0]) == want


def test_hb_test_rejects_a_true_null_on_at_most_delta_of_draws():
    """At the null's edge (mean loss = cap) with Bernoulli losses, Bentkus's worst case: rejections <= d."""
    n, cap, d, draws = 100, 0.3, 0.1, 20000
    r = hb_critical_mean(n, cap, d)
    means = np.random.default_rng(0).binomial(n, cap, draws) / n
    assert np.mean(means <= r + 1e-12) <= d


def test_coverage_and_cost_caps_hold_with_probability_one_minus_delta():
    """Known risks: kappa_i ~ U(0,1) (miscoverage at kappa is kappa); two rounds costing 1 cent each, the
    second reached iff kappa <= r_i, r_i ~ U(0,1) (mean cost 2 - kappa, at most 2). At alpha 0.2 and a
    budget of 1.85 cents the thresholds meeting both are [0.15, 0.2]: the cost cap is at stake."""
    alpha, budget, delta, n, draws = 0.2, 1.85, 0.1, 400, 4000
    g = PAC(delta, None, budget)
    c_cov, c_guide = g.ltt_counts(n, alpha)
    crit = g.cost_critical(n, 2.0) * n * (1 - 1e-5)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    kap = jax.random.uniform(k1, (draws, n))
    r = jax.random.uniform(k2, (draws, n))
    reach = jnp.stack([jnp.full_like(r, jnp.inf), r], -1)
    cost = jnp.ones((n, 2))
    grid = jnp.linspace(0.0, 1.0, 1001)

    def one(a, b):
        return C.ltt_threshold(a, jnp.zeros(n), c_cov, c_guide, grid, C.cost_on_grid(b, cost, grid), crit)
    lam, feas, _ = jax.vmap(one)(kap, reach)
    lam, feas = np.asarray(lam, np.float64), np.asarray(feas)
    violated = feas & ((lam > alpha + 1e-6) | (2 - lam > budget + 1e-6))
    assert 0.02 < feas.mean()  # feasible on some draws (4.35% measured) ...
    assert violated.mean() <= delta  # ... and the choice breaks a cap on at most delta of all draws


def test_ltt_entry_names_the_cap_that_made_each_split_infeasible():
    """Three risks: a split is counted under the cap(s) failing at its coverage threshold; the test cost
    per question is the summed test cost over the test split's size, and a feasible split over budget breaks a cap."""
    from ccpo_jax.ccpo.guarantee_results import ltt_entry

    feas = np.array([[True, False, False, False, False]])
    x = {"feasible": feas, "guide_rate": np.full(feas.shape, 0.5), "cal_guide_rate": np.full(feas.shape, 0.9),
         "cal_cost": np.full(feas.shape, 0.02), "cost_coverage_only": np.full(feas.shape, 2.0),
         "coverage_ok": np.array([[True, True, True, True, False]]),
         "guide_ok": np.array([[True, False, True, False, True]]), "cost_ok": np.array([[True, True, False, False, True]]),
         "cost": np.array([[3.0, np.nan, np.nan, np.nan, np.nan]])}
    e = ltt_entry(x, PAC(0.1, 0.8, 0.025), np.full(feas.shape, 0.95), 0.1, n_test=100)
    assert e["binding"] == {"coverage": 1, "guide_cap (infeasible)": 1, "cost_cap (infeasible)": 1,
                            "both caps (infeasible)": 1, "no coverage threshold (infeasible)": 1}
    assert e["cost_per_question_cents"] == pytest.approx(0.03) and e["cost_above_cap"] == {"count": 1, "n": 1}
    assert e["violations"]["count"] == 1 and e["cap_cost_cents"] == pytest.approx(1.0)
