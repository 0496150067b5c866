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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="reproduce's --out (default: a fresh temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the profile here")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pstats", type=Path, default=None, help="also save the cProfile here (pstats format)")
    ap.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache directory (default: off)")
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
    prof = cProfile.Profile()
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
    if args.pstats:
        prof.dump_stats(str(args.pstats))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
    profile = {
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg(),
                    "backend": jax.default_backend(), "jax": jax.__version__},
        "args": args.rest, "cache_dir": args.cache_dir, "out": str(out),
        "wall_s": wall, "cpu_s": cpu, "first_line_s": first_line.get("s"),
        "import_jax": {"wall_s": w_jax, "cpu_s": c_jax}, "import_cli": {"wall_s": w_imp, "cpu_s": c_imp},
        "results_timing": results["timing"], "compile_log": log.summary(),
    }
    real_print(s.getvalue()[:12000], file=sys.stderr)
    summary = {k: profile[k] for k in ("wall_s", "cpu_s", "first_line_s", "import_jax", "import_cli", "results_timing")}
    summary["compile"] = {p: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items() if k != "programs"}
                          for p, d in profile["compile_log"].items()}
    real_print(json.dumps(summary, indent=1), file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(profile, indent=1))


if __name__ == "__main__":
    main()
