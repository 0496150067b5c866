"""Replicas as processes (slow tier): ``ccpo-jax gateway --workers 2 --state`` beside a second replica,
``kill -9`` of a worker under load and of a replica whose store was down (docs/gateway.md, "Replicas").

Oracle: the ids of every reply answered 200, against the journal ``data pull`` reads from Redis.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ccpo_jax.testing.chat_server import FakeChatServer, make_scripts  # noqa: E402
from ccpo_jax.testing.gateway_harness import build_artefact  # noqa: E402
from ccpo_jax.testing.redis_server import RedisServer, free_port  # noqa: E402
from tests.helpers import REPO, run_cli  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPTS = make_scripts(40)
QS = list(SCRIPTS)


def _start(args: list[str], tmp: Path, name: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    log = open(tmp / f"{name}.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "ccpo_jax.cli", "gateway", *args], stdout=subprocess.PIPE,
                         stderr=log, text=True, cwd=tmp, env=env)
    t0 = time.monotonic()
    seen = []
    while time.monotonic() - t0 < 240:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited: {''.join(seen)} {(tmp / f'{name}.log').read_text()[-2000:]}")
        seen.append(line)
        if line.startswith("gateway: model"):
            return p, line
    raise RuntimeError(f"{name} did not start")


def _ask_many(url: str, n: int) -> list[tuple[int, dict | None]]:
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            async def one(i):
                try:
                    r = await c.post(url + "/chat/completions", json={
                        "model": "ccpo-router", "messages": [{"role": "user", "content": QS[i % len(QS)]}]})
                    return r.status_code, (r.json() if r.status_code == 200 else None)
                except httpx.HTTPError:
                    return 0, None  # (the connection of a killed worker)
            return await asyncio.gather(*(one(i) for i in range(n)))
    return asyncio.run(go())


def _pulled_ids(url: str, tmp: Path) -> set[str]:
    out = tmp / "pulled.jsonl"
    res = run_cli(["data", "pull", url, "--out", str(out)])
    assert res.returncode == 0, res.stderr
    return {json.loads(x)["id"] for x in out.read_text().splitlines()[1:]}


def test_workers_and_a_second_replica_lose_nothing_answered_when_killed(tmp_path):
    art = build_artefact(tmp_path / "a")
    with RedisServer(tmp_path / "redis", persist=True) as redis, FakeChatServer(SCRIPTS, delay_s=0.02) as up:
        common = ["--base", f"{up.url},tiny-base", "--guide", f"{up.url},big-guide", "--state", redis.url,
                  "--spool", str(tmp_path / "spool"), "--max-batch", "4", "--no-access-log"]
        pw, banner = _start([str(art), "--port", str(port_w := free_port()), "--workers", "2", *common], tmp_path,
                            "workers")
        pids = [int(x) for x in re.search(r"pids ([\d, ]+)\)", banner).group(1).split(", ")]
        pr, _ = _start([str(art), "--port", str(port_r := free_port()), *common], tmp_path, "replica")
        try:
            url_w, url_r = f"http://127.0.0.1:{port_w}/v1", f"http://127.0.0.1:{port_r}/v1"
            first = _ask_many(url_w, 32)
            assert all(s == 200 for s, _ in first)
            assert {r["ccpo"]["state"]["replica"] for _, r in first} == {f"127.0.0.1:{port_w}/w0",
                                                                        f"127.0.0.1:{port_w}/w1"}
            # kill -9 of one worker while 48 requests are in flight: the others answer, the worker comes back
            async def killer():
                await asyncio.sleep(0.3)
                os.kill(pids[0], signal.SIGKILL)
            loop_res: list = []

            async def both():
                task = asyncio.create_task(killer())
                loop_res.extend(await asyncio.to_thread(_ask_many, url_w, 48))
                await task
            asyncio.run(both())
            answered = [r["id"] for s, r in first + loop_res if s == 200]
            assert len(answered) >= 32 + 1
            # the replica's own kill -9 with the store down: its answered requests wait in its spool
            redis.stop()
            down = _ask_many(url_r, 4)
            assert all(s == 200 and r["ccpo"]["state"]["journal"] == "spooled" for s, r in down)
            pr.send_signal(signal.SIGKILL)
            pr.wait(timeout=10)
            redis.start()
            pr, line = _start([str(art), "--port", str(port_r), *common], tmp_path, "replica2")
            t0 = time.monotonic()
            want = set(answered) | {r["id"] for _, r in down}
            while not want <= _pulled_ids(redis.url, tmp_path) and time.monotonic() - t0 < 30:
                time.sleep(0.5)
            assert want <= _pulled_ids(redis.url, tmp_path)
            # the killed worker was started again: the workers' port still answers, metrics summed over them
            assert all(s == 200 for s, _ in _ask_many(url_w, 8))
            text = httpx.get(f"http://127.0.0.1:{port_w}/metrics").text
            ok = [ln for ln in text.splitlines() if ln.startswith('ccpo_gateway_requests_total{outcome="ok"')]
            assert ok and f'replica="127.0.0.1:{port_w}"' in ok[0]
        finally:
            for p in (pw, pr):
                p.send_signal(signal.SIGTERM)
            for p in (pw, pr):
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
