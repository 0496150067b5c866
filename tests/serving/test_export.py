"""Export of a trained router and its verified loading (docs/export.md; issue 6).

Oracle: the trainer-side forward pass, ``conformal_set(masked_probs(policy_net.apply(params, obs),
available), kappa, available)`` from ccpo_jax.core.networks / ccpo_jax.core.conformal, evaluated by plain
jitted JAX on the raw flax params; the router sees only the artefact.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.core.conformal import conformal_set
from ccpo_jax.core.networks import masked_probs, policy_net
from envs.replay.features import n_features
from envs.replay.env import make_env_params
from envs.generators.synthetic import generate
from tests.helpers import REPO

N_OBS = 10_000
HIDDEN = (64, 64, 64)


def _trained_like_params(key, F):
    """Policy params with a non-degenerate head (the init's 0.01 scale gives probs ~1/3)."""
    p = policy_net(HIDDEN).init(key, jnp.zeros((F,), jnp.float32))
    p = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 300.0 if "Dense_3" in jax.tree_util.keystr(path) else x, p)
    return p


def _reference(params, obs, avail, kappa):
    net = policy_net(HIDDEN)
    f = jax.jit(lambda p, o, a: masked_probs(net.apply(p, o), a))
    probs = f(params, obs, avail)
    return np.asarray(probs), np.asarray(conformal_set(probs, jnp.float32(kappa), avail))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A RUN_DIR as ``ccpo-jax reproduce`` leaves it (policies/ via the trainer's own save_policies)
    with a SYNTHETIC cache, plus 10,000 observations (cache rows + random) and their reference sets."""
    from ccpo_jax.ccpo.policy_store import save_policies

    root = tmp_path_factory.mktemp("export")
    cache = generate("hotpotqa-llama2", 200, 0)
    env = make_env_params(cache)
    T, F = cache.T, n_features(cache.T)
    m = np.asarray(env.round_mask).reshape(-1)
    cache_obs = np.asarray(env.obs).reshape(-1, F)[m]
    cache_av = np.asarray(env.available).reshape(-1, 3)[m]
    rng = np.random.default_rng(0)
    n_rand = N_OBS - cache_obs.shape[0]
    rand_obs = np.concatenate([rng.normal(0, 1.5, (n_rand // 2, F)),
                               cache_obs[rng.integers(0, len(cache_obs), n_rand - n_rand // 2)]
                               + rng.normal(0, 0.05, (n_rand - n_rand // 2, F))]).astype(np.float32)
    rand_av = rng.random((n_rand, 3)) < 0.7
    rand_av[:, :2] |= ~rand_av.any(axis=1, keepdims=True)
    obs = np.concatenate([cache_obs, rand_obs])
    avail = np.concatenate([cache_av, rand_av])

    p_ccpo = _trained_like_params(jax.random.PRNGKey(1), F)
    p_cpo = _trained_like_params(jax.random.PRNGKey(2), F)
    # Exact calibration makes kappa equal to some pi(a|o) of the cache: do the same, so that
    # a 1-ulp difference between router and trainer would flip a set.
    probs_ref, _ = _reference(p_ccpo, obs, avail, 0.0)
    # (the one nearest 0.3, so that sets of 0, 1, 2 and 3 actions all occur).
    kappa = float(probs_ref[np.argmin(np.abs(probs_ref[:, 0] - 0.3)), 0])
    variants = [Variant("CPO", conformal=False, lam=0.0), Variant("CCPO (lambda=0)", conformal=True, lam=0.0)]
    stack = jax.tree.map(lambda a, b: np.stack([a, b])[:, None, None], p_cpo, p_ccpo)  # [V, S=1, N=1, ...]
    state = types.SimpleNamespace(policy=stack, kappa=np.array([[[0.3]], [[0.31]]], np.float32))
    kappas = {"CPO batch": np.array([[0.25]], np.float32), "CCPO (lambda=0)": np.array([[kappa]], np.float32)}
    run_dir = root / "run"
    save_policies(run_dir / "policies", TrainConfig(), variants, state, kappas, cache, "recalibrate")
    (run_dir / "results.json").write_text(json.dumps({"setting": "test-synthetic"}))
    from ccpo_jax.ccpo.export import export_router

    art = export_router(run_dir, root / "art")
    return types.SimpleNamespace(root=root, run_dir=run_dir, art=art, cache=cache, env=env, obs=obs, avail=avail,
                                 params=p_ccpo, params_cpo=p_cpo, kappa=kappa, T=T, F=F)


@pytest.fixture(scope="module")
def router(run):
    from ccpo_jax.serving import Router

    return Router.load(run.art)


def test_action_sets_bit_for_bit(run, router):
    probs_ref, sets_ref = _reference(run.params, run.obs, run.avail, run.kappa)
    assert run.obs.shape == (N_OBS, run.F)
    # kappa equals a probability of an observation: the threshold is exercised with equality.
    assert (probs_ref == np.float32(run.kappa)).any()
    sets = router.action_set(run.obs, run.avail)
    assert sets.dtype == bool and np.array_equal(sets, sets_ref)
    assert np.array_equal(router.probs(run.obs, run.avail), probs_ref)
    # Sets of different sizes occur (not a constant answer).
    assert len(np.unique(sets_ref.sum(1))) >= 3
    # Batch size and position do not change a row (blocks of 2,048 rows).
    for lo, hi in ((0, 1), (17, 18), (100, 164), (5000, 6024), (0, 2049)):
        assert np.array_equal(router.action_set(run.obs[lo:hi], run.avail[lo:hi]), sets_ref[lo:hi])


def test_manifest_contents(run, router):
    from envs.replay.features import SCALES, feature_names

    m = router.manifest
    meta = json.loads((run.run_dir / "policies" / "ccpo-lambda-0" / "policy.json").read_text())
    assert m["format_version"] == 2 and m["policy"]["row"] == "CCPO (lambda=0)"
    assert m["kappa"] == run.kappa and m["alpha"] == 0.1 and m["T"] == run.T
    assert m["features"]["names"] == list(feature_names(run.T)) and m["features"]["scales"] == SCALES
    assert m["actions"] == ["base", "guide", "next"]
    assert m["cache"]["checksum"] == run.cache.checksum() and m["cache"]["provenance"]["kind"] == "synthetic"
    assert m["models"] == meta["models"] and m["train_config"]["alpha"] == 0.1
    assert set(m["files"]) == {"policy.jaxexport", "params.npz"} and "jax" in m["versions"]
    assert m["source"]["setting"] == "test-synthetic"
    assert m["module"]["platforms"] == ["cpu", "cuda", "tpu"]


def test_export_other_row_and_errors(run, tmp_path):
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.errors import UserError
    from ccpo_jax.serving import Router

    art = export_router(run.run_dir, tmp_path / "cpo", row="CPO batch")
    r = Router.load(art)
    assert r.manifest["policy"]["training"] == "cpo" and r.kappa == np.float32(0.25)
    _, ref = _reference(run.params_cpo, run.obs[:3000], run.avail[:3000], 0.25)
    assert np.array_equal(r.action_set(run.obs[:3000], run.avail[:3000]), ref)
    with pytest.raises(UserError, match="already exists"):
        export_router(run.run_dir, art)
    with pytest.raises(UserError, match="available: 'CPO batch', 'CCPO \\(lambda=0\\)'|available: 'CCPO"):
        export_router(run.run_dir, tmp_path / "x", row="CCPO (lambda=7)")
    with pytest.raises(UserError, match="no policies/ folder"):
        export_router(tmp_path, tmp_path / "y")
    # Nothing partial left behind by the failures.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpo"]


def test_export_failure_leaves_nothing(run, tmp_path, monkeypatch):
    import ccpo_jax.ccpo.export as ex

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ex, "_self_check", boom)
    with pytest.raises(RuntimeError):
        ex.export_router(run.run_dir, tmp_path / "art")
    assert list(tmp_path.iterdir()) == []


def _copy(run, tmp_path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(run.art, dst)
    return dst


@pytest.mark.parametrize("tamper, match", [
    ("module_byte", "policy.jaxexport: sha256 mismatch"),
    ("params_byte", "params.npz: sha256 mismatch"),
    ("manifest_kappa", "manifest checksum mismatch"),
    ("manifest_space", None),  # reformatting the JSON keeps its content: accepted
    ("missing_module", "policy.jaxexport: missing"),
    ("missing_manifest", "manifest.json: missing"),
    ("version", r"format_version 3 is not supported by this build \(reads \[1, 2\]\)"),
    ("format", "format is 'other'"),
    ("not_json", "not valid JSON"),
])
def test_tampered_artifact_refused(run, tmp_path, tamper, match):
    from ccpo_jax.serving import ArtifactError, Router
    from ccpo_jax.serving.artifact import manifest_checksum

    art = _copy(run, tmp_path)
    mp = art / "manifest.json"
    man = json.loads(mp.read_text())
    if tamper in ("module_byte", "params_byte"):
        f = art / ("policy.jaxexport" if tamper == "module_byte" else "params.npz")
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
    elif tamper == "manifest_kappa":
        man["kappa"] = man["kappa"] * 0.5
        mp.write_text(json.dumps(man))
    elif tamper == "manifest_space":
        mp.write_text(json.dumps(man, indent=4))
    elif tamper == "missing_module":
        (art / "policy.jaxexport").unlink()
    elif tamper == "missing_manifest":
        mp.unlink()
    elif tamper in ("version", "format"):
        # A consistent manifest (checksum recomputed) of another version/format is still refused.
        if tamper == "version":
            man["format_version"] = 3  # a future version
        else:
            man["format"] = "other"
        man["manifest_sha256"] = manifest_checksum(man)
        mp.write_text(json.dumps(man))
    elif tamper == "not_json":
        mp.write_text("{not json")
    if match is None:
        Router.load(art)
        return
    with pytest.raises(ArtifactError, match=match):
        Router.load(art)


def test_input_validation(router):
    from ccpo_jax.serving import RouterInputError

    F = router.F
    ok = np.zeros((2, F), np.float32)
    bad = [
        (np.zeros((2, F + 1), np.float32), None, "expected shape \\[B, %d\\]" % F),
        (np.zeros((F,), np.float32), None, "expected shape"),
        (np.where(np.eye(2, F) > 0, np.nan, 0.0), None, "obs\\[0, 0\\] \\(round_1\\): not finite"),
        (np.array([["a"] * F] * 2), None, "expected real numbers"),
        (np.zeros((2, F), bool), None, "expected real numbers"),
        (ok, np.ones((2, 4), bool), "expected shape \\[2, 3\\]"),
        (ok, np.array([[1, 0, 0], [0, 0, 0]], bool), "available\\[1\\]: no action"),
        (ok, np.full((2, 3), 0.5), "expected booleans"),
    ]
    for obs, av, match in bad:
        with pytest.raises(RouterInputError, match=match):
            router.action_set(obs, av)
    assert router.action_set(np.zeros((0, F))).shape == (0, 3)
    assert router.probs(ok.astype(np.float64)).shape == (2, 3)  # numbers of any real dtype are accepted


def test_serving_imports_without_training_stack(run):
    """ccpo_jax.serving loads and decides with optax, orbax, tensorboardX, flax and the trainer blocked."""
    code = f"""
import sys
BLOCK = ("optax", "orbax", "tensorboardX", "flax", "ccpo_jax.ccpo.train", "ccpo_jax.ccpo.export", "chex", "distrax", "rlax")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCK):
            raise ImportError("blocked for this test: " + name)
        return None
sys.meta_path.insert(0, Blocker())
from ccpo_jax.serving import Router
r = Router.load({str(run.art)!r})
rnd = {{"base": {{"answer": "Paris", "tokens_in": 800, "tokens_out": 20}},
        "guide": {{"verdict": False, "answer": "Lyon", "tokens_in": 90, "tokens_out": 4}}}}
d = r.decide([rnd])
assert d["round"] == 1 and set(d["action_set"]) <= {{"base", "guide", "next"}}, d
bad = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCK)]
assert not bad, bad
print("OK", d["action_set"])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, cwd=REPO)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]


def test_cli_export_and_errors(run, tmp_path):
    cli = [sys.executable, "-m", "ccpo_jax.cli"]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cli + ["export", str(run.run_dir), "--row", "cpo-batch", "--out", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exported 'CPO batch'" in res.stdout and "SYNTHETIC" in res.stdout
    assert (tmp_path / "a" / "manifest.json").is_file()
    res = subprocess.run(cli + ["route", str(tmp_path / "missing"), "--input", "x.jsonl"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert res.returncode == 2 and "no such artefact directory" in res.stderr and "Traceback" not in res.stderr


def test_blocked_probs_match_router_on_small_caches(run, router):
    """``blocked_policy_probs`` (for the trainer's calibration table) gives the router's bits on a
    [Q, T, F] cache of 800 rows, also vmapped over variants as the trainer evaluates. (The plain
    formula at this size may use another XLA:CPU matmul kernel and differ by an ulp.)"""
    from ccpo_jax.ccpo.blocked import blocked_policy_probs

    m = np.asarray(run.env.round_mask)
    want = router.probs(run.obs[: m.sum()], run.avail[: m.sum()])  # the cache rows, in order
    got = np.asarray(jax.jit(blocked_policy_probs)(run.params, run.env.obs, run.env.available))
    assert got.shape == m.shape + (3,) and np.array_equal(got[m], want)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), run.params_cpo, run.params)
    got_v = np.asarray(jax.jit(jax.vmap(blocked_policy_probs, in_axes=(0, None, None)))(
        stacked, run.env.obs, run.env.available))
    assert np.array_equal(got_v[1][m], want)


def _diag(kappa, full, coverage=0.95, cost=1.0):
    return {"n": 200, "kappa": kappa, "coverage": coverage, "target": 0.9, "full_set_fraction": full,
            "degenerate": full >= 0.9 or kappa < 1e-6, "set_size_counts": {"1": 200},
            "test_cost_cents_mean": cost, "test_coverage_mean": coverage}


def test_export_refuses_a_degenerate_router_and_picks_the_cheapest_usable_row(run, tmp_path):
    """kappa-hat ~ 0 / the full set for nearly every calibration question: refused unless --force;
    the default row is the cheapest calibrated row whose calibration coverage holds."""
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.errors import UserError
    from ccpo_jax.serving import Router

    variants = [Variant("CPO", conformal=False), Variant("CCPO (lambda=0)", conformal=True),
                Variant("CCPO (lambda=2e-4)", conformal=True, lam=2e-4)]
    stack = jax.tree.map(lambda a: np.stack([a, a, a])[:, None, None], run.params)
    state = types.SimpleNamespace(policy=stack, kappa=np.full((3, 1, 1), 0.3, np.float32))
    kappas = {"CPO batch": np.array([[0.2]]), "CCPO (lambda=0)": np.array([[3.7e-7]]),
              "CCPO (lambda=2e-4)": np.array([[0.3]])}
    diag = {"CPO batch": _diag(0.2, 0.1, cost=5.9), "CCPO (lambda=0)": _diag(3.7e-7, 0.98, cost=12.0),
            "CCPO (lambda=2e-4)": _diag(0.3, 0.05, coverage=0.85, cost=4.0)}  # cheapest, but misses
    run_dir = tmp_path / "run"
    save_policies(run_dir / "policies", TrainConfig(), variants, state, kappas, run.cache, "recalibrate", diag)
    said = []
    art = export_router(run_dir, tmp_path / "default", echo=said.append)
    assert Router.load(art).manifest["policy"]["row"] == "CPO batch"
    assert "cheapest calibrated row whose calibration coverage holds" in said[0]
    with pytest.raises(UserError, match=r"kappa-hat 3.7e-07.*98% of the 200 calibration.*'CPO batch'.*would serve better.*`force`") as e:
        export_router(run_dir, tmp_path / "ccpo", row="CCPO (lambda=0)")
    assert str(e.value.for_cli({"force": "--force"})).endswith("pass --force to export it anyway")
    assert not (tmp_path / "ccpo").exists()
    art = export_router(run_dir, tmp_path / "forced", row="CCPO (lambda=0)", force=True, echo=said.append)
    assert Router.load(art).manifest["policy"]["row"] == "CCPO (lambda=0)" and "degenerate" in said[-1]


def test_calibration_diagnostics_by_hand(run):
    """A uniform policy at kappa 0 holds every available action everywhere: degenerate; at kappa 0.5
    the sets are empty, so only unsolvable questions are covered."""
    from ccpo_jax.ccpo.evaluation import calibration_diagnostics

    zero = jax.tree.map(np.zeros_like, run.params)  # all logits 0: uniform over available actions
    cal = np.arange(50)
    d = calibration_diagnostics(zero, run.env, 0.0, cal, 0.1)
    assert d["full_set_fraction"] == 1.0 and d["degenerate"] and d["kappa"] == 0.0
    d = calibration_diagnostics(zero, run.env, 0.5, cal, 0.1)
    assert d["full_set_fraction"] == 0.0 and not d["degenerate"]
    assert d["coverage"] == pytest.approx(float(np.mean(run.cache.unsolvable[cal])))
    assert d["set_size_counts"] == {"0": 50}


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["module"].update(block_rows="x"), "module.block_rows: expected an integer in [1, 65536], got 'x'"),
    (lambda m: m["module"].update(block_rows=0), "module.block_rows: expected an integer in [1, 65536], got 0"),
    (lambda m: m.update(module=5), "module: expected an object, got int 5"),
    (lambda m: m.update(kappa=2.0), "kappa: expected a number in [0, 1], got 2.0"),
    (lambda m: m.update(alpha=0), "alpha: expected a number in (0, 1), got 0"),
])
def test_rehashed_manifest_values_are_one_error_line_in_route_and_serve(run, tmp_path, edit, message):
    """Issue 27 item 5: a manifest edited and rehashed (it passes its checksum) with a bad value
    was a traceback from ``route`` and ``serve``; now both print one line and exit 2."""
    from ccpo_jax.serving.artifact import manifest_checksum
    from tests.helpers import run_cli

    art = _copy(run, tmp_path)
    mp = art / "manifest.json"
    man = json.loads(mp.read_text())
    edit(man)
    man["manifest_sha256"] = manifest_checksum(man)
    mp.write_text(json.dumps(man))
    (tmp_path / "in.jsonl").write_text("")
    for argv in (["route", str(art), "--input", str(tmp_path / "in.jsonl")], ["serve", str(art), "--port", "0"]):
        r = run_cli(argv)
        assert r.returncode == 2 and r.stderr.strip() == f"error: {mp}: {message}", r.stderr


def test_out_of_range_number_in_a_manifest_is_a_checksum_mismatch(run, tmp_path):
    """Issue 27 item 4: ``kappa`` edited to 1e400 (no rehash) raised ValueError while hashing."""
    from tests.helpers import run_cli

    art = _copy(run, tmp_path)
    mp = art / "manifest.json"
    text = mp.read_text()
    mp.write_text(re.sub(r'"kappa": [^,}]+', '"kappa": 1e400', text, count=1))
    (tmp_path / "in.jsonl").write_text("")
    r = run_cli(["route", str(art), "--input", str(tmp_path / "in.jsonl")], in_subprocess=True)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {mp}: manifest checksum mismatch (manifest_sha256); the manifest was edited or damaged"), r.stderr
