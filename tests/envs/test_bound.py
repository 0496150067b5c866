"""The clairvoyant bound (envs.replay.bound) against a brute force over per-question plans."""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from envs.replay.bound import bound_of_cache, bound_of_params, clairvoyant, required_covered
from envs.replay.env import evaluate_sets, make_env_params
from envs.generators.synthetic import generate


def _random_cache(rng, n, T):
    mask = np.zeros((n, T), bool)
    rounds = rng.integers(1, T + 1, n)
    for i, r in enumerate(rounds):
        mask[i, :r] = True
    cost = np.where(mask, rng.uniform(0.1, 2.0, (n, T)) * np.arange(1, T + 1), 0.0)
    base = (rng.random((n, T)) < 0.3) & mask
    guide = (rng.random((n, T)) < 0.3) & mask
    return cost, base, guide, mask


def _brute(cost, base, guide, mask, alpha):
    """Every question picks the round it stops at (collecting every answer up to there): the
    cheapest choice whose coverage >= 1 - alpha (unsolvable questions count as covered)."""
    n = cost.shape[0]
    per_q = []
    for q in range(n):
        right = (base[q] | guide[q]) & mask[q]
        opts = []
        for d in range(1, int(mask[q].sum()) + 1):
            opts.append((cost[q, :d].sum(), bool(right[:d].any() or not right.any())))
        per_q.append(opts)
    best = np.inf
    for combo in itertools.product(*per_q):
        if sum(c for _, c in combo) >= (1 - alpha) * n - 1e-9:
            best = min(best, sum(x for x, _ in combo))
    return best


@pytest.mark.parametrize("case", range(12))
def test_bound_equals_brute_force(case):
    rng = np.random.default_rng(case)
    n, T = int(rng.integers(3, 7)), int(rng.integers(1, 4))
    cost, base, guide, mask = _random_cache(rng, n, T)
    alpha = float(rng.choice([0.05, 0.1, 0.2, 0.34, 0.5]))
    got = clairvoyant(cost, base, guide, mask, np.arange(n), alpha)
    assert got["cost_cents"] == pytest.approx(_brute(cost, base, guide, mask, alpha), rel=1e-12)
    assert got["coverage"] >= 1 - alpha - 1e-12


def test_required_count_is_the_ceiling():
    assert required_covered(150, 0.1) == 135
    assert required_covered(10, 0.1) == 9
    assert required_covered(11, 0.1) == 10  # 9.9 -> 10
    assert required_covered(7, 0.5) == 4


def test_bound_is_below_every_fixed_depth_policy_that_covers():
    """On the synthetic cache: the bound (per split) is at most the cost of 'collect both answers
    and go on to round d' for every d whose coverage meets the target, evaluated by the replay env."""
    cache = generate("hotpotqa-llama2", n_questions=400, seed=3)
    params = make_env_params(cache)
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(400)[:150] for _ in range(5)])
    b = bound_of_params(params, idx, 0.1)
    assert b["cost_cents"].shape == (5,)
    np.testing.assert_allclose(b["cost_cents"], bound_of_cache(cache, idx, 0.1)["cost_cents"], rtol=1e-6)
    T = params.T
    for d in range(1, T + 1):
        in_set = np.zeros((150, T, 3), bool)
        in_set[:, :, :2] = True
        in_set[:, : d - 1, 2] = True
        for s in range(5):
            m = evaluate_sets(jnp.asarray(in_set), params, jnp.asarray(idx[s]))
            cov = float(np.mean(m.covered))
            if cov >= 0.9:
                assert b["cost_cents"][s] <= float(np.sum(m.cost_cents)) + 1e-6
    # the bound is strictly cheaper than always going to the last round
    assert np.all(b["cost_cents"] < np.asarray(params.cost)[idx].sum((-1, -2)))


def test_data_check_prints_the_bound():
    from envs.replay.report import describe

    cache = generate("hotpotqa-llama2", n_questions=300, seed=1)
    b = bound_of_cache(cache, np.arange(300), 0.1)
    line = [x for x in describe(cache, "x").splitlines() if x.startswith("clairvoyant bound")]
    assert len(line) == 1 and f"{b['cost_cents']:.4g} cents" in line[0] and "coverage 0.900" in line[0]
