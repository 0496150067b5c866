"""Calls per second of ``ccpo-jax data collect`` against a local scripted server.

The server is the tests' chat-completions fake (``ccpo_jax/testing/chat_server.py``: stdlib
http.server on 127.0.0.1, deterministic replies with usage and logprobs), run
in its own process, so the figure is the collector's own overhead (HTTP
client, parsing, call log fsync, cache appends) plus the fake server's, at the
given concurrency; with
``--server-delay-ms`` each reply waits that long, as a remote model would.
Protocol: T = 4 rounds, LLM-EXIT of both models and LLM-as-policy of the guide.

Prints one JSON record per line {"name","value","unit","backend","device","config"}
and writes them to --out (atomic).

    python benchmarks/collect_throughput.py [--questions 200] [--concurrency 8] [--server-delay-ms 0,50]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, write_questions

from ccpo_jax.collect.collector import collect
from ccpo_jax.collect.settings import Execution, Settings
from ccpo_jax.llm.questions import load_questions
from ccpo_jax.llm.wire import Endpoint, RetryPolicy
from envs.cache.atomic import atomic_write_json


def run_once(n: int, concurrency: int, delay_ms: float, work: Path) -> dict:
    qf = work / f"q{n}.jsonl"
    write_questions(qf, n)
    questions, sha = load_questions(qf)
    out = work / f"c{concurrency}-d{delay_ms:g}.jsonl"
    # the server in its own process, as a real one would be (in-process it would share the GIL)
    srv = subprocess.Popen([sys.executable, "-m", "ccpo_jax.testing.chat_server", str(n), "--delay-ms", str(delay_ms)],
                           stdout=subprocess.PIPE, text=True)
    try:
        url = srv.stdout.readline().strip()
        s = Settings(T=4, base=Endpoint(url, BASE_MODEL), guide=Endpoint(url, GUIDE_MODEL),
                     prices={"base": (0.0, 0.0), "guide": (2.5, 10.0)}, price_sources={"base": "-", "guide": "-"},
                     questions_file=qf.name, questions_sha256=sha, exit_roles=("base", "guide"),
                     policy_roles=("guide",))
        o = collect(s, questions, out, Execution(concurrency=concurrency, retry=RetryPolicy(), progress=False),
                    echo=lambda *_: None)
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    assert o.complete
    return {"calls": o.meter.sent, "seconds": o.elapsed_s, "calls_per_s": o.meter.sent / o.elapsed_s,
            "questions_per_s": n / o.elapsed_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=Execution().concurrency)
    ap.add_argument("--server-delay-ms", default="0,50")
    ap.add_argument("--out", default="runs/benchmarks/collect_throughput.json")
    args = ap.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in (float(x) for x in args.server_delay_ms.split(",")):
            r = run_once(args.questions, args.concurrency, d, Path(tmp))
            cfg = {"questions": args.questions, "concurrency": args.concurrency, "server_delay_ms": d,
                   "T": 4, "baselines": "exit base,guide; policy guide", "calls": r["calls"],
                   "seconds": round(r["seconds"], 3), "cpus": os.cpu_count()}
            rec = {"name": "collect_calls_per_s", "value": round(r["calls_per_s"], 1), "unit": "calls/s",
                   "backend": "http-loopback", "device": platform.processor() or platform.machine(), "config": cfg}
            print(json.dumps(rec))
            records.append(rec)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, records, indent=2)


if __name__ == "__main__":
    main()
