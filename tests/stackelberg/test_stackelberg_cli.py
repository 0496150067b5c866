"""``ccpo-jax stackelberg --quick`` end to end (subprocess, as a user runs it from the README)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.helpers import FAST_COMPILE_XLA_FLAGS, run_cli


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stk") / "run"
    cmd = [sys.executable, "-m", "ccpo_jax.cli", "stackelberg", "--out", str(out), "--quick", "--episodes", "400", "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow
def test_quick_cli_writes_everything(quick_run):
    out, stdout = quick_run
    for f in ("results.json", "table.md", "pareto_paper_size.png", "pareto_large.png"):
        assert (out / f).is_file(), f
    assert "SYNTHETIC" in (out / "table.md").read_text() and "SYNTHETIC" in stdout
    res = json.loads((out / "results.json").read_text())
    assert res["data"]["synthetic"] and res["data"]["provenance"]["kind"] == "synthetic"
    ev = res["evaluation"]
    assert ev["paper_size"]["episodes"] == 20 and ev["large"]["episodes"] == 400
    strat = ev["large"]["strategies"]
    assert set(strat) == {"Middle", "Conservative", "Task-aware raw", "Scalar+R", "Task-aware+R"}
    for name, row in strat.items():
        assert row["n_turns"] == 400 * 3
        if name != "Conservative":
            assert 0.0 <= row["p_tokens_vs_conservative"] <= 1.0
    assert any((out / "tb").iterdir()) and any((out / "checkpoints").iterdir())
    ref = ev["large"]["reference"]
    assert set(ref) == {"Untrained+R", "Best constant+R", "Best table+R", "Scalar+R, BC follower",
                        "Task-aware+R, BC follower"}
    md = (out / "table.md").read_text()
    for kind in ("scalar", "task"):  # the Followers table: GAIL's selected seed and BC's best, from results.json
        im = res["training"][kind]["imitation_error"]
        g, b = im["gail"][res["training"][kind]["follower_seed"]], min(im["bc"])
        assert f"| {kind} | {g:.4f} | {b:.4f} | {g / b:.2f}x |" in md
    assert all(r["trap_audit_executed"]["trap_rate"] == 0.0 and r["n_turns"] == 400 * 3 for r in ref.values())
    for kind in ("scalar", "task"):
        for mode in ("surrogate", "replay"):
            o = res["leader_oracle"][kind][mode]
            assert o["n_candidates"] == 11 * 11 and len(o["constant"]["action"]) == 2
            assert {"learned", "untrained", "table"} <= set(o) and o["learned"]["u_leader_se"] > 0
    assert "Leader oracles" in (out / "table.md").read_text() and "gap_to_table" in o["learned"]
    assert res["leader_profile"] == {"name": "paper", "synthetic": False, "w_savings": 1.0, "w_quality": 2.0, "w_subsidy": 0.1}
    assert res["config"]["leader_profile"] == "paper" and "SYNTHETIC leader" not in (out / "table.md").read_text()


@pytest.mark.slow
def test_repaired_strategies_have_no_traps_raw_report_theirs(quick_run):
    out, _ = quick_run
    res = json.loads((out / "results.json").read_text())
    audit = res["trap_audit"]
    for name in ("Scalar + proj.", "Task-aware + proj.", "Scalar+R", "Task-aware+R"):
        assert audit[name]["trap_rate"] == 0.0, name
    for name in ("Scalar raw", "Task-aware raw"):
        assert 0.0 <= audit[name]["trap_rate"] <= 1.0 and len(audit[name]["mean_action"]) == 3


def test_bad_flag_is_a_one_line_user_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ccpo_jax.cli", "stackelberg", "--out", str(tmp_path / "x"),
                           "--grid", str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no such file" in proc.stderr


def test_unknown_leader_profile_is_a_one_line_user_error(tmp_path):
    r = run_cli(["stackelberg", "--out", str(tmp_path / "x"), "--leader-profile", "nope"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--leader-profile" in r.stderr and "state-feedback" in r.stderr
    assert not (tmp_path / "x").exists()


def test_bad_seed_list_is_a_one_line_user_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ccpo_jax.cli", "stackelberg", "--out", str(tmp_path / "x"),
                           "--seed-list", "0,a"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--seed-list" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_seed_list_writes_the_spread(tmp_path):
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ccpo_jax.cli", "stackelberg", "--out", str(out), "--quick", "--episodes", "200",
           "--no-progress", "--seed-list", "0,1", "--leader-profile", "state-feedback"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sp = json.loads((out / "spread.json").read_text())
    assert sp["seeds"] == [0, 1] and {"Scalar+R", "Untrained+R", "Best constant+R"} <= set(sp["large"])
    for s in (0, 1):
        r = json.loads((out / f"seed_{s}" / "results.json").read_text())
        assert sp["large"]["Scalar+R"]["token_change_per_seed"][s] == r["evaluation"]["large"]["strategies"]["Scalar+R"]["token_change_vs_conservative"]
    assert "SYNTHETIC leader profile 'state-feedback'" in (out / "spread.md").read_text()
    r = json.loads((out / "seed_0" / "results.json").read_text())
    assert r["leader_profile"]["synthetic"] and r["leader_profile"]["w_savings"] == [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    assert json.loads((out / "seed_0" / "run.json").read_text())["config"]["leader_profile"] == "state-feedback"
    assert "SYNTHETIC profile 'state-feedback'" in (out / "seed_0" / "table.md").read_text()
