"""The three speed goals of the project in one run (docs/performance.md): the default reproduce, the
gateway's overhead and the CPO step against its PyTorch peer, as ratios measured back to back where a
ratio exists, with absolute times labelled with the machine.

    python benchmarks/perf.py [--out perf.json] [--only reproduce,gateway,cpo] [--quick]
        [--reproduce-args "--splits 100"] [--requests 300] [--torch-python PATH]

* ``reproduce``: ``ccpo-jax reproduce`` (default setting) twice in fresh processes sharing one new
  persistent compilation cache folder (the first run compiles, the second reads, the trainer's and the
  evaluations' executables without tracing them: ``executables/`` beside it; docs/performance.md),
  wall and CPU seconds of each, its ``timing``, the executables kept, and whether the two results.json are
  equal value for value
  (``benchmarks/diff_results.py``); then once more with the cache off (the run a user without the cache
  pays).
* ``gateway``: ``benchmarks/gateway_overhead.py`` on the default export of the first run (``ccpo-jax
  export`` picks the row), scripted upstream at 20 ms a call, concurrency 1, 16 and 64: the median and p99
  overhead over the direct upstream calls, the gateway's CPU per request (the bound: one event loop).
* ``cpo``: ``benchmarks/cpo_step.py``'s step, one XLA thread, one problem and 100 problems in one vmapped
  call, against ``benchmarks/cpo_step_torch.py`` with one torch thread on the same problems (skipped when
  no python with torch is found; ``--torch-python``), and that the peer computed the same step.

Every record is ``{"name","value","unit","backend","device","config"}``; the JSON is rewritten after each
section. Speed is measured here and never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from timing import Recorder, device_desc  # noqa: E402

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _env(**extra) -> dict:
    # the runs' caches are the folders given here, with the executables beside (ccpo_jax.runtime.executables)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "CCPO_JAX_EXECUTABLES"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _timed(cmd: list[str], env: dict) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, CPU s of the child and its children, the process) of one command."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr[-2000:]}")
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), p


def reproduce_section(rec: Recorder, work: Path, args) -> Path:
    """First and second run with one fresh cache folder, then one without a cache; returns the first run."""
    from diff_results import diff

    cache = work / "xla-cache"
    extra = shlex.split(args.reproduce_args)
    runs = {}
    for name, value in (("first", str(cache)), ("second", str(cache)), ("no_cache", "off")):
        out = work / f"reproduce-{name}"
        wall, cpu, _ = _timed([sys.executable, "-m", "ccpo_jax.cli", "reproduce", "--out", str(out), "--no-progress",
                               *extra], _env(CCPO_JAX_COMPILATION_CACHE=value))
        res = json.loads((out / "results.json").read_text())
        runs[name] = res
        cfg = dict(run=name, args=" ".join(extra) or "default", load_average=round(os.getloadavg()[0], 2))
        rec.add("reproduce_wall_s", wall, "s", **cfg)
        rec.add("reproduce_cpu_s", cpu, "s", **cfg)
        for k in ("compile_s", "train_s", "eval_s"):
            rec.add(f"reproduce_{k}", res["timing"].get(k, 0.0), "s", **cfg)
        if value != "off":  # the programs kept without tracing (ccpo_jax.runtime.executables): the second run adds none
            kept = sorted(p.name for p in (cache / "executables").glob("*.exe"))
            rec.add("reproduce_executables_kept", len(kept), "count", **cfg, names=",".join(k.rsplit("-", 1)[0] for k in kept))
    walls = {r["config"]["run"]: r["value"] for r in rec.records if r["name"] == "reproduce_wall_s"}
    rec.add("reproduce_second_over_first_wall", walls["second"] / walls["first"], "ratio")
    for other in ("second", "no_cache"):
        d = list(diff(runs["first"], runs[other], ignore=frozenset({"timing"})))
        rec.add(f"reproduce_results_equal_{other}_vs_first", float(not d), "bool", differences=len(d))
    return work / "reproduce-first"


def gateway_section(rec: Recorder, work: Path, run_dir: Path, args) -> None:
    art = work / "artifact"
    _, _, p = _timed([sys.executable, "-m", "ccpo_jax.cli", "export", str(run_dir), "--out", str(art)],
                     _env(CCPO_JAX_COMPILATION_CACHE="off"))
    row = json.loads((art / "manifest.json").read_text())["policy"]["row"]
    out = work / "gateway.json"
    subprocess.run([sys.executable, "benchmarks/gateway_overhead.py", str(art), "--concurrency", "1,16,64",
                    "--requests", str(args.requests), "--json", str(out)], cwd=REPO, env=_env(), check=True,
                   capture_output=True, text=True)
    g = json.loads(out.read_text())
    for c, lv in g["levels"].items():
        cfg = dict(concurrency=int(c), row=row, requests=args.requests, delay_ms=g["delay_ms_per_upstream_call"],
                   load_average=lv["gateway"]["load_average_1min"])
        rec.add("gateway_overhead_median_ms", lv["overhead_median_ms"], "ms", **cfg)
        rec.add("gateway_overhead_p99_ms", lv["overhead_p99_ms"], "ms", **cfg)
        rec.add("gateway_over_direct_median_latency", lv["gateway"]["median_ms"] / lv["direct"]["median_ms"], "ratio", **cfg)
        rec.add("gateway_over_direct_requests_per_s", lv["gateway"]["requests_per_s"] / lv["direct"]["requests_per_s"],
                "ratio", **cfg)
        rec.add("gateway_cpu_ms_per_request", lv["gateway"]["gateway_cpu_ms_per_request"], "ms", **cfg)
        rec.add("gateway_errors", lv["gateway"]["errors"] + lv["direct"]["errors"], "count", **cfg)
    for name, v in g["router"].items():
        rec.add("router_decision_median_ms", v["median_ms"], "ms", path=name, row=row)


def _torch_python(given: str | None) -> str | None:
    cands = [given] if given else [sys.executable, str(REPO / ".venv-torch" / "bin" / "python")]
    for py in cands:
        if py and Path(py).exists() and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


def cpo_worker(out: Path, problems: int, repeats: int) -> None:
    """The JAX side (run in a process with one XLA thread): problems to npz, timings and steps to JSON."""
    import jax
    import numpy as np

    import cpo_step as B

    keys = jax.random.split(jax.random.PRNGKey(1), problems)
    params, batch = jax.vmap(B.make_problem)(keys)
    d = {f"{n}{k}": np.asarray(params["params"][f"Dense_{k}"][leaf]) for k in range(4)
         for n, leaf in (("W", "kernel"), ("b", "bias"))}
    d.update({k: np.asarray(v) for k, v in batch.items()})
    d.update(kappa=B.KAPPA, alpha=B.ALPHA, delta=B.DELTA, cg_iters=10, backtrack_steps=15)
    np.savez(out / "problems.npz", **d)
    one = jax.tree.map(lambda x: x[0], (params, batch))
    c1, t1 = B._time(jax.jit(B.cpo_step), one, repeats)
    cb, tb = B._time(jax.jit(jax.vmap(B.cpo_step)), (params, batch), max(3, repeats // 4))
    new, info = jax.jit(jax.vmap(B.cpo_step))(params, batch)
    flat = np.concatenate([np.asarray(new["params"][f"Dense_{k}"][leaf]).reshape(problems, -1) for k in range(4)
                           for leaf in ("kernel", "bias")], axis=1)
    np.save(out / "jax_params.npy", flat)
    (out / "jax.json").write_text(json.dumps({"single_s": t1, "single_compile_s": c1, "vmap_s": tb, "vmap_compile_s": cb,
                                              "backtracks": np.asarray(info.n_backtracks).tolist(),
                                              "cases": np.asarray(info.direction.case).tolist()}))


def cpo_section(rec: Recorder, work: Path, args) -> None:
    import numpy as np

    d = work / "cpo"
    d.mkdir(exist_ok=True)
    env = _env(XLA_FLAGS=ONE_THREAD, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", ""))
    subprocess.run([sys.executable, __file__, "--cpo-worker", str(d), "--problems", str(args.problems)], env=env,
                   cwd=REPO, check=True)
    j = json.loads((d / "jax.json").read_text())
    cfg = dict(problems=args.problems, xla_threads=1, step="benchmarks/cpo_step.py (KL-Hessian products, CG 10, 15 candidates)")
    rec.add("cpo_step_jax_single_ms", 1e3 * j["single_s"], "ms", **cfg)
    rec.add("cpo_step_jax_vmap_ms", 1e3 * j["vmap_s"], "ms", **cfg)
    rec.add("cpo_step_jax_compile_s", j["single_compile_s"] + j["vmap_compile_s"], "s", **cfg)
    py = _torch_python(args.torch_python)
    if py is None:
        rec.add("cpo_step_torch_skipped", 1.0, "bool", reason="no python with torch (--torch-python)")
        return
    subprocess.run([py, str(REPO / "benchmarks" / "cpo_step_torch.py"), str(d / "problems.npz"), str(d / "torch.json"),
                    "--threads", "1"], cwd=REPO, check=True)
    t = json.loads((d / "torch.json").read_text())
    cfg = dict(cfg, torch=t["torch"], torch_threads=1)
    rec.add("cpo_step_torch_single_ms", 1e3 * t["single_s"], "ms", **cfg)
    rec.add("cpo_step_torch_loop_ms", 1e3 * t["loop_s"], "ms", **cfg)
    rec.add("cpo_step_torch_over_jax_single", t["single_s"] / j["single_s"], "ratio", **cfg)
    rec.add("cpo_step_torch_loop_over_jax_vmap", t["loop_s"] / j["vmap_s"], "ratio", **cfg)
    jp, tp = np.load(d / "jax_params.npy"), np.asarray(t["params"])
    th0 = np.load(d / "problems.npz")
    th0 = np.concatenate([th0[f"{n}{k}"].reshape(args.problems, -1) for k in range(4) for n in "Wb"], axis=1)
    rel = np.linalg.norm((jp - th0) - (tp - th0), axis=1) / np.maximum(np.linalg.norm(jp - th0, axis=1), 1e-12)
    rec.add("cpo_step_peer_max_relative_step_difference", float(rel.max()), "ratio", **cfg)
    rec.add("cpo_step_peer_same_backtracks_and_cases", float(t["backtracks"] == j["backtracks"] and t["cases"] == j["cases"]),
            "bool", **cfg)


def _section(rec: Recorder, name: str, fn, *a):
    """Run one section; a failure (a package missing on a GPU image, a server that did not start) is a
    record saying so, and the other sections still run."""
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        rec.add(f"{name}_failed", 1.0, "bool", error=f"{type(e).__name__}: {str(e)[-500:]}")
        print(f"perf: section {name} failed: {e}", file=sys.stderr, flush=True)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks/perf.json"))
    ap.add_argument("--only", default="reproduce,gateway,cpo")
    ap.add_argument("--quick", action="store_true", help="10 splits, 100 requests per cell, 20 CPO problems")
    ap.add_argument("--reproduce-args", default="")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--torch-python", default=None)
    ap.add_argument("--cpo-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpo_worker is not None:
        cpo_worker(args.cpo_worker, args.problems, 20)
        return 0
    if args.quick:
        args.reproduce_args = args.reproduce_args or "--splits 10"
        args.requests, args.problems = min(args.requests, 100), min(args.problems, 20)
    backend, device = device_desc()
    rec = Recorder(backend, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec.records, indent=1) + "\n")
        tmp.replace(args.out)

    rec.on_add = save
    only = set(args.only.split(","))
    print(f"perf: {device} ({backend}), load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ccpo-perf-") as tmp:
        work = Path(tmp)
        run_dir = None
        if "reproduce" in only:
            run_dir = _section(rec, "reproduce", reproduce_section, rec, work, args)
        if "gateway" in only:
            if run_dir is None:
                _timed([sys.executable, "-m", "ccpo_jax.cli", "reproduce", "--out", str(work / "run"), "--no-progress",
                        *shlex.split(args.reproduce_args)], _env())
                run_dir = work / "run"
            _section(rec, "gateway", gateway_section, rec, work, run_dir, args)
        if "cpo" in only:
            _section(rec, "cpo", cpo_section, rec, work, args)
    print(f"perf: wrote {len(rec.records)} records to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
