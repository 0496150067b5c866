"""Progress everywhere (issue 51, item 5): a line per phase on stdout with the seconds since the start, a
plain line per training chunk when stdout is not a terminal (a tqdm bar when it is), ``--no-progress``
silences both; and ``ccpo-jax --version``.

Oracles: the lines read back from the captured stdout, in the order the phases run; the loop's chunk
sizes computed by hand (5 iterations in chunks of 2: 2, 2, 1).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers import run_cli

from ccpo_jax.runtime import loop, progress

PHASE = re.compile(r"^\[ *\d+\.\d s\] ")


def test_status_lines_and_the_plain_bar_off_a_terminal(capsys):
    progress.restart_clock()
    progress.status("loading ...")
    progress.status("hidden", enabled=False)
    bar = progress.bar(4, "train", enabled=True)
    assert isinstance(bar, progress.PlainBar)  # capsys' stdout is not a terminal
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and PHASE.match(out[0]) and out[0].endswith("] loading ...")


def test_the_chunked_loop_prints_a_line_per_chunk_and_per_compilation(capsys):
    def compile_chunk(n, state):
        return lambda s: (s + n, {"x": np.zeros(n)})

    res = loop.run_chunks(compile_chunk, np.float32(0), iterations=5, chunk=2, desc="train 1 variant",
                          postfix=lambda m: f"x {m['x'].sum():.0f}", progress=True)
    assert float(res.state) == 5
    lines = [ln[ln.index("] ") + 2:] for ln in capsys.readouterr().out.splitlines()]
    assert lines[0] == "train 1 variant (compiling a 2-iteration chunk) ..."
    progress_lines = [ln for ln in lines if "iterations" not in ln and ": " in ln]
    assert [ln.split(" (")[0] for ln in progress_lines] == [
        "train 1 variant: 2/5 it", "train 1 variant: 4/5 it", "train 1 variant: 5/5 it"]
    assert "train 1 variant (compiling a 1-iteration chunk) ..." in lines
    assert all(ln.endswith("; x 0") for ln in progress_lines)
    loop.run_chunks(compile_chunk, np.float32(0), iterations=2, chunk=2, desc="quiet", progress=False)
    assert capsys.readouterr().out == ""


def _phases(text: str) -> list[str]:
    return [ln[ln.index("] ") + 2:] for ln in text.splitlines() if PHASE.match(ln)]


def test_reproduce_says_its_phases_with_a_stand_in_trainer(tmp_path, capsys):
    from ccpo_jax.ccpo.reproduce import LearnedRows, reproduce
    from ccpo_jax.ccpo.settings import METRICS
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    def trainer(run, data, execution):
        S = data.splits.test.shape[0]
        return LearnedRows(rows={"CCPO (lambda=0)": {m: np.full(S, 0.9) for m in METRICS}}, timing={})

    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path / "c")
    given = dict(cache=str(tmp_path / "c"), n_splits=2, split_sizes="60,20,20", seeds=1, trainer=trainer)
    reproduce(out_dir=tmp_path / "o", echo=print, **given)
    phases = _phases(capsys.readouterr().out)
    assert [p.split(":")[0].split(" (")[0] for p in phases] == [
        "preparing the run", "evaluating the non-learned rows, the clairvoyant bound and the best observable "
        "reference on 2 splits ...", "training the learned rows", "writing results.json, table.md and the box plots ..."]
    reproduce(out_dir=tmp_path / "q", echo=print, progress=False, **given)
    assert _phases(capsys.readouterr().out) == []


@pytest.mark.slow
def test_reproduce_says_every_phase_in_order(tmp_path):
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path / "c")
    args = ["reproduce", "--cache", str(tmp_path / "c"), "--split-sizes", "60,20,20", "--splits", "2",
            "--iterations", "2", "--seeds", "1"]
    r = run_cli(args + ["--out", str(tmp_path / "o")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    phases = _phases(r.stdout)
    want = ["reproduce: starting", "preparing the run", "evaluating the non-learned rows", "training the learned rows",
            "train ", "evaluating", "writing results.json"]
    at = [next(i for i, p in enumerate(phases) if p.startswith(w) and (w != "evaluating" or "learned variant" in p))
          for w in want]
    assert at == sorted(at), phases
    assert "\r" not in r.stdout + r.stderr  # no bar off a terminal
    quiet = run_cli(args + ["--no-progress", "--out", str(tmp_path / "q")], cwd=tmp_path)
    assert quiet.returncode == 0 and not any(PHASE.match(ln) for ln in quiet.stdout.splitlines())


def test_version():
    r = run_cli(["--version"])
    assert r.returncode == 0 and re.fullmatch(r"ccpo-jax \d+\.\d+\.\d+\S*\n", r.stdout), r.stdout
