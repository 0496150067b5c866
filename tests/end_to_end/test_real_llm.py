"""The whole loop against a real LLM (issue 49): collect -> data check -> reproduce -> export -> gateway
(the official ``openai`` client) -> live-eval, with SmolLM2-135M-Instruct under ``llama-server`` in both
roles (docs/real-llms.md). Skipped, with the reason, without the binary or the model package.

What it asserts is what the loop must deliver, not one model's answers: the json protocol's
signals on >= 95% of rounds, a journal and a cache that ``data check`` reads, a non-empty reply under
the default ``--on-empty``, live-eval's table.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.end_to_end import real_llm_loop as R

pytestmark = [pytest.mark.slow, pytest.mark.skipif(R.missing() is not None, reason=R.missing() or "")]

N_COLLECT, N_LIVE = 24, 6


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "ccpo_jax.cli.main", *args], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=900)
    assert r.returncode == 0, f"{args[:2]}: {r.stderr[-3000:]}"
    return r


def test_the_loop_against_a_real_llm(tmp_path):
    import openai

    rows = (R.QUESTIONS / "cache.jsonl").read_text().splitlines()
    live = (R.QUESTIONS / "live.jsonl").read_text().splitlines()
    (tmp_path / "q.jsonl").write_text("\n".join(rows[:N_COLLECT]) + "\n")
    (tmp_path / "live.jsonl").write_text("\n".join(live[:N_LIVE]) + "\n")
    with R.server(tmp_path / "server.log") as url:
        spec = f"{url},{R.ALIAS}"
        _cli("data", "collect", "--questions", "q.jsonl", "--base", spec, "--guide", spec, "--rounds", "2",
             "--base-price", "0,0", "--guide-price", "2.5,10", "--concurrency", "2", "--out", "cache.jsonl",
             "--no-progress", cwd=tmp_path)
        lines = [json.loads(x) for x in (tmp_path / "cache.jsonl").read_text().splitlines()]
        assert lines[0]["manifest"]["provenance"]["round_protocol"] == "json"
        rounds = [r for q in lines[1:] for r in q["rounds"]]
        assert len(rounds) == 2 * N_COLLECT
        assert sum("confidence" in r["base"] for r in rounds) >= 0.95 * len(rounds)
        assert sum("uncertainty" in r["guide"] for r in rounds) >= 0.95 * len(rounds)
        assert sum(r["base"].get("answer_parsed", True) for r in rounds) >= 0.95 * len(rounds)
        _cli("data", "check", "cache.jsonl", cwd=tmp_path)
        _cli("reproduce", "--cache", "cache.jsonl", "--splits", "2", "--split-sizes", "12,6,6", "--alpha", "0.3", "--iterations", "4",
             "--seeds", "1", "--no-progress", "--out", "run", cwd=tmp_path)
        _cli("export", "run", "--row", "CCPO (lambda=0)", "--force", "--out", "art", cwd=tmp_path)
        gw = subprocess.Popen([sys.executable, "-m", "ccpo_jax.cli.main", "gateway", "art", "--base", spec, "--guide",
                               spec, "--port", str(port := R.free_port()), "--max-batch", "1"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = gw.stdout.readline()
            assert "gateway:" in line, line
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
            q = json.loads(live[0])["question"]
            r = client.chat.completions.create(model="ccpo-router", messages=[{"role": "user", "content": q}])
            c = r.model_extra["ccpo"]
            assert r.choices[0].message.content  # an answer: the set's, or the default --on-empty guide's
            assert c["empty_set"] == (c["fallback"] is not None) and c["abstained"] is False
        finally:
            gw.terminate()
            gw.wait(timeout=30)
        out = _cli("live-eval", "art", "--base", spec, "--guide", spec, "--questions", "live.jsonl", "--journal",
                   "journal.jsonl", "--results", "run/results.json", "--max-batch", "1", cwd=tmp_path).stdout
    assert f"live-eval: {N_LIVE} question(s) answered" in out and "| coverage: set (CP 95%) |" in out
    assert "reply accuracy (content correct, CP 95%) by --on-empty: guide" in out
    # the router's own prediction: its replay over the cache that run/run.json names
    assert "prediction of this router (its replay over the cache" in out and "this router over the cache (" in out
    _cli("data", "check", "journal.jsonl", cwd=tmp_path)
