"""J-bar (arXiv 2511.11828, Eq. 8) against exact enumeration of every action path of small chains."""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal as cf
from ccpo_jax.core import constraint as cs


def _question(rng, T):
    avail = np.ones((T, 3), bool)
    avail[-1, 2] = False
    p = rng.dirichlet(np.ones(3) * 0.7, T) * avail
    p /= p.sum(-1, keepdims=True)
    correct = rng.random((T, 2)) < 0.35
    return p, avail, correct


def _hard_S_np(p, avail, kappa):
    """NumPy reference of S_{pi,kappa}: uniform over {a available: pi >= kappa}, else argmax."""
    in_set = (p >= kappa) & avail
    out = np.zeros_like(p)
    for t in range(p.shape[0]):
        if in_set[t].any():
            out[t] = in_set[t] / in_set[t].sum()
        else:
            out[t, np.argmax(np.where(avail[t], p[t], -1))] = 1.0
    return out


def _paths(T):
    """All action paths of a T-round chain: (next x t, then answer a), as [2T, T] actions + lengths."""
    acts, lens = [], []
    for t in range(T):
        for a in (0, 1):
            acts.append([2] * t + [a] + [0] * (T - t - 1))
            lens.append(t + 1)
    return np.array(acts), np.array(lens)


def _enumerate(p, avail, correct, kappa):
    """Exact: pi(path), S(path), per-step ratios, success per path, set coverage by chain walk."""
    T = p.shape[0]
    S = _hard_S_np(p, avail, kappa)
    acts, lens = _paths(T)
    mask = np.arange(T)[None] < lens[:, None]
    take = lambda P: np.where(mask, P[np.arange(T)[None], acts], 1.0)
    pi_t, s_t = take(p), take(S)
    succ = correct[lens - 1, acts[np.arange(len(lens)), lens - 1]]
    in_set = (p >= kappa) & avail
    covered, reached = False, True
    for t in range(T):
        if reached:
            covered |= bool((in_set[t, :2] & correct[t]).any())
        reached = reached and in_set[t, 2]
    return dict(pi=pi_t.prod(1), S=s_t.prod(1), rho=np.where(mask, s_t / np.where(mask, pi_t, 1), 1.0),
                mask=mask, succ=succ, covered=covered, acts=acts)


@pytest.mark.parametrize("T", [2, 3])
def test_expectation_by_enumeration_and_bias_direction(T):
    rng = np.random.default_rng(T)
    strict = 0
    for _ in range(30):
        p, avail, correct = _question(rng, T)
        kappa = rng.uniform(0.05, 1 / 3)
        e = _enumerate(p, avail, correct, kappa)
        n = len(e["pi"])
        # expectation of the per-episode estimator under pi = weighted mean over all paths
        unclipped = cs.coverage_estimate(e["rho"], e["succ"], np.zeros(n, bool), e["mask"], weights=e["pi"])
        clipped = cs.coverage_estimate(e["rho"], e["succ"], np.zeros(n, bool), e["mask"], clip_rho=1.0,
                                       weights=e["pi"])
        p_success_S = float((e["S"] * e["succ"]).sum())  # Pr[S(Q) = Y*], exact
        np.testing.assert_allclose(unclipped, p_success_S, atol=1e-5)  # unbiased
        assert float(clipped) <= p_success_S + 1e-6  # clipping biases down
        assert p_success_S <= float(e["covered"]) + 1e-6  # single answer <= set coverage
        strict += float(clipped) < p_success_S - 1e-4
    assert strict > 0  # the bias is real on these problems


def test_unsolvable_counts_one_and_monte_carlo_matches_enumeration():
    rng = np.random.default_rng(0)
    T, kappa = 3, 0.25
    p, avail, correct = _question(rng, T)
    correct[0, 0] = True
    e = _enumerate(p, avail, correct, kappa)
    exact = 0.2 * 1.0 + 0.8 * float((e["S"] * e["succ"]).sum())  # 20% unsolvable questions
    B = 20000
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    idx = np.asarray(jax.random.choice(key1, len(e["pi"]), (B,), p=jnp.asarray(e["pi"])))
    unsolv = np.asarray(jax.random.uniform(key2, (B,)) < 0.2)
    per = np.where(unsolv, 1.0, e["rho"][idx].prod(1) * e["succ"][idx])
    est = cs.coverage_estimate(e["rho"][idx], e["succ"][idx], unsolv, e["mask"][idx])
    np.testing.assert_allclose(est, per.mean(), rtol=1e-5)
    assert abs(float(est) - exact) <= 4 * per.std() / math.sqrt(B)


def test_surrogate_value_and_gradient_against_enumeration():
    rng = np.random.default_rng(5)
    T, kappa = 3, 0.3
    p, avail, correct = _question(rng, T)
    e = _enumerate(p, avail, correct, kappa)
    acts, mask, n = e["acts"], e["mask"], len(e["pi"])
    logits0 = jnp.log(jnp.asarray(p) + 1e-30)

    def soft_logp(logits):
        probs = jax.nn.softmax(jnp.where(avail, logits, -1e9), -1)
        return cf.soft_conformal_log_policy(probs, kappa, avail, eps=0.05)

    def taken(logp):  # [n, T]
        return jnp.where(mask, logp[jnp.arange(T)[None], acts], 0.0)

    behaviour = taken(jnp.log(jnp.asarray(p)))

    def surrogate(logits):
        return cs.coverage_surrogate(taken(soft_logp(logits)), behaviour, e["succ"], np.zeros(n, bool), mask,
                                     weights=e["pi"])

    def exact(logits):  # direct path probabilities of S~, no importance weights
        return jnp.sum(jnp.exp(jnp.sum(taken(soft_logp(logits)), -1)) * e["succ"])

    np.testing.assert_allclose(surrogate(logits0), exact(logits0), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(surrogate)(logits0), jax.grad(exact)(logits0), atol=1e-5)
    # value at theta_k equals J-bar with rho = S~_k / pi_k
    rho = np.where(mask, np.exp(np.asarray(taken(soft_logp(logits0))) - np.asarray(behaviour)), 1.0)
    np.testing.assert_allclose(surrogate(logits0),
                               cs.coverage_estimate(rho, e["succ"], np.zeros(n, bool), mask, weights=e["pi"]),
                               rtol=1e-5)
    np.testing.assert_allclose(cs.coverage_constraint_value(0.85, 0.1), 0.05, atol=1e-7)


def test_jit_vmap_100_problems_equal_unbatched_no_retrace():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    rho = jax.random.uniform(k[0], (100, 10, 4), maxval=2.0)
    succ = jax.random.bernoulli(k[1], 0.6, (100, 10)).astype(jnp.float32)
    unsolv = jax.random.bernoulli(k[2], 0.1, (100, 10))
    mask = jnp.arange(4)[None, None] < jax.random.randint(k[3], (100, 10, 1), 1, 5)
    logb = jnp.log(jax.random.uniform(k[0], (100, 10, 4), minval=0.1))
    fns = {
        "estimate": lambda r, s, u, m, lb: cs.coverage_estimate(r, s, u, m),
        "clipped": lambda r, s, u, m, lb: cs.coverage_estimate(r, s, u, m, clip_rho=1.0),
        "surrogate": lambda r, s, u, m, lb: cs.coverage_surrogate(jnp.log(r + 1e-3), lb, s, u, m),
    }
    for name, f in fns.items():
        batched = jax.jit(jax.vmap(chex.assert_max_traces(f, n=1)))
        out = batched(rho, succ, unsolv, mask, logb)
        batched(rho * 0.5, succ, unsolv, mask, logb)
        single = jax.jit(f)
        for i in (0, 50, 99):
            np.testing.assert_allclose(out[i], single(rho[i], succ[i], unsolv[i], mask[i], logb[i]), rtol=1e-6,
                                       err_msg=name)
