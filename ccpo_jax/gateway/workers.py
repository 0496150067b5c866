"""``ccpo-jax gateway --workers N``: N gateway processes behind one port on this machine.

The parent binds the port (SO_REUSEPORT, not listening: it holds the port), checks the
configuration (it joins the shared store once, so that a refusal is one error line), then starts N
workers with ``multiprocessing``'s spawn (a fresh interpreter each: JAX does not survive a fork).
Each worker listens on its own SO_REUSEPORT socket of the port, and the kernel hashes the
connections over the listening sockets (one shared socket was tried first: one worker's event loop
accepted all 32 connections of a burst). Each worker is a replica of the
deployment (``--state`` is required), with its own spool in ``--spool``. A worker that dies
(``kill -9`` included) is started again; what it had answered is in the store or in its spool, which
the next worker adopts. The workers' metrics are one scrape target: prometheus_client's multiprocess
mode sums them (``PROMETHEUS_MULTIPROC_DIR``, a folder made for this run).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time

log = logging.getLogger("ccpo_jax.gateway")


def _worker(artifact: str, cfg, address: tuple, family: int, index: int, ready) -> None:
    """One worker: load the gateway (its own replica name, spool and store connection) and serve."""
    import socket

    import uvicorn

    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.service import load_gateway
    from ccpo_jax.gateway.app import build_app
    from ccpo_jax.serving.server import uvicorn_config

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s %(name)s[w{index}]: %(message)s")
    logging.getLogger("ccpo_jax.gateway").setLevel(logging.INFO)
    try:
        gw = load_gateway(artifact, dataclasses.replace(cfg, replica=f"{cfg.replica}/w{index}"))
    except UserError as e:
        ready.put((index, f"error: {e}"))
        sys.exit(2)
    server = uvicorn.Server(uvicorn_config(build_app(gw), cfg.server, timeout_graceful_shutdown=5))
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)

    def tell():
        while not server.started:
            time.sleep(0.05)
        ready.put((index, "ready"))
    threading.Thread(target=tell, daemon=True).start()
    server.run(sockets=[sock])


#: A worker that dies again before it serves waits this long before its next start (doubling, seconds):
#: a worker refused at start-up (the store restarted empty, a spool of another deployment) is not a loop
#: of fresh interpreters, one every second.
RESTART_BACKOFF_S = (2.0, 60.0)


def serve_workers(artifact: str, cfg, sock, n: int, banner: str, echo=print, target=None,
                  backoff_s: tuple[float, float] = RESTART_BACKOFF_S) -> int:
    """Run ``n`` workers on ``sock`` until SIGTERM / SIGINT; restart a worker that dies (at once the first
    time, then after ``backoff_s`` doubling while it dies before serving; why it was refused is logged,
    once per reason). Exit status. ``target``: the worker function (tests)."""

    metrics_dir = tempfile.mkdtemp(prefix="ccpo-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (inherited by the spawned workers)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    stop = threading.Event()

    def start(i: int):
        p = ctx.Process(target=target or _worker, args=(artifact, cfg, sock.getsockname(), sock.family, i, ready),
                        name=f"ccpo-gateway-w{i}")
        p.start()
        return p

    procs = {i: start(i) for i in range(n)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        up = 0
        while up < n and not stop.is_set():
            try:
                i, msg = ready.get(timeout=1.0)
            except queue.Empty:
                if any(not p.is_alive() for p in procs.values()):
                    echo("error: a gateway worker exited during start-up", file=sys.stderr)
                    return 2
                continue
            if msg != "ready":
                echo(msg, file=sys.stderr)
                return 2
            up += 1
        echo(f"{banner} ({n} workers, pids {', '.join(str(p.pid) for p in procs.values())})", flush=True)
        _supervise(procs, start, ready, stop, backoff_s)
        return 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(procs: dict, start, ready, stop: threading.Event, backoff_s: tuple[float, float]) -> None:
    """Restart dead workers until ``stop``: a worker's first death at once, then, while it dies before it
    reports ready, after ``backoff_s[0]``, doubling up to ``backoff_s[1]``; a refusal it reported is logged
    once per reason."""
    from prometheus_client import multiprocess

    fails, due, said = {i: 0 for i in procs}, {}, set()
    while not stop.is_set():
        stop.wait(0.5)
        while True:
            try:
                i, msg = ready.get_nowait()
            except queue.Empty:
                break
            if msg == "ready":
                fails[i] = 0
            elif msg not in said:
                said.add(msg)
                log.error("worker %d could not start: %s", i, msg.removeprefix("error: "))
        now = time.monotonic()
        for i, p in list(procs.items()):
            if p.is_alive() or stop.is_set():
                continue
            if i not in due:
                multiprocess.mark_process_dead(p.pid)
                wait = 0.0 if fails[i] == 0 else min(backoff_s[1], backoff_s[0] * 2 ** (fails[i] - 1))
                fails[i] += 1
                due[i] = now + wait
                log.warning("worker %d (pid %s) exited with %s; starting it again%s", i, p.pid, p.exitcode,
                            f" in {wait:g} s" if wait else "")
            if now >= due[i]:
                del due[i]
                procs[i] = start(i)
