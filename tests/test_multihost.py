"""Multi-host runs (``jax.distributed.initialize``, DESIGN 7) on this one machine.

Two OS processes with two forced CPU devices each join through
``CCPO_JAX_DISTRIBUTED=1`` and a coordinator on 127.0.0.1 (the cross-process
collectives are JAX's CPU gloo backend) and run ``experiments.multihost``:
CCPO training over one global 4-device mesh, state gathered to every host,
every split evaluated. The oracle is the same script in ONE process on four
forced devices, and on two: with ``--member-block 1`` every device runs the
same block program, so the trained state (SHA-256) and every per-split metric
must be bit-identical across the three layouts.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--splits", "3", "--iterations", "8", "--member-block", "1"]


def _env(n_local_devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env.pop("CCPO_JAX_DISTRIBUTED", None)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: Path) -> dict:
    d = json.loads(path.read_text())
    d.pop("timing")
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("multihost")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.multihost", "--out", str(tmp / "two_hosts.json"), *ARGS],
            env=_env(2, CCPO_JAX_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                     JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    out = {"two_hosts": _load(tmp / "two_hosts.json"), "stdout": [so for so, _ in outs]}
    for n in (4, 2):
        r = subprocess.run([sys.executable, "-m", "experiments.multihost", "--out", str(tmp / f"one_host_{n}.json"), *ARGS],
                           env=_env(n), cwd=tmp, capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        out[f"one_host_{n}"] = _load(tmp / f"one_host_{n}.json")
    out["files"] = sorted(p.name for p in tmp.iterdir())
    return out


def test_two_hosts_form_one_four_device_mesh(runs):
    two = runs["two_hosts"]
    assert two["processes"] == 2 and two["devices"] == 4
    assert runs["one_host_4"]["processes"] == 1 and runs["one_host_4"]["devices"] == 4
    # only process 0 reports and writes
    assert sum("process 0 of 2" in s for s in runs["stdout"]) == 1
    assert runs["files"] == ["one_host_2.json", "one_host_4.json", "two_hosts.json"]
    assert "SYNTHETIC" in two["note"]


def test_two_hosts_equal_one_host_bitwise(runs):
    two, one4, one2 = runs["two_hosts"], runs["one_host_4"], runs["one_host_2"]
    assert two["state_sha256"] == one4["state_sha256"] == one2["state_sha256"]
    for key in ("rows", "kappa_hat", "kappa_online_curve_mean"):
        assert two[key] == one4[key] == one2[key], key
    # the runs did something: every row has 3 splits of coverage in [0, 1], kappa moved
    assert {"CPO", "CPO batch", "CPO online", "CCPO (lambda=0)"} <= set(two["rows"])
    for row in two["rows"].values():
        assert len(row["coverage"]) == 3 and all(0.0 <= c <= 1.0 for c in row["coverage"])
    curve = two["kappa_online_curve_mean"]
    assert len(curve) == 8 and curve[-1] != curve[0]


def test_reproduce_refuses_multi_host_with_a_clear_error(tmp_path):
    """``ccpo-jax reproduce`` writes one output directory, so under CCPO_JAX_DISTRIBUTED with two
    processes it stops on every process (exit 2, one error line, nothing written)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ccpo_jax.cli", "reproduce", "--out", str(tmp_path / "run")],
            env=_env(1, CCPO_JAX_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                     JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    for i, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 2, err[-2000:]
        assert f"error: reproduce runs on one host (this is process {i} of 2)" in err
        assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
