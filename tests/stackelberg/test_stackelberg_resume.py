"""``stackelberg --resume``: the work directory, the configuration check, and an interrupted run
resumed to the same results as an uninterrupted one (ccpo_jax.runtime.workdir, as reproduce)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from ccpo_jax.errors import UserError
from ccpo_jax.stackelberg import pipeline as P
from ccpo_jax.stackelberg.config import StackelbergConfig


def _fake_run(fail: bool):
    def run(cfg, work, progress, log):
        (work / "checkpoints" / "phase" / "1").mkdir(parents=True, exist_ok=True)  # a completed step:
        (work / "checkpoints" / "phase" / "1.digest.json").write_text("{}")  # its folder and digest
        if fail:
            raise RuntimeError("killed")
        (work / "results.json").write_text("{}")
        return {"ok": True}
    return run


def test_killed_run_resumes_only_with_its_configuration(tmp_path, monkeypatch):
    cfg, out = StackelbergConfig().quick(), tmp_path / "r"
    monkeypatch.setattr(P, "_run_in", _fake_run(True))
    with pytest.raises(RuntimeError) as e:
        P.run_pipeline(cfg, out, log=lambda s: None)
    work = tmp_path / ".r.partial"
    assert not out.exists() and (work / P.RUN_FILE).is_file()
    assert any("--resume" in n for n in e.value.__notes__)
    with pytest.raises(UserError, match="an interrupted run for .* exists"):
        P.run_pipeline(cfg, out)  # a new run must not overwrite it
    other = dataclasses.replace(cfg, leader=dataclasses.replace(cfg.leader, iterations=11))
    with pytest.raises(UserError, match=r"resume: the interrupted run used leader.iterations=10, not 11"):
        P.run_pipeline(other, out, resume=True)
    monkeypatch.setattr(P, "_run_in", _fake_run(False))
    assert P.run_pipeline(cfg, work, resume=True) == {"ok": True}  # the work dir names the run too
    assert (out / "results.json").is_file() and (out / P.RUN_FILE).is_file() and not work.exists()
    with pytest.raises(UserError, match="holds a finished run"):
        P.run_pipeline(cfg, out, resume=True)
    with pytest.raises(UserError, match="already exists"):
        P.run_pipeline(cfg, out)
    with pytest.raises(UserError, match="no interrupted run"):
        P.run_pipeline(cfg, tmp_path / "none", resume=True)


def test_run_failing_before_a_checkpoint_leaves_nothing(tmp_path, monkeypatch):
    def boom(cfg, work, progress, log):
        raise RuntimeError("bad grid")
    monkeypatch.setattr(P, "_run_in", boom)
    with pytest.raises(RuntimeError):
        P.run_pipeline(StackelbergConfig().quick(), tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def _values(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "timing"}


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_uninterrupted_results(tmp_path, monkeypatch):
    """Kill the run after the scalar controller is trained (before the task controller); --resume
    loads the finished phases (their loop runs no chunk) and gives the same results.json values."""
    from ccpo_jax.runtime import loop

    r = dataclasses.replace
    cfg = StackelbergConfig().quick()
    cfg = r(cfg, eval=r(cfg.eval, episodes=200, paper_episodes=20), oracle=r(cfg.oracle, levels=5))
    want = P.run_pipeline(cfg, tmp_path / "whole", progress=False, log=lambda s: None)
    inner = P.train_controller
    monkeypatch.setattr(P, "train_controller", lambda kind, *a: (_ for _ in ()).throw(KeyboardInterrupt())
                        if kind == "task" else inner(kind, *a))
    with pytest.raises(KeyboardInterrupt):
        P.run_pipeline(cfg, tmp_path / "cut", progress=False, log=lambda s: None)
    monkeypatch.setattr(P, "train_controller", inner)
    steps = []
    run_chunks = loop.run_chunks
    monkeypatch.setattr(loop, "run_chunks", lambda compile_chunk, *a, **k: run_chunks(
        lambda n, placed: (lambda f: (lambda s: steps.append(k["desc"]) or f(s)))(compile_chunk(n, placed)), *a, **k))
    got = P.run_pipeline(cfg, tmp_path / "cut", progress=False, log=lambda s: None, resume=True)
    assert not any(d.startswith("scalar_") for d in steps) and any(d.startswith("task_") for d in steps)
    assert json.dumps(_values(got), sort_keys=True) == json.dumps(_values(want), sort_keys=True)
    disk = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert _values(disk) == _values(json.loads((tmp_path / "whole" / "results.json").read_text()))


def test_an_interrupted_run_says_how_to_resume_from_the_shared_context(tmp_path, monkeypatch):
    """stackelberg builds its run in ``workdir.committed`` (as reproduce and sweep): interrupted
    once training started, the work directory with run.json stays and the run's log says how to go on."""
    def cut(cfg, work, progress, log):
        (work / "checkpoints").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "_run_in", cut)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        P.run_pipeline(StackelbergConfig().quick(), tmp_path / "s", progress=False, log=said.append)
    assert said == [f"interrupted; continue with: ccpo-jax stackelberg --resume {tmp_path / 's'} (with the run's options)"]
    assert (tmp_path / ".s.partial" / "run.json").is_file() and not (tmp_path / "s").exists()
