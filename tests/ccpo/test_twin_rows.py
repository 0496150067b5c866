"""A calibrated row's two seed twins.

``ROW [kept seed]`` (``ccpo_jax.ccpo.rows.kept_seeds``): of the row's training seeds, the one whose calibrated
sets cost least on its own training questions. Checked against a brute force (each seed evaluated alone,
in-sample on the training questions, the argmin taken here), under both protocols; in the rows, results.json
and table.md; and the policy ``export`` serves.

``ROW [ensemble]`` (``ccpo_jax.ccpo.rows.ensemble_rows``): the seeds as one policy, pi the mean of their
probabilities. Checked against a NumPy float64 forward pass of every seed and a threshold found by scanning
every candidate kappa on the calibration questions (neither the trainer's blocked forward pass nor
``largest_covering_kappa`` / ``calibrate_kappa``); and its exported router against the trainer's sets."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import serialization

from ccpo_jax.ccpo import rows as rows_mod
from ccpo_jax.ccpo.evaluation import calibrated_rows, evaluate_trained
from ccpo_jax.core.conformal import conformal_rank_f64, conformal_set
from ccpo_jax.ccpo.export import export_router
from ccpo_jax.ccpo.policy_store import POLICIES_DIR, POLICY_META, POLICY_PARAMS, policy_row, policy_slug
from ccpo_jax.ccpo.presets import DEFAULT
from ccpo_jax.ccpo.reproduce import reproduce
from ccpo_jax.ccpo.rows import RowsRun, RunData, learned_rows, train_seeds
from ccpo_jax.ccpo.rowid import RowId, Twin
from ccpo_jax.ccpo.splits import Splits
from ccpo_jax.runtime.execution import QUIET
from envs.generators.synthetic import generate
from envs.replay.env import evaluate_sets, make_env_params

SEEDS = 4
KEPT_SEED, ENSEMBLE = Twin.KEPT_SEED.value, Twin.ENSEMBLE.value  # the twins' name suffixes


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


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``learned_rows`` under recalibrate (3 splits, 4 seeds, lambdas 0 and 2e-4), its policies in RUN/policies:
    (run, data, what train_seeds returned inside it, what learned_rows returned, RUN)."""
    run = RowsRun(DEFAULT.replace(iterations=8, chunk=4), (2e-4,), seeds=SEEDS)
    data = _data(3, False)
    root = tmp_path_factory.mktemp("twins") / "run"
    seen, real = {}, rows_mod.train_seeds

    def spy(*a, **k):
        seen["tr"] = real(*a, **k)
        return seen["tr"]

    rows_mod.train_seeds = spy
    try:
        got = learned_rows(run, data, dataclasses.replace(QUIET, ckpt_dir=root / "checkpoints"))
    finally:
        rows_mod.train_seeds = real
    return run, data, seen["tr"], got, root


@pytest.fixture(scope="module")
def retrained():
    run = RowsRun(DEFAULT.replace(iterations=8, chunk=4), (2e-4,), seeds=SEEDS, protocol="retrain")
    data = _data(2, True)
    return run, data, train_seeds(run, data, QUIET)


@pytest.fixture(params=["recalibrate", "retrain"])
def trained(request):
    if request.param == "recalibrate":
        return request.getfixturevalue("saved")[:3]
    return request.getfixturevalue("retrained")


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
    assert not any(r.endswith(KEPT_SEED) for r in tr.rows if RowId.parse(r).base.name in ("CPO", "CPO online"))


def test_the_saved_policy_is_the_kept_seeds(saved, tmp_path):
    """learned_rows saves each row's kept seed (split 0): its parameters bit for bit, its kappa, the rule;
    the exported router names the seed; the twin's own figures feed export's choice of row."""
    _, _, tr, got, run_dir = saved
    pdir = run_dir / POLICIES_DIR
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
    art = export_router(run_dir, tmp_path / "router", row="CCPO (lambda=0)", force=True, echo=None)
    man = json.loads((art / "manifest.json").read_text())
    assert man["seed"] == int(tr.kept["CCPO (lambda=0)"]["seed"][0]) and man["seed_rule"].startswith("the kept seed")
    # the table's name of that policy finds it too; the live evaluation reads that row's prediction
    from ccpo_jax.gateway.liveeval import served_row

    twin = export_router(run_dir, tmp_path / "twin", row="CCPO (lambda=0) [kept seed]", force=True, echo=None)
    assert (twin / "params.npz").read_bytes() == (art / "params.npz").read_bytes()
    assert served_row(man) == "CCPO (lambda=0) [kept seed]"


def test_results_json_of_the_kept_seeds_is_plain_json():
    from ccpo_jax.ccpo.rows import kept_json

    cost = np.array([[3.0], [np.inf], [1.5]])  # [N seeds, S_train]; seed 1 infeasible under a cap
    got = kept_json({"CCPO (lambda=0)": {"seed": np.array([2]), "train_cost_cents": cost}})
    assert got == {"CCPO (lambda=0) [kept seed]": {"seed": [2], "train_cost_cents": [[3.0, None, 1.5]]}}
    json.dumps(got, allow_nan=False)


def test_one_seed_saves_seed_0_and_no_ensemble(tmp_path):
    run = RowsRun(DEFAULT.replace(iterations=2, chunk=2), (), seeds=1)
    learned_rows(run, _data(1, False), dataclasses.replace(QUIET, ckpt_dir=tmp_path / "run" / "checkpoints"))
    pdir = tmp_path / "run" / POLICIES_DIR
    assert sorted(p.name for p in pdir.iterdir()) == ["ccpo-lambda-0", "cpo-batch"]
    meta = json.loads((pdir / "ccpo-lambda-0" / POLICY_META).read_text())
    assert meta["seed"] == 0 and meta["seed_rule"] == "seed 0"


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
    assert "CCPO (lambda=0) [kept seed]" in res.table and "[kept seed]: one seed of ROW" in res.table
    assert "CCPO (lambda=0) [ensemble]" in res.table and "[ensemble]: ROW's seeds as one policy" in res.table
    assert names.index("CCPO (lambda=0)" + ENSEMBLE) == names.index("CCPO (lambda=0)") + 2
    assert pol["CCPO (lambda=0)" + ENSEMBLE]["ensemble"]["members"] == 3
    meta = json.loads((tmp_path / "out" / POLICIES_DIR / "ccpo-lambda-0" / POLICY_META).read_text())
    assert meta["seed"] == pol["CCPO (lambda=0) [kept seed]"]["kept_seed"]["seed"][0]


def _probs64(policy, obs: np.ndarray, avail: np.ndarray) -> np.ndarray:
    """One policy's pi(.|o) in float64 by NumPy: the mlp-tanh (flax Dense layers) and the softmax over the
    available actions."""
    layers = sorted(policy["params"], key=lambda k: int(k.split("_")[1]))
    h = obs.astype(np.float64)
    for i, name in enumerate(layers):
        h = h @ np.asarray(policy["params"][name]["kernel"], np.float64) + np.asarray(policy["params"][name]["bias"])
        if i < len(layers) - 1:
            h = np.tanh(h)
    z = np.where(avail, h, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _ensemble_by_hand(data, members, cal, test, alpha) -> float:
    """Test cost of the seeds' mean pi, its threshold the largest kappa among every calibration probability
    at which at least ceil((n+1)(1-alpha)) calibration questions are covered (a scan, no order statistic)."""
    p = data.params
    obs, avail = np.asarray(p.obs), np.asarray(p.available)
    probs = np.mean([_probs64(m, obs, avail) for m in members], axis=0).astype(np.float32)
    need = int(conformal_rank_f64(cal.size, alpha))
    cands = np.unique(probs[cal][avail[cal]])[::-1]
    def n_covered(k):
        return jax.numpy.sum(evaluate_sets(conformal_set(probs[cal], k, avail[cal]), p, cal).covered)

    covered = jax.vmap(n_covered)(cands)
    ok = np.nonzero(np.asarray(covered) >= need)[0]
    kappa = cands[ok[0]] if ok.size else 0.0
    return float(np.sum(evaluate_sets(conformal_set(probs[test], kappa, avail[test]), p, test).cost_cents))


def test_the_ensemble_is_the_seeds_mean_policy_calibrated(trained):
    run, data, tr = trained
    S = data.splits.test.shape[0]
    for v, var in enumerate(tr.variants):
        for row in calibrated_rows(var):
            got = tr.rows[row + ENSEMBLE]["cost_cents"]
            assert got.shape == (1, S)
            for split in range(S):
                t = split if run.protocol == "retrain" else 0
                members = [jax.tree.map(lambda x: np.asarray(x)[v, t, n], tr.state.policy) for n in range(SEEDS)]
                want = _ensemble_by_hand(data, members, np.asarray(data.splits.cal)[split],
                                         np.asarray(data.splits.test)[split], var.alpha)
                assert got[0, split] == pytest.approx(want, rel=1e-3), (row, split)  # float64 vs float32 pi
            # not one seed's figures: the ensemble is its own policy
            assert not any(np.array_equal(got[0], tr.rows[row]["cost_cents"][n]) for n in range(SEEDS)), row


def test_the_exported_ensemble_routes_as_the_trainer_evaluates(saved, tmp_path):
    """learned_rows saves ROW [ensemble] (all seeds of split 0); its exported router's sets on every question
    and round of the cache equal the trainer's at the saved kappa, screened or not."""
    from ccpo_jax.ccpo.evaluation import policy_tables
    from ccpo_jax.serving import Router

    _, data, tr, _, run_dir = saved
    pdir = run_dir / POLICIES_DIR / policy_slug("CCPO (lambda=0)" + ENSEMBLE)
    meta = json.loads((pdir / POLICY_META).read_text())
    assert meta["ensemble"] == SEEDS and meta["seed"] is None and meta["calibration"]["n"] == 50
    assert meta["kappa"] == float(tr.kappas["CCPO (lambda=0)" + ENSEMBLE][0, 0])
    art = export_router(run_dir, tmp_path / "router", row="CCPO (lambda=0) [ensemble]", force=True, echo=None)
    router = Router.load(art)
    assert router.manifest["policy"]["network"]["ensemble"] == SEEDS
    from ccpo_jax.ccpo.policy_store import load_policy

    members, _ = load_policy(pdir)
    probs, _ = policy_tables(members, data.params, DEFAULT.hidden, ensemble=True)
    obs = np.asarray(data.params.obs).reshape(-1, router.F)
    avail = np.asarray(data.params.available).reshape(-1, 3)
    want = np.asarray(conformal_set(probs.reshape(-1, 3), np.float32(meta["kappa"]), avail))
    assert np.array_equal(router.action_set(obs, avail), want)
    np.testing.assert_allclose(router.probs64(obs, avail), np.asarray(probs).reshape(-1, 3), atol=1e-5)
