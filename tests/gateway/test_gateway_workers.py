"""``gateway --workers``: the parent's supervision of its workers (ccpo_jax.gateway.workers.serve_workers).

Stand-in workers (module functions, started by the real spawn context) report ready or a refusal as
the gateway's worker does, so that the restart policy is tested without JAX or a store: a worker that
is refused every time it starts (before: started again every half second, a fresh interpreter each, the
reason never shown) is restarted with a growing delay, and its reason is logged once.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

# loaded before serve_workers sets PROMETHEUS_MULTIPROC_DIR: prometheus_client picks its value class at import,
# so a first import under that variable would leave every later Metrics of this process in multiprocess mode
import prometheus_client  # noqa: F401,E402


def _stand_in(folder: str, cfg, address, family, index: int, ready) -> None:
    """Worker 1 serves; worker 0 serves once, dies, and is refused at every later start."""
    d = Path(folder)
    with open(d / f"starts-{index}", "a") as f:
        f.write(f"{time.monotonic()}\n")
    if index == 0 and (d / "served-0").exists():
        ready.put((0, "error: --state redis://x/0: the store holds no deployment (refused)"))
        sys.exit(2)
    ready.put((index, "ready"))
    (d / f"served-{index}").touch()
    if index == 0:
        while not (d / "served-1").exists():
            time.sleep(0.05)
        time.sleep(0.3)
        sys.exit(1)  # (a crash after serving)
    time.sleep(600)


def test_a_worker_refused_at_every_start_is_restarted_with_a_growing_delay_and_says_why(tmp_path, caplog,
                                                                                        monkeypatch):
    from ccpo_jax.gateway.workers import serve_workers

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unset")  # (serve_workers sets it: undone after the test)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    old = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(6.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway"):
            rc = serve_workers(str(tmp_path), None, sock, 2, "banner", echo=lambda *a, **k: None,
                               target=_stand_in, backoff_s=(1.0, 60.0))
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
        sock.close()
    assert rc == 0
    starts = [float(x) for x in (tmp_path / "starts-0").read_text().split()]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # served, died: started again at once; refused: after 1 s, then 2 s (the next, 4 s later, past the 6 s)
    assert 3 <= len(starts) <= 4, gaps
    assert all(g >= w for g, w in zip(gaps[1:], (1.0, 2.0))), gaps
    refusals = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert refusals == ["worker 0 could not start: --state redis://x/0: the store holds no deployment (refused)"]
    assert len((tmp_path / "starts-1").read_text().split()) == 1  # the serving worker was left alone
