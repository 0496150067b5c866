"""A real ``redis-server`` on a free loopback port, for the shared-state tests (Debian's package).

Skipped with the reason when the binary is missing, except under ``CI=true``, where that is a
failure: ``.ci/run`` installs it. ``persist=True`` keeps an append-only file (fsync always) in the
server's folder, so that a stop and start keeps the data; without it a restart is empty.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def redis_binary() -> str:
    import pytest  # here only: pytest is a test dependency, not a runtime one

    b = shutil.which("redis-server")
    if b is None:
        msg = "redis-server is not installed (apt-get install redis-server): the shared-state tests need a real one"
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):  # tests.helpers.IN_CI's rule
            pytest.fail(msg + "; .ci/run installs it")
        pytest.skip(msg)
    return b


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder: Path, persist: bool = False):
        self.bin, self.dir, self.persist = redis_binary(), Path(folder), persist
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.bin, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.proc is not None:
            self.resume()
        self.stop()
