"""The HTTP endpoint under abuse (issue 15): memory over every batch size, connects, p99 beside a slow client.

Starts ``ccpo-jax serve`` in a subprocess (as deployed; the clients here do not share its GIL) on an
export of an UNTRAINED policy on a SYNTHETIC cache (latency does not depend on the weights), then:

  * ``rss_mb_before`` / ``rss_mb_after``: the server's resident memory (``/proc/PID/status``
    VmRSS) after start-up and after one ``{"batch": [...]}`` request of every size 1..``--max-batch``
    (default 1..1,024), then after a second such sweep (flat memory: the second adds ~nothing);
  * ``connect_s_max`` / ``connect_s_total``: ``socket.create_connection`` times for ``--connections``
    (default 200) connections opened one after another and held open, against this server
    (backlog 1024) and against a second one started with ``--backlog 5`` (the stdlib default);
  * ``p50_ms`` / ``p99_ms``: one-decision ``POST /v1/route`` latency of 16 concurrent clients
    (each on its own keep-alive connection, ``--requests`` requests each), alone and while a slow
    client trickles one byte every ``--trickle-s`` seconds (it gets its 408 after the server's
    request deadline and reconnects).

Prints a table and writes JSON records {"name","value","unit","backend","device","config"}.

    python benchmarks/serving_abuse.py [--max-batch 1024] [--connections 200] [--requests 200] [--out FILE]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def make_artifact(root: Path) -> tuple[Path, list[dict]]:
    import jax
    import jax.numpy as jnp

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.features import n_features
    from envs.cache.jsonl import cache_to_records
    from envs.generators.synthetic import generate

    cache = generate("hotpotqa-llama2", 200, 0)
    p = policy_net().init(jax.random.PRNGKey(0), jnp.zeros((n_features(cache.T),), jnp.float32))
    state = types.SimpleNamespace(policy=jax.tree.map(lambda a: np.asarray(a)[None, None, None], p),
                                  kappa=np.array([[[0.3]]], np.float32))
    save_policies(root / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[0.3]], np.float32)}, cache, "recalibrate")
    return export_router(root / "run", root / "art"), cache_to_records(cache)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def post(conn: http.client.HTTPConnection, body: bytes) -> int:
    conn.request("POST", "/v1/route", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status


def _serve(art: Path, max_batch: int, env: dict, *extra: str) -> tuple[subprocess.Popen, int]:
    """``ccpo-jax serve ART`` in a subprocess on a free port: (process, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "ccpo_jax.cli", "serve", str(art), "--port", "0",
                             "--max-batch", str(max_batch), "--max-bytes", str(8 << 20), *extra],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = proc.stderr.readline()
    return proc, int(line.split("http://127.0.0.1:")[1].split()[0])


def _connects(port: int, n: int) -> tuple[list[float], float]:
    """Seconds of each of ``n`` connections opened one after another and held open, and in all."""
    socks, times = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        t1 = time.perf_counter()
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        times.append(time.perf_counter() - t1)
    total = time.perf_counter() - t0
    for s in socks:
        s.close()
    return times, total


def _memory_sweeps(proc: subprocess.Popen, port: int, records: list[dict], max_batch: int,
                   sweeps: int) -> tuple[float, list[float], float, float]:
    """The server's RSS before, after each sweep of every batch size 1..max_batch, and at its peak (MB);
    the sweeps' seconds."""
    before = rss_mb(proc.pid)
    peak, after = before, []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    for _ in range(sweeps):
        for b in range(1, max_batch + 1):
            batch = [{"rounds": records[i % len(records)]["rounds"][: 1 + i % 4]} for i in range(b)]
            assert post(conn, json.dumps({"batch": batch}).encode()) == 200
            if b % 64 == 0:
                peak = max(peak, rss_mb(proc.pid))
        after.append(rss_mb(proc.pid))
    sweep_s = time.perf_counter() - t0
    conn.close()
    return before, after, max(peak, *after), sweep_s


def _clients(port: int, one: bytes, n_clients: int, n_requests: int) -> np.ndarray:
    """Latencies (ms) of ``n_clients`` concurrent clients, each on its own keep-alive connection."""
    lat: list[float] = []
    lock = threading.Lock()

    def run():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        for _ in range(n_requests):
            t = time.perf_counter()
            assert post(c, one) == 200
            mine.append(time.perf_counter() - t)
        c.close()
        with lock:
            lat.extend(mine)

    ts = [threading.Thread(target=run) for _ in range(n_clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return np.array(lat) * 1e3


def _trickle(port: int, one: bytes, trickle_s: float, stop: threading.Event, trickled: dict) -> None:
    """A slow client: one byte of a request every ``trickle_s`` seconds until ``stop``; counts the
    bytes sent and the 408s received in ``trickled``, and reconnects after each answer."""
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(one)}\r\n\r\n").encode() + one
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            for i in range(len(head)):
                if stop.is_set():
                    return
                try:
                    s.sendall(head[i:i + 1])
                except OSError:
                    break
                trickled["bytes"] += 1
                s.settimeout(trickle_s)
                try:
                    got = s.recv(4096)
                except socket.timeout:
                    continue
                if got.startswith(b"HTTP/1.1 408"):
                    trickled["408"] += 1
                break


def _measure(args: argparse.Namespace, art: Path, records: list[dict], env: dict) -> dict:
    """The three phases against one server (module docstring), then the connects against a second
    one with ``--backlog 5``: every measured number, by name."""
    proc, port = _serve(art, args.max_batch, env)
    try:
        log_lines: list[str] = []
        threading.Thread(target=lambda: log_lines.extend(proc.stderr), daemon=True).start()
        one = json.dumps({"rounds": records[0]["rounds"][:1]}).encode()

        # 1. memory over every batch size
        before, after, peak, sweep_s = _memory_sweeps(proc, port, records, args.max_batch, args.sweeps)

        # 2. connect times
        times, connect_total = _connects(port, args.connections)
        time.sleep(0.5)

        # 3. p99 of 16 clients, alone and beside a trickling client
        alone = _clients(port, one, args.clients, args.requests)
        stop = threading.Event()
        trickled = {"bytes": 0, "408": 0}
        tt = threading.Thread(target=_trickle, args=(port, one, args.trickle_s, stop, trickled), daemon=True)
        tt.start()
        time.sleep(1.0)
        beside = _clients(port, one, args.clients, args.requests)
        stop.set()
        tt.join(timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    proc5, port5 = _serve(art, args.max_batch, env, "--backlog", "5", "--max-batch", "8")
    try:
        times5, total5 = _connects(port5, args.connections)
    finally:
        proc5.terminate()
        proc5.wait(timeout=20)
    return dict(before=before, after=after, peak=peak, sweep_s=sweep_s, times=times, connect_total=connect_total,
                alone=alone, beside=beside, trickled=trickled, times5=times5, total5=total5, log_lines=log_lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200, help="requests per client per phase")
    ap.add_argument("--trickle-s", type=float, default=0.5)
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="serving-abuse-"))
    art, records = make_artifact(tmp)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    m = _measure(args, art, records, env)

    import jax

    recs: list[dict] = []
    cfg = {"max_batch": args.max_batch, "connections": args.connections, "clients": args.clients,
           "requests": args.requests, "trickle_s": args.trickle_s, "cpus": os.cpu_count()}
    dev = str(jax.devices()[0])

    def rec(name, value, unit, **extra):
        recs.append({"name": name, "value": round(float(value), 4), "unit": unit, "backend": "cpu", "device": dev,
                     "config": {**cfg, **extra}})

    times, times5, alone, beside = m["times"], m["times5"], m["alone"], m["beside"]
    rec("server_rss_mb_before_sweep", m["before"], "MB")
    for i, a in enumerate(m["after"], start=1):
        rec(f"server_rss_mb_after_sweep_{i}", a, "MB", sweep_s=round(m["sweep_s"], 2))
    rec("server_rss_mb_peak_sweep", m["peak"], "MB")
    rec("connect_s_max", max(times), "s", backlog=1024, slow_connects=sum(t > 0.5 for t in times))
    rec("connect_s_total", m["connect_total"], "s", backlog=1024)
    rec("connect_s_max_backlog5", max(times5), "s", backlog=5, slow_connects=sum(t > 0.5 for t in times5))
    rec("connect_s_total_backlog5", m["total5"], "s", backlog=5)
    rec("p50_ms_16_clients", np.percentile(alone, 50), "ms")
    rec("p99_ms_16_clients", np.percentile(alone, 99), "ms")
    rec("p50_ms_16_clients_beside_trickler", np.percentile(beside, 50), "ms")
    rec("p99_ms_16_clients_beside_trickler", np.percentile(beside, 99), "ms",
        trickled_bytes=m["trickled"]["bytes"], trickler_408s=m["trickled"]["408"])
    for r in recs:
        print(f"{r['name']:40s} {r['value']:>12} {r['unit']}")
    log_lines = m["log_lines"]
    print(f"server log lines: {len(log_lines)}; tracebacks: {sum('Traceback' in ln for ln in log_lines)}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in recs))


if __name__ == "__main__":
    main()
