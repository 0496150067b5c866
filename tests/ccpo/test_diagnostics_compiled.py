"""``calibration_diagnostics`` (the saved policies' diagnostics, read by ``export``) as one compiled
program: equal to the same function run op by op (``jax.disable_jit``, the oracle: what it computed
before), thresholds at the policy's own probabilities included, and no tracing or compiling again for
another policy of the same network."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from ccpo_jax.ccpo.evaluation import calibration_diagnostics, policy_tables
from ccpo_jax.core.networks import policy_net
from envs.generators.synthetic import generate
from envs.replay.env import make_env_params
from envs.replay.features import n_features


@pytest.fixture(scope="module")
def env():
    cache = generate("hotpotqa-llama2", 120, 0)
    return cache, make_env_params(cache)


def _policy(seed, F, scale=30.0):
    p = policy_net().init(jax.random.PRNGKey(seed), np.zeros((1, F), np.float32))
    return jax.tree.map(lambda x: x * scale, p)  # sharp enough that the sets vary with kappa


@pytest.mark.parametrize("ensemble", [False, True])
def test_compiled_diagnostics_equal_the_op_by_op_run(env, ensemble):
    cache, params = env
    F = n_features(cache.T)
    pols = [_policy(s, F) for s in range(3)]
    pol = jax.tree.map(lambda *x: np.stack(x), *pols) if ensemble else pols[0]
    cal = np.arange(10, 90)
    probs, _ = policy_tables(pol, params, None, ensemble)
    own = float(np.sort(np.asarray(probs)[cal].reshape(-1))[150])  # a threshold equal to one of its probabilities
    for kappa in (0.0, 0.05, own, 0.4, 0.9):
        got = calibration_diagnostics(pol, params, kappa, cal, 0.1, ensemble=ensemble)
        with jax.disable_jit():
            want = calibration_diagnostics(pol, params, kappa, cal, 0.1, ensemble=ensemble)
        assert got == want, kappa
    assert len({str(calibration_diagnostics(pol, params, k, cal, 0.1, ensemble=ensemble)["set_size_counts"])
                for k in (0.0, own, 0.9)}) > 1  # the kappas above reach different sets


def test_another_policy_traces_and_compiles_nothing(env):
    cache, params = env
    F = n_features(cache.T)
    cal = np.arange(50)
    pols = [_policy(seed, F) for seed in range(3)]
    calibration_diagnostics(pols[0], params, 0.2, cal, 0.1)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if name.startswith("/jax/core/compile/") else None)
    try:
        for seed in (1, 2):
            calibration_diagnostics(pols[seed], params, 0.2 + 0.1 * seed, cal, 0.1)
    finally:
        jax.monitoring.clear_event_listeners()
    assert events == []  # op by op, each policy traced (and compiled) its forward pass again
