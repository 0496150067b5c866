"""Multi-host runs (``jax.distributed.initialize``, docs/performance.md) on this one machine.

Two OS processes with two forced CPU devices each join through
``CCPO_JAX_DISTRIBUTED=1`` and a coordinator on 127.0.0.1 (the cross-process
collectives are JAX's CPU gloo backend) and run ``ccpo-jax multihost``:
CCPO training over one global 4-device mesh, state gathered to every host,
every split evaluated. The oracle is the same script in one process: with
``--member-block 1`` the trained state (SHA-256), every per-split metric and
the calibrated kappas
must be bit-identical to ONE process on ONE device (each device runs the
one-device program, ``sharding.PerDevice``). Without a block (one SPMD
program), two hosts x two devices must equal one host with four devices.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import FAST_COMPILE_XLA_FLAGS, REPO

ARGS = ["--splits", "3", "--iterations", "8"]


def _env(n_local_devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env.pop("CCPO_JAX_DISTRIBUTED", None)
    env["XLA_FLAGS"] = f"{FAST_COMPILE_XLA_FLAGS} --xla_force_host_platform_device_count={n_local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
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


def _two_hosts(tmp: Path, name: str, extra: list[str]) -> list[str]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ccpo_jax.cli", "multihost", "--out", str(tmp / f"{name}.json"), *ARGS, *extra],
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
    for p, (_, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    return [so for so, _ in outs]


def _one_host(tmp: Path, name: str, n_devices: int, extra: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "ccpo_jax.cli", "multihost", "--out", str(tmp / f"{name}.json"), *ARGS, *extra],
                       env=_env(n_devices), cwd=tmp, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("multihost")
    # Both layouts in one pair of processes: member blocks of 1 (-1.json), then one SPMD program (-0.json).
    out = {"stdout": _two_hosts(tmp, "two_hosts-{block}", ["--member-block", "1,0"])}
    _one_host(tmp, "one_device", 1, ["--member-block", "1"])
    _one_host(tmp, "one_host_4_spmd", 4, ["--member-block", "0"])
    out["files"] = sorted(p.name for p in tmp.iterdir())
    for name, file in (("two_hosts", "two_hosts-1"), ("two_hosts_spmd", "two_hosts-0"), ("one_device", "one_device"),
                       ("one_host_4_spmd", "one_host_4_spmd")):
        out[name] = _load(tmp / f"{file}.json")
    return out


@pytest.mark.slow
def test_two_hosts_form_one_four_device_mesh(runs):
    two = runs["two_hosts"]
    assert two["processes"] == 2 and two["devices"] == 4 and two["member_block"] == 1
    assert runs["one_device"]["processes"] == 1 and runs["one_device"]["devices"] == 1
    # only process 0 reports and writes
    assert [out.count("process 0 of 2") for out in runs["stdout"]] == [2, 0]  # one line per layout
    assert runs["files"] == ["one_device.json", "one_host_4_spmd.json", "two_hosts-0.json", "two_hosts-1.json"]
    assert "SYNTHETIC" in two["note"]


def _assert_same(a: dict, b: dict) -> None:
    assert a["state_sha256"] == b["state_sha256"]
    for key in ("rows", "kappa_hat", "kappa_online_curve_mean"):
        assert a[key] == b[key], key


@pytest.mark.slow
def test_two_hosts_with_member_block_equal_one_device_bitwise(runs):
    """member_block=1: each device of each host runs the one-device program (sharding.PerDevice)."""
    two = runs["two_hosts"]
    _assert_same(two, runs["one_device"])
    # the runs did something: every row has 3 splits of coverage in [0, 1], kappa moved
    assert {"CPO", "CPO batch", "CPO online", "CCPO (lambda=0)"} <= set(two["rows"])
    for row in two["rows"].values():
        assert len(row["coverage"]) == 3 and all(0.0 <= c <= 1.0 for c in row["coverage"])
    curve = two["kappa_online_curve_mean"]
    assert len(curve) == 8 and curve[-1] != curve[0]


@pytest.mark.slow
def test_two_hosts_spmd_equal_one_host_with_four_devices_bitwise(runs):
    """No block: one SPMD program over 4 partitions, whether the partitions are on 1 host or 2."""
    assert runs["two_hosts_spmd"]["member_block"] is None and runs["two_hosts_spmd"]["processes"] == 2
    _assert_same(runs["two_hosts_spmd"], runs["one_host_4_spmd"])


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


def test_multihost_bad_options_are_one_error_line(tmp_path):
    """``ccpo-jax multihost``'s options are typed and checked before JAX starts: one line naming the flag, exit 2."""
    from tests.helpers import run_cli

    for args, want in ((["--member-block", "1,0"], "error: --out: with several --member-block values it must contain "
                                                    "'{block}', got"),
                       (["--split-sizes", "1,2"], "error: --split-sizes: expected TRAIN,CAL,TEST, got '1,2'"),
                       (["--member-block", "-1"], "error: --member-block: expected integers >= 0"),
                       (["--alpha", "1.5"], "error: --alpha: must be in (0, 1)")):
        r = run_cli(["multihost", "--out", str(tmp_path / "r.json"), *args])
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
