"""The gateway's overhead per request over the direct upstream calls, and the router path's decisions/s.

    python benchmarks/gateway_overhead.py ARTIFACT [--delay-ms 20] [--requests 200]
        [--concurrency 1,16,64] [--json OUT.json]

Three processes: the scripted upstream (ccpo_jax/testing/chat_server.py, a fixed latency per call),
``ccpo-jax gateway`` in front of it, and this load generator (asyncio + httpx). At each
concurrency C, C clients send requests back to back (aiohttp: the load generator shares the cores
with the gateway and the upstream, so it is kept light, 0.3 ms of CPU a call against httpx's 2 ms):

* direct: the protocol's upstream calls made by the client itself (base, then guide, with
  data collect's prompts and bodies, as many rounds as the gateway ran for that question);
* gateway: ``POST /v1/chat/completions`` through the gateway.

Overhead = gateway latency - direct latency, at the median and p99 of each distribution.
Then the router alone: ``Router.decide`` and the gateway's Decider on one round, in a loop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _start(cmd: list[str], ready: str, env=None) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd[:3]} exited")
        if ready in line:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # keep the pipe drained
            return p, line.strip()
    raise RuntimeError(f"{cmd[:3]} did not start")


async def _post_json(client, url: str, body: dict) -> dict:
    async with client.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:100]}")
        return await r.json()


async def _direct(client, url, question, rounds):
    from ccpo_jax.gateway.engine import ProtocolConfig
    from ccpo_jax.llm import paper as P
    from ccpo_jax.llm.calls import request_body
    from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL

    cfg, history = ProtocolConfig().resolved({}), []  # (the paper's protocol: the scripted server's)
    for t in range(rounds):
        bm = P.base_messages(question, history)
        body = request_body(BASE_MODEL, bm, cfg.base_max_tokens, cfg.base_temperature[t > 0], cfg.seed, True)
        b = (await _post_json(client, url, body))["choices"][0]["message"]["content"]
        br = P.read_base(b, None)
        gm = P.guide_messages(question, br.shown)
        body = request_body(GUIDE_MODEL, gm, cfg.guide_max_tokens, 0.0, cfg.seed, True)
        g = (await _post_json(client, url, body))["choices"][0]["message"]["content"]
        history.append((b, g))


async def _load(kind: str, conc: int, n: int, questions: list[str], up: str, gw: str, rounds: dict,
                errors: list) -> list[float]:
    import aiohttp

    lat: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(limit=conc * 2)) as client:
        todo = iter(range(n))

        async def worker():
            for i in todo:
                q = questions[i % len(questions)]
                t0 = time.perf_counter()
                try:
                    if kind == "gateway":
                        r = await _post_json(client, gw + "/chat/completions", {"model": "ccpo-router", "messages": [
                            {"role": "user", "content": q}]})
                        rounds[q] = r["ccpo"]["rounds"]
                    else:
                        await _direct(client, up + "/chat/completions", q, rounds[q])
                except Exception as e:  # noqa: BLE001 - counted and reported, not a crash of the run
                    errors.append(f"{kind}: {type(e).__name__} {str(e)[:100]}")
                    continue
                lat.append(time.perf_counter() - t0)
        await asyncio.gather(*(worker() for _ in range(conc)))
    return lat


def _router_rate(artifact: str, seconds: float = 3.0) -> dict:
    from ccpo_jax.gateway.engine import Decider
    from ccpo_jax.gateway.online import CoverageState
    from ccpo_jax.serving import Router

    r = Router.load(artifact)
    rnd = [{"base": {"answer": "x", "tokens_in": 40, "tokens_out": 13, "confidence": 0.5},
            "guide": {"verdict": False, "answer": "y", "tokens_in": 30, "tokens_out": 1, "uncertainty": 0.2}}]
    out = {}
    dec = Decider(r, CoverageState(r.alpha, 0.5, 1.0))
    for name, f, per in (("Router.decide (the exported module: one block of rows)", lambda: r.decide(rnd), 1),
                         ("Decider (screened, online kappa)", lambda: dec.decide(rnd, False, None), 1),
                         ("Decider.decide_many (screened), batch of 64",
                          lambda: dec.decide_many([(rnd, False, None)] * 64), 64)):
        for _ in range(20):
            f()
        ts, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        ts = np.asarray(ts)
        out[name] = {"decisions_per_s": round(per * len(ts) / ts.sum(), 1), "median_ms": round(1e3 * float(np.median(ts)), 3),
                     "p99_ms": round(1e3 * float(np.quantile(ts, 0.99)), 3)}
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=200, help="requests per concurrency level and kind")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from ccpo_jax.testing.chat_server import make_scripts

    questions = list(make_scripts(50))
    from ccpo_jax.llm import calls, paper  # noqa: F401 - imported before timing (the direct path uses them)
    from ccpo_jax.gateway import engine  # noqa: F401
    up_p, up = _start([sys.executable, "-m", "ccpo_jax.testing.chat_server", "50", "--delay-ms", str(a.delay_ms)], "http://")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    gw_p, _ = _start([sys.executable, "-m", "ccpo_jax.cli", "gateway", a.artifact, "--port", str(a.port), "--base",
                      f"{up},tiny-base", "--guide", f"{up},big-guide"], "gateway:", env)
    gw = f"http://127.0.0.1:{a.port}/v1"
    res: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "delay_ms_per_upstream_call": a.delay_ms,
                 "requests_per_level": a.requests, "levels": {}}
    try:
        time.sleep(1.0)
        rounds: dict = {}
        asyncio.run(_load("gateway", 4, len(questions), questions, up, gw, rounds, []))  # warm-up, learns rounds
        for c in (int(x) for x in a.concurrency.split(",")):
            row = {}
            for kind in ("direct", "gateway"):
                cpu0, up0, me0 = _cpu_s(gw_p.pid), _cpu_s(up_p.pid), time.process_time()
                t0 = time.perf_counter()
                errors: list = []
                lat = np.asarray(asyncio.run(_load(kind, c, a.requests, questions, up, gw, rounds, errors)))
                wall = time.perf_counter() - t0
                row[kind] = {"median_ms": round(1e3 * float(np.median(lat)), 2),
                             "p99_ms": round(1e3 * float(np.quantile(lat, 0.99)), 2),
                             "requests_per_s": round(a.requests / wall, 1), "errors": len(errors),
                             "error_kinds": sorted(set(errors))[:5]}
                # CPU time per request of each process: where the two cores went
                row[kind]["upstream_cpu_ms_per_request"] = round(1e3 * (_cpu_s(up_p.pid) - up0) / a.requests, 2)
                row[kind]["load_generator_cpu_ms_per_request"] = round(1e3 * (time.process_time() - me0) / a.requests, 2)
                if kind == "gateway":
                    row[kind]["gateway_cpu_ms_per_request"] = round(1e3 * (_cpu_s(gw_p.pid) - cpu0) / a.requests, 2)
                row[kind]["load_average_1min"] = round(os.getloadavg()[0], 2)
            row["overhead_median_ms"] = round(row["gateway"]["median_ms"] - row["direct"]["median_ms"], 2)
            row["overhead_p99_ms"] = round(row["gateway"]["p99_ms"] - row["direct"]["p99_ms"], 2)
            res["levels"][c] = row
            print(c, json.dumps(row), flush=True)
        import httpx

        m = httpx.get(gw.replace("/v1", "/metrics")).text
        res["metrics_excerpt"] = [ln for ln in m.splitlines() if ln.startswith(("ccpo_gateway_decision_seconds_sum",
                                  "ccpo_gateway_decision_seconds_count", "ccpo_gateway_requests_total",
                                  "ccpo_gateway_rounds_per_request_sum", "ccpo_gateway_rounds_per_request_count"))]
    finally:
        for p in (gw_p, up_p):
            p.terminate()
            p.wait(timeout=10)
    res["router"] = _router_rate(a.artifact)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
