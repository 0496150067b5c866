"""Guide-less cascades (docs/caches.md "Guide-less cascades"): ``models.guide: null``. Oracles: the
cache's arrays read back in both formats, per-element base-only costs in plain Python, the plain-Python
reference env (envs/replay/reference.py), closed-form values of the guide features, a brute-force
clairvoyant bound, and the replay env's observations for the exported router's featuriser."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import run_cli
from envs.cache.fast import save_fast, write_fast_dir
from envs.cache.formats import load_cache, save_cache
from envs.cache.jsonl import cache_to_records
from envs.cache.schema import A_GUIDE, CacheError, Manifest, ModelInfo, ResponseCache
from envs.generators.cascade import as_cascade
from envs.generators.synthetic import generate
from envs.replay.bound import bound_of_cache
from envs.replay.env import OrchestrationEnv, evaluate_sets, make_env_params
from envs.replay.features import feature_names
from envs.replay.reference import ReferenceEnv, random_cache, reference_evaluate_set, reference_features

RUNGS = (ModelInfo("small-1b", 0.05, 0.1), ModelInfo("mid-8b", 0.3, 0.6), ModelInfo("big-70b", 1.5, 3.0))
NO_GUIDE_MSG = "the manifest's models.guide is null: a cascade has no guide"


def _rungs(T: int) -> tuple[ModelInfo, ...]:
    return tuple(RUNGS[min(t, len(RUNGS) - 1)] for t in range(T))


def _cascade(n=120, seed=0) -> ResponseCache:
    c = generate("hotpotqa-llama2", n, seed)
    return as_cascade(c, _rungs(c.T))


# -- the format ---------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_round_trips_both_formats_with_its_checksum(tmp_path, suffix):
    c = _cascade()
    assert not c.manifest.has_guide and c.manifest.to_dict()["models"]["guide"] is None
    p = save_cache(c, tmp_path / f"k{suffix}")
    back = load_cache(p)
    assert back.manifest == c.manifest and back.manifest.checksum == c.manifest.checksum == c.checksum()
    for k, v in c.arrays.items():
        np.testing.assert_array_equal(back.arrays[k], v, err_msg=k)
    if suffix == ".jsonl":
        lines = [json.loads(x) for x in p.read_text().splitlines()]
        assert lines[0]["manifest"]["models"]["guide"] is None
        assert all(set(r) == {"base"} for q in lines[1:] for r in q["rounds"])  # no guide object
    # the checksum covers the null: the same arrays under a guide model hash differently
    with_guide = dataclasses.replace(c.manifest, guide=ModelInfo("g", 0.0, 0.0))
    assert ResponseCache(with_guide, c.arrays).checksum() != c.checksum()


def test_guide_arrays_hold_the_no_call_values():
    a = _cascade().arrays
    assert (a["guide_answer"] == -1).all() and not a["guide_correct"].any() and not a["guide_verdict"].any()
    assert (a["guide_tokens_in"] == 0).all() and (a["guide_tokens_out"] == 0).all()
    assert np.isnan(a["guide_uncertainty"]).all()


def _jsonl(tmp_path, manifest: dict, recs: list[dict]):
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in [{"manifest": manifest}] + recs))
    return p


def test_a_guide_object_in_a_cascade_names_file_line_and_round(tmp_path):
    c = _cascade(5)
    recs = cache_to_records(c)
    recs[2]["rounds"][1]["guide"] = {"verdict": True, "answer": "x", "correct": False, "tokens_in": 1, "tokens_out": 1}
    p = _jsonl(tmp_path, c.manifest.to_dict(), recs)
    with pytest.raises(CacheError, match=rf"bad\.jsonl:4: rounds\[1\]\.guide: {NO_GUIDE_MSG}"):
        load_cache(p)
    r = run_cli(["data", "check", str(p)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and f"bad.jsonl:4: rounds[1].guide: {NO_GUIDE_MSG}" in r.stderr


def test_a_guide_cache_without_its_guide_object_keeps_its_error(tmp_path):
    c = generate("hotpotqa-llama2", 5, 0)
    recs = cache_to_records(c)
    del recs[0]["rounds"][0]["guide"]
    with pytest.raises(CacheError, match=r"bad\.jsonl:2: rounds\[0\]\.guide: missing required field"):
        load_cache(_jsonl(tmp_path, c.manifest.to_dict(), recs))


@pytest.mark.parametrize("field, value, where", [
    ("guide_answer", 0, "rounds[1].guide"),
    ("guide_correct", True, "rounds[1].guide"),
    ("guide_verdict", True, "rounds[1].guide"),
    ("guide_tokens_in", 3.0, "rounds[1].guide"),
    ("guide_tokens_out", 1.0, "rounds[1].guide"),
    ("guide_uncertainty", 0.25, "rounds[1].guide"),
])
def test_fast_format_refuses_guide_values_in_a_cascade(tmp_path, field, value, where):
    c = _cascade(6)
    a = {k: v.copy() for k, v in c.arrays.items()}
    a[field][3, 1] = value
    bad = ResponseCache(c.manifest, a).with_checksum()
    qid = str(a["question_ids"][3])
    with pytest.raises(CacheError, match=rf"fast \(not written\): question '{qid}': {re.escape(where)}: {NO_GUIDE_MSG}"):
        save_fast(bad, tmp_path / "fast")
    assert not (tmp_path / "fast").exists()
    write_fast_dir(tmp_path / "old", bad.manifest.to_dict(), bad.arrays)  # written without the check
    with pytest.raises(CacheError, match=rf"arrays\.npz: question '{qid}': {re.escape(where)}: {NO_GUIDE_MSG}"):
        load_cache(tmp_path / "old")


def test_a_cached_llm_policy_taking_the_guide_is_refused_in_a_cascade(tmp_path):
    c = _cascade(6)
    a = {k: v.copy() for k, v in c.arrays.items()}
    a["llm_policy_actions"] = np.full((6, 1, c.T), -1, np.int32)
    a["llm_policy_actions"][:, 0, 0] = 0
    a["llm_policy_actions"][2, 0, :2] = (2, 1)
    m = dataclasses.replace(c.manifest, llm_policy_models=("p",))
    with pytest.raises(CacheError, match=r"question '\S+-q2': baselines\.llm_policy\.p\[1\]: action 1 \(guide\)"):
        save_fast(ResponseCache(m, a).with_checksum(), tmp_path / "fast")


def test_gold_equal_to_answer_zero_is_not_read_into_the_empty_guide_slot():
    """The guide slot's id -1 is no answer: the gold rule must not read it as answer 0 flagged incorrect."""
    c = _cascade(40)
    a = c.arrays
    first_right = a["base_correct"][:, 0] & (np.char.str_len(a["gold"]) > 0)
    assert first_right.any()  # answer 0 equals gold for these questions, and their guide slots are false
    from envs.cache.schema import values_problem
    assert values_problem(c.manifest, a) is None


def test_only_the_guide_may_be_null():
    d = _cascade(3).manifest.to_dict()
    d["models"]["base"] = None
    with pytest.raises(CacheError, match=r"manifest\.models\.base: expected an object"):
        Manifest.from_dict(d)


def test_data_check_prints_no_guide(tmp_path):
    p = save_cache(_cascade(30), tmp_path / "k.jsonl")
    r = run_cli(["data", "check", str(p)])
    assert r.returncode == 0, r.stderr
    assert "guide model: none (a cascade" in r.stdout
    assert "guide accuracy" not in r.stdout and "verdict accuracy" not in r.stdout
    assert "rounds 3,4: big-70b" in r.stdout  # the base ladder


# -- the env, features, bound ------------------------------------------------------------


Q, T = 120, 4


@pytest.fixture(scope="module")
def rcache() -> ResponseCache:
    return as_cascade(random_cache(Q, T, seed=5), _rungs(T))


@pytest.fixture(scope="module")
def params(rcache):
    return make_env_params(rcache)


def test_guide_never_available_and_a_round_costs_the_base_call(rcache, params):
    av = np.asarray(params.available)
    n = rcache.n_rounds
    a = rcache.arrays
    for q in range(Q):
        for t in range(T):
            assert av[q, t].tolist() == [t < n[q], False, t < n[q] - 1]
            r = _rungs(T)[t]
            want = (float(a["base_tokens_in"][q, t]) * r.price_in + float(a["base_tokens_out"][q, t]) * r.price_out) \
                / 1e6 * 100 if t < n[q] else 0.0
            assert float(params.cost[q, t]) == pytest.approx(want, rel=1e-5, abs=1e-12)


def test_guide_features_take_their_missing_values(rcache, params):
    names = feature_names(T)
    obs = np.asarray(params.obs)
    col = {k: names.index(k) for k in names}
    a, n = rcache.arrays, rcache.n_rounds
    for q in range(Q):
        for t in range(n[q]):
            o = obs[q, t]
            assert o[col["guide_verdict"]] == 0 and o[col["guide_uncertainty"]] == 0.5
            assert o[col["has_guide_uncertainty"]] == 0 and o[col["base_guide_agree"]] == 0
            assert o[col["guide_repeats_prev"]] == 0
            assert o[col["cum_guide_tokens_in"]] == 0 and o[col["cum_guide_tokens_out"]] == 0
            distinct = len(set(int(x) for x in a["base_answer"][q, : t + 1]))
            assert o[col["distinct_answers"]] == pytest.approx(distinct / (2 * T))
    ref = np.array([reference_features(rcache, q) for q in range(Q)], np.float64)
    np.testing.assert_allclose(obs, ref, rtol=1e-5, atol=1e-6)


def test_env_matches_reference_with_guide_actions(rcache, params):
    """The 'guide' action (unavailable) ends the episode with no answer, in the env and the reference."""
    env, ref = OrchestrationEnv(), ReferenceEnv(rcache)
    acts = np.random.default_rng(0).choice([0, 1, 1, 2, 2], size=(Q, T + 1)).astype(np.int32)

    @jax.jit
    def run(acts):
        def one(q, aa):
            _, s = env.reset(jax.random.PRNGKey(0), params, q)

            def body(s, x):
                o, s, r, te, tr, info = env.step(jax.random.PRNGKey(1), s, x, params)
                return s, (r, te, info)

            return jax.lax.scan(body, s, aa)[1]
        return jax.vmap(one)(jnp.arange(Q), acts)

    r, te, info = jax.tree.map(np.asarray, run(acts))
    guide_taken = 0
    for q in range(Q):
        ref.reset(q)
        for k in range(T + 1):
            _, rr, tte, _, inf = ref.step(int(acts[q, k]))
            assert r[q, k] == pytest.approx(rr, rel=1e-6, abs=1e-9) and bool(te[q, k]) == tte
            for key in ("correct", "constraint", "round", "answer"):
                assert info[key][q, k] == inf[key], (q, k, key)
        first_end = next(k for k in range(T + 1) if acts[q, k] != 2 or k >= rcache.n_rounds[q] - 1)
        if acts[q, first_end] == 1:
            guide_taken += 1
            assert info["answer"][q, first_end] == -1 and not info["correct"][q, first_end]
    assert guide_taken > 10


def test_sets_with_guide_collect_base_answers_only(rcache, params):
    in_set = np.random.default_rng(1).random((Q, T, 3)) < 0.6
    m = jax.tree.map(np.asarray, evaluate_sets(jnp.asarray(in_set), params, jnp.arange(Q)))
    for q in range(Q):
        want = reference_evaluate_set(rcache, q, in_set[q].tolist())
        assert m.cost_cents[q] == pytest.approx(want["cost_cents"], rel=1e-5)
        assert bool(m.covered[q]) == want["covered"] and int(m.set_size[q]) == want["set_size"]
        # independent: distinct base answers of the reached rounds
        reached, t = [], 0
        while True:
            reached.append(t)
            if not (in_set[q, t, 2] and t + 1 < rcache.n_rounds[q]):
                break
            t += 1
        ids = {int(rcache.arrays["base_answer"][q, s]) for s in reached if in_set[q, s, 0]}
        assert int(m.set_size[q]) == len(ids)


def test_bound_by_brute_force_only_base_answers_cover():
    c = as_cascade(random_cache(7, 3, seed=11), _rungs(3))
    a, n = c.arrays, c.n_rounds
    cost = c.round_cost_cents().astype(np.float64)
    unsolvable = [not a["base_correct"][q, : n[q]].any() for q in range(7)]
    for alpha in (0.1, 0.3, 0.5):
        need = math.ceil((1 - alpha) * 7 - 1e-9)
        best = math.inf
        for stops in itertools.product(*[range(1, n[q] + 1) for q in range(7)]):
            covered = sum(unsolvable[q] or bool(a["base_correct"][q, :s].any()) for q, s in enumerate(stops))
            if covered >= need:
                best = min(best, sum(cost[q, :s].sum() for q, s in enumerate(stops)))
        got = bound_of_cache(c, np.arange(7), alpha)
        assert float(got["cost_cents"]) == pytest.approx(best, rel=1e-9)


# -- baselines, reproduce, export, serving -----------------------------------------------


def test_baselines_leave_out_uala_and_random_never_takes_the_guide(rcache, params):
    from ccpo_jax.ccpo.baselines import left_out_rows, non_learned_rows, random_actions

    idx = np.arange(Q)
    acts = np.asarray(random_actions(jax.random.PRNGKey(0), params, jnp.asarray(idx)))
    assert not (acts == A_GUIDE).any()
    rows = non_learned_rows(rcache, params, jax.random.PRNGKey(0), idx[None, :60], idx[None, 60:], 0.1)
    assert "UALA" not in rows and "Random" in rows
    assert "guide-less cascade" in left_out_rows(rcache, idx[60:])["UALA"]


@pytest.mark.slow
def test_reproduce_runs_end_to_end_and_its_router_never_takes_the_guide(tmp_path):
    """``ccpo-jax reproduce`` (small) on a 3-rung guide-less cascade, then ``export``: the learned row's
    router never puts "guide" in a set on any round of any question."""
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.serving import Router

    c = generate("hotpotqa-llama2", 100, 0)
    save_fast(as_cascade(c, _rungs(c.T)), tmp_path / "k")
    r = run_cli(["reproduce", "--cache", str(tmp_path / "k"), "--splits", "2", "--split-sizes", "60,20,20",
                 "--iterations", "4", "--seeds", "2", "--member-block", "1", "--no-progress", "--out",
                 str(tmp_path / "run")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {"Random", "CPO batch", "CCPO (lambda=0)"} <= set(res["policies"])
    assert "UALA" not in res["policies"] and "guide-less cascade" in res["left_out"]["UALA"]
    assert (tmp_path / "run" / "boxplot_cost.png").is_file() and "| Policy |" in (tmp_path / "run" / "table.md").read_text()
    router = Router.load(export_router(tmp_path / "run", tmp_path / "art"))
    reqs = _every_round(load_cache(tmp_path / "k"))[0]
    decisions = router.decide_many(reqs)
    assert all("guide" not in d["action_set"] and d["probs"]["guide"] == 0.0 for d in decisions)
    assert any("base" in d["action_set"] for d in decisions)


def _every_round(c: ResponseCache) -> tuple[list[dict], list[tuple[int, int]]]:
    reqs, where = [], []
    for q, rec in enumerate(cache_to_records(c)):
        for t in range(len(rec["rounds"])):
            reqs.append({"rounds": rec["rounds"][: t + 1], "can_continue": t + 1 < len(rec["rounds"])})
            where.append((q, t))
    return reqs, where


def test_exported_router_routes_rounds_without_guide(tmp_path):
    """Export of a cascade policy: the featuriser equals the env bit for bit, "guide" is never available
    nor in a set, and a guide object is refused naming the place (decide and ``ccpo-jax route``)."""
    import types

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from ccpo_jax.serving import Router, RouterInputError
    c = _cascade(60, 3)
    F = make_env_params(c).F  # T + 16: the cascade's base ladder has its rung-price feature
    p = policy_net().init(jax.random.PRNGKey(5), jnp.zeros((F,), jnp.float32))
    state = types.SimpleNamespace(policy=jax.tree.map(lambda x: np.asarray(x)[None, None, None], p),
                                  kappa=np.array([[[0.2]]], np.float32))
    save_policies(tmp_path / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[0.2]], np.float32)}, c, "recalibrate")
    router = Router.load(export_router(tmp_path / "run", tmp_path / "art", force=True))
    assert router.manifest["models"]["guide"] is None and not router.has_guide
    env = make_env_params(c)
    reqs, where = _every_round(c)
    obs, avail, _ = router.featurise(reqs)
    q, t = np.array(where).T
    assert np.array_equal(obs, np.asarray(env.obs)[q, t]) and np.array_equal(avail, np.asarray(env.available)[q, t])
    decisions = router.decide_many(reqs)
    assert all("guide" not in d["action_set"] and "guide" not in d["available"] for d in decisions)
    bad = [dict(reqs[0]["rounds"][0], guide={"verdict": True, "answer": "a", "tokens_in": 1, "tokens_out": 1})]
    with pytest.raises(RouterInputError, match=rf"rounds\[0\]\.guide: {NO_GUIDE_MSG}"):
        router.decide(bad)
    f = tmp_path / "req.jsonl"
    f.write_text(json.dumps({"rounds": reqs[0]["rounds"]}) + "\n" + json.dumps({"rounds": bad}) + "\n")
    r = run_cli(["route", str(tmp_path / "art"), "--input", str(f)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"req.jsonl:2.rounds[0].guide: {NO_GUIDE_MSG}" in r.stderr
