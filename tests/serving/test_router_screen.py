"""Screened decisions (``Router.decide_many(screen=True)``, the gateway's): the float64 forward pass
decides the rows away from their threshold and the exported module the rest, so every set equals
the module's. Oracle: the module itself (``screen=False``), on random and adversarial inputs."""
from __future__ import annotations

import numpy as np
import pytest

from ccpo_jax.serving import Router
from ccpo_jax.serving import router as router_mod
from ccpo_jax.testing.gateway_harness import build_artefact
from envs.cache.schema import N_ACTIONS


@pytest.fixture(scope="module", params=[1.0, 300.0], ids=["soft", "sharp"])
def router(request, tmp_path_factory):
    return Router.load(build_artefact(tmp_path_factory.mktemp("screen"), scale=request.param))


def _inputs(router, n, seed):
    rng = np.random.default_rng(seed)
    obs = (rng.normal(0, 3, (n, router.F)) * rng.choice([0.1, 1, 10], (n, 1))).astype(np.float32)
    avail = rng.random((n, N_ACTIONS)) < 0.7
    avail[~avail.any(axis=1), 0] = True
    return obs, avail


def test_float64_pass_is_within_1e6_of_the_module(router):
    obs, avail = _inputs(router, 4096, 0)
    exact, _ = router._run(obs, avail)
    p = router.probs64(obs, avail)
    gap = np.abs(p - exact).max()
    assert gap <= 1e-5, gap  # measured: 6e-8 (soft) / 6.9e-7 (sharp); SCREEN_MARGIN is 1e-4
    assert np.array_equal(p > 0, avail)  # unavailable actions have probability 0


def test_screened_sets_equal_the_module_also_at_the_threshold(router, monkeypatch):
    obs, avail = _inputs(router, 4096, 1)
    exact, _ = router._run(obs, avail)
    rng = np.random.default_rng(2)
    k = rng.uniform(0, 1, len(obs)).astype(np.float32)
    # adversarial rows: the threshold is exactly one of the module's probabilities, where the
    # float64 pass alone decides the other way about half the time
    adv = rng.random(len(obs)) < 0.5
    pick = np.argmax(avail * rng.random(avail.shape), axis=1)
    k[adv] = exact[adv, pick[adv]]
    want = (exact >= k[:, None]) & avail
    probs, in_set = router._run_screened(obs, avail, k)
    assert np.array_equal(in_set, want)
    assert np.array_equal(probs[adv], exact[adv])  # decided by the module, bit for bit
    assert np.abs(probs - exact).max() <= 1e-5
    # the test has teeth: without the margin the float64 pass flips sets on the adversarial rows
    monkeypatch.setattr(router_mod, "SCREEN_MARGIN", 0.0)
    _, unscreened = router._run_screened(obs, avail, k)
    assert not np.array_equal(unscreened, want)


def test_decide_many_screened_equals_unscreened_decisions(router):
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(300):
        t = int(rng.integers(1, router.T + 1))
        rounds = [{"base": {"answer": f"a{j}", "tokens_in": int(rng.integers(1, 400)), "tokens_out": int(rng.integers(1, 50)),
                            "confidence": float(rng.random())},
                   "guide": {"verdict": bool(rng.random() < 0.5), "answer": f"g{j}", "tokens_in": int(rng.integers(1, 400)),
                             "tokens_out": int(rng.integers(1, 5)), "uncertainty": float(rng.random())}} for j in range(t)]
        reqs.append({"rounds": rounds, "can_continue": t < router.T})
    for kappa in (None, 0.2, 0.45):
        a = router.decide_many(reqs, kappa=kappa)
        b = router.decide_many(reqs, screen=True, kappa=kappa)
        for x, y in zip(a, b):
            assert x["action_set"] == y["action_set"] and x["kappa"] == y["kappa"]
            assert x["probs"] == pytest.approx(y["probs"], abs=1e-5)


def test_other_networks_are_not_screened(router, monkeypatch):
    """A manifest whose network is not the mlp-tanh: no float64 pass, the module decides every row."""
    m = dict(router.manifest, policy=dict(router.manifest["policy"], network={"type": "other"}))
    assert router_mod.dense_layers(m, router._params) is None
    monkeypatch.setattr(router, "_dense", None)
    obs, avail = _inputs(router, 64, 4)
    exact, _ = router._run(obs, avail)
    k = np.full(64, 0.3, np.float32)
    probs, in_set = router._run_screened(obs, avail, k)
    assert np.array_equal(probs, exact) and np.array_equal(in_set, (exact >= k[:, None]) & avail)
