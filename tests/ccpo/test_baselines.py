"""Non-learned baselines against brute force, exact enumeration and plain-Python replays."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.ccpo.baselines import (
    exit_rows,
    llm_policy_rows,
    make_baseline_data,
    non_learned_rows,
    random_rows,
    uala,
    uala_threshold,
)
from envs.cache.schema import ResponseCache
from envs.replay.env import make_env_params, summarise
from envs.replay.reference import ReferenceEnv, random_cache

Q, T = 120, 4


@pytest.fixture(scope="module")
def cache():
    return random_cache(Q, T, seed=11, n_exit=2, n_llm_policy=2)


@pytest.fixture(scope="module")
def params(cache):
    return make_env_params(cache)


def _uala_plain(cache: ResponseCache, qs, theta: float):
    """Plain-Python UALA rollouts: (total cost, coverage, avg len, avg set size) over questions qs."""
    a, cost, n = cache.arrays, cache.round_cost_cents().tolist(), cache.n_rounds.tolist()
    ga, gc, gu = a["guide_answer"].tolist(), a["guide_correct"].tolist(), a["guide_uncertainty"].tolist()
    unsolvable = cache.unsolvable.tolist()
    tot, cov, lens, sizes = 0.0, 0, 0, 0
    for q in qs:
        answers, hit = set(), False
        for t in range(n[q]):
            tot += cost[q][t]
            answers.add(ga[q][t])
            hit |= gc[q][t]
            u = gu[q][t]
            if t == n[q] - 1 or (not math.isnan(u) and u <= theta):
                break
        cov += hit or unsolvable[q]
        lens += t + 1
        sizes += len(answers)
    k = len(qs)
    return tot, cov / k, lens / k, sizes / k


_uala_summary = jax.jit(lambda p, c, t, alpha: summarise(uala(p, c, t, alpha)))


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2, 0.4, 0.0])
def test_uala_threshold_is_cheapest_feasible(cache, params, alpha):
    rng = np.random.default_rng(int(alpha * 100))
    perm = rng.permutation(Q)
    cal, test = perm[:60], perm[60:]
    theta = float(jax.jit(uala_threshold)(params, jnp.asarray(cal), alpha))
    # brute force over a grid that contains every behaviour: all uncertainties, midpoints, and both ends
    u = cache.guide_uncertainty[cal][np.isfinite(cache.guide_uncertainty[cal])]
    vals = np.unique(np.concatenate([u, [-1.0, 2.0]]))
    grid = np.concatenate([vals, (vals[1:] + vals[:-1]) / 2])
    results = [(th, *_uala_plain(cache, cal, th)) for th in grid]
    feasible = [r for r in results if r[2] >= 1 - alpha - 1e-9]
    c_cost, c_cov, *_ = _uala_plain(cache, cal, theta)
    if feasible:
        assert c_cov >= 1 - alpha - 1e-9
        assert c_cost == pytest.approx(min(r[1] for r in feasible), rel=1e-5, abs=1e-9)
    else:  # nothing reaches 1 - alpha: UALA goes to the last round (highest coverage)
        assert theta == -np.inf and c_cov == pytest.approx(max(r[2] for r in results))
    got = _uala_summary(params, jnp.asarray(cal), jnp.asarray(test), alpha)
    exp = _uala_plain(cache, test, theta)
    for k, e in zip(("cost_cents", "coverage", "avg_len", "set_size"), exp):
        assert float(got[k]) == pytest.approx(e, rel=1e-5, abs=1e-9), k


def test_exit_rows_equal_numpy(cache, params):
    data = make_baseline_data(cache)
    a = cache.arrays
    idx = np.arange(0, Q, 3)
    for m in range(2):
        s = summarise(exit_rows(data, params, jnp.asarray(idx), m))
        cov = np.mean(a["exit_correct"][idx, m] | cache.unsolvable[idx])
        assert float(s["cost_cents"]) == pytest.approx(a["exit_cost_cents"][idx, m].astype(np.float64).sum(), rel=1e-5)
        assert float(s["coverage"]) == pytest.approx(cov)
        assert float(s["avg_len"]) == pytest.approx(a["exit_rounds"][idx, m].mean())
        assert float(s["set_size"]) == pytest.approx(a["exit_rounds"][idx, m].mean())


def test_random_matches_exact_enumeration(cache, params):
    a, cost, n = cache.arrays, cache.round_cost_cents(), cache.n_rounds
    exp_cov = exp_cost = exp_len = 0.0
    for q in range(Q):
        reach, cov = 1.0, 0.0
        for t in range(n[q]):
            last = t == n[q] - 1
            p = 0.5 if last else 1 / 3
            exp_cost += reach * float(cost[q, t])
            exp_len += reach  # E[deepest round] = sum over rounds of P(round reached)
            cov += reach * p * (float(a["base_correct"][q, t]) + float(a["guide_correct"][q, t]))
            reach /= 3
        exp_cov += 1.0 if cache.unsolvable[q] else cov
    exp = {"coverage": exp_cov / Q, "cost_cents": exp_cost, "avg_len": exp_len / Q}
    R = 400
    keys = jax.random.split(jax.random.PRNGKey(0), R)
    out = jax.jit(jax.vmap(lambda k: summarise(random_rows(k, params, jnp.arange(Q)))))(keys)
    # Monte-Carlo error over R * Q independent episodes: 5 standard errors with a variance bound
    se_cov = 0.5 / math.sqrt(R * Q)
    assert float(out["coverage"].mean()) == pytest.approx(exp["coverage"], abs=5 * se_cov)
    se_len = math.sqrt((T - 1) ** 2 / 4 / (R * Q))
    assert float(out["avg_len"].mean()) == pytest.approx(exp["avg_len"], abs=5 * se_len)
    se_cost = float(cost.sum(1).max()) * math.sqrt(Q) / 2 / math.sqrt(R)
    assert float(out["cost_cents"].mean()) == pytest.approx(exp["cost_cents"], abs=5 * se_cost)
    assert float(out["set_size"].min()) == 1.0  # a pointwise policy at a valid action always answers


def test_llm_policy_rows_equal_plain_replay(cache, params):
    data = make_baseline_data(cache)
    env = ReferenceEnv(cache)
    acts = cache.llm_policy_actions
    for m in range(2):
        got = jax.tree.map(np.asarray, llm_policy_rows(data, params, jnp.arange(Q), m))
        for q in range(Q):
            env.reset(q)
            cost, t, done, info = 0.0, 0, False, None
            while not done:
                _, r, done, _, info = env.step(int(acts[q, m, t]))
                cost -= r
                t += 1
            assert got.cost_cents[q] == pytest.approx(cost, rel=1e-5, abs=1e-9)
            assert got.length[q] == t
            assert bool(got.covered[q]) == (info["constraint"] == 1.0)
            assert got.set_size[q] == (info["answer"] >= 0)


def test_non_learned_rows_names_and_batching(cache, params):
    S, n = 3, 40
    rng = np.random.default_rng(0)
    perms = np.stack([rng.permutation(Q) for _ in range(S)])
    cal, test = perms[:, :n], perms[:, n:2 * n]
    rows = non_learned_rows(cache, params, jax.random.PRNGKey(1), cal, test, 0.1)
    assert list(rows) == ["exit-model-0 EXIT", "exit-model-1 EXIT", "Random",
                          "LLM policy (policy-model-0)", "LLM policy (policy-model-1)", "UALA"]
    for r in rows.values():
        assert set(r) == {"cost_cents", "coverage", "avg_len", "set_size"}
        assert all(v.shape == (S,) for v in r.values())
    data = make_baseline_data(cache)
    uala_j = jax.jit(lambda c, t: summarise(uala(params, c, t, 0.1)))
    for s in range(S):
        u = uala_j(cal[s], test[s])
        e = summarise(exit_rows(data, params, jnp.asarray(test[s]), 1))
        for k in u:
            assert rows["UALA"][k][s] == pytest.approx(float(u[k]), rel=1e-6)
            assert rows["exit-model-1 EXIT"][k][s] == pytest.approx(float(e[k]), rel=1e-6)


def test_rows_absent_without_data():
    c = random_cache(30, 3, seed=2, n_exit=1, with_uncertainty=False)
    a = dict(c.arrays)
    a["exit_mask"] = a["exit_mask"].copy()
    a["exit_mask"][5, 0] = False  # one test question lacks the EXIT run
    c = ResponseCache(c.manifest, a)
    p = make_env_params(c)
    idx = np.arange(30)[None]
    rows = non_learned_rows(c, p, jax.random.PRNGKey(0), idx[:, 15:], idx[:, :15], 0.1)
    assert list(rows) == ["Random"]
