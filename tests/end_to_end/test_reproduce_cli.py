"""``ccpo-jax reproduce``: input errors through the CLI, the pipeline's trainer call site,
interrupted runs and --resume, and one small end-to-end run."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.ccpo.prepare import CKPT_DIR
from ccpo_jax.ccpo.reproduce import reproduce
from ccpo_jax.ccpo.rows import LearnedRows
from ccpo_jax.ccpo.settings import METRICS
from ccpo_jax.errors import UserError
from tests.helpers import FAST_COMPILE_XLA_FLAGS, run_cli

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    """A 100-question SYNTHETIC cache in the fast format."""
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    path = tmp_path_factory.mktemp("cache") / "syn100"
    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), path)
    return path


def _cli(args: list[str], cwd: Path, in_subprocess: bool = False, env: dict = ENV) -> subprocess.CompletedProcess:
    """``ccpo-jax reproduce ARGS`` (in-process unless ``in_subprocess``; tests.helpers.run_cli)."""
    return run_cli(["reproduce", *args], cwd=cwd, in_subprocess=in_subprocess, env=env)


def _assert_user_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert err, r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)


def test_cli_rejects_bad_input_without_output(tmp_path):
    """Through a real subprocess: exit 2, one 'error:' line, no traceback, nothing written
    (the other bad inputs below go through ``cli.main`` in-process)."""
    r = _cli(["--setting", "hotpotqa-gpt5", "--out", str(tmp_path / "out")], tmp_path, in_subprocess=True)
    _assert_user_error(r, "unknown setting", "hotpotqa-llama2-a0.1", "mmlu-llama3-a0.2")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no out dir, no runs/, no .partial


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--split-sizes", "60,20"], "--split-sizes"),
        (["--split-sizes", "60,x,20"], "--split-sizes"),
        (["--alpha", "1.5"], "--alpha"),
        (["--alpha", "0"], "--alpha"),
        (["--alpha", "-0.1"], "--alpha"),
        (["--splits", "0"], "--splits"),
        (["--iterations", "0"], "--iterations"),
        (["--seed", "-1"], "--seed"),
        (["--cache", "does/not/exist"], "does/not/exist"),
        (["--resume", "no/such/run"], "--resume"),
        (["--devices", "0"], "--devices"),
        (["--devices", "many"], "--devices"),
        (["--devices", "4"], "--devices 4: only 1 cpu device(s) available"),
        (["--member-block", "0"], "--member-block"),
    ],
)
def test_cli_main_rejects_bad_input_in_process(tmp_path, monkeypatch, capsys, args, fragment):
    """The same checks through ``cli.main`` (cheaper than a subprocess each)."""
    import jax

    from ccpo_jax.cli.main import main

    # JAX is started here with its one CPU device, so --devices 4 cannot force more
    # (and must not change XLA_FLAGS for the rest of the test session).
    assert len(jax.devices()) == 1
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.chdir(tmp_path)
    extra = [] if "--resume" in args else ["--out", str(tmp_path / "out")]
    assert main(["reproduce", *args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_protocol_is_an_argparse_error(tmp_path, monkeypatch, capsys):
    from ccpo_jax.cli.main import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["reproduce", "--protocol", "sometimes"])
    assert e.value.code == 2 and "--protocol" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_splits_larger_than_the_cache_and_unwritable_out(tmp_path, small_cache):
    out = tmp_path / "out"
    r = _cli(["--cache", str(small_cache), "--split-sizes", "60,30,20", "--splits", "2", "--out", str(out)], tmp_path)
    _assert_user_error(r, "--split-sizes 60,30,20 needs 110 questions", "has only 100")
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    r = _cli(["--cache", str(small_cache), "--split-sizes", "60,20,20", "--out", str(blocker / "run")], tmp_path)
    _assert_user_error(r, "--out", "not a directory")
    (tmp_path / "exists").mkdir()
    r = _cli(["--cache", str(small_cache), "--split-sizes", "60,20,20", "--out", str(tmp_path / "exists")], tmp_path)
    _assert_user_error(r, "--out", "already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "exists"]


def test_list_settings(tmp_path):
    r = _cli(["--list-settings"], tmp_path)
    assert r.returncode == 0
    assert len([ln for ln in r.stdout.splitlines() if "(synthetic)" in ln]) == 8


# -- the trainer call site, with a stand-in trainer -------------------------------------------

class FakeTrainer:
    """Stands in for ccpo_jax.ccpo.rows.learned_rows; records its arguments."""

    def __init__(self, interrupt: bool = False):
        self.calls: list[dict] = []
        self.interrupt = interrupt

    def __call__(self, run, data, execution):
        self.calls.append(dict(run=run, data=data, execution=execution))
        S = data.splits.test.shape[0]
        execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if self.interrupt:
            raise KeyboardInterrupt
        rng = np.random.default_rng(0)
        rows = {name: {m: rng.uniform(0.5, 1.0, S) for m in METRICS}
                for name in ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)")}
        return LearnedRows(rows=rows, timing={"compile_s": 1.0, "train_s": 2.0, "eval_s": 0.5})


def test_pipeline_calls_the_trainer_and_merges_its_rows(tmp_path, small_cache):
    fake = FakeTrainer()
    out = tmp_path / "run"
    res = reproduce(cache=str(small_cache), n_splits=3, split_sizes="60,20,20", out_dir=out,
                    iterations=7, trainer=fake, echo=None)
    (kw,) = fake.calls
    assert kw["run"].alpha == 0.1 and kw["run"].lambdas == (2e-4,) and kw["run"].protocol == "recalibrate"
    assert kw["run"].train_config().iterations == 7 and kw["execution"].member_block is None  # recalibrate: one plain vmap
    sp = kw["data"].splits
    assert sp.train.shape == (3, 60) and sp.cal.shape == (3, 20) and sp.test.shape == (3, 20)
    assert kw["data"].params.n_questions == 100 and kw["data"].cache.n_questions == 100
    assert kw["execution"].ckpt_dir.parent == tmp_path / ".run.partial" == kw["execution"].tb_dir.parent
    # outputs complete, the work dir renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    names = {p.name for p in out.iterdir()}
    assert {"results.json", "table.md", "boxplot_cost.png", "boxplot_coverage.png", "run.json"} <= names
    back = json.loads((out / "results.json").read_text())
    assert back == res.results
    for row in ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)", "Random", "UALA"):
        assert row in back["policies"], row
    assert back["timing"]["compile_s"] == 1.0 and back["timing"]["train_s"] == 2.0
    # The stand-in reports 0.5 s of evaluation it never spent, so only the sum is checkable:
    # eval_s = the baselines' measured time + the trainer's reported 0.5 s.
    assert back["timing"]["eval_s"] >= 0.5 and back["timing"]["total_s"] > 0
    assert back["cache"]["provenance"]["kind"] == "synthetic"
    assert "SYNTHETIC" in (out / "table.md").read_text()
    # issue 48 item 14: the per-split means over the 20 test questions are exact (k / 20 in float64, so
    # 18 of 20 reads 0.9, not 0.8999999761581421), the covered counts beside them
    for row in ("Random", "UALA", "Clairvoyant bound"):
        e = back["policies"][row]
        cov, cnt = e["per_split"]["coverage"], e["per_split_covered"]
        assert cnt["of"] == 20 and [k / 20 for k in cnt["covered"]] == cov, row
        for x in e["per_split"]["coverage"] + e["per_split"]["avg_len"] + e["per_split"]["set_size"]:
            assert x is None or x == round(x * 20) / 20, (row, x)


@pytest.mark.parametrize("given, block", [({}, 2 * 4), ({"member_block": 3}, 3), ({"seeds": 1}, 4)])
def test_retrain_trains_one_splits_rows_x_seeds_per_block(tmp_path, small_cache, given, block):
    """--protocol retrain without --member-block: blocks of the learned rows (CPO, CPO (calibrated),
    CCPO (lambda=0), CCPO (lambda=2e-4): 4) x seeds; an explicit --member-block wins. Said on screen."""
    fake, lines = FakeTrainer(), []
    reproduce(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", out_dir=tmp_path / "r", iterations=2,
              protocol="retrain", trainer=fake, echo=lines.append, **{"seeds": 2, **given})
    assert fake.calls[0]["execution"].member_block == block
    assert f"training sharded over 1 cpu device(s), {block} member(s) per block" in "\n".join(lines)


def test_interrupted_run_leaves_no_out_and_resumes(tmp_path, small_cache):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        reproduce(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", out_dir=out,
                  trainer=FakeTrainer(interrupt=True), echo=None)
    assert not out.exists()
    work = tmp_path / ".run.partial"
    assert (work / CKPT_DIR).is_dir() and (work / "run.json").is_file()
    # a new run into the same --out is refused while the interrupted one exists
    with pytest.raises(UserError, match=r"^out_dir: an interrupted run .* resume that run"):
        reproduce(cache=str(small_cache), n_splits=2, split_sizes="60,20,20", out_dir=out,
                  trainer=FakeTrainer(), echo=None)
    with pytest.raises(UserError, match="splits"):
        reproduce(resume=out, n_splits=5, trainer=FakeTrainer(), echo=None)
    fake = FakeTrainer()
    res = reproduce(resume=out, trainer=fake, echo=None)
    assert fake.calls[0]["execution"].ckpt_dir == work / CKPT_DIR and fake.calls[0]["data"].splits.test.shape == (2, 20)
    assert res.out_dir == out and (out / "results.json").is_file() and not work.exists()
    with pytest.raises(UserError, match="finished run"):
        reproduce(resume=out, trainer=FakeTrainer(), echo=None)


# -- end to end, real baselines and trainer ----------------------------------------------------

# The one-device end-to-end run, shared by the two tests below (it is also the one-device
# reference of the --devices run, so it uses --member-block 1). Both runs are fresh processes with
# the fast-compile XLA flags of the other multi-device subprocess tests (tests.helpers): their programs
# run for well under a second, compiling them is the cost, and the comparison needs the same flags
# on both sides. The default flags' pipeline runs end to end in test_coverage and test_settings_smoke.
E2E = ["--splits", "3", "--split-sizes", "60,20,20", "--iterations", "6", "--seeds", "2", "--member-block", "1",
       "--no-progress"]
FAST_ENV = dict(ENV, XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)


@pytest.fixture(scope="module")
def e2e(small_cache, tmp_path_factory):
    """``ccpo-jax reproduce`` in a fresh process on one device: (exit code, stdout, stderr, output
    dir, cwd listing)."""
    cwd = tmp_path_factory.mktemp("e2e_cwd")
    out = cwd / "e2e"
    r = _cli(["--cache", str(small_cache), *E2E, "--out", str(out)], cwd, in_subprocess=True, env=FAST_ENV)
    return r.returncode, r.stdout, r.stderr, out, sorted(p.name for p in cwd.iterdir())


@pytest.mark.slow
def test_end_to_end_small(e2e):
    """``ccpo-jax reproduce --splits 3 --split-sizes 60,20,20`` with the real baselines and trainer."""
    rc, stdout, stderr, out, listing = e2e
    assert rc == 0, stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["splits"] == 3 and res["setting"] == "hotpotqa-llama2-a0.1"
    rows = set(res["policies"])
    assert {"Random", "UALA", "CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)"} <= rows
    for entry in res["policies"].values():
        cov = [x for x in entry["per_split"]["coverage"] if x is not None]
        assert len(cov) == 3 and all(0.0 <= c <= 1.0 for c in cov)
    assert res["timing"]["compile_s"] > 0 and res["timing"]["total_s"] > res["timing"]["compile_s"]
    assert "SYNTHETIC" in stdout and "| Policy |" in stdout
    assert "training sharded over 1 cpu device(s), 1 member(s) per block" in stdout
    assert (out / "boxplot_coverage.png").is_file() and any((out / "tensorboard").iterdir())
    assert listing == ["e2e"]


@pytest.mark.slow
def test_devices_flag_with_member_block_equals_one_device(tmp_path, small_cache, e2e):
    """``--devices 2 --member-block 1`` (the CLI forces 2 CPU host devices) gives every row of
    results.json identical, split for split, to the one-device end-to-end run above."""
    r = _cli(["--cache", str(small_cache), *E2E, "--devices", "2", "--out", str(tmp_path / "d2")], tmp_path,
             in_subprocess=True, env=FAST_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training sharded over 2 cpu device(s), 1 member(s) per block" in r.stdout
    two = json.loads((tmp_path / "d2" / "results.json").read_text())
    assert len(two["environment"]["devices"]) == 2
    one = json.loads((e2e[3] / "results.json").read_text())
    assert {"CPO", "CCPO (lambda=0)"} <= set(one["policies"]) and sorted(one["policies"]) == sorted(two["policies"])
    for row in one["policies"]:
        assert one["policies"][row]["per_split"] == two["policies"][row]["per_split"], row


@pytest.mark.slow
def test_retrain_on_2_devices_equals_one_device_by_default(tmp_path, small_cache):
    """``--protocol retrain`` trains in blocks of one split's rows x seeds by default (here 4 x 2 = 8 of
    4 x 3 x 2 = 24 members), so ``--devices 2`` (each device runs the one-device block program,
    24 members padded to 32) gives results.json identical, split for split, to the one-device run."""
    args = ["--cache", str(small_cache), *E2E[:E2E.index("--member-block")], "--no-progress", "--protocol", "retrain"]
    runs = {}
    for name, extra in (("one", []), ("two", ["--devices", "2"])):
        r = _cli([*args, *extra, "--out", str(tmp_path / name)], tmp_path, in_subprocess=True, env=FAST_ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        n_dev = 2 if extra else 1
        assert f"training sharded over {n_dev} cpu device(s), 8 member(s) per block" in r.stdout
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    one, two = runs["one"], runs["two"]
    assert len(two["environment"]["devices"]) == 2 and one["protocol"] == "retrain"
    assert {"CPO", "CCPO (lambda=0)"} <= set(one["policies"]) and sorted(one["policies"]) == sorted(two["policies"])
    for row in one["policies"]:
        assert one["policies"][row]["per_split"] == two["policies"][row]["per_split"], row
