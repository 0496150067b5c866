"""An ensemble router's float64 screening pass (``Router.probs64``, the gateway's decisions): all members
in one stacked matmul per layer, equal bit for bit to the members' forward passes one by one (the
oracle, written here) and averaged."""
from __future__ import annotations

import numpy as np
import pytest

from ccpo_jax.serving import Router
from ccpo_jax.testing.gateway_harness import build_artefact
from envs.cache.schema import N_ACTIONS

MEMBERS = 5


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """The test artefact's router with its dense layers replaced by MEMBERS random members ([M, ...] leaves,
    the layout an exported ensemble's ``dense_layers`` has)."""
    r = Router.load(build_artefact(tmp_path_factory.mktemp("ens64")))
    rng = np.random.default_rng(0)
    r._dense = [(rng.normal(0, 1 / np.sqrt(W.shape[0]), (MEMBERS,) + W.shape), rng.normal(0, 0.1, (MEMBERS,) + b.shape))
                for W, b in r._dense]
    return r


def _one_member(obs, avail, dense):
    h = obs.astype(np.float64)
    for W, b in dense[:-1]:
        h = np.tanh(h @ W + b)
    W, b = dense[-1]
    z = np.where(avail, h @ W + b, -np.inf)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _inputs(F, n, seed):
    rng = np.random.default_rng(seed)
    avail = rng.random((n, N_ACTIONS)) < 0.7
    avail[~avail.any(axis=1), 0] = True
    return (rng.normal(0, 3, (n, F))).astype(np.float32), avail


@pytest.mark.parametrize("n", [1, 3, 64, 2048])
def test_ensemble_probs64_equals_the_members_mean_bit_for_bit(ensemble, n):
    obs, avail = _inputs(ensemble.F, n, n)
    members = [_one_member(obs, avail, [(W[m], b[m]) for W, b in ensemble._dense]) for m in range(MEMBERS)]
    assert np.array_equal(ensemble.probs64(obs, avail), np.mean(members, axis=0))


class _CountingMatmul(np.ndarray):
    """An ndarray that counts the matmuls it takes part in."""

    calls = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            type(self).calls += 1
        args = [np.asarray(x) if isinstance(x, _CountingMatmul) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)


def test_ensemble_probs64_is_one_matmul_per_layer(ensemble, monkeypatch):
    """The members go through each layer together: as many matmuls as layers, not members x layers
    (a Python loop over members cost 89 us a decision against 25 us stacked, 5 members)."""
    dense = [(W.view(_CountingMatmul), b) for W, b in ensemble._dense]
    monkeypatch.setattr(ensemble, "_dense", dense)
    _CountingMatmul.calls = 0
    obs, avail = _inputs(ensemble.F, 1, 0)
    ensemble.probs64(obs, avail)
    assert _CountingMatmul.calls == len(dense)
