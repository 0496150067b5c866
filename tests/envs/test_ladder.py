"""Model ladders in the cache (docs/caches.md#model-ladders): round t's base (and guide) model has its own
prices. Oracles: per-element costs in plain Python, the one-model cache (a ladder of equal rungs must
price bit for bit the same), the brute-force clairvoyant bound, and the replay env's observations for the
exported router's featuriser."""
from __future__ import annotations

import dataclasses
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import run_cli
from envs.cache.formats import load_cache, save_cache
from envs.cache.jsonl import cache_to_records
from envs.cache.schema import CacheError, Manifest, ModelInfo, ResponseCache
from envs.generators.synthetic import generate
from envs.replay.bound import bound_of_cache

RUNGS = (ModelInfo("tiny-1b", 0.02, 0.04), ModelInfo("mid-8b", 0.2, 0.6), ModelInfo("mid-8b", 0.2, 0.6),
         ModelInfo("big-70b", 0.9, 0.9))


def _ladder(n=150, seed=0, guides=None) -> ResponseCache:
    c = generate("hotpotqa-llama2", n, seed)
    m = dataclasses.replace(c.manifest, base_ladder=RUNGS[: c.T], guide_ladder=guides or ())
    return ResponseCache(m, c.arrays).with_checksum()


def test_cost_per_round_at_that_rounds_prices():
    c = _ladder()
    a, got = c.arrays, c.round_cost_cents()
    for q in range(0, c.n_questions, 7):
        for t in range(c.T):
            b, g = RUNGS[t], c.manifest.guide
            usd = (float(a["base_tokens_in"][q, t]) * b.price_in + float(a["base_tokens_out"][q, t]) * b.price_out
                   + float(a["guide_tokens_in"][q, t]) * g.price_in + float(a["guide_tokens_out"][q, t]) * g.price_out)
            want = 100 * usd / 1e6 if a["round_mask"][q, t] else 0.0
            assert got[q, t] == pytest.approx(want, rel=1e-5)
    # a ladder whose rungs are all the one model prices every round bit for bit as that model
    one = generate("hotpotqa-llama2", 150, 0)
    same = dataclasses.replace(one.manifest, base_ladder=(one.manifest.base,) * one.T,
                               guide_ladder=(one.manifest.guide,) * one.T)
    assert np.array_equal(ResponseCache(same, one.arrays).round_cost_cents(), one.round_cost_cents())
    # per-round guide prices too
    g = tuple(ModelInfo(f"judge-{t}", 1.0 + t, 4.0) for t in range(c.T))
    cg = _ladder(guides=g)
    diff = cg.round_cost_cents() - c.round_cost_cents()
    want = 100 * ((np.arange(c.T) + 1.0 - 2.5) * a["guide_tokens_in"] + (4.0 - 10.0) * a["guide_tokens_out"]) / 1e6
    assert np.allclose(diff, np.where(a["round_mask"], want, 0), rtol=1e-4, atol=1e-7)


def test_bound_uses_the_ladders_prices():
    """The bound (envs/replay/bound.py's rule: every question pays round 1, unsolvable ones count as
    covered, then the cheapest extra rounds up to the first right answer) from costs summed by hand."""
    c = _ladder()
    a, n = c.arrays, c.n_questions
    cost = c.round_cost_cents().astype(np.float64)
    first_cost, extras, unsolvable = 0.0, [], 0
    for q in range(n):
        first_cost += cost[q, 0]
        right = [t for t in range(c.T) if a["round_mask"][q, t] and (a["base_correct"][q, t] or a["guide_correct"][q, t])]
        if right:
            extras.append(sum(cost[q, 1: right[0] + 1]))
        else:
            unsolvable += 1
    k = max(int(np.ceil(0.9 * n - 1e-9)) - unsolvable, 0)
    want = first_cost + sum(sorted(extras)[:k])
    got = bound_of_cache(c, np.arange(n), 0.1)
    assert float(got["cost_cents"]) == pytest.approx(want, rel=1e-6)
    one = generate("hotpotqa-llama2", 150, 0)
    assert float(bound_of_cache(one, np.arange(n), 0.1)["cost_cents"]) != pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_ladder_round_trips_both_formats_and_data_check_prints_it(tmp_path, suffix, capsys):
    c = _ladder()
    path = save_cache(c, tmp_path / f"ladder{suffix}")
    back = load_cache(path)
    assert back.manifest.base_ladder == RUNGS[: c.T] and back.manifest.guide_ladder == ()
    assert back.checksum() == c.checksum() and np.array_equal(back.round_cost_cents(), c.round_cost_cents())
    r = run_cli(["data", "check", str(path)])
    assert r.returncode == 0, r.stderr
    assert "base model:  a ladder, one model per round:" in r.stdout
    assert "rounds 2,3: mid-8b  ($0.2 in / $0.6 out per 1M tokens): 300 calls" in r.stdout


def test_one_model_caches_keep_their_manifest_and_checksum():
    c = generate("hotpotqa-llama2", 50, 0)
    d = c.manifest.to_dict()
    assert isinstance(d["models"]["base"], dict) and isinstance(d["models"]["guide"], dict)
    assert not c.manifest.is_ladder and Manifest.from_dict(d) == c.manifest
    assert c.checksum() == c.manifest.checksum


def _manifest_with(models, T=4):
    d = generate("hotpotqa-llama2", 5, 0).manifest.to_dict()
    d["models"], d["T"] = models, T
    return d


@pytest.mark.parametrize("models, match", [
    ({"base": [{"name": "a", "price_in": 1, "price_out": 1}] * 3, "guide": {"name": "g"}},
     r"manifest\.models\.base: a ladder lists one model per round: expected T = 4 entries, got 3"),
    ({"base": [{"name": "a", "price_in": 1, "price_out": 1}] * 3 + [{"name": "b", "price_in": 1}],
      "guide": {"name": "g"}}, r"manifest\.models\.base\[3\]: missing field 'price_out'"),
    ({"base": [{"name": "a", "price_in": 1, "price_out": 1}] * 3 + ["big"], "guide": {"name": "g"}},
     r"manifest\.models\.base\[3\]: expected an object"),
    ({"base": {"name": "a"}, "guide": [{"name": "g", "price_in": -1, "price_out": 1}] * 4},
     r"manifest\.models\.guide\[0\]\.price_in"),
    ({"base": None, "guide": None}, r"manifest\.models\.base: expected an object"),  # only the guide may be null
    ({"base": {"name": "a"}}, r"manifest\.models: missing field 'guide'"),
])
def test_bad_ladders_name_the_place(models, match):
    with pytest.raises(CacheError, match=match):
        Manifest.from_dict(_manifest_with(models))


def test_bad_ladder_file_is_one_error_line(tmp_path):
    c = generate("hotpotqa-llama2", 5, 0)
    recs = cache_to_records(c)
    m = c.manifest.to_dict()
    m["models"]["base"] = [RUNGS[0].to_dict()] * 2
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in [{"manifest": m}] + recs))
    r = run_cli(["data", "check", str(p)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "models.base: a ladder lists one model per round: expected T = 4 entries, got 2" in r.stderr


GUIDES = tuple(ModelInfo(f"judge-{t}", 1.0 + t, 4.0) for t in range(4))


def test_rung_price_features_by_hand():
    """The rung-price features (envs/replay/features.py): round t's price_in + price_out over the role's
    dearest rung, 0 on padding rounds, after the T + 15 others; by hand from RUNGS and GUIDES, and the
    plain-Python reference featuriser on every round of every question."""
    from envs.replay.env import make_env_params, raw_rounds
    from envs.replay.features import build_features, feature_names
    from envs.replay.reference import reference_features

    base = [0.06 / 1.8, 0.8 / 1.8, 0.8 / 1.8, 1.0]  # (0.02 + 0.04), (0.2 + 0.6) twice, (0.9 + 0.9)
    guide = [5 / 8, 6 / 8, 7 / 8, 1.0]  # (1 + t) + 4
    for guides, cols in (((), [base]), (GUIDES, [base, guide])):
        c = _ladder(40, 1, guides=guides)
        arrays = dict(c.arrays, round_mask=c.arrays["round_mask"].copy())
        arrays["round_mask"][::3, 2:] = False  # questions whose chain ends at round 2: padding rounds
        c = ResponseCache(c.manifest, arrays)
        env = make_env_params(c)
        obs, mask = np.asarray(env.obs), c.arrays["round_mask"]
        names = feature_names(c.T, ("base", "guide") if guides else ("base",))
        assert len(names) == env.F == c.T + 15 + len(cols)
        for j, col in enumerate(cols):
            got = obs[..., c.T + 15 + j]
            assert names[c.T + 15 + j] == ("base_rung_price", "guide_rung_price")[j]
            np.testing.assert_allclose(got, np.where(mask, np.asarray(col, np.float32), 0.0), rtol=1e-6)
        assert (~mask).any()  # padding rounds were checked
        ref = np.array([reference_features(c, q) for q in range(c.n_questions)])
        np.testing.assert_allclose(obs, ref, rtol=1e-5, atol=1e-6)
        # raw_rounds gives [Q, T] rung prices like every raw field: any leading shape featurises the same
        two = {k: v.reshape(2, -1, c.T) for k, v in raw_rounds(c).items()}
        ladder = ("base", "guide") if guides else ("base",)
        assert np.array_equal(np.asarray(build_features(two, c.T, ladder)).reshape(obs.shape), obs)
    # a guide ladder alone, and a ladder of free rungs (all 0)
    one = generate("hotpotqa-llama2", 20, 2)
    free = tuple(ModelInfo(f"local-{t}") for t in range(one.T))
    m = dataclasses.replace(one.manifest, base_ladder=free, guide_ladder=GUIDES[: one.T])
    env = make_env_params(ResponseCache(m, one.arrays))
    np.testing.assert_array_equal(np.asarray(env.obs)[..., -2], 0.0)
    np.testing.assert_allclose(np.asarray(env.obs)[..., -1], np.where(one.arrays["round_mask"], guide, 0.0), rtol=1e-6)
    m = dataclasses.replace(one.manifest, guide_ladder=GUIDES[: one.T])
    assert feature_names(one.T, ("guide",))[-1] == "guide_rung_price"
    assert make_env_params(ResponseCache(m, one.arrays)).F == one.T + 16


def test_export_refuses_a_ladder_policy_without_the_rung_features(tmp_path):
    """A ladder run saved before the rung features (policy.json's T + 15 names, a T + 15-wide policy) and a
    policy whose width does not fit its names: ``export`` says so in one line, exit 2, nothing written."""
    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.features import feature_names

    c = _ladder(30, 2)
    p = policy_net().init(jax.random.PRNGKey(5), jnp.zeros((c.T + 15,), jnp.float32))
    state = types.SimpleNamespace(policy=jax.tree.map(lambda x: np.asarray(x)[None, None, None], p),
                                  kappa=np.array([[[0.3]]], np.float32))
    save_policies(tmp_path / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[0.3]], np.float32)}, c, "recalibrate")
    meta_path = tmp_path / "run" / "policies" / "ccpo-lambda-0" / "policy.json"
    meta = json.loads(meta_path.read_text())
    for names, match in ((feature_names(c.T), r"policy.json: feature_names differ from .*feature_names\(4, \('base',\)\)"),
                         (feature_names(c.T, ("base",)), r"params.msgpack does not fit the 20 features of policy.json")):
        meta_path.write_text(json.dumps(dict(meta, feature_names=list(names))))
        r = run_cli(["export", str(tmp_path / "run"), "--row", "CCPO (lambda=0)", "--force", "--out", str(tmp_path / "art")])
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: ") and re.search(match, r.stderr), r.stderr
        assert not (tmp_path / "art").exists()


def test_one_model_caches_keep_their_features():
    """No rung feature on a one-model cache (nor a cascade): F = T + 15, as before the ladders' features."""
    from envs.replay.env import make_env_params
    from envs.replay.features import feature_names

    one = generate("hotpotqa-llama2", 20, 2)
    env = make_env_params(one)
    assert env.F == env.obs.shape[-1] == one.T + 15 and feature_names(one.T)[-1] == "cum_cost_cents"
    cascade = ResponseCache(dataclasses.replace(one.manifest, guide=None), one.arrays)
    assert make_env_params(cascade).F == one.T + 15


@pytest.mark.parametrize("guides", [(), GUIDES], ids=["base-ladder", "base-and-guide-ladders"])
def test_exported_router_prices_each_round_like_the_replay_env(tmp_path, guides):
    """A router exported from a ladder cache carries the ladder in its manifest, and its featuriser (the
    cumulative cost features and the rung prices) equals the replay env's observations bit for bit at
    every round; the manifest's feature names are the env's."""
    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from ccpo_jax.serving import Router
    from envs.replay.env import make_env_params

    c = _ladder(60, 3, guides=guides)
    env = make_env_params(c)
    want = ["base_rung_price"] + (["guide_rung_price"] if guides else [])
    assert env.F == c.T + 15 + len(want) == env.obs.shape[-1]
    p = policy_net().init(jax.random.PRNGKey(5), jnp.zeros((env.F,), jnp.float32))
    state = types.SimpleNamespace(policy=jax.tree.map(lambda x: np.asarray(x)[None, None, None], p),
                                  kappa=np.array([[[0.3]]], np.float32))
    save_policies(tmp_path / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[0.3]], np.float32)}, c, "recalibrate")
    router = Router.load(export_router(tmp_path / "run", tmp_path / "art"))
    assert [m["name"] for m in router.manifest["models"]["base"]] == [m.name for m in RUNGS[: c.T]]
    assert router.manifest["format_version"] == 2 and router.F == env.F
    assert router.manifest["features"]["names"][-len(want):] == want == list(router.feature_names[c.T + 15:])
    reqs, where = [], []
    for q, rec in enumerate(cache_to_records(c)):
        for t in range(c.T):
            reqs.append({"rounds": rec["rounds"][: t + 1], "can_continue": t + 1 < c.T})
            where.append((q, t))
    obs, avail, _ = router.featurise(reqs)
    q, t = np.array(where).T
    assert np.array_equal(obs, np.asarray(env.obs)[q, t]) and np.array_equal(avail, np.asarray(env.available)[q, t])
    one = generate("hotpotqa-llama2", 60, 3)  # the one-model prices give other cost features
    assert not np.array_equal(np.asarray(make_env_params(one).obs), np.asarray(env.obs))


@pytest.mark.slow
def test_reproduce_export_route_on_a_ladder(tmp_path):
    """``reproduce`` (small) on a base + guide ladder cache in the human format, ``export``, ``route
    --every-round``: the trained policy and the artefact (format version 2) have the rung features, and
    route's decisions equal the router's on the replay env's own observations (the same features)."""
    from ccpo_jax.serving import Router
    from envs.replay.env import make_env_params

    c = _ladder(100, 4, guides=GUIDES)
    save_cache(c, tmp_path / "ladder.jsonl")
    r = run_cli(["reproduce", "--cache", str(tmp_path / "ladder.jsonl"), "--splits", "2", "--split-sizes",
                 "60,20,20", "--iterations", "4", "--seeds", "2", "--member-block", "1", "--no-progress",
                 "--out", str(tmp_path / "run")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "run" / "policies" / "ccpo-lambda-0" / "policy.json").read_text())
    assert meta["feature_names"][-2:] == ["base_rung_price", "guide_rung_price"]
    r = run_cli(["export", str(tmp_path / "run"), "--row", "CCPO (lambda=0)", "--force", "--out",
                 str(tmp_path / "art")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(["route", str(tmp_path / "art"), "--input", str(tmp_path / "ladder.jsonl"), "--out",
                 str(tmp_path / "d.jsonl"), "--every-round"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    router = Router.load(tmp_path / "art")
    assert router.manifest["format_version"] == 2 and router.F == c.T + 17
    env = make_env_params(load_cache(tmp_path / "ladder.jsonl"))
    obs, avail = np.asarray(env.obs).reshape(-1, env.F), np.asarray(env.available).reshape(-1, 3)
    sets = router.action_set(obs, avail)[np.asarray(env.round_mask).reshape(-1)]
    routed = [json.loads(x)["action_set"] for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert routed == [[a for a, k in zip(router.actions, s) if k] for s in sets]
