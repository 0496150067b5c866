"""Timing and recording helpers of the benchmark suite (benchmarks/run.py; docs/performance.md):
the machine's description, compile-then-time of a jitted function, and the records of one run."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_desc() -> tuple[str, str]:
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return "cpu", f"{n}-core CPU ({cpu_name()})"
    return jax.default_backend(), f"{len(jax.devices())} x {d.device_kind}"


def compile_and_time(fn, *args, repeats: int = 3, min_time: float = 0.2):
    """(compile_s, best seconds per call): AOT-compile ``jax.jit(fn)``, then time calls until ``min_time``."""
    import jax

    t0 = time.perf_counter()
    comp = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(comp(*args))  # first run (allocations)
    best, total, n = float("inf"), 0.0, 0
    while n < repeats or (total < min_time and n < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(comp(*args))
        dt = time.perf_counter() - t0
        best, total, n = min(best, dt), total + dt, n + 1
    return compile_s, best


def n_steps_for(n_envs: int, work: int, lo: int = 10, hi: int = 2000) -> int:
    return int(min(hi, max(lo, work // n_envs)))


class Recorder:
    def __init__(self, backend: str, device: str):
        self.records: list[dict] = []
        self.backend, self.device = backend, device
        self.on_add = None  # called after every record (saves the JSON so far)

    def add(self, name: str, value: float, unit: str, **config) -> dict:
        r = {"name": name, "value": float(value), "unit": unit, "backend": self.backend,
             "device": self.device, "config": config}
        self.records.append(r)
        if self.on_add is not None:
            self.on_add()
        cfg = ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("cache", "synthetic", "impl"))
        print(f"  {name:44s} {value:16,.2f}  {unit:14s} {cfg[:90]}", flush=True)
        return r
