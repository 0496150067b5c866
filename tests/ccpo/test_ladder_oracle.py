"""The ladder oracle cache (envs.generators.oracle.ladder) and the ladder baselines
(ccpo_jax.ccpo.ladder_rows): "Always rung k" and the threshold cascade (FrugalGPT's rule)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.ccpo import ladder_rows as lr
from ccpo_jax.ccpo.baselines import left_out_rows, non_learned_rows
from envs.generators import oracle
from envs.replay.env import evaluate_sets, make_env_params

ALPHA = 0.1
SPEC = oracle.ladder()["ladder"]
#: Round costs in cents: guide (80 t in x $2.5 + 4 out x $10) + rung t (200 in, 30 out) at its price.
J = [(80 * t * 2.5 + 40 + 200 * pi + 30 * po) / 1e4 for t, (pi, po) in zip((1, 2, 3), SPEC.base_prices)]
#: By hand (the spec's docstring): go on at rung 1 iff confidence <= 0.6 (every non-easy question
#: and a third of easy: 2/3 of all), at rung 2 iff confidence <= 0.7 / 3 (a third of hard +
#: unsolvable, 0.2 / 3).
HAND_COST = J[0] + 2 / 3 * J[1] + 0.2 / 3 * J[2]


def test_round_costs_are_the_ladder_prices():
    assert J == pytest.approx([0.0272, 0.076, 0.384])
    cache = oracle.build(SPEC, 50)
    assert [m.name for m in cache.manifest.base_ladder] == ["rung 1", "rung 2", "rung 3"]
    np.testing.assert_allclose(cache.round_cost_cents()[0], J, rtol=1e-6)
    assert [SPEC.round_cost_cents(t) for t in (1, 2, 3)] == pytest.approx(J)


def test_best_observable_equals_hand_derivation():
    best = oracle.best_observable(SPEC, ALPHA)
    assert best.thresholds[("q", 0)] == pytest.approx(0.6)
    # the brute force's grid (step 1/400) holds 0.235, the first point past 0.7 / 3
    assert best.thresholds[("q", 1)] == pytest.approx(0.235)
    assert best.cost_per_question == pytest.approx(HAND_COST + (0.235 - 0.7 / 3) / 0.7 * 0.2 * J[2], rel=1e-9)
    assert best.coverage == pytest.approx(0.9 + 0.15 * (0.235 - 0.7 / 3) / 0.7, abs=1e-9)
    cover_all = J[0] + 2 / 3 * J[1] + (0.2 + 0.3 * 0.4 + 0.5 / 3 * 0.4) * J[2]
    assert cover_all / HAND_COST > 2.0


def test_best_observable_through_the_replay_env_stops_at_different_rungs():
    best = oracle.best_observable(SPEC, ALPHA)
    n = 20_000
    cache = oracle.build(SPEC, n, seed=5)
    sets = oracle.threshold_sets(SPEC, cache, oracle.class_of(cache), best.thresholds)
    m = evaluate_sets(jnp.asarray(sets), make_env_params(cache), jnp.arange(n))
    assert abs(float(np.mean(m.covered)) - best.coverage) < 4 * np.sqrt(0.09 / n)
    assert float(np.mean(m.cost_cents)) == pytest.approx(best.cost_per_question, rel=0.02)
    length, kind = np.asarray(m.length), oracle.type_of(cache)
    # the most common stopping rung per type: easy 1 (2/3 of them), mid 2 (all), hard 2 (2/3) / 3
    assert np.mean(length[kind == "easy"] == 1) == pytest.approx(2 / 3, abs=0.02)
    assert np.all(length[kind == "mid"] == 2)
    assert np.mean(length[kind == "hard"] == 3) == pytest.approx(0.235 / 0.7, abs=0.03)


def test_always_rung_k_rows_closed_form():
    """Rung k's coverage: easy (+ mid from rung 2, + hard at rung 3) + unsolvable; cost J1 + ... + Jk."""
    n = 1000
    cache = oracle.build(SPEC, n, seed=2)
    params = make_env_params(cache)
    test = np.arange(n)[None]
    rows, _ = lr.ladder_rows(cache, params, None, test, ALPHA)
    assert list(rows) == ["Always rung 1 (rung 1)", "Always rung 2 (rung 2)", "Always rung 3 (rung 3)"]
    for k, cov in zip((1, 2, 3), (0.55, 0.85, 1.0)):
        r = rows[lr.rung_row_name(k, f"rung {k}")]
        assert r["coverage"][0] == pytest.approx(cov, abs=1e-6)
        assert r["cost_cents"][0] == pytest.approx(n * sum(J[:k]), rel=1e-5)
        assert r["avg_len"][0] == pytest.approx(k) and r["set_size"][0] == pytest.approx(1)


def _brute_force(conf, correct, cost, unsolvable, alpha):
    """Plain Python: every tau per non-last rung among the data's confidences and +inf; (cost, coverage)
    of the cheapest feasible one (ties: higher coverage), else of the highest coverage."""
    n, T = conf.shape
    grids = [sorted(set(conf[:, t].tolist())) + [float("inf")] for t in range(T - 1)]
    best = None
    for taus in itertools.product(*grids):
        tot, hit = 0.0, 0
        for i in range(n):
            s = next((t for t in range(T - 1) if conf[i, t] >= taus[t]), T - 1)
            tot += sum(cost[i, :s + 1])
            hit += bool(correct[i, s] or unsolvable[i])
        cov = hit / n
        key = (0, tot, -cov) if cov >= 1 - alpha - 1e-6 else (1, -cov, tot)
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(6))
def test_cascade_fit_equals_brute_force(seed):
    """11 questions: the 41 quantile levels hold every data point (n - 1 divides 40), so the grid is exact."""
    rng = np.random.default_rng(seed)
    n, T = 11, 3
    conf = rng.random((n, T)).round(2)
    correct = rng.random((n, T)) < np.array([0.4, 0.6, 0.8])
    cost = np.cumsum(rng.random((n, T)), axis=1)
    uns = rng.random(n) < 0.1
    nr = np.full(n, T)
    for alpha in (0.1, 0.3):
        taus = lr.fit_cascade(conf, correct, cost, nr, uns, alpha)
        tot, cov = lr.cascade_metrics(conf, correct, cost, nr, uns, taus[None])
        want = _brute_force(conf, correct, cost, uns, alpha)
        got = (0, tot[0], -cov[0]) if cov[0] >= 1 - alpha - 1e-6 else (1, -cov[0], tot[0])
        assert got[0] == want[0] and got[1:] == pytest.approx(want[1:], rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_cascade_pairwise_search_matches_exhaustive(monkeypatch, seed):
    """T = 4 (42^3 tau combinations > EXHAUSTIVE_MAX): the pairwise coordinate search reaches the
    exhaustive optimum (measured on these draws; it is a heuristic, not a guarantee)."""
    rng = np.random.default_rng(10 + seed)
    n, T = 200, 4
    kind = rng.integers(0, T + 1, n)  # first rung that is right (T = never)
    correct = np.arange(T)[None] >= kind[:, None]
    conf = np.clip(rng.normal(0.3 + 0.4 * correct, 0.2), 0, 1)
    cost = np.tile(np.array([0.02, 0.06, 0.2, 0.6]), (n, 1))
    args = (conf, correct, cost, np.full(n, T), kind == T)
    pair = lr.fit_cascade(*args, ALPHA)
    monkeypatch.setattr(lr, "EXHAUSTIVE_MAX", 10**6)
    full = lr.fit_cascade(*args, ALPHA)
    m_pair, m_full = lr.cascade_metrics(*args, pair[None]), lr.cascade_metrics(*args, full[None])
    assert m_full[1][0] >= 1 - ALPHA - 1e-6 and m_pair[1][0] >= 1 - ALPHA - 1e-6
    assert m_pair[0][0] == pytest.approx(m_full[0][0], rel=1e-9)


def test_cascade_rows_in_non_learned_rows_and_left_out():
    cache = oracle.build(SPEC, 600, seed=4)
    params = make_env_params(cache)
    idx = np.random.default_rng(0).permutation(600).reshape(3, 200)
    train, cal, test = np.stack([idx[0]] * 2), np.stack([idx[1]] * 2), np.stack([idx[2]] * 2)
    rows = non_learned_rows(cache, params, jax.random.PRNGKey(0), cal, test, ALPHA, train_idx=train)
    assert lr.CASCADE_ROW in rows and "Always rung 3 (rung 3)" in rows
    assert rows[lr.CASCADE_ROW]["coverage"].shape == (2,)
    assert rows[lr.CASCADE_ROW]["set_size"][0] == pytest.approx(1)
    without = non_learned_rows(cache, params, jax.random.PRNGKey(0), cal, test, ALPHA)
    assert lr.CASCADE_ROW not in without and lr.CASCADE_ROW not in left_out_rows(cache, test)
    # a one-model cache with a guide: no rung rows and no cascade (not a baseline there), with or
    # without base confidences; a guide-less cascade without confidences: left out with a note
    from envs.generators.cascade import as_cascade

    for name in ("uncertainty", "confidence"):
        plain = oracle.build(oracle.builtin()[name], 300)
        rows = non_learned_rows(plain, make_env_params(plain), jax.random.PRNGKey(0), cal[:, :50] % 300,
                                test[:, :50] % 300, ALPHA, train_idx=train[:, :50] % 300)
        assert not any(r.startswith("Always rung") or r == lr.CASCADE_ROW for r in rows), name
        assert lr.CASCADE_ROW not in left_out_rows(plain, test % 300)
    bare = as_cascade(oracle.build(oracle.builtin()["uncertainty"], 300))
    assert "base confidence" in left_out_rows(bare, test % 300)[lr.CASCADE_ROW]


def test_cascade_on_a_one_model_cache_is_a_confidence_stopping_rule():
    """partial-confidence: stopping at round 1 iff confidence > 0.4667 is the best observable rule there;
    on 20,000 questions the fitted cascade's training cost is within 3 % of it at the target."""
    spec = oracle.partial()["partial-confidence"]
    cache = oracle.build(spec, 20_000, seed=6)
    a, params = cache.arrays, make_env_params(cache)
    args = (a["base_confidence"].astype(float), a["base_correct"], np.asarray(params.cost, float),
            a["round_mask"].sum(-1), np.asarray(params.unsolvable))
    taus = lr.fit_cascade(*args, ALPHA)
    tot, cov = lr.cascade_metrics(*args, taus[None])
    assert cov[0] >= 1 - ALPHA - 1e-6
    assert tot[0] / 20_000 == pytest.approx(oracle.best_observable(spec, ALPHA).cost_per_question, rel=0.03)


def test_reproduce_and_sweep_write_the_ladder_rows(tmp_path):
    """reproduce's results.json / table.md and sweep's frontier carry the ladder rows like the
    other baselines (cost / bound, cost / best observable); the same rows as ladder_rows."""
    import json

    from ccpo_jax.ccpo import frontier as fr
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.ccpo.sweep import sweep

    cache = oracle.build(SPEC, 200, seed=7)
    reproduce(cache=cache, n_splits=2, split_sizes="100,50,50", out_dir=tmp_path / "run", train=False, echo=None)
    pol = json.loads((tmp_path / "run" / "results.json").read_text())["policies"]
    names = ["Always rung 1 (rung 1)", "Always rung 2 (rung 2)", "Always rung 3 (rung 3)", lr.CASCADE_ROW]
    table = (tmp_path / "run" / "table.md").read_text()
    for name in names:
        assert "cost_vs_bound" in pol[name] and "cost_over_best_observable" in pol[name], pol[name].keys()
        assert name in table
    assert pol["Always rung 1 (rung 1)"]["per_split"]["avg_len"] == pytest.approx([1, 1])
    sweep(cache=cache, n_splits=2, split_sizes="100,50,50", alphas=(0.1, 0.2), out_dir=tmp_path / "sw",
          train=False, echo=None)
    rows = json.loads((tmp_path / "sw" / fr.FRONTIER_JSON).read_text())["rows"]
    assert all(name in rows for name in names)
