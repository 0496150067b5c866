"""Where the default ``ccpo-jax reproduce`` spends its time: imports, tracing, lowering and XLA
compilation per program, the pipeline's own timing, and a cProfile of the rest.

    python benchmarks/profile_reproduce.py [--out DIR] [--json PROFILE.json] [--top 30] [--pstats P.prof]
        [--cache-dir DIR] [-- reproduce flags]

Runs the command in this process (so every compilation is seen): ``jax_log_compiles`` reports each
program's tracing, jaxpr -> MLIR lowering and XLA compilation; programs named ``jit(<op>)`` of one
primitive are eager operations compiled one at a time. Wall and CPU seconds of each phase are
written to JSON with the machine and its load average; the cProfile's top functions by cumulative
time are printed. ``--cache-dir DIR`` turns on JAX's persistent compilation cache there (run twice
to see a first and a second run). Measurements, not assertions: on a shared machine the absolute
figures move with the load (the JSON holds ``os.getloadavg()`` before and after).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import re
import sys
import time
from collections import defaultdict
from pathlib import Path


_PHASES = {"tracing": re.compile(r"Finished tracing (.+?) for (\w+) in ([0-9.e-]+) sec"),
           "lowering": re.compile(r"Finished jaxpr to MLIR module conversion (.+?) in ([0-9.e-]+) sec"),
           "xla_compile": re.compile(r"Finished XLA compilation of (.+?) in ([0-9.e-]+) sec")}


class CompileLog(logging.Handler):
    """Collects jax's compile log lines: per phase, per program name, count and seconds."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.by = {p: defaultdict(lambda: [0, 0.0]) for p in _PHASES}

    def emit(self, record):
        msg = record.getMessage()
        for phase, rx in _PHASES.items():
            m = rx.search(msg)
            if m:
                name, secs = m.group(1), float(m.group(m.lastindex))
                e = self.by[phase][name]
                e[0] += 1
                e[1] += secs
                return

    def summary(self) -> dict:
        out = {}
        for phase, d in self.by.items():
            progs = sorted(d.items(), key=lambda kv: -kv[1][1])
            eager = [(n, c, s) for n, (c, s) in progs if _eager(n)]
            out[phase] = {"total_s": sum(s for _, (c, s) in progs), "count": sum(c for _, (c, s) in progs),
                          "eager_ops_s": sum(s for _, _, s in eager), "eager_ops_count": sum(c for _, c, _ in eager),
                          "programs": [{"name": n, "count": c, "s": round(s, 4)} for n, (c, s) in progs[:25]]}
        return out


def _eager(name: str) -> bool:
    """A program that is one primitive run eagerly (``jit(add)``, ``jit(convert_element_type)``)."""
    m = re.fullmatch(r"jit\((\w+)\)", name)
    return bool(m) and m.group(1) in _PRIMS


_PRIMS = set()


def _record_phases(w0: float, c0: float) -> list:
    """(phase line, wall s, CPU s since start) at every phase line of the run, shown or not: the pipeline's
    ``status`` calls mark where one phase ends and the next begins."""
    from ccpo_jax.ccpo import reproduce
    from ccpo_jax.runtime import progress

    marks, real = [], progress.status

    def status(text, enabled=True):
        marks.append((text, time.perf_counter() - w0, time.process_time() - c0))
        real(text, enabled)

    progress.status = reproduce.status = status
    return marks


#: Functions of the run outside its compiled programs whose seconds ``--time-fn`` counts by default.
_TIMED = ("ccpo_jax.ccpo.observable:fit_scores", "ccpo_jax.ccpo.observable:best_observable_row",
          "ccpo_jax.ccpo.report:write_boxplots", "ccpo_jax.ccpo.report:write_results",
          "ccpo_jax.ccpo.report:write_table", "ccpo_jax.ccpo.prepare:prepare",
          "ccpo_jax.ccpo.baselines:non_learned_rows", "ccpo_jax.ccpo.members:train_many",
          "ccpo_jax.ccpo.evaluation:evaluate_members", "ccpo_jax.ccpo.rows:kept_seeds",
          "ccpo_jax.ccpo.policy_store:save_policies", "ccpo_jax.ccpo.prepare:load_run_cache",
          "ccpo_jax.ccpo.prepare:bound_row", "ccpo_jax.ccpo.evaluation:calibration_diagnostics")


#: The functions that run the default reproduce's compiled programs (training chunks, evaluations).
_PROGRAMS = ("ccpo_jax.ccpo.members:train_many", "ccpo_jax.ccpo.evaluation:evaluate_members",
             "ccpo_jax.ccpo.baselines:non_learned_rows", "ccpo_jax.ccpo.evaluation:calibration_diagnostics")


def _again(a: tuple, k: dict) -> tuple[tuple, dict]:
    """The arguments of a repeated call: any ``Execution`` without checkpoints (which a second
    ``train_many`` would resume from, training nothing), curves or progress."""
    import dataclasses

    from ccpo_jax.runtime.execution import Execution

    quiet = lambda x: (dataclasses.replace(x, ckpt_dir=None, tb_dir=None, progress=False)
                       if isinstance(x, Execution) else x)
    return tuple(map(quiet, a)), {n: quiet(v) for n, v in k.items()}


def _ready(out):
    """Wait for every jax array in ``out`` (dispatch is asynchronous)."""
    import jax

    jax.tree.map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, out)


def _time_functions(specs, repeat=()) -> dict:
    """Wrap each ``module:function`` (and every loaded module's name bound to the same object, so
    ``from m import f`` callers are counted too) to add its calls, wall and CPU seconds (the
    process's: all threads) to the returned dict; those in ``repeat`` are called once more after each
    call (result discarded), its seconds added apart. A name that does not exist is skipped with a note."""
    import importlib

    acc = {}
    specs = list(dict.fromkeys([*specs, *repeat]))
    for spec in specs:
        mod_name, fn_name = spec.split(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            print(f"profile_reproduce: --time-fn {spec}: {e}; skipped", file=sys.stderr)
            continue
        acc[spec] = [0, 0.0, 0.0] + ([0.0, 0.0] if spec in repeat else [])

        def wrapped(*a, _fn=fn, _k=spec, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                out = _fn(*a, **k)
            finally:
                e = acc[_k]
                e[0], e[1], e[2] = e[0] + 1, e[1] + time.perf_counter() - w, e[2] + time.process_time() - c
            if len(acc[_k]) > 3:
                w, c = time.perf_counter(), time.process_time()
                a2, k2 = _again(a, k)
                _ready(_fn(*a2, **k2))
                e[3], e[4] = e[3] + time.perf_counter() - w, e[4] + time.process_time() - c
            return out

        for m in list(sys.modules.values()):
            for name, obj in list(getattr(m, "__dict__", {}).items()):
                if obj is fn:
                    setattr(m, name, wrapped)
    return acc


def _phase_table(marks: list, wall: float, cpu: float) -> list[dict]:
    """Each phase's wall and CPU seconds, from one mark to the next (the last one to the end)."""
    ends = marks[1:] + [("end", wall, cpu)]
    return [{"phase": t[:90], "wall_s": round(e[1] - w, 3), "cpu_s": round(e[2] - c, 3)}
            for (t, w, c), e in zip(marks, ends)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="reproduce's --out (default: a fresh temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the profile here")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pstats", type=Path, default=None, help="also save the cProfile here (pstats format)")
    ap.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache directory (default: off)")
    ap.add_argument("--timer", choices=("wall", "cpu", "none"), default="wall",
                    help="the cProfile's clock: wall, the process's CPU time (all threads; it costs a system call "
                         "per Python call, so it inflates the run), or none (no cProfile: the phases' and --time-fn "
                         "CPU seconds as they are)")
    ap.add_argument("--time-fn", action="append", default=None, metavar="MODULE:FUNCTION",
                    help=f"also count each call's wall and CPU seconds of this function (repeatable; default: "
                         f"{', '.join(_TIMED)})")
    ap.add_argument("--repeat", action="store_true",
                    help=f"call {', '.join(_PROGRAMS)} a second time, right after the first (its result discarded; "
                         "no checkpoints or curves): that call traces, lowers and compiles nothing, so its CPU "
                         "seconds are the programs' execution, the bound no cache can remove")
    ap.add_argument("rest", nargs="*", help="extra reproduce flags after --")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    # the command line's own cache (ccpo_jax.runtime.compile_cache, set up before jax is imported, as the CLI
    # does) only with --cache-dir: without it a profile is a cold run
    os.environ["CCPO_JAX_COMPILATION_CACHE"] = args.cache_dir or "off"
    from ccpo_jax.runtime.compile_cache import configure

    configure()
    w0, c0 = time.perf_counter(), time.process_time()
    import jax  # noqa: F401 - timed: the import is part of start-up
    from jax._src import core as jcore
    w_jax, c_jax = time.perf_counter() - w0, time.process_time() - c0
    _PRIMS.update(n for n in dir(jax.lax) if not n.startswith("_"))
    _PRIMS.update(p.name for p in vars(jcore).values() if isinstance(p, jcore.Primitive))
    jax.config.update("jax_log_compiles", True)
    log = CompileLog()
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.pjit", "jax._src.stages"):
        lg = logging.getLogger(name)
        lg.addHandler(log)
        lg.setLevel(logging.DEBUG)
        lg.propagate = False
    from ccpo_jax.cli.main import main as cli_main  # noqa: E402
    w_imp, c_imp = time.perf_counter() - w0, time.process_time() - c0
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"profile-reproduce-{os.getpid()}"
    prof = cProfile.Profile(time.process_time) if args.timer == "cpu" else cProfile.Profile()
    phases = _record_phases(w0, c0)
    timed = _time_functions(args.time_fn or _TIMED, _PROGRAMS if args.repeat else ())
    if args.timer != "none":
        prof.enable()
    first_line = {}
    real_print = print

    def say(*a, **k):
        first_line.setdefault("s", time.perf_counter() - w0)
        real_print(*a, **k)

    import builtins
    builtins.print = say
    try:
        cli_main(["reproduce", "--out", str(out), "--no-progress", *args.rest])
    except SystemExit as e:
        if e.code:
            raise
    finally:
        builtins.print = real_print
        prof.disable()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    results = json.loads((out / "results.json").read_text())
    s = io.StringIO()
    if args.timer != "none":
        if args.pstats:
            prof.dump_stats(str(args.pstats))
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
    profile = {
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg(),
                    "backend": jax.default_backend(), "jax": jax.__version__},
        "args": args.rest, "cache_dir": args.cache_dir, "out": str(out),
        "wall_s": wall, "cpu_s": cpu, "first_line_s": first_line.get("s"),
        "import_jax": {"wall_s": w_jax, "cpu_s": c_jax}, "import_cli": {"wall_s": w_imp, "cpu_s": c_imp},
        "results_timing": results["timing"], "compile_log": log.summary(), "timer": args.timer,
        "phases": _phase_table(phases, wall, cpu),
        "functions": {k: {"calls": v[0], "wall_s": round(v[1], 3), "cpu_s": round(v[2], 3),
                          **({"repeat_wall_s": round(v[3], 3), "repeat_cpu_s": round(v[4], 3)} if len(v) > 3 else {})}
                      for k, v in timed.items()},
    }
    real_print(s.getvalue()[:12000], file=sys.stderr)
    summary = {k: profile[k] for k in ("wall_s", "cpu_s", "first_line_s", "import_jax", "import_cli", "results_timing",
                                       "phases", "functions")}
    summary["compile"] = {p: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items() if k != "programs"}
                          for p, d in profile["compile_log"].items()}
    real_print(json.dumps(summary, indent=1), file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(profile, indent=1))


if __name__ == "__main__":
    main()
