"""JAX's persistent compilation cache for the ``ccpo-jax`` command line.

A second ``ccpo-jax reproduce`` of the same shapes compiles nothing: every XLA program (the trainer's
chunk, the evaluations, the eager operations) is read back from disk, the same executable, so the
results are the same bits (docs/performance.md#the-persistent-compilation-cache: the default reproduce's
CPU time, first and second run). Tracing and lowering still run; only XLA's compilation is skipped (the
run's big programs skip those too: :mod:`ccpo_jax.runtime.executables`, in ``<folder>/executables``).

Where it lives: ``$XDG_CACHE_HOME/ccpo-jax/xla/<host>`` (default ``~/.cache/ccpo-jax/xla/<host>``), one
folder per CPU model and instruction set (:func:`host_key`), so a home directory shared by machines of
different CPUs never loads code compiled for another; JAX keys every entry by the program, the jax and
XLA versions, the flags and the devices on top of that, and evicts the least recently used entries past
1 GiB. Off: ``CCPO_JAX_COMPILATION_CACHE=off`` (or ``0``/``false``/``no``); another folder:
``CCPO_JAX_COMPILATION_CACHE=DIR``. JAX's own ``JAX_COMPILATION_CACHE_DIR``, when set, wins.
Only the command line turns it on; ``from ccpo_jax ...`` in Python leaves JAX's settings alone.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path
from typing import MutableMapping

ENV = "CCPO_JAX_COMPILATION_CACHE"
#: The executables' layer's variable (:data:`ccpo_jax.runtime.executables.ENV`; not imported: this module
#: runs before jax is).
EXECUTABLES = "CCPO_JAX_EXECUTABLES"
OFF = ("0", "off", "false", "no", "none")
#: JAX evicts least recently used entries beyond this many bytes (a default reproduce writes ~3 MB).
MAX_BYTES = 1 << 30


def host_key() -> str:
    """12 hex digits naming this machine's CPU: architecture, model name and instruction-set flags
    (Linux ``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in parts:
                    parts.append(line.strip())
                if not line.strip() and len(parts) > 2:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def default_dir(environ: MutableMapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/ccpo-jax/xla/<host_key()>`` (``~/.cache`` without the variable)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ccpo-jax" / "xla" / host_key()


def configure(environ: MutableMapping[str, str] | None = None, executables: bool = True) -> str | None:
    """Turn the cache on for this process (and its children) through JAX's environment variables,
    before JAX is imported; returns the folder, or None when off. ``CCPO_JAX_COMPILATION_CACHE``: unset
    = :func:`default_dir`, ``off`` = no cache, else a folder. A ``JAX_COMPILATION_CACHE_DIR`` already set
    is kept. Programs of any compile time are cached (small eager operations too: on a second default
    reproduce they are most of the compilation left; docs/performance.md#figures-behind-code-comments).
    ``environ``: another mapping to fill instead (then JAX's configuration is not touched). ``executables``:
    also keep the big programs' executables beside it (:mod:`ccpo_jax.runtime.executables`); the command line
    does for its own process only, not when ``main`` is called in a Python process (tests), whose traced code
    may be patched at run time, which no key of those executables sees."""
    env, environ = environ, os.environ if environ is None else environ
    choice = (environ.get(ENV) or "").strip()
    if choice.lower() in OFF and choice:
        environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        environ[EXECUTABLES] = "off"
        if env is None:
            _update_jax(None)
        return None
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        if executables:
            _executables(environ, environ["JAX_COMPILATION_CACHE_DIR"])
        return environ["JAX_COMPILATION_CACHE_DIR"]
    path = str(Path(choice).expanduser()) if choice else str(default_dir(environ))
    environ["JAX_COMPILATION_CACHE_DIR"] = path
    if executables:
        _executables(environ, path)
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_BYTES))
    if env is None:
        _update_jax(path)
    return path


def _executables(environ: MutableMapping[str, str], path: str) -> None:
    """The executables kept without tracing (:mod:`ccpo_jax.runtime.executables`) go to ``path/executables``,
    unless ``CCPO_JAX_EXECUTABLES=off`` turns that layer off alone."""
    if (environ.get(EXECUTABLES) or "").strip().lower() not in OFF:
        environ[EXECUTABLES] = str(Path(path) / "executables")


def _update_jax(path: str | None) -> None:
    """JAX reads its variables when imported: if it already is (a caller of ``ccpo_jax.cli.main``), set its
    configuration too, unless that already names a folder."""
    if "jax" not in sys.modules:
        return
    import jax

    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
    elif jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
