"""Trainer presets, --set FIELD=VALUE, --seeds, and seeds in results.json / table.md."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.ccpo.config import TrainConfig
from ccpo_jax.ccpo.presets import DEFAULT, PAPER, apply_overrides, deviations, get_preset, presets_table
from ccpo_jax.ccpo.report import policy_entry
from ccpo_jax.ccpo.reproduce import reproduce
from ccpo_jax.ccpo.rows import LearnedRows
from ccpo_jax.ccpo.settings import METRICS
from ccpo_jax.errors import UserError
from tests.helpers import run_cli


def test_paper_preset_is_the_published_setting():
    """arXiv 2511.11828 section 5.1: batch 10, 1,500 steps, learning rate 1e-3, delta 0.01,
    softmask eps 0.01, three layers of 64, xi 0.1; constraint by the J-bar of Eq. 8."""
    p = get_preset("paper")
    assert (p.batch_size, p.iterations, p.critic_lr, p.delta, p.softmask_eps, p.hidden, p.xi) == (
        10, 1500, 1e-3, 0.01, 0.01, (64, 64, 64), 0.1)
    assert p.estimator == "jbar" and p.constraint_z == 0.0
    assert TrainConfig() == DEFAULT
    assert set(deviations(DEFAULT)) == {"estimator", "iterations", "pointwise_z", "cg_iters", "backtrack_steps",
                                       "ccpo_target"}
    assert deviations(PAPER) == {}


def test_overrides_are_typed_and_validated():
    cfg = apply_overrides(DEFAULT, ["batch_size=100", "estimator=vtrace", "hidden=32,32", "delta=0.02",
                                    "exact-batch=0"])
    assert (cfg.batch_size, cfg.estimator, cfg.hidden, cfg.delta, cfg.exact_batch) == (100, "vtrace", (32, 32), 0.02, 0)
    for item, msg in [("batchsize=3", "unknown trainer field 'batchsize'"), ("batch_size=ten", "bad value for batch_size"),
                      ("estimator=magic", "estimator must be one of exact, jbar, vtrace"), ("delta=nan", "finite"),
                      ("iterations", "expected FIELD=VALUE"), ("batch_size=0", "batch_size must be >= 1")]:
        with pytest.raises(UserError, match=msg):
            apply_overrides(DEFAULT, [item])
    table = presets_table()
    assert "estimator" in table and "jbar" in table and "exact" in table


def test_policy_entry_reports_seeds_and_their_spread():
    v = np.array([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])  # 2 seeds x 3 splits
    e = policy_entry({m: v for m in METRICS}, 3, "row")
    c = e["cost_cents"]
    assert c["mean"] == pytest.approx(3.0) and c["median"] == pytest.approx(3.0)
    assert c["seed_sd"] == pytest.approx(np.std([2.0, 4.0], ddof=1)) and (c["seed_min"], c["seed_max"]) == (2.0, 4.0)
    assert e["per_split"]["cost_cents"] == [2.0, 3.0, 4.0] and e["per_seed"]["cost_cents"] == [2.0, 4.0]
    assert e["seeds"] == 2
    one = policy_entry({m: v[0] for m in METRICS}, 3, "row")
    assert one["cost_cents"]["seed_sd"] is None and one["seeds"] == 1


class SeedTrainer:
    """Stands in for ccpo_jax.ccpo.rows.learned_rows: rows of [seeds, splits], records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, run, data, execution):
        self.calls.append(dict(run=run, data=data, execution=execution))
        S, N = data.splits.test.shape[0], run.seeds
        execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
        base = np.arange(N, dtype=float)[:, None] + np.zeros((N, S))
        rows = {name: {m: base + 1.0 for m in METRICS} for name in ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)")}
        return LearnedRows(rows=rows)


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    path = tmp_path_factory.mktemp("cache") / "syn100"
    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), path)
    return path


def test_reproduce_passes_preset_overrides_and_seeds(tmp_path, small_cache):
    fake = SeedTrainer()
    out = tmp_path / "run"
    res = reproduce(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", out_dir=out, trainer=fake,
                    echo=None, seeds=3, preset="paper", overrides=["batch_size=20"], iterations=11)
    (kw,) = fake.calls
    cfg = kw["run"].train_config()
    assert kw["run"].seeds == 3 and cfg == dataclasses.replace(PAPER, batch_size=20, iterations=11)
    assert kw["run"].alpha == 0.1  # the run's alpha: the trainer configuration has none
    r = json.loads((out / "results.json").read_text())
    assert r["seeds"] == 3 and r["preset"] == "paper" and r["train_config"]["batch_size"] == 20
    ccpo = r["policies"]["CCPO (lambda=0)"]
    assert ccpo["per_seed"]["cost_cents"] == [1.0, 2.0, 3.0] and ccpo["cost_cents"]["seed_sd"] == pytest.approx(1.0)
    assert r["policies"]["Random"]["seeds"] == 1
    table = (out / "table.md").read_text()
    assert "3 training seeds" in table and "±1" in table
    assert ("trainer preset `paper`, 3 training seeds; it changes the paper's published setting: "
            "11 training iterations instead of 1500; batch_size 10 -> 20") in table
    saved = json.loads((out / "run.json").read_text())
    assert saved["seeds"] == 3 and saved["preset"] == "paper" and saved["overrides"] == ["batch_size=20"]
    assert saved["command"] == "reproduce"  # what `sweep --resume` names when given this run (test_options.py)
    assert res.results == r


def test_resume_keeps_the_trainer_configuration(tmp_path, small_cache):
    class Killed(SeedTrainer):
        def __call__(self, run, data, execution):
            execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        reproduce(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", out_dir=out, trainer=Killed(),
                  echo=None, seeds=2, overrides=["batch_size=20"])
    with pytest.raises(UserError, match="seeds=2"):
        reproduce(resume=out, trainer=SeedTrainer(), echo=None, seeds=4)
    with pytest.raises(UserError, match="preset='default'"):
        reproduce(resume=out, trainer=SeedTrainer(), echo=None, preset="paper")
    fake = SeedTrainer()
    reproduce(resume=out, trainer=fake, echo=None, seeds=2, preset="default", overrides=["batch_size=20"])
    assert fake.calls[0]["run"].seeds == 2 and fake.calls[0]["run"].train_config().batch_size == 20


@pytest.mark.parametrize("args, fragment", [
    (["--set", "nope=1"], "--set: 'nope=1': unknown trainer field 'nope'"),
    (["--set", "alpha=0.2"], "--set: alpha=0.2: alpha is set separately"),
    (["--preset", "fast"], "--preset: unknown preset 'fast'; valid: default, paper"),
    (["--seeds", "0"], "--seeds"),
])
def test_cli_rejects_bad_trainer_flags(tmp_path, args, fragment):
    r = run_cli(["reproduce", *args, "--out", str(tmp_path / "o")], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert fragment in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_lists_presets(tmp_path):
    r = run_cli(["reproduce", "--list-presets"], cwd=tmp_path)
    assert r.returncode == 0 and "constraint_z" in r.stdout and "paper" in r.stdout


def test_a_direct_train_config_is_validated():
    """TrainConfig.__post_init__ validates: a direct construction is checked, not only .replace()."""
    with pytest.raises(UserError, match="iterations must be >= 1"):
        TrainConfig(iterations=0)
    with pytest.raises(UserError, match="pointwise_z must be >= 0"):
        TrainConfig(pointwise_z=-1.0)
