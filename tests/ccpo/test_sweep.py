"""``ccpo-jax sweep`` (ccpo_jax.ccpo.sweep, ccpo_jax.ccpo.frontier): the grid's checks, the
frontier's statistics against hand computations, a point equal to the reproduce run at its
alpha, learners at every alpha against the brute-force optimum of an oracle cache, and resume."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from ccpo_jax.ccpo import frontier as fr
from ccpo_jax.ccpo import rows as rows_mod
from ccpo_jax.ccpo.presets import DEFAULT
from ccpo_jax.ccpo.reproduce import reproduce
from ccpo_jax.ccpo.rows import RowsRun, RunData, train_sweep
from ccpo_jax.ccpo.rowid import Twin
from ccpo_jax.ccpo.splits import Splits
from ccpo_jax.ccpo.sweep import sweep
from ccpo_jax.errors import UserError
from ccpo_jax.runtime.execution import QUIET
from envs.generators import oracle
from envs.replay.bound import BOUND_ROW
from envs.replay.env import make_env_params

KEPT_SEED = Twin.KEPT_SEED.value

from tests.helpers import run_cli


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    """A 100-question SYNTHETIC cache in the fast format."""
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    path = tmp_path_factory.mktemp("cache") / "syn100"
    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), path)
    return path


def _sweep_cli(args, cwd, in_subprocess=False):
    return run_cli(["sweep", *args], cwd=cwd, in_subprocess=in_subprocess)


@pytest.mark.parametrize("args, fragment", [
    (["--alphas", ""], "--alphas: the grid is empty"),
    (["--alphas", "0.2,0.1"], "--alphas: the values are not in increasing order; give them increasing, e.g. 0.1,0.2"),
    (["--alphas", "0.1,0.1"], "--alphas: 0.1 is given twice"),
    (["--alphas", "0.1,1.2"], "--alphas: 1.2 is not in (0, 1)"),
    (["--alphas", "0.1,x"], "--alphas: expected numbers separated by commas"),
    (["--lambdas", "1e-4,0"], "--lambdas: the values are not in increasing order"),
    (["--lambdas", "-1"], "--lambdas: -1 is not a finite lambda >= 0"),
    # the trainer computes in float32: 1e300 is inf there (it trained nothing, as a row named with 301
    # digits), 1e-50 is 0, two lambdas 1e-10 apart are one
    (["--lambdas", "0,1e300"], "--lambdas: 1e+300 is not finite in float32 (the largest float32 is 3.403e+38)"),
    (["--lambdas", "0,1e-50"], "--lambdas: 1e-50 is 0 to the trainer"),
    (["--lambdas", "1e-4,1.000000001e-4"], "--lambdas: 0.0001 and 0.0001000000001 are one value in float32"),
    (["--alphas", "0.1,0.9999999999"], "--alphas: 0.9999999999 is 1.0 in float32"),
    # 20 calibration questions: alpha 0.02 needs rank ceil(21 x 0.98) = 21 > 20
    (["--split-sizes", "60,20,20", "--alphas", "0.02,0.1"],
     "--alphas: alpha 0.02: 20 calibration questions are too few for alpha=0.02"),
])
def test_cli_refuses_a_bad_grid_without_output(tmp_path, small_cache, args, fragment):
    r = _sweep_cli(["--cache", str(small_cache), "--split-sizes", "60,20,20", *args, "--out", str(tmp_path / "o")],
                   tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and fragment in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_too_small_calibration_names_the_size_needed():
    from ccpo_jax.ccpo.run_config import SweepConfig

    # by hand: the rank ceil(0.98 (n + 1)) is below n (not the single lowest score) iff 1.98 <= 0.02 n, n >= 99
    with pytest.raises(UserError, match=r"use at least 99 ") as e:
        SweepConfig(split_sizes="60,20,20", alphas=(0.02,))
    assert e.value.field == "alphas"


def test_a_tiny_alpha_is_refused_at_once():
    """--alphas 1e-9 was refused after 140 s (the size needed, counted up one at a time, twice) with
    advice of 33554433, a float32 artefact; the size is 2 / alpha - 1 less the rank's 1e-4 slack."""
    import time

    from ccpo_jax.ccpo.run_config import SweepConfig

    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"alpha 1e-09: 20 calibration questions .* use at least 19998\d{5} ") as e:
        SweepConfig(split_sizes="60,20,20", alphas=(1e-9, 0.1))
    assert e.value.field == "alphas" and time.perf_counter() - t0 < 1.0


def test_point_stats_and_misses_by_hand():
    v = np.array([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])  # per-seed means 2, 4: sd sqrt(2)
    s = fr.point_stats(v)
    assert s["mean"] == 3.0 and s["seed_sd"] == pytest.approx(np.sqrt(2.0))
    assert s["q05"] == pytest.approx(np.quantile(v, 0.05)) and s["q95"] == pytest.approx(np.quantile(v, 0.95))
    assert fr.point_stats(v[:1])["seed_sd"] is None
    # coverage per split 0.85 +- 0.01 (se = 0.01 / sqrt(4) x sqrt(4/3)): meets 0.85, misses 0.9 at 0.1
    cov = np.array([[0.84, 0.86, 0.84, 0.86]])
    one = {"cost_cents": np.array([[2.0, 2.0, 2.0, 2.0]]), "coverage": cov, "avg_len": cov, "set_size": cov}
    bound = dict(one, cost_cents=np.ones((1, 4)))
    grid = {0.1: {"A": one, BOUND_ROW: bound}, 0.15: {"A": one, BOUND_ROW: bound}}
    out = fr.build_frontier(grid, setting="s", cache={"name": "c", "provenance": {"kind": "synthetic"}},
                            protocol="recalibrate", n_splits=4, seeds=1, lambdas=(0.0,), preset="default",
                            train_config=None, timing={}, learned=())
    a = out["rows"]["A"]
    assert [p["meets_target"] for p in a["points"]] == [False, True] and a["misses_target_at"] == [0.1]
    assert a["points"][0]["cost_vs_bound"]["mean"] == 2.0 and a["summary"]["mean_cost_vs_bound"] == 2.0
    assert out["synthetic"] and "SYNTHETIC" in fr.format_frontier(out)
    assert "A at alpha 0.1" in fr.format_frontier(out)
    assert fr.row_lambda("CCPO (lambda=2e-4)") == 2e-4 and fr.row_lambda("CPO batch") == 0.0


def _values(results_rows, row):
    return {m: results_rows[row][m]["mean"] for m in ("cost_cents", "coverage", "set_size")}


def test_the_point_at_an_alpha_equals_reproduce_at_it(tmp_path, small_cache):
    """Same seed, splits and member keys, and by default blocks of one reproduce run's members (so every
    member runs reproduce's compiled program; a plain vmap rounds by its batch size): the sweep's point
    at alpha 0.2 is reproduce --alpha 0.2 bit for bit, for every learned row and every baseline."""
    kw = dict(cache=str(small_cache), n_splits=3, split_sizes="60,20,20", seeds=2, iterations=4, progress=False,
              echo=None)
    sw = sweep(alphas=(0.1, 0.2), lambdas=(0.0, 2e-4), out_dir=tmp_path / "sweep", **kw)
    rp = reproduce(alpha=0.2, out_dir=tmp_path / "rep", **kw)
    pol = rp.results["policies"]
    assert set(sw.frontier["rows"]) == set(pol) and "CCPO (lambda=2e-4)" + KEPT_SEED in pol  # the kept seeds too
    for row, e in sw.frontier["rows"].items():
        (pt,) = [p for p in e["points"] if p["alpha"] == 0.2]
        for m in ("cost_cents", "coverage"):
            assert pt[m]["mean"] == pol[row][m]["mean"], (row, m)
    names = {p.name for p in (tmp_path / "sweep").iterdir()}
    assert {"frontier.json", "frontier.md", "frontier.png", "run.json"} <= names
    assert json.loads((tmp_path / "sweep" / "frontier.json").read_text())["alphas"] == [0.1, 0.2]


def test_the_point_equals_reproduce_under_retrain_with_blocks_across_rows(tmp_path, small_cache):
    """Under --protocol retrain both commands compute members in blocks of one split's rows x seeds
    (reproduce's 4 learned rows x 2 seeds = 8). The sweep here trains 3 rows (no lambda 2e-4) x 2
    alphas x 3 splits x 2 seeds = 36 members, padded to 40, so its blocks mix rows and alphas that
    reproduce's never do: a member's bits depend on the block's size, not on its neighbours."""
    kw = dict(cache=str(small_cache), n_splits=3, split_sizes="60,20,20", seeds=2, iterations=4, progress=False,
              echo=None, protocol="retrain")
    sw = sweep(alphas=(0.1, 0.2), lambdas=(0.0,), out_dir=tmp_path / "sweep", **kw)
    rp = reproduce(alpha=0.2, out_dir=tmp_path / "rep", **kw)
    pol = rp.results["policies"]
    learned = {"CPO", "CPO batch", "CPO online", "CCPO (lambda=0)",
               "CPO batch" + KEPT_SEED, "CCPO (lambda=0)" + KEPT_SEED}
    assert learned <= set(sw.frontier["rows"]) and "CCPO (lambda=2e-4)" not in sw.frontier["rows"]
    for row in learned:
        (pt,) = [p for p in sw.frontier["rows"][row]["points"] if p["alpha"] == 0.2]
        for m in ("cost_cents", "coverage", "set_size"):
            assert pt[m]["mean"] == pol[row][m]["mean"], (row, m)


def test_learners_follow_the_optimum_along_the_alpha_grid():
    """On an oracle cache whose optimum spends the alpha slack (envs.generators.oracle partial-uncertainty),
    the best observable cost falls as alpha grows; CCPO (lambda=0) and CPO batch trained in one
    sweep program stay within 10 % / 25 % of it at every alpha on at least 4 of 5 seeds, at the
    target coverage within 0.03 (cost and coverage: means over 5 calibration/test redraws)."""
    spec = oracle.partial()["partial-uncertainty"]
    n_train, n_cal, n_test, redraws, seeds = 300, 150, 150, 5, 5
    cache = oracle.build(spec, n_train + n_cal + n_test, seed=3)
    params = make_env_params(cache)
    rng = np.random.default_rng(0)
    perm = rng.permutation(cache.n_questions)
    held = perm[n_train:]
    draws = np.stack([rng.permutation(held) for _ in range(redraws)])
    splits = Splits(train=np.tile(perm[:n_train], (redraws, 1)), cal=draws[:, :n_cal], test=draws[:, n_cal:])
    alphas = (0.05, 0.1, 0.2)
    cfg = DEFAULT.replace(iterations=30)
    got, _ = train_sweep(RowsRun(cfg, (0.0,), seeds, alphas=alphas), RunData(cache, params, splits, jax.random.PRNGKey(0)),
                         QUIET)
    optima = [oracle.best_observable(spec, a).cost_of(n_test) for a in alphas]
    assert optima[0] > optima[1] > optima[2]  # the grid is a real trade-off on this cache
    for a, opt in zip(alphas, optima):
        for row, tol in (("CCPO (lambda=0)", 1.10), ("CPO batch", 1.25)):
            ratio = got[a][row]["cost_cents"].mean(axis=1) / opt
            cov = got[a][row]["coverage"].mean(axis=1)
            assert (ratio <= tol).sum() >= seeds - 1, (a, row, np.round(ratio, 3))
            assert np.all(cov >= 1 - a - 0.03), (a, row, np.round(cov, 3))


def test_a_killed_sweep_resumes_to_the_same_frontier(tmp_path, small_cache, monkeypatch):
    kw = dict(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", seeds=1, iterations=4,
              overrides=["chunk=2"], alphas=(0.1, 0.2), lambdas=(0.0,), progress=False, echo=None)
    whole = sweep(out_dir=tmp_path / "whole", **kw)
    assert not any(r.endswith(KEPT_SEED) for r in whole.frontier["rows"])  # one seed: nothing to choose from
    real = rows_mod.train_many

    def killed(*a):
        real(*a[:-1], dataclasses.replace(a[-1], stop_after_chunks=1))
        raise KeyboardInterrupt

    monkeypatch.setattr(rows_mod, "train_many", killed)
    with pytest.raises(KeyboardInterrupt):
        sweep(out_dir=tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists() and (tmp_path / ".run.partial" / "checkpoints").is_dir()
    monkeypatch.setattr(rows_mod, "train_many", real)
    with pytest.raises(UserError, match="alphas"):
        sweep(resume=tmp_path / "run", alphas=(0.1, 0.3), echo=None)
    done = sweep(resume=tmp_path / "run", echo=None)
    strip = lambda f: {k: v for k, v in f.items() if k not in ("timing", "environment")}  # noqa: E731
    assert strip(done.frontier) == strip(whole.frontier)


def test_the_member_block_default_is_decided_once():
    """ccpo.prepare.default_member_block: reproduce under recalibrate, one plain vmap (None); under
    retrain, and a sweep under either protocol, one reproduce run's learned rows x seeds; a given
    --member-block wins."""
    from ccpo_jax.ccpo.prepare import default_member_block
    from ccpo_jax.ccpo.rows import row_variants
    from ccpo_jax.ccpo.run_config import ReproduceConfig, SweepConfig

    r = ReproduceConfig(seeds=2)
    n_rows = len(row_variants(r.lambdas, r.train_config()))
    assert n_rows == 4  # CPO, CPO (calibrated), CCPO (lambda=0), CCPO (lambda=2e-4)
    assert default_member_block(r) is None
    assert default_member_block(ReproduceConfig(seeds=2, protocol="retrain")) == n_rows * 2
    for protocol in ("recalibrate", "retrain"):  # the sweep's own lambdas do not change its block
        assert default_member_block(SweepConfig(seeds=2, protocol=protocol, lambdas=(0.0,))) == n_rows * 2
    assert default_member_block(ReproduceConfig(seeds=2, member_block=3)) == 3
