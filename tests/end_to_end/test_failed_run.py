"""A ``reproduce`` run that fails after training keeps its checkpoints and says how to resume
(issue 27 item 2): any exception, not only Ctrl-C; only a successful run or ``--discard-failed``
removes them. The slow test fills a real tmpfs after real training."""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.ccpo.prepare import CKPT_DIR
from ccpo_jax.ccpo.rows import LearnedRows
from ccpo_jax.ccpo.settings import METRICS
from tests.helpers import run_cli

ROWS = ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)")


@pytest.fixture(scope="module")
def cache100(tmp_path_factory) -> Path:
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    return save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path_factory.mktemp("c") / "c100")


class Trainer:
    """Stands in for learned_rows: writes one checkpoint file, returns fixed rows, counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, run, data, execution):
        self.calls += 1
        # a completed step: its folder and its digest (ccpo_jax.runtime.checkpoints)
        (execution.ckpt_dir / "orbax" / "1").mkdir(parents=True, exist_ok=True)
        (execution.ckpt_dir / "orbax" / "1" / "state").write_bytes(b"x")
        (execution.ckpt_dir / "orbax" / "1.digest.json").write_text("{}")
        S = data.splits.test.shape[0]
        return LearnedRows(rows={r: {m: np.full(S, 0.5) for m in METRICS} for r in ROWS}, timing={})


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr[-3000:])
    return lines[0]


ARGS = ["--splits", "2", "--split-sizes", "60,20,20", "--no-progress"]


@pytest.mark.parametrize("failure", ["full disk", "a bug in the report"])
def test_a_failure_after_training_keeps_the_checkpoints_and_prints_resume(tmp_path, cache100, monkeypatch, failure):
    import ccpo_jax.ccpo.rows as rows_module
    from ccpo_jax.ccpo import report

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.png"))

    def bug(*a, **k):
        raise RuntimeError("boom")

    fake = Trainer()
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    real_plots = report.write_boxplots
    monkeypatch.setattr(report, "write_boxplots", enospc if failure == "full disk" else bug)
    out = tmp_path / "run"
    work = tmp_path / ".run.partial"
    hint = f"the training checkpoints are kept in {work}; after fixing the cause, continue with " \
           f"`ccpo-jax reproduce --resume {out}` (or delete {work})"
    if failure == "full disk":
        line = _one_error_line(run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--out", str(out)]))
        assert line.startswith("error: no space left on device writing ") and line.endswith("; " + hint)
    else:  # not a user error: a traceback, with the hint as a note
        with pytest.raises(RuntimeError, match="boom") as e:
            run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--out", str(out)])
        assert e.value.__notes__ == [hint]
    assert not out.exists() and (work / CKPT_DIR / "orbax" / "1" / "state").is_file() and (work / "run.json").is_file()
    monkeypatch.setattr(report, "write_boxplots", real_plots)
    r = run_cli(["reproduce", "--resume", str(out), "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert (out / "results.json").is_file() and not work.exists() and fake.calls == 2


def test_discard_failed_removes_the_work_directory(tmp_path, cache100, monkeypatch):
    import ccpo_jax.ccpo.rows as rows_module
    from ccpo_jax.ccpo import report, results

    def table_full(path, *a, **k):  # the disk fills while table.md is written (results.write_outputs)
        if Path(path).name == report.TABLE_FILE:
            raise OSError(errno.ENOSPC, "full")
        return real_write(path, *a, **k)

    real_write = results.atomic_write_text
    monkeypatch.setattr(rows_module, "learned_rows", Trainer())
    monkeypatch.setattr(results, "atomic_write_text", table_full)
    out = tmp_path / "run"
    line = _one_error_line(run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--discard-failed", "--out", str(out)]))
    assert "no space left on device" in line and "--resume" not in line
    assert os.listdir(tmp_path) == []


class LoopTrainer:
    """Stands in for learned_rows with the real chunked loop and its verified orbax checkpoints, on a
    tiny host state (nothing to compile): 3 chunks of one iteration; ``starts`` records the state
    each call started its first chunk from (0: fresh, k: resumed after k chunks)."""

    def __init__(self):
        self.starts: list[float] = []

    def __call__(self, run, data, execution):
        from ccpo_jax.runtime.loop import run_chunks

        calls_before = len(self.starts)

        def compile_chunk(n, state):
            def step(s):
                if len(self.starts) == calls_before:
                    self.starts.append(float(np.asarray(s["w"])[0]))
                return {"w": np.asarray(s["w"]) + n}, {"loss": np.zeros(n)}
            return step

        res = run_chunks(compile_chunk, {"w": np.zeros(3)}, iterations=3, chunk=1, desc="t",
                         ckpt_dir=execution.ckpt_dir, meta={"stand-in": 1}, progress=False)
        assert np.asarray(res.state["w"]).tolist() == [3.0, 3.0, 3.0]
        S = data.splits.test.shape[0]
        return LearnedRows(rows={r: {m: np.full(S, 0.5) for m in METRICS} for r in ROWS}, timing={})


def _orbax_fails_at(monkeypatch, fail_step: int) -> None:
    """orbax's save of ``fail_step`` dies the way tensorstore reports a full disk, after writing part
    of its temporary folder (what a real full tmpfs left behind)."""
    import orbax.checkpoint as ocp

    real_save = ocp.CheckpointManager.save

    def save(self, step, *a, **k):
        if int(step) == fail_step:
            half = Path(self.directory) / f"{step}.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp" / "d"
            half.mkdir(parents=True)
            (half / "ab12").write_bytes(b"half")
            raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database: Failed writing: '
                             f'"{half}/ab12": No space left on device [os_error_code=28]')
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)


def _leftovers(work: Path) -> list[str]:
    return sorted(p.name for p in work.rglob("*") if "orbax-checkpoint-tmp" in p.name)


def test_full_disk_during_the_first_checkpoint_keeps_nothing_and_says_so(tmp_path, cache100, monkeypatch):
    """Issue 41 item 5: the error said "the training checkpoints are kept" and left the work directory
    (run.json, TensorBoard, orbax's half-written temporary folder) when no checkpoint had completed."""
    import ccpo_jax.ccpo.rows as rows_module

    monkeypatch.setattr(rows_module, "learned_rows", LoopTrainer())
    _orbax_fails_at(monkeypatch, 1)
    out = tmp_path / "run"
    line = _one_error_line(run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--out", str(out)]))
    assert line.startswith(f"error: no space left on device writing {tmp_path / '.run.partial' / CKPT_DIR}")
    assert line.endswith("; no training checkpoint had completed; nothing was kept"), line
    assert os.listdir(tmp_path) == []


def test_full_disk_during_a_later_checkpoint_keeps_the_completed_ones_and_resumes(tmp_path, cache100, monkeypatch):
    import ccpo_jax.ccpo.rows as rows_module

    fake = LoopTrainer()
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    _orbax_fails_at(monkeypatch, 2)
    out, work = tmp_path / "run", tmp_path / ".run.partial"
    line = _one_error_line(run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--out", str(out)]))
    assert line.endswith(f"; the training checkpoints are kept in {work}; after fixing the cause, continue with "
                         f"`ccpo-jax reproduce --resume {out}` (or delete {work})"), line
    orbax = work / CKPT_DIR / "orbax"
    assert sorted(p.name for p in orbax.iterdir()) == ["1", "1.digest.json"] and _leftovers(work) == []
    monkeypatch.undo()
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    r = run_cli(["reproduce", "--resume", str(out), "--no-progress"])
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-3000:]
    assert fake.starts == [0.0, 1.0] and (out / "results.json").is_file() and not work.exists()


def test_full_disk_during_the_first_checkpoint_of_a_resumed_run(tmp_path, cache100, monkeypatch):
    """A resumed run that had no checkpoint keeps its work directory (its configuration) and says
    exactly that; orbax's half-written folder is gone, and the next --resume starts afresh."""
    import ccpo_jax.ccpo.rows as rows_module

    def killed(run, data, execution):
        execution.ckpt_dir.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(rows_module, "learned_rows", killed)
    out, work = tmp_path / "run", tmp_path / ".run.partial"
    r = run_cli(["reproduce", "--cache", str(cache100), *ARGS, "--out", str(out)])
    assert r.returncode == 130 and (work / "run.json").is_file(), (r.returncode, r.stderr[-2000:])
    fake = LoopTrainer()
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    _orbax_fails_at(monkeypatch, 1)
    line = _one_error_line(run_cli(["reproduce", "--resume", str(out), "--no-progress"]))
    assert line.endswith(f"; no training checkpoint had completed; {work} keeps the run's configuration; after "
                         f"fixing the cause, continue with `ccpo-jax reproduce --resume {out}` (or delete {work})"), line
    assert (work / "run.json").is_file() and _leftovers(work) == []
    monkeypatch.undo()
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    r = run_cli(["reproduce", "--resume", str(out), "--no-progress"])
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-3000:]
    assert fake.starts == [0.0, 0.0] and (out / "results.json").is_file()


def test_only_a_step_with_its_digest_counts_as_a_checkpoint(tmp_path):
    from ccpo_jax.runtime.checkpoints import completed_steps
    from ccpo_jax.runtime.workdir import has_checkpoints

    root = tmp_path / CKPT_DIR
    (root / "loop_meta.json").parent.mkdir()
    (root / "loop_meta.json").write_text("{}")
    (root / "orbax" / "1.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # a save cut short
    (root / "orbax" / "2").mkdir()  # renamed into place, digest never written
    (root / "orbax.damaged" / "3-x" / "3").mkdir(parents=True)  # set aside by a resume
    (root / "orbax.damaged" / "3-x" / "3.digest.json").write_text("{}")
    assert completed_steps(root) == [] and not has_checkpoints(tmp_path, CKPT_DIR)
    (root / "orbax" / "2.digest.json").write_text("{}")
    assert completed_steps(root) == [root / "orbax" / "2"] and has_checkpoints(tmp_path, CKPT_DIR)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_real_full_disk_after_real_training_then_resume_without_retraining(tmp_path, cache100, monkeypatch):
    """A 64 MiB tmpfs holds the run; right after the real trainer returns, a file fills the
    tmpfs, so writing the outputs hits a real ENOSPC. The run exits 2 with one line naming
    ``--resume``, its checkpoints stay; after freeing the space, ``--resume`` compiles and runs no
    training chunk and writes the rows the trainer had computed, bit for bit."""
    import ccpo_jax.ccpo.rows as rows_module
    from ccpo_jax.runtime import loop

    mnt = tmp_path / "disk"
    if not _tmpfs(mnt, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        real, trained = rows_module.learned_rows, {}
        filler = mnt / "filler"

        def train_then_fill_the_disk(run, data, execution):
            got = real(run, data, execution)
            trained.update(got.rows)
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            return got

        chunks: list[int] = []
        real_run = loop.run_chunks

        def counting_run_chunks(compile_chunk, *a, **k):
            def counted(n, state):
                chunks.append(n)
                return compile_chunk(n, state)
            return real_run(counted, *a, **k)

        monkeypatch.setattr(loop, "run_chunks", counting_run_chunks)
        monkeypatch.setattr(rows_module, "learned_rows", train_then_fill_the_disk)
        out = mnt / "run"
        work = mnt / ".run.partial"
        argv = ["reproduce", "--cache", str(cache100), *ARGS, "--iterations", "4", "--seeds", "1", "--out", str(out)]
        line = _one_error_line(run_cli(argv))
        assert line.startswith("error: no space left on device") and f"--resume {out}`" in line, line
        assert chunks, "the first run trained"
        ckpts = sorted(p.name for p in (work / CKPT_DIR).rglob("*") if p.is_dir() and p.name.isdigit())
        assert ckpts and not out.exists()
        filler.unlink()
        chunks.clear()
        monkeypatch.setattr(rows_module, "learned_rows", real)
        r = run_cli(["reproduce", "--resume", str(out), "--no-progress"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert chunks == [], "the resumed run compiled and ran no training chunk"
        res = json.loads((out / "results.json").read_text())
        for row, metrics in trained.items():
            for m, v in metrics.items():
                got = np.array([np.nan if x is None else x for x in res["policies"][row]["per_split"][m]], float)
                want = np.asarray(v, float).reshape(-1)
                if m == "cost_cents":
                    np.testing.assert_array_equal(got, want, err_msg=f"{row} {m}")
                else:  # means of counts are written exactly (k / n_test in float64): within 2 float32 ulps
                    np.testing.assert_allclose(got, want, rtol=2 ** -22, atol=0, err_msg=f"{row} {m}")
        assert not work.exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
