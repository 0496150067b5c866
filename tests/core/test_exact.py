"""Replay-exact estimator (ccpo_jax.core.exact) against brute-force enumeration, and the sampled
estimators of the trainer against it: they must agree in expectation."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.core import conformal, exact
from ccpo_jax.core.constraint import coverage_estimate
from envs.replay.env import make_env_params, trajectories
from envs.replay.reference import random_cache


@pytest.fixture(scope="module")
def env():
    cache = random_cache(40, T=4, seed=11)
    params = make_env_params(cache)
    logits = jax.random.normal(jax.random.PRNGKey(3), params.available.shape)
    probs = jnp.where(params.available, jax.nn.softmax(jnp.where(params.available, logits, -1e9)), 0.0)
    return cache, params, probs


def _enumerate(cache, q, p):
    """Plain Python: every action sequence of question q with its probability -> (E cost, Pr success)."""
    a, cost = cache.arrays, cache.round_cost_cents()
    n = int(a["round_mask"][q].sum())
    unsolvable = bool(cache.unsolvable[q])
    e_cost = succ = 0.0
    for seq in itertools.product(range(3), repeat=n):
        prob, c, ok = 1.0, 0.0, False
        for t, act in enumerate(seq):
            prob *= float(p[t, act])
            c += float(cost[q, t])
            if act != 2:
                ok = bool(a["base_correct"][q, t]) if act == 0 else bool(a["guide_correct"][q, t])
                break
        else:
            continue  # "next" at the last round has probability 0 (masked)
        if len(seq) > t + 1 and any(s != 0 for s in seq[t + 1:]):
            continue  # count each episode once: the actions after the answer are set to 0
        e_cost += prob * c
        succ += prob * (ok or unsolvable)
    return e_cost, succ


def test_exact_cost_and_success_equal_enumeration(env):
    cache, params, probs = env
    cost = np.asarray(exact.expected_cost(probs, params.cost))
    succ = np.asarray(exact.success_probability(probs, params.base_correct, params.guide_correct, params.unsolvable))
    p = np.asarray(probs)
    for q in range(cache.n_questions):
        c_ref, s_ref = _enumerate(cache, q, p[q])
        assert cost[q] == pytest.approx(c_ref, rel=1e-5, abs=1e-9)
        assert succ[q] == pytest.approx(s_ref, rel=1e-5, abs=1e-7)


def test_sampled_estimates_agree_with_exact_in_expectation(env):
    """Monte-Carlo rollouts of pi: mean cost, mean success and the paper's J-bar (Eq. 8) of the
    softmasked CCPO target S~ converge to the exact values (within 4 standard errors)."""
    _, params, probs = env
    n_rep = 1500
    Q = probs.shape[0]
    idx = jnp.tile(jnp.arange(Q), n_rep)
    p = probs[idx]
    a = jax.random.categorical(jax.random.PRNGKey(0), jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    traj = trajectories(a, params, idx)
    cost_s = np.asarray(jnp.sum(jnp.where(traj.valid, params.cost[idx], 0.0), axis=1))
    succ_s = np.asarray(jnp.any(traj.constraint > 0, axis=1), float)
    cost_x = float(jnp.mean(exact.expected_cost(probs, params.cost)))
    succ_x = float(jnp.mean(exact.success_probability(probs, params.base_correct, params.guide_correct,
                                                      params.unsolvable)))
    assert cost_s.mean() == pytest.approx(cost_x, abs=4 * cost_s.std() / np.sqrt(cost_s.size))
    assert succ_s.mean() == pytest.approx(succ_x, abs=4 * succ_s.std() / np.sqrt(succ_s.size))

    # J-bar of the target S~ (importance weights S~/pi), against S~'s exact success.
    kappa = 0.3
    s_soft = jnp.exp(conformal.soft_conformal_log_policy(probs, kappa, params.available, 0.05))  # S~
    w = jnp.take_along_axis(s_soft[idx] / jnp.maximum(p, 1e-12), a[..., None], -1)[..., 0]
    answered = jnp.any(traj.correct, axis=1)
    per = np.asarray(jnp.where(params.unsolvable[idx], 1.0,
                               jnp.prod(jnp.where(traj.valid, w, 1.0), axis=1) * answered))
    jbar = float(coverage_estimate(jnp.where(traj.valid, w, 1.0), answered, params.unsolvable[idx], traj.valid))
    assert jbar == pytest.approx(per.mean(), rel=1e-5)
    target = float(jnp.mean(exact.success_probability(s_soft, params.base_correct, params.guide_correct,
                                                      params.unsolvable)))
    assert jbar == pytest.approx(target, abs=4 * per.std() / np.sqrt(per.size))


def test_soft_set_size_tends_to_the_hard_set_size(env):
    """As eps -> 0 the softmask inclusion is the hard set, and the expected size counts the
    answers collected by the set rollout (with multiplicity), computed here in plain Python."""
    cache, params, probs = env
    kappa = 0.25
    size = np.asarray(exact.soft_set_size(probs, kappa, params.available, eps=1e-5))
    p, av, mask = np.asarray(probs), np.asarray(params.available), cache.arrays["round_mask"]
    for q in range(cache.n_questions):
        n_ans = 0
        for t in range(int(mask[q].sum())):
            inset = (p[q, t] >= kappa) & av[q, t]
            n_ans += int(inset[0]) + int(inset[1])
            if not inset[2]:
                break
        assert size[q] == pytest.approx(n_ans, abs=1e-3)


def test_soft_set_outcomes_tend_to_the_hard_set_rollout(env):
    """eps -> 0: cost and coverage equal envs.replay.env.evaluate_sets of C_{pi,kappa}
    (an independent implementation of the set rollout, itself checked against envs.replay.reference)."""
    from envs.replay.env import evaluate_sets

    _, params, probs = env
    idx = jnp.arange(probs.shape[0])
    for kappa in (0.2, 0.3, 0.45):
        cost, cov, size = exact.soft_set_outcomes(probs, kappa, params.available, params.base_correct,
                                                  params.guide_correct, params.unsolvable, params.cost, eps=1e-6)
        hard = evaluate_sets(conformal.conformal_set(probs, kappa, params.available), params, idx)
        np.testing.assert_allclose(np.asarray(cost), np.asarray(hard.cost_cents), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(cov), np.asarray(hard.covered, float), atol=1e-4)
        np.testing.assert_allclose(np.asarray(size), np.asarray(exact.soft_set_size(probs, kappa, params.available,
                                                                                    1e-6)), atol=1e-4)


def test_exact_success_gradient_matches_finite_differences(env):
    _, params, probs = env
    logits = jnp.log(jnp.maximum(probs, 1e-30))

    def f(lg):
        pr = jnp.where(params.available, jax.nn.softmax(jnp.where(params.available, lg, -1e9)), 0.0)
        return jnp.mean(exact.success_probability(pr, params.base_correct, params.guide_correct, params.unsolvable))

    g = jax.grad(f)(logits)
    d = jax.random.normal(jax.random.PRNGKey(5), logits.shape) * params.available
    h = 1e-2
    fd = (f(logits + h * d) - f(logits - h * d)) / (2 * h)
    assert float(jnp.sum(g * d)) == pytest.approx(float(fd), rel=2e-2, abs=1e-6)
