"""Exact batch calibration (arXiv 2511.11828 §5.1; docs/algorithms.md) against a NumPy set-valued rollout,
the paper's 1e-6 grid search, and the split-conformal coverage guarantee."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as cf

T = 4


def _pool(seed, Q):
    """Random policies on random chains: probs [Q,T,3] (next masked at the last round), flags [Q,T]."""
    rng = np.random.default_rng(seed)
    n_rounds = rng.integers(2, T + 1, Q)
    round_mask = np.arange(T)[None] < n_rounds[:, None]
    avail = np.ones((Q, T, 3), bool)
    avail[np.arange(Q), n_rounds - 1, 2] = False
    probs = rng.dirichlet(np.ones(3), (Q, T)) * avail
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    base_c = (rng.random((Q, T)) < 0.4) & round_mask
    guide_c = (rng.random((Q, T)) < 0.4) & round_mask
    unsolvable = ~(base_c | guide_c).any(-1)
    return probs, avail, base_c, guide_c, round_mask, unsolvable


def covered_np(kappa, probs, avail, base_c, guide_c, round_mask, unsolvable):
    """Reference: walk each question's chain with the set C = {a available: pi(a|o) >= kappa}.
    kappa: scalar or [Q]. Returns covered [Q]."""
    kappa = np.broadcast_to(np.asarray(kappa, np.float64), unsolvable.shape)[:, None]
    reached = np.ones(unsolvable.shape, bool)
    covered = np.zeros(unsolvable.shape, bool)
    for t in range(probs.shape[1]):
        in_set = (probs[:, t].astype(np.float64) >= kappa) & avail[:, t]
        live = reached & round_mask[:, t]
        covered |= live & ((in_set[:, 0] & base_c[:, t]) | (in_set[:, 1] & guide_c[:, t]))
        reached = live & in_set[:, 2]
    return covered | unsolvable


@pytest.fixture(scope="module")
def pool():
    data = _pool(0, 400)
    probs, avail, base_c, guide_c, round_mask, unsolvable = data
    scores = jax.jit(jax.vmap(cf.largest_covering_kappa))(probs, base_c, guide_c, round_mask, unsolvable)
    return data, np.asarray(scores)


def test_score_is_the_exact_coverage_boundary(pool):
    data, scores = pool
    unsolv = data[-1]
    assert np.isposinf(scores[unsolv]).all() and np.isfinite(scores[~unsolv]).all()
    s = scores[~unsolv].astype(np.float64)
    sub = [x[~unsolv] for x in data]
    # covered exactly at kappa_i, not covered just above it (the reference walks the chain)
    assert covered_np(s, *sub).all()
    assert not covered_np(np.nextafter(s.astype(np.float32), np.float32(2)), *sub).any()
    # a question with no correct answer on existing rounds, marked solvable: never covered
    probs, avail, base_c, guide_c, rm, _ = [x[:1] for x in data]
    none = cf.largest_covering_kappa(probs[0], np.zeros(T, bool), np.zeros(T, bool), rm[0], False)
    assert np.isneginf(float(none))


def test_calibrate_kappa_rank_by_hand_and_include_all():
    kap = jnp.array([0.9, 0.1, 0.5, 0.7, 0.3, 0.2, 0.8, 0.6, 0.4])  # n = 9
    # alpha = 0.2: ceil(10 * 0.8) = 8 -> 8th largest = 0.2
    np.testing.assert_allclose(cf.calibrate_kappa(kap, 0.2), 0.2)
    # alpha = 0.05: ceil(10 * 0.95) = 10 > 9 -> include everything
    assert float(cf.calibrate_kappa(kap, 0.05)) == 0.0
    # float32 rounding must not bump the rank: n = 99, alpha = 0.2 -> k = 80 exactly
    kap = jnp.arange(99, dtype=jnp.float32) / 100
    np.testing.assert_allclose(cf.calibrate_kappa(kap, 0.2), np.sort(np.asarray(kap))[::-1][79])
    # +inf (unsolvable) clips to 1, -inf (uncoverable) to 0
    assert float(cf.calibrate_kappa(jnp.array([jnp.inf] * 5), 0.5)) == 1.0
    assert float(cf.calibrate_kappa(jnp.array([-jnp.inf] * 5), 0.5)) == 0.0


def _grid_search(cal, alpha, grid=1e-6):
    """The paper's procedure: the largest kappa on a 1e-6 grid whose calibration coverage count is
    >= ceil((n+1)(1-alpha)), coverage evaluated by walking the chains. Coverage is monotone in kappa
    (checked on a coarse grid first), so the largest such grid point is found by bisection over
    the 10^6 grid indices instead of a 10^6-point scan."""
    n = len(cal[0])
    k = math.ceil(round((n + 1) * (1 - alpha), 9))
    coarse = np.array([covered_np(kk, *cal).sum() for kk in np.linspace(0, 1, 201)])
    assert (np.diff(coarse) <= 0).all(), "coverage must be monotone in kappa"
    if k > n:
        return 0.0
    lo, hi = 0, int(round(1 / grid))  # invariant: count(lo) >= k
    if covered_np(hi * grid, *cal).sum() >= k:
        return hi * grid
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if covered_np(mid * grid, *cal).sum() >= k:
            lo = mid
        else:
            hi = mid
    return lo * grid


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_exact_calibration_matches_grid_search(pool, alpha):
    data, scores = pool
    rng = np.random.default_rng(int(alpha * 100))
    for _ in range(3):
        perm = rng.permutation(len(scores))
        cal, test = perm[:200], perm[200:]
        kap_exact = float(cf.calibrate_kappa(jnp.asarray(scores[cal]), alpha))
        kap_grid = _grid_search([x[cal] for x in data], alpha)
        assert abs(kap_exact - kap_grid) <= 1e-6 + 1e-7
        for idx in (cal, test):
            sub = [x[idx] for x in data]
            np.testing.assert_array_equal(covered_np(kap_exact, *sub), covered_np(kap_grid, *sub))
        assert covered_np(kap_exact, *[x[cal] for x in data]).sum() >= math.ceil(201 * (1 - alpha) - 1e-9)


def test_split_conformal_coverage_over_2000_draws(pool):
    data, scores = pool
    n, m, alpha, D = 100, 100, 0.2, 2000
    keys = jax.random.split(jax.random.PRNGKey(0), D)

    @jax.jit
    def draw(key, s):
        perm = jax.random.permutation(key, s.shape[0])
        return cf.calibrate_kappa(s[perm[:n]], alpha), perm[n:n + m]

    kap, test_idx = jax.vmap(draw, in_axes=(0, None))(keys, jnp.asarray(scores))  # one vmapped call
    kap, test_idx = np.asarray(kap), np.asarray(test_idx)
    flat = [x[test_idx.reshape(-1)] for x in data]
    cov = covered_np(np.repeat(kap, m), *flat).reshape(D, m).mean(1)
    se = cov.std(ddof=1) / math.sqrt(D)
    lo, hi = 1 - alpha, 1 - alpha + 1 / (n + 1)
    assert lo - 4 * se <= cov.mean() <= hi + 4 * se, (cov.mean(), lo, hi, se)


def test_calibration_size_warning_names_trivial_and_minimal_thresholds():
    from ccpo_jax.core.conformal import calibration_size_warning, conformal_rank

    # k = ceil((n+1)(1-alpha)) > n: kappa-hat = 0, coverage 1 by construction (6 questions at 0.1)
    w = calibration_size_warning(6, 0.1)
    assert w and "= 7 exceeds n = 6" in w and "coverage is 1" in w and "at least 19" in w
    assert "equals n = 18" in calibration_size_warning(18, 0.1)  # k = n: the lowest score
    for n, alpha in ((19, 0.1), (200, 0.1), (9, 0.2), (100, 0.05)):
        assert calibration_size_warning(n, alpha) is None
    # the same rank as the calibration itself, for every small n
    for alpha in (0.05, 0.1, 0.2):
        for n in range(1, 60):
            k = int(conformal_rank(n, alpha))
            assert (calibration_size_warning(n, alpha) is None) == (k < n), (n, alpha)


def _search(alpha, below):
    """The oracle: the fewest n whose rank (the calibration's own float32 rule) is <= n + 1 - below,
    found by counting up one n at a time (what calibration_size_warning did before its closed form)."""
    n = 1
    while cf.conformal_rank_host(n, alpha) > n + 1 - below:
        n += 1
    return n


def test_min_calibration_size_closed_form_equals_the_search():
    """The closed form against the search for ~1,500 alphas where searching is cheap (n_min < 400):
    a grid, 1/m (where (n+1) alpha hits an integer, the boundary the rank's slack exists for) and
    random alphas; both sizes: a threshold at all (rank <= n) and more than the lowest score (rank < n)."""
    rng = np.random.default_rng(41)
    alphas = sorted({*(k / 1000 for k in range(5, 1000)), *(1 / m for m in range(2, 201)),
                     *rng.uniform(0.005, 0.99, 300)})
    for a in alphas:
        for below in (1, 2):
            assert cf.min_calibration_size(a, below) == _search(a, below), (a, below)
        n2 = cf.min_calibration_size(a, 2)
        assert cf.calibration_size_warning(n2, a) is None and cf.calibration_size_warning(n2 - 1, a) is not None
    assert (cf.min_calibration_size(0.05), cf.min_calibration_size(0.1, 2)) == (19, 19)  # run_config.GROUP_MIN's note


def test_a_tiny_alpha_gets_its_size_at_once():
    """alpha 1e-9 took 140 s (a count up to 33,554,433, a float32 artefact: 1 - 1e-9 is 1 in float32).
    The size by exact rational arithmetic on the float64 alpha: the fewest n with alpha (n+1) >= 2 - 1e-4."""
    import time
    from fractions import Fraction

    for alpha in (3e-9, 7.7e-8, 0.000123):  # off the boundaries, where float64 rounding could decide
        exact = math.ceil((2 - Fraction(1, 10_000)) / Fraction(alpha)) - 1
        t0 = time.perf_counter()
        w = cf.calibration_size_warning(200, alpha)
        assert time.perf_counter() - t0 < 1.0
        assert w.endswith(f"use at least {exact} (the middle number of --split-sizes)") and "= 201 exceeds n = 200" in w
        assert cf.min_calibration_size(alpha, 2) == exact
    assert 1.99e9 < cf.min_calibration_size(1e-9, 2) < 2e9  # not 33554433


def test_learned_rows_name_their_twins_by_the_row_identities():
    """rows.py names the learned rows and their twins by ccpo.rowid (issue 52 G4): every calibrated row's kept-seed,
    ensemble and Mondrian twin is RowId's name of that twin (RowId.parse, the boundary reader, as the oracle)."""
    from ccpo_jax.ccpo import rows
    from ccpo_jax.ccpo.evaluation import MONDRIAN, calibrated_rows
    from ccpo_jax.ccpo.presets import get_preset
    from ccpo_jax.ccpo.rowid import RowId, Twin

    variants = rows.row_variants((1e-4, 2e-4), get_preset("default"))
    names = [r for v in variants for r in v.table_rows()]
    assert names == ["CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=1e-4)", "CCPO (lambda=2e-4)"]
    cal = [r for v in variants for r in calibrated_rows(v)]
    assert cal == ["CPO batch", "CCPO (lambda=0)", "CCPO (lambda=1e-4)", "CCPO (lambda=2e-4)"]
    for row in cal:
        rid = RowId.parse(row)
        assert rid.calibrated
        for kind in Twin:
            assert rows.twin_name(row, kind) == rid.twin_of(kind).name
    assert MONDRIAN == RowId.parse("CPO batch").twin_of(Twin.MONDRIAN).name[len("CPO batch"):]
    assert not hasattr(rows, "LEARNED_ROWS")  # unreferenced, deleted (item 9)
