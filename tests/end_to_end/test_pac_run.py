"""``reproduce --guarantee pac --delta D`` end to end (real trainer, tiny): the PAC order statistic of
each calibrated row's own calibration scores, per group too; results.json, table.md, the exported
manifest and the served decision state the guarantee."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from ccpo_jax.errors import UserError
from tests.end_to_end.test_mondrian_run import _grouped_cache
from tests.helpers import run_cli

SIZES = "100,60,40"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ccpo_jax.ccpo.reproduce import reproduce

    tmp = tmp_path_factory.mktemp("pac")
    path, groups = _grouped_cache(tmp)
    kw = dict(cache=str(path), n_splits=3, split_sizes=SIZES, seeds=2, iterations=4, calibration="mondrian",
              group_min=20, echo=None, progress=False)
    pac = reproduce(out_dir=tmp / "pac", guarantee="pac", delta=0.1, **kw)
    marg = reproduce(out_dir=tmp / "marg", **kw)
    return pac, marg, path, groups


def _cal_scores(res, path, row_slug):
    """The saved policy's calibration scores on split 0 (its saved seed), computed from the policy alone."""
    from ccpo_jax.ccpo.evaluation import policy_tables
    from ccpo_jax.ccpo.policy_store import load_policy
    from ccpo_jax.ccpo.splits import splits_for_protocol
    from envs.cache.formats import load_cache
    from envs.replay.env import make_env_params

    cache = load_cache(path)
    params_env = make_env_params(cache)
    k_split = jax.random.split(jax.random.PRNGKey(0), 3)[0]  # reproduce's split key (seed 0)
    splits = splits_for_protocol("recalibrate", k_split, cache.n_questions, 100, 60, 40, 3)
    pol, meta = load_policy(res.out_dir / "policies" / row_slug)
    _, kappa_i = policy_tables(pol, params_env, tuple(meta["hidden"]))
    cal = np.asarray(splits.cal)[0]
    return np.asarray(kappa_i)[cal], cal, meta


def test_pac_threshold_is_the_pac_order_statistic_of_the_calibration_scores(runs):
    from ccpo_jax.core.guarantee import pac_rank

    pac, marg, path, groups = runs
    scores, cal, meta = _cal_scores(pac, path, "ccpo-lambda-0")
    k = pac_rank(60, 0.1, 0.1)
    assert k == 58  # P(Binomial(60, 0.9) <= 57) >= 0.9 first at k = 58 (test_guarantee checks pac_rank)
    want = float(np.clip(np.sort(scores)[::-1][k - 1], 0.0, 1.0))
    assert meta["kappa"] == pytest.approx(want, abs=0)
    assert meta["guarantee"] == {"kind": "pac", "alpha": 0.1, "delta": 0.1, "statement": meta["guarantee"]["statement"]}
    # on the same policy the marginal threshold (rank ceil(61 * 0.9) = 55) is the larger: PAC is the more conservative
    marginal = float(np.clip(np.sort(scores)[::-1][55 - 1], 0.0, 1.0))
    assert marginal > meta["kappa"]
    marg_meta = json.loads((marg.out_dir / "policies" / "ccpo-lambda-0" / "policy.json").read_text())
    if marg_meta["seed"] == meta["seed"]:  # each run saves its own kept seed (chosen under its own guarantee)
        assert marg_meta["kappa"] == pytest.approx(marginal, abs=0)
    # per group: groups a and b have about 30 / 24 calibration questions; PAC needs 22 at (0.1, 0.1)
    m = meta["mondrian"]
    assert m["group_min"] == 22 and pac.results["calibration"]["group_min_asked"] == 20
    for g, kap in m["kappas"].items():
        s = np.sort(scores[groups[cal] == g])[::-1]
        assert kap == pytest.approx(float(np.clip(s[pac_rank(len(s), 0.1, 0.1) - 1], 0, 1)), abs=0)


def test_results_and_table_state_the_guarantee_and_the_splits_below_target(runs):
    pac, marg, _, _ = runs
    for res, kind in ((pac, "pac"), (marg, "marginal")):
        assert res.results["guarantee"]["kind"] == kind
        pol = res.results["policies"]
        for row in ("CPO batch", "CCPO (lambda=0)", "CCPO (lambda=0) [Mondrian]"):
            bt = pol[row]["below_target"]
            assert bt["n"] == 6 and 0 <= bt["count"] <= 6 and bt["ci"][0] <= bt["fraction"] <= bt["ci"][1]
            assert pol[row]["guarantee"]["delta"] == (0.1 if kind == "pac" else None)
            assert ("within_delta" in bt) == (kind == "pac")
        assert "guarantee" not in pol["CPO online"] and "below_target" not in pol["CPO online"]
    # per group: the splits whose group coverage fell below target (below_target itself: test_guarantee.py)
    g = pac.results["policies"]["CCPO (lambda=0) [Mondrian]"]
    for name, e in g["groups"].items():
        bt = e["below_target"]
        assert bt["n"] <= 6 and 0 <= bt["count"] <= bt["n"]
    assert g["group_below_target"]["n_groups"] == 3 and 0 <= g["group_below_target"]["within_delta"] <= 3
    assert "within_delta" not in marg.results["policies"]["CCPO (lambda=0) [Mondrian]"]["group_below_target"]
    assert "## Guarantee: pac (delta 0.1)" in pac.table and "## Guarantee: marginal" in marg.table
    assert "## Guarantee: pac" in (pac.out_dir / "table.md").read_text()


def test_exported_manifest_and_decisions_state_the_guarantee(runs, tmp_path):
    from ccpo_jax.serving import Router

    pac, marg, path, _ = runs
    r = run_cli(["export", str(pac.out_dir), "--row", "CCPO (lambda=0)", "--guarantee", "pac", "--out",
                 str(tmp_path / "art")])
    assert r.returncode == 0, r.stderr
    assert "guarantee pac (delta 0.1)" in r.stdout
    router = Router.load(tmp_path / "art")
    assert router.manifest["guarantee"]["kind"] == "pac" and router.manifest["guarantee"]["delta"] == 0.1
    rounds = json.loads(path.read_text().splitlines()[1])["rounds"][:1]
    d = router.decide(rounds)
    assert d["guarantee"] == {"kind": "pac", "alpha": 0.1, "delta": 0.1}
    assert router.describe()["guarantee"]["kind"] == "pac"
    # a marginal run exported as pac: refused naming the flag, nothing written
    bad = run_cli(["export", str(marg.out_dir), "--row", "CCPO (lambda=0)", "--guarantee", "pac", "--out",
                   str(tmp_path / "no")])
    assert bad.returncode == 2 and bad.stderr.startswith("error: --guarantee:") and not (tmp_path / "no").exists()
    assert Router.load(tmp_path / "art").decide(rounds)["guarantee"]["kind"] == "pac"


def test_bad_guarantee_options_are_refused(tmp_path):
    from ccpo_jax.ccpo.run_config import ReproduceConfig

    with pytest.raises(UserError, match="delta: only with --guarantee pac") as e:
        ReproduceConfig(delta=0.1)
    assert e.value.field == "delta"
    with pytest.raises(UserError, match=r"delta: must be in \(0, 1\)"):
        ReproduceConfig(guarantee="pac", delta=1.5)
    # 21 calibration questions: 0.9^21 = 0.109 > 0.1, no PAC threshold; the message names 22
    with pytest.raises(UserError, match="21 calibration questions are too few .* n >= 22"):
        ReproduceConfig(guarantee="pac", delta=0.1, alpha=0.1, split_sizes="60,21,20")
    assert ReproduceConfig(guarantee="pac", alpha=0.1, split_sizes="60,22,20").delta == 0.1  # the default delta
    r = run_cli(["reproduce", "--guarantee", "pac", "--delta", "0.1", "--split-sizes", "60,21,20", "--out",
                 str(tmp_path / "x")])
    assert r.returncode == 2 and r.stderr.startswith("error: --delta: 21 calibration questions are too few")
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_two_risks_choose_the_learn_then_test_threshold_and_refuse_an_infeasible_request(runs, tmp_path):
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.core import conformal as C
    from ccpo_jax.core.guarantee import LTT_GRID, PAC

    _, _, path, _ = runs
    kw = dict(cache=str(path), n_splits=3, split_sizes=SIZES, seeds=2, iterations=4, echo=None, progress=False,
              guarantee="pac", delta=0.1)
    # alpha 0.5: the coverage threshold is high enough for sets that leave the guide out on some questions
    res = reproduce(out_dir=tmp_path / "ltt", guide_cap=0.9, alpha=0.5, **kw)
    pol = res.results["policies"]
    assert res.results["guarantee"]["guide_cap"] == 0.9
    e = pol["CCPO (lambda=0)"]["ltt"]
    assert e["splits"] == 6 and e["binding"]["coverage"] + e["binding"]["guide_cap (infeasible)"] == 6
    assert e["violations"]["n"] == 6 and e["violations"]["count"] <= e["feasible"]
    # the two-risk threshold is at most the PAC one (delta/2 <= delta, nested sets): it costs no less
    feasible_rows = [pol[r]["ltt"] for r in pol if "ltt" in pol[r] and pol[r]["ltt"]["feasible"]]
    assert feasible_rows and all(x["cap_cost_cents"] >= -1e-4 for x in feasible_rows)
    assert "Learn then Test, guide-call rate <= 0.9" in res.table
    assert sum(pol[r]["ltt"]["feasible"] for r in ("CPO batch", "CCPO (lambda=0)", "CCPO (lambda=2e-4)")) > 0
    # the saved threshold (seed 0, split 0) is the largest grid point passing both tests on the policy's scores
    scores, cal, meta = _cal_scores(res, path, "ccpo-lambda-0")
    from ccpo_jax.ccpo.policy_store import load_policy
    from envs.cache.formats import load_cache
    from envs.replay.env import make_env_params

    p = make_env_params(load_cache(path))
    polp, _ = load_policy(res.out_dir / "policies" / "ccpo-lambda-0")
    from ccpo_jax.ccpo.evaluation import policy_tables

    probs, _ = policy_tables(polp, p, tuple(meta["hidden"]))
    g = np.asarray(jax.vmap(C.largest_guide_kappa)(probs, p.available, p.round_mask))[cal]
    c_cov, c_guide = PAC(0.1, 0.9).ltt_counts(60, 0.5)
    ok = [j for j, lam in enumerate(LTT_GRID) if np.sum(scores < lam) <= c_cov and np.sum(g >= lam) <= c_guide]
    assert meta["calibration"]["ltt_feasible"] == bool(ok)
    if ok:  # a threshold passed both tests: the largest
        assert meta["kappa"] == pytest.approx(float(LTT_GRID[max(ok)]), abs=0)
    # export refuses a row whose saved threshold passed only the coverage test, naming the caps
    import shutil

    run_dir = tmp_path / "infeasible"
    shutil.copytree(res.out_dir / "policies", run_dir / "policies")
    mp = run_dir / "policies" / "ccpo-lambda-0" / "policy.json"
    m = json.loads(mp.read_text())
    m["calibration"]["ltt_feasible"] = False
    mp.write_text(json.dumps(m))
    bad = run_cli(["export", str(run_dir), "--row", "CCPO (lambda=0)", "--out", str(tmp_path / "art")])
    assert bad.returncode == 2 and bad.stderr.startswith("error: --row: 'CCPO (lambda=0)' has no threshold that meets")
    assert "guide-call rate <= 0.9" in bad.stderr and not (tmp_path / "art").exists()
    # a cap no policy of this run meets: an error naming the caps, nothing written but the checkpoints
    with pytest.raises(UserError, match=r"guide_cap: infeasible request \(coverage >= 0.9, guide-call rate <= 0.95"):
        reproduce(out_dir=tmp_path / "no", guide_cap=0.95, discard_failed=True, **kw)
    assert not (tmp_path / "no").exists()
    with pytest.raises(UserError, match="guide_cap: a cap on a second risk needs --guarantee pac"):
        reproduce(out_dir=tmp_path / "no2", guide_cap=0.5, cache=str(path), split_sizes=SIZES, echo=None)


def test_sweep_takes_the_guarantee_and_its_point_equals_reproduce(tmp_path):
    """sweep --guarantee pac --delta D: the point at alpha a is reproduce --alpha a with the same guarantee,
    and frontier.json states the guarantee and each calibrated point's splits below target."""
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.ccpo.sweep import sweep
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    path = tmp_path / "syn100"
    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), path)
    kw = dict(cache=str(path), n_splits=3, split_sizes="60,20,20", seeds=2, iterations=4, progress=False, echo=None,
              guarantee="pac", delta=0.2)
    sw = sweep(alphas=(0.1, 0.2), lambdas=(0.0,), out_dir=tmp_path / "sweep", **kw)
    rp = reproduce(alpha=0.2, out_dir=tmp_path / "rep", **kw)
    assert sw.frontier["guarantee"] == {"kind": "pac", "delta": 0.2}
    pol = rp.results["policies"]
    for row in ("CPO batch", "CCPO (lambda=0)"):
        (pt,) = [p for p in sw.frontier["rows"][row]["points"] if p["alpha"] == 0.2]
        assert pt["cost_cents"]["mean"] == pol[row]["cost_cents"]["mean"]
        assert pt["below_target"]["count"] == pol[row]["below_target"]["count"]
    # alpha 0.05 at delta 0.2 needs 32 calibration questions: refused naming --delta and the size
    r = run_cli(["sweep", "--cache", str(path), "--split-sizes", "60,20,20", "--alphas", "0.05,0.1", "--guarantee",
                 "pac", "--delta", "0.2", "--out", str(tmp_path / "no")])
    assert r.returncode == 2 and r.stderr.startswith("error: --delta: 20 calibration questions are too few for a PAC "
                                                     "threshold at alpha 0.05") and not (tmp_path / "no").exists()


def test_cost_cap_chooses_the_learn_then_test_threshold_and_refuses_bad_budgets(runs, tmp_path):
    """--cost-cap: the saved threshold is the largest grid point passing the coverage test and the mean
    cost's Hoeffding-Bentkus test (both written out here) on the policy's own calibration questions."""
    from ccpo_jax.ccpo.evaluation import policy_tables
    from ccpo_jax.ccpo.policy_store import load_policy
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.core.guarantee import LTT_GRID, PAC
    from envs.cache.formats import load_cache
    from envs.replay.env import evaluate_sets, make_env_params
    from ccpo_jax.core import conformal as C
    import jax.numpy as jnp
    from tests.core.test_cost_cap import _hb

    _, _, path, _ = runs
    p = make_env_params(load_cache(path))
    B = float(np.max(np.sum(np.asarray(p.cost, np.float64), -1)))
    budget = 0.97 * B
    kw = dict(cache=str(path), n_splits=3, split_sizes=SIZES, seeds=2, iterations=4, echo=None, progress=False,
              guarantee="pac", delta=0.1)
    res = reproduce(out_dir=tmp_path / "cc", cost_cap=budget, alpha=0.5, **kw)
    assert res.results["guarantee"]["cost_cap"] == budget
    e = res.results["policies"]["CCPO (lambda=0)"]["ltt"]
    assert e["binding"]["coverage"] + e["binding"].get("cost_cap (infeasible)", 0) \
        + e["binding"].get("no coverage threshold (infeasible)", 0) == 6
    assert "mean cost <= " in res.table
    scores, cal, meta = _cal_scores(res, path, "ccpo-lambda-0")
    polp, _ = load_policy(res.out_dir / "policies" / "ccpo-lambda-0")
    probs, _ = policy_tables(polp, p, tuple(meta["hidden"]))
    c_cov, _ = PAC(0.1, None, budget).ltt_counts(60, 0.5)
    cal_j = jnp.asarray(cal)
    ok_cov = [j for j, lam in enumerate(LTT_GRID) if np.sum(scores < lam) <= c_cov]
    ok = []
    for j in reversed(range(len(LTT_GRID))):  # the cost test in fixed sequence from the largest kappa down
        s = C.conformal_set(probs[cal_j], LTT_GRID[j], p.available[cal_j])
        mean = float(np.mean(np.asarray(evaluate_sets(s, p, cal_j).cost_cents, np.float64)))
        if _hb(mean / B, 60, budget / B) > 0.05:
            break
        ok.append(j)
    both = set(ok) & set(ok_cov)
    assert meta["calibration"]["ltt_feasible"] == bool(both)
    if both:
        assert meta["kappa"] == pytest.approx(float(LTT_GRID[max(both)]), abs=0)
    # exported and served: the manifest and every decision state the cost cap beside the guarantee;
    # a row whose saved threshold passed only the coverage test is refused naming the cap
    from ccpo_jax.serving import Router

    art = run_cli(["export", str(res.out_dir), "--row", "CCPO (lambda=0)", "--out", str(tmp_path / "cc-art")])
    if both:
        assert art.returncode == 0, art.stderr
        router = Router.load(tmp_path / "cc-art")
        assert router.manifest["guarantee"]["cost_cap"] == budget
        d = router.decide(json.loads(path.read_text().splitlines()[1])["rounds"][:1])
        assert d["guarantee"]["kind"] == "pac" and d["guarantee"]["cost_cap"] == budget
        assert d["kappa"] == pytest.approx(meta["kappa"], abs=1e-7)
    else:
        assert art.returncode == 2 and "mean cost <= " in art.stderr and not (tmp_path / "cc-art").exists()
    # a budget a question can never exceed caps nothing; a cap with Mondrian; both refused, nothing written
    for extra, msg in ((["--cost-cap", str(2 * B)], "error: --cost-cap: "),
                       (["--cost-cap", "0.001", "--calibration", "mondrian"], "error: --cost-cap: not with --calibration mondrian"),
                       (["--cost-cap", "-1"], "error: --cost-cap: must be a number of cents > 0")):
        r = run_cli(["reproduce", "--cache", str(path), "--split-sizes", SIZES, "--guarantee",
                     "pac", *extra, "--out", str(tmp_path / "x")])
        assert r.returncode == 2 and r.stderr.startswith(msg), r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
    assert "caps nothing" in run_cli(["reproduce", "--cache", str(path), "--split-sizes", SIZES,
                                      "--guarantee", "pac", "--cost-cap", str(2 * B), "--out",
                                      str(tmp_path / "x")]).stderr


def test_caps_are_refused_in_sweep_and_with_mondrian_saying_why(tmp_path):
    """sweep has no caps (a point would average a varying subset of splits) and Mondrian has none (one
    threshold per row): one error line each naming the flag, the reason and what to run instead."""
    for flag in ("--guide-cap", "--cost-cap"):
        r = run_cli(["sweep", "--guarantee", "pac", flag, "0.5", "--out", str(tmp_path / "s")])
        assert r.returncode == 2 and r.stderr.startswith(f"error: {flag}: not in sweep: with a cap a split can have "
                                                         "no threshold"), r.stderr
        assert f"reproduce --guarantee pac --alpha A {flag}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "s").exists()
    r = run_cli(["reproduce", "--guarantee", "pac", "--guide-cap", "0.5", "--calibration", "mondrian", "--out",
                 str(tmp_path / "m")])
    assert r.returncode == 2 and r.stderr.startswith("error: --guide-cap: not with --calibration mondrian: the caps")
    assert "use --calibration marginal with the cap" in r.stderr and not (tmp_path / "m").exists()
