"""What bounds the CPO step (``benchmarks/cpo_step.py``) on this CPU, measured with one XLA thread.

    python benchmarks/cpo_bound.py [--out F.json] [--torch-ms 16.97] [--repeats 200]

1. **Kernels per step.** The compiled step's optimised HLO (``jax.jit(...).lower().compile().as_text()``):
   every instruction of a computation XLA:CPU runs as a sequence of thunks (the entry, while bodies and
   conditions, conditional branches, calls; not the fused computations or reducers inside a kernel) that
   is not free (parameter, constant, tuple, get-tuple-element, bitcast), counted once per execution: a
   while loop's body times its trips (the conjugate gradient's: ``cg_iters``, as ``tol = atol = 0``).
2. **The floor of one kernel.** K trivial kernels in sequence (a loop of K trips over ``sin`` of 64 floats;
   the kernels it executes counted from its HLO as above): (t(K) - t(1)) / (kernels(K) - kernels(1)).
3. **The conjugate gradient's sequential cost.** The step timed with ``cg_iters`` = 10 and 2: every
   iteration waits for the previous one's Hessian-vector product, so (t10 - t2) / 8 is one iteration,
   whatever the cores.
4. **What 25x the peer needs:** ``--torch-ms`` / 25 (the PyTorch peer's single-step time, measured by
   ``benchmarks/perf.py``), against kernels x floor.

Times are the median CPU seconds of a call (one XLA thread: the call's own, which the other jobs of a
shared machine do not inflate as they do wall time). Prints and writes (``--out``) house-format records.
Measurements, not assertions.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # one XLA thread, set before jax starts (not when a test imports the counter)
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cpo_step as cs  # noqa: E402  (benchmarks/cpo_step.py)
from ccpo_jax.core import trust_region as tr  # noqa: E402

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
         "opt-barrier"}
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .+? ([a-z][a-z0-9\-]*)\((.*)$")


def parse_hlo(text: str) -> tuple[str, dict[str, list[tuple[str, str]]]]:
    """(entry name, {computation: [(opcode, rest of line)]}) of an HLO module's text."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
            continue
        if line.strip() == "}":
            cur = None
            continue
        i = _INSTR.match(line) if cur else None
        if i:
            comps[cur].append((i.group(1), i.group(2)))
    return entry, comps


def executed_kernels(text: str, while_trips: int) -> dict:
    """Kernels (thunks) one execution runs: each sequenced computation's non-free instructions, a while
    loop's body ``while_trips`` times (or its known trip count) and its condition once more; nested loops
    multiply (``while_loops`` then lists an inner loop once per count of it)."""
    entry, comps = parse_hlo(text)
    loops = []

    def count(name: str, times: int) -> int:
        n = 0
        for op, rest in comps.get(name, []):
            if op in _FREE:
                continue
            n += times
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                trips = int(trips.group(1)) if trips else while_trips
                ops = [o for o, _ in comps.get(body, []) if o not in _FREE]
                fused = [re.search(r"calls=%?([\w.\-]+)", r) for o, r in comps.get(body, []) if o == "fusion"]
                dots = sum(any(o in ("dot", "convolution") for o, _ in comps.get(f.group(1), [])) for f in fused if f)
                loops.append({"body": body, "trips": trips, "body_kernels": count(body, 1),
                              "body_opcodes": {o: ops.count(o) for o in sorted(set(ops))},
                              "body_kernels_with_a_product": dots + ops.count("dot")})
                n += count(body, times * trips) + count(cond, times * (trips + 1))
            elif op == "conditional":
                branches = re.findall(r"%?([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)
                                      if "branch_computations" in rest else "")
                n += max((count(b, times) for b in branches), default=0)
            elif op == "call":
                n += count(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1), times)
        return n

    total = count(entry, 1)
    ops = [op for op, _ in comps[entry] if op not in _FREE]
    return {"executed": total, "entry": len(ops), "while_loops": loops,
            "opcodes_in_entry": {o: ops.count(o) for o in sorted(set(ops))}}


def median_s(fn, args, repeats: int) -> float:
    """Median CPU seconds of a call (the process's: with one XLA thread, the call's own; unlike wall time it
    does not grow with the other jobs on a shared machine)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        jax.block_until_ready(fn(*args))
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def chain(k: int):
    """k trivial kernels in sequence: a loop of k trips over ``sin`` of 64 floats (XLA fuses a straight chain
    into one kernel, barriers or not; a loop's body runs as its own kernels on every trip)."""
    return jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda i, y: jnp.sin(y), x))


def matmuls(k: int):
    """k dependent [40, 64] x [64, 64] float32 products (the policy's hidden layer on the step's 40 rows)."""
    w = jnp.eye(64, dtype=jnp.float32) * 0.5
    return jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda i, y: y @ w, x))


def step_with(cg_iters: int):
    """cpo_step.py's step with another CG iteration count (traced with it, then restored)."""
    real = tr.cpo_update

    def f(params, batch):
        tr.cpo_update = functools.partial(real, cg_iters=cg_iters)
        try:
            return cs.cpo_step(params, batch)
        finally:
            tr.cpo_update = real
    return jax.jit(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--torch-ms", type=float, default=None, help="the peer's single step (perf.py), for the 25x line")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    dev = f"{os.cpu_count()}-core CPU" if jax.default_backend() == "cpu" else str(jax.devices()[0].device_kind)
    cfg = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "load_average": round(os.getloadavg()[0], 2)}
    recs = []

    def rec(name, value, unit, **c):
        recs.append({"name": name, "value": value, "unit": unit, "backend": jax.default_backend(), "device": dev,
                     "config": dict(cfg, **c)})
        print(f"{name:42s} {value:12.4g} {unit:6s} {c if c else ''}", flush=True)

    params, batch = cs.make_problem(jax.random.PRNGKey(0))
    text = jax.jit(cs.cpo_step).lower(params, batch).compile().as_text()
    k = executed_kernels(text, while_trips=10)
    rec("cpo_step_kernels_executed", k["executed"], "count", entry=k["entry"], while_loops=k["while_loops"])
    x = jnp.ones((64,), jnp.float32)
    n_short, n_long = 1, 2000
    ks = [executed_kernels(chain(n).lower(x).compile().as_text(), 1)["executed"] for n in (n_short, n_long)]
    t_short, t_long = (median_s(chain(n), (x,), args.repeats) for n in (n_short, n_long))
    floor = (t_long - t_short) / (ks[1] - ks[0])
    rec("kernel_floor_us", 1e6 * floor, "us", kernels=ks, t_short_us=1e6 * t_short, t_long_us=1e6 * t_long,
        kernel="a fori_loop over sin of 64 float32")
    rec("call_floor_us", 1e6 * t_short, "us", what="one jitted call of one trivial kernel, dispatch included")
    h = jnp.ones((40, 64), jnp.float32)
    t_m = (median_s(matmuls(501), (h,), args.repeats // 4) - median_s(matmuls(1), (h,), args.repeats // 4)) / 500
    rec("matmul_40x64x64_us", 1e6 * t_m, "us", gflops=2 * 40 * 64 * 64 / t_m / 1e9,
        what="one dependent [40,64]x[64,64] float32 product in a loop, kernel overheads included")
    t10 = median_s(step_with(10), (params, batch), args.repeats)
    t2 = median_s(step_with(2), (params, batch), args.repeats)
    rec("cpo_step_ms", 1e3 * t10, "ms", cg_iters=10)
    rec("cpo_step_cg2_ms", 1e3 * t2, "ms", cg_iters=2)
    rec("cg_iteration_us", 1e6 * (t10 - t2) / 8, "us", body_kernels=[w["body_kernels"] for w in k["while_loops"]],
        body_kernels_with_a_product=[w["body_kernels_with_a_product"] for w in k["while_loops"]])
    rec("cpo_step_cg_share", 10 * (t10 - t2) / 8 / t10, "ratio", what="10 CG iterations / the step")
    rec("cpo_step_kernel_floor_ms", 1e3 * k["executed"] * floor, "ms", what="kernels executed x floor of one kernel")
    rec("cpo_step_kernel_floor_share", k["executed"] * floor / t10, "ratio")
    if args.torch_ms:
        need = args.torch_ms / 25
        rec("cpo_step_ms_for_25x", need, "ms", torch_ms=args.torch_ms)
        rec("cpo_step_kernels_for_25x_at_floor", 1e-3 * need / floor, "count",
            what="the most kernels a step could run at the floor alone, computing nothing")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(recs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
