"""Replay env, features and set-valued evaluation against the plain-Python reference (envs/replay/reference.py)."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.cache.schema import Manifest, ModelInfo, ResponseCache, empty_arrays
from envs.replay.features import available_actions, build_features, feature_names
from envs.replay.env import (
    OrchestrationEnv,
    evaluate_actions,
    evaluate_sets,
    make_env_params,
    raw_rounds,
    summarise,
    trajectories,
)
from envs.replay.reference import ReferenceEnv, random_cache, reference_evaluate_set, reference_features

Q, T = 120, 4


@pytest.fixture(scope="module")
def cache():
    return random_cache(Q, T, seed=3)


@pytest.fixture(scope="module")
def params(cache):
    return make_env_params(cache)


@pytest.fixture(scope="module")
def ref_env(cache):
    return ReferenceEnv(cache)


def test_features_match_reference(cache, params):
    names = feature_names(T)
    assert len(names) == params.F == params.obs.shape[-1]
    ref = np.array([reference_features(cache, q) for q in range(Q)], np.float64)
    np.testing.assert_allclose(np.asarray(params.obs), ref, rtol=1e-5, atol=1e-6)
    # numpy input and a leading batch axis of any rank work the same
    raw = raw_rounds(cache)
    two = {k: v.reshape(2, Q // 2, T) for k, v in raw.items()}
    np.testing.assert_array_equal(np.asarray(build_features(two, T)).reshape(Q, T, -1), np.asarray(params.obs))


def test_available_actions(cache):
    av = np.asarray(available_actions(cache.round_mask))
    n = cache.n_rounds
    for q in range(Q):
        for t in range(T):
            exp = [t < n[q], t < n[q], t < n[q] - 1]
            assert av[q, t].tolist() == exp


def _run_jax_env(params, actions):
    """Step the jitted env on every question at once: actions [Q, T+1] -> per-step outputs."""
    env = OrchestrationEnv()

    @jax.jit
    def run(actions):
        def one(q, acts):
            obs0, state = env.reset(jax.random.PRNGKey(0), params, q)

            def body(state, a):
                obs, state, r, term, trunc, info = env.step(jax.random.PRNGKey(1), state, a, params)
                return state, (obs, r, term, trunc, info)

            _, out = jax.lax.scan(body, state, acts)
            return obs0, out

        return jax.vmap(one)(jnp.arange(params.round_mask.shape[0]), actions)

    return run(actions)


def test_env_matches_reference_step_for_step(params, ref_env):
    rng = np.random.default_rng(0)
    # mostly valid actions, with "next" often (also at the last round: invalid, ends with no answer) and some bad ids
    actions = rng.choice([0, 1, 2, 2, 2, -1], size=(Q, T + 1)).astype(np.int32)
    obs0, (obs, r, term, trunc, info) = jax.tree.map(np.asarray, _run_jax_env(params, actions))
    n_ends = 0
    for q in range(Q):
        np.testing.assert_allclose(obs0[q], ref_env.reset(q), rtol=1e-5, atol=1e-6)
        for k in range(T + 1):
            o, rr, te, tr, inf = ref_env.step(int(actions[q, k]))
            np.testing.assert_allclose(obs[q, k], o, rtol=1e-5, atol=1e-6)
            assert r[q, k] == pytest.approx(rr, rel=1e-6, abs=1e-9)
            assert bool(term[q, k]) == te and bool(trunc[q, k]) == tr
            for key in ("correct", "constraint", "round", "answer"):
                assert info[key][q, k] == inf[key], (q, k, key)
            assert info["cost_cents"][q, k] == pytest.approx(inf["cost_cents"], rel=1e-6, abs=1e-9)
            n_ends += int(inf["constraint"] > 0)
    assert term[:, -1].all()  # every episode is over after T + 1 steps
    assert 0 < n_ends < Q  # the check covered both constraint values


def test_trajectories_match_env(params):
    rng = np.random.default_rng(1)
    actions = rng.choice([0, 1, 2, 2, -1], size=(Q, T)).astype(np.int32)
    _, (obs, r, term, _, info) = jax.tree.map(np.asarray, _run_jax_env(params, np.pad(actions, ((0, 0), (0, 1)))))
    tr = jax.tree.map(np.asarray, trajectories(actions, params, jnp.arange(Q)))
    prev_done = np.concatenate([np.zeros((Q, 1), bool), term[:, :T - 1]], 1)
    np.testing.assert_array_equal(tr.valid, ~prev_done)
    np.testing.assert_allclose(tr.reward, r[:, :T], rtol=1e-6)
    np.testing.assert_array_equal(tr.done, term[:, :T] & ~prev_done)
    np.testing.assert_array_equal(tr.constraint, info["constraint"][:, :T])
    np.testing.assert_array_equal(tr.correct, info["correct"][:, :T])
    # a pointwise rollout's return and final constraint equal evaluate_actions'
    m = evaluate_actions(actions, params, jnp.arange(Q))
    np.testing.assert_allclose(-tr.reward.sum(1), np.asarray(m.cost_cents), rtol=1e-5)
    np.testing.assert_array_equal(tr.constraint.sum(1) > 0, np.asarray(m.covered))


def _flip_labels(cache: ResponseCache, seed: int) -> ResponseCache:
    rng = np.random.default_rng(seed)
    a = dict(cache.arrays)
    a["base_correct"] = a["round_mask"] & (rng.random(a["base_correct"].shape) < 0.5)
    a["guide_correct"] = a["round_mask"] & rng.permutation(a["guide_correct"].ravel()).reshape(a["guide_correct"].shape)
    a["gold"] = rng.permutation(a["gold"])
    return ResponseCache(cache.manifest, a)


def test_no_label_leakage(cache, params):
    env = OrchestrationEnv()
    flipped = make_env_params(_flip_labels(cache, 7))
    assert not np.array_equal(np.asarray(flipped.guide_correct), np.asarray(params.guide_correct))
    np.testing.assert_array_equal(np.asarray(flipped.obs), np.asarray(params.obs))
    np.testing.assert_array_equal(np.asarray(flipped.available), np.asarray(params.available))
    # and the observations the env emits along any action sequence
    acts = np.random.default_rng(2).choice([0, 1, 2], size=(Q, T + 1)).astype(np.int32)
    o1 = jax.tree.map(np.asarray, _run_jax_env(params, acts))
    o2 = jax.tree.map(np.asarray, _run_jax_env(flipped, acts))
    np.testing.assert_array_equal(o1[0], o2[0])
    np.testing.assert_array_equal(o1[1][0], o2[1][0])
    del env


def _random_sets(rng, n, T):
    s = rng.random((n, T, 3)) < np.array([0.4, 0.5, 0.6])
    s[rng.random(n) < 0.15] = False  # whole empty sets
    return s


def test_evaluate_sets_matches_reference(cache, params):
    rng = np.random.default_rng(4)
    idx = rng.integers(0, Q, size=300).astype(np.int32)
    sets = _random_sets(rng, 300, T)  # entries on padding rounds are set too: must be ignored
    m = jax.tree.map(np.asarray, jax.jit(evaluate_sets)(sets, params, idx))
    for i, q in enumerate(idx):
        ref = reference_evaluate_set(cache, int(q), sets[i].tolist())
        assert m.cost_cents[i] == pytest.approx(ref["cost_cents"], rel=1e-5, abs=1e-9)
        for k in ("covered", "length", "set_size", "unsolvable"):
            assert m.__getattribute__(k)[i] == ref[k], (i, k)
    s = summarise(m)
    assert float(s["coverage"]) == pytest.approx(np.mean(m.covered))
    assert (m.set_size == 0).any() and (m.length == T).any()


def test_jit_vmap_over_splits_and_no_retrace(params):
    rng = np.random.default_rng(5)
    S, n = 6, 40
    idx = np.stack([rng.permutation(Q)[:n] for _ in range(S)]).astype(np.int32)
    sets = np.stack([_random_sets(rng, n, T) for _ in range(S)])

    @jax.jit
    @chex.assert_max_traces(n=1)
    def batched(sets, idx):
        return jax.vmap(lambda s, i: summarise(evaluate_sets(s, params, i)))(sets, idx)

    out = jax.tree.map(np.asarray, batched(sets, idx))
    for s in range(S):
        one = summarise(evaluate_sets(sets[s], params, idx[s]))
        for k in one:
            assert out[k][s] == pytest.approx(float(one[k]), rel=1e-6), (s, k)
    # same shapes, new values: no recompilation (assert_max_traces raises otherwise)
    batched(sets[::-1].copy(), idx[::-1].copy())
    batched(~sets, idx)


def _two_question_cache() -> ResponseCache:
    """q0: 3 rounds, gold = id 1; q1: 1 round, unsolvable. Guide price $1/M in, $0 out: cents = tokens_in / 1e4."""
    a = empty_arrays(2, 3)
    a["round_mask"] = np.array([[1, 1, 1], [1, 0, 0]], bool)
    a["base_answer"] = np.array([[0, 0, 1], [0, -1, -1]], np.int32)
    a["guide_answer"] = np.array([[0, 1, 1], [1, -1, -1]], np.int32)
    a["base_correct"] = a["base_answer"] == np.array([[1], [-5]])
    a["guide_correct"] = a["guide_answer"] == np.array([[1], [-5]])
    a["guide_tokens_in"] = np.array([[100, 200, 300], [400, 0, 0]], np.float32)
    a["guide_verdict"] = np.array([[1, 0, 1], [0, 0, 0]], bool)
    a["guide_uncertainty"] = np.array([[0.2, np.nan, 0.9], [0.4, np.nan, np.nan]], np.float32)
    man = Manifest("two", "test", 3, ModelInfo("b"), ModelInfo("g", 1.0, 0.0), {"kind": "synthetic"})
    return ResponseCache(man, a)


def test_hand_computed_example():
    p = make_env_params(_two_question_cache())
    # round costs in cents: q0 = 0.01, 0.02, 0.03; q1 = 0.04
    sets = np.zeros((2, 3, 3), bool)
    sets[0, 0] = [1, 0, 1]  # round 1: base answer (id 0, wrong), next
    sets[0, 1] = [0, 1, 0]  # round 2: guide answer (id 1, right), stop
    sets[0, 2] = [1, 1, 1]  # never reached
    sets[1, 0] = [0, 0, 1]  # "next" at q1's only round: unavailable -> empty set
    m = jax.jit(evaluate_sets)(sets, p, jnp.array([0, 1]))
    np.testing.assert_allclose(np.asarray(m.cost_cents), [0.03, 0.04], rtol=1e-6)
    assert np.asarray(m.covered).tolist() == [True, True]  # q1 covered because unsolvable
    assert np.asarray(m.length).tolist() == [2, 1]
    assert np.asarray(m.set_size).tolist() == [2, 0]
    s = summarise(m)
    assert float(s["cost_cents"]) == pytest.approx(0.07) and float(s["avg_len"]) == 1.5 and float(s["set_size"]) == 1.0
    # features of q0 round 2: agree 0 (0 vs 1), base repeats 1, guide repeats 0, distinct {0,1} = 2/6,
    # uncertainty NaN -> 0.5 with flag 0, cum guide in log1p(300/1000), cost log1p(0.03*10)
    f = dict(zip(feature_names(3), np.asarray(p.obs[0, 1]).tolist()))
    exp = {"round_2": 1, "is_last_round": 0, "guide_verdict": 0, "guide_uncertainty": 0.5, "has_guide_uncertainty": 0,
           "base_guide_agree": 0, "base_repeats_prev": 1, "guide_repeats_prev": 0, "distinct_answers": 2 / 6,
           "cum_guide_tokens_in": np.log1p(0.3), "cum_cost_cents": np.log1p(0.3)}
    for k, v in exp.items():
        assert f[k] == pytest.approx(v, abs=1e-6), k
    assert np.asarray(p.obs[1, 1:]).sum() == 0  # padding rounds are zeros
    assert float(p.obs[1, 0, feature_names(3).index("is_last_round")]) == 1.0
    # the step env: q0 next, next, guide -> cost 0.06, correct; q1 base -> cost 0.04, wrong but unsolvable
    env = OrchestrationEnv()
    k = jax.random.PRNGKey(0)
    reset, step = jax.jit(env.reset), jax.jit(env.step)
    _, st = reset(k, p, 0)
    rewards = []
    for a in (2, 2, 1):
        _, st, r, done, _, info = step(k, st, a, p)
        rewards.append(float(r))
    assert sum(rewards) == pytest.approx(-0.06) and bool(done) and bool(info["correct"]) and info["round"] == 3
    _, st = reset(k, p, 1)
    _, st, r, done, _, info = step(k, st, 0, p)
    assert float(r) == pytest.approx(-0.04) and bool(done) and not bool(info["correct"]) and float(info["constraint"]) == 1.0


def test_reset_random_question(params):
    env = OrchestrationEnv()
    keys = jax.random.split(jax.random.PRNGKey(0), 512)
    _, st = jax.vmap(lambda k: env.reset(k, params))(keys)
    qs = np.asarray(st.question)
    assert qs.min() >= 0 and qs.max() < Q and len(np.unique(qs)) > Q // 2


@pytest.mark.parametrize("T_small", [1, 2])
def test_short_horizons_match_reference(T_small):
    """T = 1 (a single-round cascade) and T = 2: features, env and set evaluation against the reference."""
    c = random_cache(25, T_small, seed=T_small)
    p = make_env_params(c)
    ref = np.array([reference_features(c, q) for q in range(25)])
    np.testing.assert_allclose(np.asarray(p.obs), ref, rtol=1e-5, atol=1e-6)
    rng = np.random.default_rng(0)
    sets = _random_sets(rng, 25, T_small)
    m = jax.tree.map(np.asarray, jax.jit(evaluate_sets)(sets, p, jnp.arange(25)))
    actions = rng.choice([0, 1, 2, 2], size=(25, T_small + 1)).astype(np.int32)
    _, (_, r, term, _, info) = jax.tree.map(np.asarray, _run_jax_env(p, actions))
    env = ReferenceEnv(c)
    for q in range(25):
        e = reference_evaluate_set(c, q, sets[q].tolist())
        assert (m.length[q], m.set_size[q], bool(m.covered[q])) == (e["length"], e["set_size"], e["covered"])
        assert m.cost_cents[q] == pytest.approx(e["cost_cents"], rel=1e-5, abs=1e-9)
        env.reset(q)
        for k in range(T_small + 1):
            _, rr, te, _, inf = env.step(int(actions[q, k]))
            assert r[q, k] == pytest.approx(rr, rel=1e-6, abs=1e-9) and bool(term[q, k]) == te
            assert info["constraint"][q, k] == inf["constraint"]
