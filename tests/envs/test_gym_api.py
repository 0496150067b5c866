"""The replay env through gymnax's API (envs/replay/gymnax.py; issue 53): the same transitions as
envs/replay/env.py step by step, set episodes equal to the plain-Python recursive set evaluator,
auto-reset within the split, 4,096 envs under jit+vmap, and the training ids of reproduce.

gymnax is an optional extra: without it these tests skip locally, but under CI=true (.ci/run
installs the extra) a missing gymnax is an error."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import IN_CI

if IN_CI:
    import gymnax  # noqa: F401  CI installs '.[gymnax]': its absence must fail, not skip
pytest.importorskip("gymnax")

from envs.replay.env import OrchestrationEnv, make_env_params  # noqa: E402
from envs.replay.gymnax import N_SETS, ReplayGymnax, make, set_id, set_members, training_questions  # noqa: E402
from envs.replay.reference import random_cache, reference_evaluate_set  # noqa: E402

Q, T = 150, 4
RAW_OF_SINGLETON = {1: 0, 2: 1, 4: 2, 0: -1}  # {base}, {guide}, {next}, {} -> the raw env's action ids


@pytest.fixture(scope="module")
def cache():
    return random_cache(Q, T, seed=11)


@pytest.fixture(scope="module")
def env_params(cache):
    return make(cache, questions=np.arange(Q))


def _episodes(env, params, questions, actions):
    """Both envs on question ``questions[n]`` with set ids ``actions[n]`` [N, T+1], each step
    through the wrapper's step_env (no auto-reset) and, for singleton sets, the raw env's step."""
    raw = OrchestrationEnv()
    raw_actions = jnp.asarray(np.vectorize(lambda a: RAW_OF_SINGLETON.get(int(a), -9))(actions), jnp.int32)

    @jax.jit
    def run(qs, acts, raw_acts):
        def one(q, a_row, r_row):
            p1 = params.replace(questions=q[None])  # a one-question split: the reset draws q
            obs, st = env.reset(jax.random.PRNGKey(0), p1)
            robs, rst = raw.reset(jax.random.PRNGKey(0), params.replay, q)

            def body(carry, a):
                st, rst = carry
                o, st2, r, term, info = env.step_env(jax.random.PRNGKey(1), st, a[0], params)
                ro, rst2, rr, rterm, rtrunc, rinfo = raw.step(jax.random.PRNGKey(1), rst, a[1], params.replay)
                keep = ~st.inner.done  # the wrapper is never stepped past the end by gymnax (auto-reset)
                return (st2, rst2), (o, st2.inner, r, term, info, ro, rst2, rr, rterm, rinfo, keep)

            _, out = jax.lax.scan(body, (st, rst), jnp.stack([a_row, r_row], -1))
            return (obs, robs), out

        return jax.vmap(one)(qs, acts, raw_acts)

    return jax.tree.map(np.asarray, run(jnp.asarray(questions), jnp.asarray(actions, jnp.int32), raw_actions))


def test_singleton_sets_step_exactly_as_the_raw_env(env_params):
    env, params = env_params
    rng = np.random.default_rng(0)
    # singletons mostly (with "next" also at the last round: unavailable, ends without an answer) and the empty set
    actions = rng.choice([1, 2, 4, 4, 4, 0], size=(Q, T + 1))
    (obs0, robs0), (o, st, r, term, info, ro, rst, rr, rterm, rinfo, _) = _episodes(env, params, np.arange(Q), actions)
    np.testing.assert_array_equal(obs0, robs0)
    np.testing.assert_array_equal(o, ro)
    for f in ("question", "round", "cost_cents", "done"):
        np.testing.assert_array_equal(getattr(st, f), getattr(rst, f))
    np.testing.assert_array_equal(r, rr)
    np.testing.assert_array_equal(term, rterm)
    np.testing.assert_array_equal(info["cost"], rinfo["cost_cents"])
    np.testing.assert_array_equal(info["round"], rinfo["round"])
    np.testing.assert_array_equal(info["covered"], rinfo["constraint"])  # one answer: covered = the raw constraint
    assert 0 < rinfo["constraint"].sum() < Q  # both outcomes occur


def test_set_episodes_equal_the_recursive_set_evaluator(cache, env_params):
    """Any set per round: return = -cost and covered at the end equal reference_evaluate_set's (the
    recursive plain-Python oracle), round by round the same set."""
    env, params = env_params
    rng = np.random.default_rng(1)
    actions = rng.integers(0, N_SETS, size=(Q, T + 1))
    actions[:, :T] |= rng.random((Q, T)) < 0.5  # more rounds reached
    _, (o, st, r, term, info, *_, keep) = _episodes(env, params, np.arange(Q), actions)
    members = np.asarray(set_members(actions[:, :T]))
    for q in range(Q):
        ref = reference_evaluate_set(cache, q, members[q].tolist())
        steps = keep[q]
        assert -r[q][steps].sum() == pytest.approx(ref["cost_cents"], rel=1e-5, abs=1e-7)
        assert steps.sum() == ref["length"]
        end = np.flatnonzero(steps)[-1]
        assert term[q, end] and bool(info["covered"][q, end]) == ref["covered"]
        assert info["covered"][q][steps].sum() == float(ref["covered"])  # only the final step says it
    assert np.asarray(set_id(set_members(np.arange(N_SETS)))).tolist() == list(range(N_SETS))
    assert np.asarray(set_members(np.array([-1, 8]))).sum() == 0  # outside [0, 8): the empty set


def test_gymnax_api_autoreset_and_4096_envs(cache):
    split = np.arange(0, Q, 3)
    env, params = make(cache, questions=split)
    assert isinstance(env, ReplayGymnax) and env.num_actions == 8 and env.name == "Orchestration-sets-v0"
    assert env.action_space(params).n == 8
    assert env.observation_space(params).shape == (params.replay.F,)
    assert bool(jnp.all(env.observation_space(params).contains(params.replay.obs)))
    n_envs, n_steps = 4096, 12

    def rollout(key):
        obs, state = jax.vmap(env.reset, (0, None))(jax.random.split(key, n_envs), params)

        def body(carry, key):
            obs, state = carry
            k_act, k_step = jax.random.split(key)
            a = jax.random.randint(k_act, (n_envs,), 0, 8)
            obs, state, r, term, trunc, info = jax.vmap(env.step, (0, 0, 0, None))(
                jax.random.split(k_step, n_envs), state, a, params)
            return (obs, state), (state.inner.question, state.inner.round, r, term, trunc, info["covered"])

        return jax.lax.scan(body, (obs, state), jax.random.split(key, n_steps))[1]

    rollout = jax.jit(chex.assert_max_traces(rollout, n=1))
    qs, rounds, r, term, trunc, cov = jax.tree.map(np.asarray, rollout(jax.random.PRNGKey(3)))
    rollout(jax.random.PRNGKey(4))  # no retrace
    assert qs.shape == (n_steps, n_envs)
    assert np.isin(qs, split).all()  # auto-reset draws from the split only
    assert (rounds[term] == 0).all()  # a finished episode is replaced by a fresh one at round 1
    assert term.mean() > 0.3 and not trunc.any() and (r <= 0).all()
    assert set(np.unique(cov[term])) == {0.0, 1.0} and (cov[~term] == 0).all()


def test_default_questions_are_reproduces_training_ids():
    from ccpo_jax.ccpo.splits import make_recalibrate_splits

    for n, n_train, seed in ((1400, 1000, 0), (960, 560, 3), (500, 300, 1)):
        k_split = jax.random.split(jax.random.PRNGKey(seed), 3)[0]  # ccpo_jax/ccpo/prepare.py's key
        want = make_recalibrate_splits(k_split, n, n_train, 200 if n > 500 else 100, 200 if n > 500 else 100, 2).train[0]
        np.testing.assert_array_equal(np.asarray(training_questions(n, seed=seed)), np.asarray(want))


def test_make_from_a_path_and_bad_input(cache, tmp_path):
    from envs.cache.formats import save_cache

    save_cache(cache, tmp_path / "c.jsonl")
    env, params = make(tmp_path / "c.jsonl", questions=[0, 1, 2])
    np.testing.assert_array_equal(np.asarray(params.replay.obs), np.asarray(make_env_params(cache).obs))
    assert np.asarray(params.questions).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="questions"):
        make(cache, questions=[0, Q])
    with pytest.raises(TypeError, match="ResponseCache or a cache path"):
        make(42)
