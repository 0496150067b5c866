"""The kept seed (``ccpo_jax.ccpo.rows.kept_seeds``): of a calibrated row's training seeds, the one whose
calibrated sets cost least on its own training questions. Checked against a brute force (each seed
evaluated alone, in-sample on the training questions, the argmin taken here), under both protocols; its
twin row ``ROW [kept seed]`` in the rows, results.json and table.md; and the policy ``export`` serves."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import serialization

from ccpo_jax.ccpo import rows as rows_mod
from ccpo_jax.ccpo.evaluation import calibrated_rows, evaluate_trained
from ccpo_jax.ccpo.export import export_router
from ccpo_jax.ccpo.policy_store import POLICIES_DIR, POLICY_META, POLICY_PARAMS, policy_row, policy_slug
from ccpo_jax.ccpo.presets import DEFAULT
from ccpo_jax.ccpo.reproduce import reproduce
from ccpo_jax.ccpo.rows import RowsRun, RunData, learned_rows, train_seeds
from ccpo_jax.ccpo.settings import KEPT_SEED, twin_base
from ccpo_jax.ccpo.splits import Splits
from ccpo_jax.runtime.execution import Execution, QUIET
from envs.generators.synthetic import generate
from envs.replay.env import make_env_params

SEEDS = 4


def _data(n_splits: int, retrain: bool) -> RunData:
    """200 SYNTHETIC questions: 100 train (one draw, or one per split under retrain), 50 cal / 50 test."""
    cache = generate("hotpotqa-llama2", n_questions=200, seed=0)
    rng = np.random.default_rng(0)
    perm = rng.permutation(200)
    train = (np.stack([rng.permutation(200)[:100] for _ in range(n_splits)]) if retrain
             else np.tile(perm[:100], (n_splits, 1)))
    draws = np.stack([rng.permutation(np.setdiff1d(np.arange(200), t))[:100] for t in train])
    return RunData(cache, make_env_params(cache), Splits(train=train, cal=draws[:, :50], test=draws[:, 50:]),
                   jax.random.PRNGKey(0))


@pytest.fixture(scope="module", params=["recalibrate", "retrain"])
def trained(request):
    run = RowsRun(DEFAULT.replace(iterations=8, chunk=4), (2e-4,), seeds=SEEDS, protocol=request.param)
    data = _data(3 if request.param == "recalibrate" else 2, request.param == "retrain")
    return run, data, train_seeds(run, data, QUIET)


def _brute_force(run, data, tr) -> dict[str, np.ndarray]:
    """Per calibrated row and training split: every seed's in-sample cost, each seed evaluated alone
    (kappa fitted on the split's training questions, the sets applied to them); [N, S_train]."""
    train = np.asarray(data.splits.train)
    train = train if run.protocol == "retrain" else train[:1]
    out: dict[str, np.ndarray] = {}
    for n in range(SEEDS):
        one = jax.tree.map(lambda x: np.asarray(x)[:, :, n:n + 1], tr.state)
        rows, _ = evaluate_trained(run.train_config(), data.params, tr.variants, one, train, train,
                                   jax.random.PRNGKey(5), retrain=True)
        for var in tr.variants:
            for row in calibrated_rows(var):
                out.setdefault(row, np.zeros((SEEDS, train.shape[0])))[n] = rows[row]["cost_cents"][0]
    return out


def test_the_kept_seed_is_the_cheapest_on_its_training_questions(trained):
    run, data, tr = trained
    brute = _brute_force(run, data, tr)
    assert set(tr.kept) == set(brute) == {"CPO batch", "CCPO (lambda=0)", "CCPO (lambda=2e-4)"}
    for row, cost in brute.items():
        assert np.ptp(cost, axis=0).min() > 0.0, row  # the seeds differ: a wrong pick would show
        got = tr.kept[row]["seed"]
        np.testing.assert_allclose(tr.kept[row]["train_cost_cents"], cost, rtol=1e-5, err_msg=row)
        # the pick is the brute force's argmin (up to float ties between seeds' costs)
        best = cost.min(axis=0)
        np.testing.assert_allclose(cost[got, np.arange(cost.shape[1])], best, rtol=1e-5, err_msg=row)
    # not seed 0 by default: some row keeps another seed on this data
    assert any(np.any(k["seed"] != 0) for k in tr.kept.values())


def test_the_twin_row_is_the_kept_seeds_figures_on_every_split(trained):
    run, data, tr = trained
    S = data.splits.test.shape[0]
    for row, k in tr.kept.items():
        twin = tr.rows[row + KEPT_SEED]
        for split in range(S):
            seed = k["seed"][split] if run.protocol == "retrain" else k["seed"][0]
            for m, x in tr.rows[row].items():
                assert twin[m].shape == (1, S)
                assert twin[m][0, split] == x[seed, split], (row, m, split)
    assert not any(r.endswith(KEPT_SEED) for r in tr.rows if twin_base(r) in ("CPO", "CPO online"))


def test_the_saved_policy_is_the_kept_seeds(tmp_path, monkeypatch):
    """learned_rows saves each row's kept seed (split 0): its parameters bit for bit, its kappa, the rule;
    the exported router names the seed; the twin's own figures feed export's choice of row."""
    run = RowsRun(DEFAULT.replace(iterations=8, chunk=4), (2e-4,), seeds=SEEDS)
    data = _data(3, False)
    seen = {}
    real = rows_mod.train_seeds

    def spy(*a, **k):
        seen["tr"] = real(*a, **k)
        return seen["tr"]

    monkeypatch.setattr(rows_mod, "train_seeds", spy)
    got = learned_rows(run, data, dataclasses.replace(QUIET, ckpt_dir=tmp_path / "run" / "checkpoints"))
    tr = seen["tr"]
    pdir = tmp_path / "run" / POLICIES_DIR
    kept_somewhere_else = False
    for v, var in enumerate(tr.variants):
        row = policy_row(var)
        if row is None:
            continue
        seed = int(tr.kept[row]["seed"][0])
        kept_somewhere_else |= seed != 0
        meta = json.loads((pdir / policy_slug(row) / POLICY_META).read_text())
        assert meta["seed"] == seed and meta["seed_rule"].startswith("the kept seed")
        assert meta["kappa"] == float(np.asarray(tr.kappas[row])[seed, 0])
        want = serialization.to_bytes(jax.tree.map(lambda x: np.asarray(x[v, 0, seed]), tr.state.policy))
        assert (pdir / policy_slug(row) / POLICY_PARAMS).read_bytes() == want
        assert meta["calibration"]["test_cost_cents_mean"] == pytest.approx(
            float(np.mean(tr.rows[row + KEPT_SEED]["cost_cents"])))
        assert got.kept[row + KEPT_SEED]["seed"] == tr.kept[row]["seed"].tolist()
    assert kept_somewhere_else
    art = export_router(tmp_path / "run", tmp_path / "router", row="CCPO (lambda=0)", force=True, echo=None)
    man = json.loads((art / "manifest.json").read_text())
    assert man["seed"] == int(tr.kept["CCPO (lambda=0)"]["seed"][0]) and man["seed_rule"].startswith("the kept seed")


def test_reproduce_reports_the_twin_rows(tmp_path):
    cache = tmp_path / "syn"
    from envs.cache.fast import save_fast

    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), cache)
    res = reproduce(cache=str(cache), n_splits=2, split_sizes="60,20,20", seeds=3, iterations=4,
                    overrides=["chunk=2"], out_dir=tmp_path / "out", progress=False, echo=None)
    pol = json.loads((tmp_path / "out" / "results.json").read_text())["policies"]
    names = list(pol)
    for row in ("CPO batch", "CCPO (lambda=0)"):
        twin = pol[row + KEPT_SEED]
        assert names.index(row + KEPT_SEED) == names.index(row) + 1  # right after its row
        k = twin["kept_seed"]
        assert len(k["seed"]) == 1 and 0 <= k["seed"][0] < 3 and len(k["train_cost_cents"][0]) == 3
        assert k["train_cost_cents"][0][k["seed"][0]] == min(k["train_cost_cents"][0])
        # the twin is the kept seed's per-seed figures
        assert twin["cost_cents"]["mean"] == pytest.approx(pol[row]["per_seed"]["cost_cents"][k["seed"][0]])
        assert twin["seeds"] == 1 and "below_target" in twin and "cost_vs_bound" in twin
        assert "cost_over_best_observable" in twin
    assert "CCPO (lambda=0) [kept seed]" in res.table and "[kept seed]: the one seed" in res.table
    meta = json.loads((tmp_path / "out" / POLICIES_DIR / "ccpo-lambda-0" / POLICY_META).read_text())
    assert meta["seed"] == pol["CCPO (lambda=0) [kept seed]"]["kept_seed"]["seed"][0]
