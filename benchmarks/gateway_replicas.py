"""The gateway beyond one process: throughput through 1, 2 and 4 workers on a shared Redis state, the
state's added latency per request, and the feedback race across two replicas (docs/gateway.md, "Replicas").

    python benchmarks/gateway_replicas.py ARTIFACT [--requests 400] [--workers 1,2,4] [--delay-ms 20]
        [--out benchmarks/results/gateway-replicas-cpu-2core.json]

Processes: the scripted upstream (ccpo_jax/testing/chat_server.py, a fixed latency per call), ``redis-server``
(Debian's, no persistence), ``ccpo-jax gateway`` and this load generator (aiohttp, as
benchmarks/gateway_overhead.py). Measured:

* requests/s at concurrency 64 (``--reps`` runs back to back, the median reported beside each run)
  of the protocol's upstream calls made directly, and through the gateway: embedded (no --state),
  and --state with --workers 1, 2, 4, all with --online-kappa 1 (so each batch of decisions reads
  the store); CPU ms per request of each process (gateway processes summed, upstream, redis-server,
  load generator) and the load average;
* the shared state's added latency per request: one client at a time (concurrency 1), --state
  against the embedded gateway (the difference of medians and of p99s), and the store calls alone
  (the journal append and the kappa read, median and p99, in this process);
* the feedback race: 64 concurrent outcomes for one id, half to each of two replicas: statuses.

Prints one JSON record per line {"name","value","unit","backend","device","config"} and writes them
all to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from gateway_overhead import _cpu_s, _load, _start  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis(folder: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    p = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(folder)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return p, f"redis://127.0.0.1:{port}/0"


LOGS: list[Path] = []  # (the gateways' output, kept when --logs is given)


def _gateway(art: str, up: str, extra: list[str], env) -> tuple[subprocess.Popen, list[int], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "ccpo_jax.cli", "gateway", art, "--port", str(port), "--base", f"{up},tiny-base",
           "--guide", f"{up},big-guide", "--max-batch", "16", "--no-access-log", *extra]
    if LOGS:  # the gateway's lines to a file, and the start-up line read from it
        log = LOGS[0] / f"gateway-{port}.log"
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
        t0 = time.monotonic()
        while "gateway: model" not in log.read_text():
            if p.poll() is not None or time.monotonic() - t0 > 300:
                raise RuntimeError(f"the gateway did not start: {log.read_text()[-500:]}")
            time.sleep(0.2)
        line = next(x for x in log.read_text().splitlines() if x.startswith("gateway: model"))
    else:
        p, line = _start(cmd, "gateway: model", env)
    m = re.search(r"pids ([\d, ]+)\)", line)
    pids = [int(x) for x in m.group(1).split(", ")] if m else []
    return p, pids, f"http://127.0.0.1:{port}/v1"


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()


def _level(kind, conc, n, questions, up, gw, rounds, pids: dict[str, list[int]]) -> dict:
    cpu0 = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
    me0, t0 = time.process_time(), time.perf_counter()
    errors: list = []
    lat = np.asarray(asyncio.run(_load(kind, conc, n, questions, up, gw, rounds, errors)))
    wall = time.perf_counter() - t0
    row = {"requests_per_s": round(n / wall, 1), "median_ms": round(1e3 * float(np.median(lat)), 2),
           "p99_ms": round(1e3 * float(np.quantile(lat, 0.99)), 2), "errors": len(errors),
           "error_kinds": sorted(set(errors))[:3],
           "load_generator_cpu_ms_per_request": round(1e3 * (time.process_time() - me0) / n, 2),
           "load_average_1min": round(os.getloadavg()[0], 2)}
    for k, v in pids.items():
        row[f"{k}_cpu_ms_per_request"] = round(1e3 * (sum(_cpu_s(p) for p in v) - cpu0[k]) / n, 2)
    return row


async def _race(a: str, b: str, cid: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as c:
        async def one(i):
            async with c.post((a if i % 2 else b) + "/feedback", json={"id": cid, "gold": "answer 0"}) as r:
                return r.status
        t0 = time.perf_counter()
        codes = await asyncio.gather(*(one(i) for i in range(64)))
        return {"200": codes.count(200), "409": codes.count(409), "other": 64 - codes.count(200) - codes.count(409),
                "seconds": round(time.perf_counter() - t0, 3)}


async def _store_ops(url: str, n: int) -> dict:
    """The store calls of one request, alone (concurrency 1, in this process): the journal append (one
    Lua script) and the read a batch of online decisions makes; latency median and p99 in ms."""
    import redis.asyncio

    from ccpo_jax.gateway.redis_state import K_DEP, K_KAPPA, K_ORDER, K_OUT, K_REQ, LUA_APPEND, LUA_READ

    r = redis.asyncio.Redis.from_url(url, decode_responses=True)
    epoch = await r.hget(K_DEP, "epoch")
    append, read = r.register_script(LUA_APPEND), r.register_script(LUA_READ)
    line = json.dumps({"id": "x", "question": "q" * 200, "rounds": [{"base": {"answer": "a" * 40}}] * 2})
    out = {}
    for name, call in (("append", lambda i: append(keys=[K_DEP, K_REQ, K_ORDER], args=[epoch, f"bench-{i}", line])),
                       ("read", lambda i: read(keys=[K_DEP, K_KAPPA, K_OUT], args=[epoch, 200]))):
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            await call(i)
            ts.append(time.perf_counter() - t0)
        ts = np.asarray(ts[20:])
        out[name] = {"median_ms": round(1e3 * float(np.median(ts)), 3), "p99_ms": round(1e3 * float(np.quantile(ts, 0.99)), 3)}
    await r.delete(K_REQ, K_ORDER)
    await r.aclose()
    return out


def main(argv=None) -> int:  # noqa: C901 - one measurement script, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--reps", type=int, default=3, help="back-to-back runs of each throughput level")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, metavar="DIR", help="keep each gateway's output there")
    a = ap.parse_args(argv)
    if a.logs:
        LOGS.append(Path(a.logs))
        LOGS[0].mkdir(parents=True, exist_ok=True)
    from ccpo_jax.testing.chat_server import make_scripts

    questions = list(make_scripts(50))
    from ccpo_jax.llm import calls, paper  # noqa: F401 - imported before timing (the direct path uses them)
    from ccpo_jax.gateway import engine  # noqa: F401
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    dev = platform.processor() or platform.machine()
    recs: list[dict] = []

    def rec(name, value, unit, **cfg):
        r = {"name": name, "value": value, "unit": unit, "backend": "http-loopback", "device": dev,
             "config": {"cpus": os.cpu_count(), "delay_ms_per_upstream_call": a.delay_ms, **cfg}}
        print(json.dumps(r), flush=True)
        recs.append(r)

    def levels(kind, label, conc, n, up, gw, pids, **cfg):
        rows = [_level(kind, conc, n, questions, up, gw, rounds, pids) for _ in range(a.reps if conc > 1 else 1)]
        rate = float(np.median([x["requests_per_s"] for x in rows]))
        rec(f"{'direct' if kind == 'direct' else 'gateway'}_requests_per_s", rate, "requests/s", kind=label,
            concurrency=conc, requests=n, runs=rows, **cfg)
        return rate

    tmp = Path(tempfile.mkdtemp(prefix="ccpo-replicas-"))
    up_p, up = _start([sys.executable, "-m", "ccpo_jax.testing.chat_server", "50", "--delay-ms", str(a.delay_ms)], "http://")
    rd_p, url = _redis(tmp)
    procs = [up_p, rd_p]
    rounds: dict = {}
    base = {"upstream": [up_p.pid], "redis": [rd_p.pid]}
    state = ["--state", url, "--spool", str(tmp / "spool")]
    try:
        # one process, --online-kappa 1 (a store read per batch of decisions): embedded vs --state
        for label, extra in (("embedded", []), ("state", state)):
            gw_p, _, gw = _gateway(a.artifact, up, ["--online-kappa", "1", *extra], env)
            procs.append(gw_p)
            asyncio.run(_load("gateway", 4, len(questions), questions, up, gw, rounds, []))  # warm-up
            levels("gateway", label, 1, a.requests // 2, up, gw, dict(base, gateway=[gw_p.pid]), workers=1,
                   online_kappa=1)
            if label == "state":
                rec("state_calls", asyncio.run(_store_ops(url, 2000)), "ms",
                    kind="store calls alone, concurrency 1, in the load generator's process")
            _stop(gw_p)
            procs.remove(gw_p)
        direct = levels("direct", "direct", 64, a.requests, up, "", base)
        for label, w in [("embedded", 1)] + [("state", int(x)) for x in a.workers.split(",")]:
            extra = [] if label == "embedded" else [*state, "--workers", str(w)]
            gw_p, pids, gw = _gateway(a.artifact, up, ["--online-kappa", "1", *extra], env)
            procs.append(gw_p)
            asyncio.run(_load("gateway", 16, 4 * len(questions), questions, up, gw, rounds, []))  # warm-up
            rate = levels("gateway", label, 64, a.requests, up, gw, dict(base, gateway=[gw_p.pid, *pids]),
                          workers=w, online_kappa=1)
            rec("gateway_over_direct", round(rate / direct, 3), "ratio", kind=label, workers=w, concurrency=64)
            _stop(gw_p)
            procs.remove(gw_p)
        # the race: two replicas, one id, 64 outcomes at once
        ga, _, ua = _gateway(a.artifact, up, ["--online-kappa", "1", *state], env)
        gb, _, ub = _gateway(a.artifact, up, ["--online-kappa", "1", *state], env)
        procs += [ga, gb]
        import httpx

        cid = httpx.post(ua + "/chat/completions", json={"model": "ccpo-router", "messages": [
            {"role": "user", "content": questions[0]}]}, timeout=60).json()["id"]
        race = asyncio.run(_race(ua, ub, cid))
        rec("feedback_race_200", race["200"], "responses", kind="64 concurrent outcomes for one id, two replicas",
            **race)
    finally:
        for p in procs:
            _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
