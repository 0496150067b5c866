"""Conformal set / policy / softmask (arXiv 2511.11828, Eqs. 2-3) and the online kappa update (Eq. 9)."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ccpo_jax.core import conformal as cf


def test_set_and_uniform_policy_by_hand():
    probs = jnp.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]])
    avail = jnp.array([[True, True, True], [True, True, False]])
    s = cf.conformal_set(probs, 0.25, avail)
    np.testing.assert_array_equal(s, [[True, True, False], [True, True, False]])
    # kappa = 0 keeps every AVAILABLE action, never the masked "next" at the last round
    np.testing.assert_array_equal(cf.conformal_set(probs, 0.0, avail), avail)
    pol = cf.stochastic_conformal_policy(probs, 0.25, avail)
    np.testing.assert_allclose(pol, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    pol = cf.stochastic_conformal_policy(probs, 0.1, avail)
    np.testing.assert_allclose(pol, [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]], atol=1e-7)


def test_empty_set_is_empty_and_policy_falls_back_to_argmax():
    probs = jnp.array([[0.4, 0.35, 0.25], [0.1, 0.2, 0.7]])
    avail = jnp.array([[True, True, True], [True, True, False]])  # argmax of row 2 over available: guide
    s = cf.conformal_set(probs, 0.5, avail)
    assert not bool(s.any())
    pol = cf.stochastic_conformal_policy(probs, 0.5, avail)
    np.testing.assert_array_equal(pol, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    # the soft policy tends to the same point mass and stays finite, even deep in underflow
    soft = jnp.exp(cf.soft_conformal_log_policy(probs, 0.99, avail))
    assert np.isfinite(np.asarray(soft)).all()
    np.testing.assert_allclose(soft.sum(-1), 1.0, atol=1e-6)
    # weights ~ exp((pi - kappa)/eps): 0.4 vs 0.35 -> e^5 : 1
    np.testing.assert_allclose(soft, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], atol=1e-2)


def test_softmask_and_soft_policy_against_numpy():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=50).astype(np.float32)
    avail = np.ones((50, 3), bool)
    avail[::3, 2] = False
    probs = np.where(avail, probs, 0)
    probs /= probs.sum(-1, keepdims=True)
    kappa = 0.3
    m = 1 / (1 + np.exp(-(probs.astype(np.float64) - kappa) / 0.01))
    np.testing.assert_allclose(cf.softmask(probs, kappa), m, rtol=1e-4, atol=1e-6)
    ref = np.where(avail, m, 0)
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(jnp.exp(cf.soft_conformal_log_policy(probs, kappa, avail)), ref, atol=1e-5)
    # it approaches the hard policy as eps -> 0 (away from ties)
    hard = cf.stochastic_conformal_policy(probs, kappa, avail)
    far = np.abs(probs - kappa).min(-1) > 0.02
    np.testing.assert_allclose(np.exp(np.asarray(cf.soft_conformal_log_policy(probs, kappa, avail, eps=1e-3)))[far],
                               np.asarray(hard)[far], atol=1e-4)
    # differentiable with finite gradients, also when all masks underflow
    logp = cf.soft_conformal_log_policy(probs, kappa, avail)
    np.testing.assert_allclose(np.exp(logp), ref, atol=1e-6)
    assert np.all(np.isneginf(np.asarray(logp)[~avail]))
    g = jax.grad(lambda p: cf.soft_conformal_log_policy(p, 0.95, avail)[:, 0].sum())(jnp.asarray(probs))
    assert np.isfinite(np.asarray(g)).all()
    # KL helper against numpy, and finite gradients through it
    new = cf.soft_conformal_log_policy(probs, 0.25, avail)
    p_old = np.where(avail, ref, 0)
    kl_ref = np.sum(np.where(avail, p_old * (np.log(np.where(avail, ref, 1)) - np.where(avail, np.asarray(new), 0)), 0), -1)
    np.testing.assert_allclose(cf.soft_policy_kl(logp, new), kl_ref, atol=1e-5)
    gk = jax.grad(lambda p: cf.soft_policy_kl(logp, cf.soft_conformal_log_policy(p, 0.9, avail)).sum())(
        jnp.asarray(probs))
    assert np.isfinite(np.asarray(gk)).all()


def test_kappa_step_formula_and_sign():
    # a miss (err = 1) must LOWER kappa (bigger set); a hit raises it by eta * alpha
    k0 = 0.4
    eta = 0.5 * 4 ** -0.6
    np.testing.assert_allclose(cf.kappa_step(k0, 1.0, 4, 0.1, 0.5), k0 - eta * 0.9, rtol=1e-6)
    np.testing.assert_allclose(cf.kappa_step(k0, 0.0, 4, 0.1, 0.5), k0 + eta * 0.1, rtol=1e-6)
    assert float(cf.kappa_step(0.01, 1.0, 1, 0.1, 1.0)) == 0.0
    assert float(cf.kappa_step(0.99, 0.0, 1, 0.9, 1.0)) == 1.0
    # k < 1 is treated as 1
    assert float(cf.kappa_step(k0, 1.0, 0, 0.1, 0.5)) == float(cf.kappa_step(k0, 1.0, 1, 0.1, 0.5))


def _run_stream(scores, alpha, eta0, kappa0=1 / 3, xi=0.1):
    """scores [K, B]: each step sees B questions (err = batch mean), covered iff kappa <= score."""

    def body(kappa, xs):
        k, s = xs
        err = jnp.mean((kappa > s).astype(jnp.float32))
        new = cf.kappa_step(kappa, err, k, alpha, eta0, xi)
        eta = eta0 * k.astype(jnp.float32) ** (-(0.5 + xi))
        clip = new - (kappa + eta * (alpha - err))  # the clipping correction z_k
        return new, (kappa, err, clip / eta)

    K = scores.shape[0]
    last, (kap, err, z_over_eta) = jax.lax.scan(body, jnp.float32(kappa0), (jnp.arange(1, K + 1), scores))
    return np.asarray(last), np.asarray(kap), np.asarray(err), np.asarray(z_over_eta)


def _bound(kap_seg, z_seg, K_seg, eta_last):
    # Derived deterministic bound (Abel summation of kappa_{k+1} - kappa_k = eta_k (alpha - err_k) + z_k
    # over a segment, eta decreasing): |mean(err) - alpha| <= (range(kappa) / eta_last + sum|z_k|/eta_k) / K_seg.
    return (np.ptp(kap_seg) / eta_last + np.abs(z_seg).sum()) / K_seg


@pytest.mark.parametrize("batch", [1, 10])
def test_online_kappa_iid_converges(batch):
    alpha, eta0, K = 0.1, 0.3, 30_000 // batch
    a, b = 2.0, 3.0
    scores = jax.random.beta(jax.random.PRNGKey(batch), a, b, (K, batch))
    last, kap, err, z = _run_stream(scores, alpha, eta0)
    eta_K = eta0 * K ** -0.6
    tol = _bound(np.append(kap, last), z, K, eta_K)
    assert tol < 0.05, tol  # the bound is informative at this K
    assert abs(err.mean() - alpha) <= tol, (err.mean(), tol)
    # kappa itself converges to the alpha-quantile of the score law (ABB-2024 Thm 4, i.i.d. case);
    # tolerance 0.02 is empirical (final step size eta_K ~ 1e-4, so fluctuations are far smaller).
    assert abs(last - stats.beta.ppf(alpha, a, b)) < 0.02


def test_online_kappa_recovers_after_shift():
    alpha, eta0, K = 0.1, 0.3, 40_000
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    half = K // 2
    scores = jnp.concatenate([jax.random.beta(k1, 2.0, 3.0, (half, 1)), jax.random.beta(k2, 6.0, 2.0, (half, 1))])
    q_before, q_after = stats.beta.ppf(alpha, 2, 3), stats.beta.ppf(alpha, 6, 2)
    last, kap, err, z = _run_stream(scores, alpha, eta0)
    assert abs(kap[half - 1] - q_before) < 0.02
    # right after the shift the old kappa is far too small -> almost no misses
    assert err[half:half + 200].mean() < alpha / 2
    # recovery: over the second half the miscoverage is back within the derived bound
    seg = slice(half, K)
    tol = _bound(np.append(kap[seg], last), z[seg], half, eta0 * K ** -0.6)
    assert tol < 0.06, tol
    assert abs(err[seg].mean() - alpha) <= tol, (err[seg].mean(), tol)
    assert abs(last - q_after) < 0.02


def test_jit_vmap_100_problems_equal_unbatched_no_retrace():
    key = jax.random.PRNGKey(3)
    k1, k2, k3 = jax.random.split(key, 3)
    probs = jax.random.dirichlet(k1, jnp.ones(3), (100, 4))
    avail = jnp.ones((100, 4, 3), bool).at[:, -1, 2].set(False)
    probs = jnp.where(avail, probs, 0.0)
    probs = probs / probs.sum(-1, keepdims=True)
    kappa = jax.random.uniform(k2, (100,), maxval=0.6)
    err = jax.random.uniform(k3, (100,))

    fns = {
        "set": lambda p, k, a, e: cf.conformal_set(p, k, a),
        "policy": lambda p, k, a, e: cf.stochastic_conformal_policy(p, k, a),
        "softmask": lambda p, k, a, e: cf.softmask(p, k),
        "soft": lambda p, k, a, e: jnp.exp(cf.soft_conformal_log_policy(p, k, a)),
        "softlog_kl": lambda p, k, a, e: cf.soft_policy_kl(cf.soft_conformal_log_policy(p, k, a),
                                                           cf.soft_conformal_log_policy(p, 0.2, a)),
        "covered": lambda p, k, a, e: cf.covered_at(k, p[:, 0]),
        "kappa": lambda p, k, a, e: cf.kappa_step(k, e, 7, 0.1, 0.3),
        "score": lambda p, k, a, e: cf.largest_covering_kappa(p, p[:, 0] > 0.3, p[:, 1] > 0.4,
                                                              jnp.ones(4, bool), False),
        "calib": lambda p, k, a, e: cf.calibrate_kappa(p.reshape(-1), k),
    }
    for name, f in fns.items():
        traced = jax.jit(jax.vmap(chex.assert_max_traces(f, n=1)))
        out = traced(probs, kappa, avail, err)
        traced(probs * 0.5, kappa, avail, err)  # second call, same shapes: no retrace
        single = jax.jit(f)
        for i in (0, 42, 99):
            np.testing.assert_allclose(np.asarray(out[i]), np.asarray(single(probs[i], kappa[i], avail[i], err[i])),
                                       atol=1e-6, err_msg=name)
