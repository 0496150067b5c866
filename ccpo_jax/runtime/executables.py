"""The run's big compiled programs kept on disk, found again without tracing them.

JAX's persistent compilation cache (:mod:`ccpo_jax.runtime.compile_cache`) skips XLA's compilation on a
second run, but finds its entry by hashing the lowered module: every program is traced and lowered again
first, most of it for the trainer's two programs and the evaluations
(docs/performance.md#the-executable-cache). :func:`compile` keys a program by what it is made
of instead, and reads the executable back with ``jax.experimental.serialize_executable``:

* the program's name and the explicit ``static`` values it closes over (the configuration; arrays such
  as the replay env's by their content: dtype, shape and a SHA-256 of the bytes);
* its arguments' structure and abstract values (shape, dtype, weak type, the sharding of committed arrays);
* the code: a SHA-256 of every ``.py`` file of ``ccpo_jax`` and ``envs``, the versions of Python, jax,
  jaxlib and the libraries traced into the programs (flax, optax, chex, distrax, numpy);
* the machine: every device's platform, kind and id, the backend's version, ``XLA_FLAGS``, and JAX's
  configuration (all of ``jax.config.values`` but the cache and logging settings); the folder itself
  is already one per CPU model (:func:`ccpo_jax.runtime.compile_cache.host_key`).

A call site passes in ``static`` everything its traced function closes over that is not an argument:
a value left out would be a wrong hit. Any change of code misses (the source hash), so that list needs
to be right only for the values that change between runs of the same code. A value :func:`digest`
cannot hash deterministically makes the program uncacheable (traced as before), never a wrong key.

An entry is one file ``<name>-<key>.exe``: a magic line, the SHA-256 of its payload, the payload (the
pickled executable and its argument trees). One that is unreadable, truncated or fails its checksum is
removed with a warning and the program is traced and compiled again: never a crash. Entries beyond
:data:`MAX_BYTES` are removed, least recently used first. On only in the command line's own process, beside
its persistent cache (``CCPO_JAX_EXECUTABLES``, set by ``compile_cache.configure``: ``<cache>/executables``;
not when ``main([...])`` runs in a Python process, whose code may be patched at run time: no key sees that);
``CCPO_JAX_COMPILATION_CACHE=off`` turns both off, ``CCPO_JAX_EXECUTABLES=off`` this one alone.
The files are pickles: load only a folder you wrote (as JAX's own cache).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import io
import os
import pickle
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

ENV = "CCPO_JAX_EXECUTABLES"
OFF = ("0", "off", "false", "no", "none")
#: Entries beyond this many bytes go, least recently used first (a default reproduce writes a few MB).
MAX_BYTES = 512 << 20
MAGIC = b"ccpo-jax executable 2\n"  # part of every key: another format is another key
#: The packages whose code is traced into the programs, besides jax and jaxlib.
LIBRARIES = ("flax", "optax", "chex", "distrax", "numpy")
#: JAX settings that do not change a program (where caches live, what is logged).
_IGNORED_CONFIG = ("compilation_cache", "persistent_cache", "log_compiles", "explain_cache_misses", "logging_level",
                   "traceback", "pprint", "include_full_tracebacks", "dump_ir", "debug_log_modules")

#: What :func:`compile` did in this process, by outcome (``hit``, ``miss``, ``uncacheable``, ``corrupt``): for
#: tests and profiles.
stats: dict[str, int] = {}


class Uncacheable(TypeError):
    """A value :func:`digest` cannot hash deterministically."""


def directory(environ=os.environ) -> Path | None:
    """The folder of the entries, or None when off (the default outside the command line)."""
    value = (environ.get(ENV) or "").strip()
    return None if not value or value.lower() in OFF else Path(value)


def _update(h, obj: Any) -> None:
    """Feed a deterministic encoding of ``obj`` to the hash ``h``: its type and its value."""
    put = lambda *parts: h.update(repr(parts).encode())
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, enum.Enum, np.dtype)):
        put(type(obj).__qualname__, obj)
    elif isinstance(obj, (np.ndarray, np.generic, jax.Array)):
        a = np.asarray(obj)
        put("array", str(a.dtype), a.shape, getattr(obj, "weak_type", False))
        h.update(hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest())
    elif isinstance(obj, (tuple, list)):
        put(type(obj).__qualname__, len(obj))
        for x in obj:
            _update(h, x)
    elif isinstance(obj, dict):
        put("dict", len(obj))
        for k in sorted(obj, key=repr):
            _update(h, k)
            _update(h, obj[k])
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        put("dataclass", type(obj).__module__, type(obj).__qualname__)
        for f in dataclasses.fields(obj):
            put(f.name)
            _update(h, getattr(obj, f.name))
    else:
        raise Uncacheable(f"{type(obj).__module__}.{type(obj).__qualname__} has no deterministic key")


def digest(obj: Any) -> str:
    """SHA-256 of ``obj``: None, numbers, strings, bytes, enums, dtypes, NumPy and jax arrays (by content),
    tuples (NamedTuples too), lists, dicts and dataclasses of these; anything else raises
    :class:`Uncacheable`."""
    h = hashlib.sha256()
    _update(h, obj)
    return h.hexdigest()


def signature(args: tuple) -> tuple:
    """The arguments as lowering reads them: tree structure; per leaf shape, dtype, weak type, and the
    sharding of an array committed to devices (host arrays and uncommitted device arrays lower alike)."""
    leaves, treedef = jax.tree.flatten(args)
    out = []
    for x in leaves:
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            raise Uncacheable(f"argument of type {type(x).__qualname__}")
        aval = jax.typeof(x)
        committed = isinstance(x, jax.Array) and getattr(x, "committed", False)
        out.append((tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)),
                    repr(x.sharding) if committed else None))
    return str(treedef), tuple(out)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the ``ccpo_jax`` and ``envs`` packages (path and bytes)."""
    h = hashlib.sha256()
    for pkg in ("ccpo_jax", "envs"):
        spec = importlib.util.find_spec(pkg)
        for root in sorted(spec.submodule_search_locations or ()):
            for p in sorted(Path(root).rglob("*.py")):
                h.update(f"{pkg}/{p.relative_to(root).as_posix()}\0".encode())
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def environment() -> tuple:
    """Everything of the process a program's executable depends on besides its own inputs and code."""
    import jaxlib

    devices = jax.devices()
    config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if not any(part in k for part in _IGNORED_CONFIG))
    return (MAGIC, sys.version, jax.__version__, jaxlib.__version__, tuple(_version(n) for n in LIBRARIES),
            devices[0].client.platform, devices[0].client.platform_version,
            tuple((d.platform, d.device_kind, d.id, d.process_index) for d in devices),
            os.environ.get("XLA_FLAGS", ""), tuple(config), source_digest())


def program_key(name: str, args: tuple, static: Any) -> str:
    """The entry's key: :func:`environment`, ``name``, :func:`signature` of ``args`` and :func:`digest` of
    ``static``; raises :class:`Uncacheable` when one of them has no deterministic key."""
    return digest((environment(), name, signature(args), digest(static)))


def _count(what: str) -> None:
    stats[what] = stats.get(what, 0) + 1


def _read(path: Path):
    data = path.read_bytes()
    head, body = data[:len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if not head.startswith(MAGIC) or hashlib.sha256(body).digest() != head[len(MAGIC):]:
        raise ValueError("bad header or checksum")
    from jax.experimental import serialize_executable

    serialized, in_tree, out_tree, device_ids = pickle.loads(body)
    by_id = {d.id: d for d in jax.devices()}
    return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                     execution_devices=[by_id[i] for i in device_ids])


def _write(path: Path, compiled) -> None:
    from jax.experimental import serialize_executable

    # the devices it runs on: loaded onto all of a host's devices, a one-device program fails when called
    devices = tuple(d.id for d in compiled._executable.xla_executable.local_devices())
    body = pickle.dumps((*serialize_executable.serialize(compiled), devices), protocol=pickle.HIGHEST_PROTOCOL)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with io.open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(body).digest() + body)
    os.replace(tmp, path)  # atomic: a reader sees the whole entry or none
    _evict(path.parent)


def _evict(folder: Path, max_bytes: int = MAX_BYTES) -> None:
    """Remove the least recently used entries (by modification time, refreshed on each hit) past ``max_bytes``."""
    entries = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in folder.glob("*.exe")), reverse=True)
    total = 0
    for _, size, p in entries:
        total += size
        if total > max_bytes:
            p.unlink(missing_ok=True)


def compile(name: str, jitted: Callable, args: tuple, static: Any = None):
    """``jitted.lower(*args).compile()``, or the same executable read back from :func:`directory` when an
    entry of the same :func:`program_key` is there (no tracing, no lowering); a new one is written.
    ``static``: everything ``jitted`` closes over that is not in ``args`` (see the module's docstring)."""
    folder = directory()
    if folder is None or jax.process_count() > 1:  # a multi-host program is not one process's to keep
        return jitted.lower(*args).compile()
    try:
        path = folder / f"{name}-{program_key(name, args, static)[:40]}.exe"
    except Uncacheable:
        _count("uncacheable")
        return jitted.lower(*args).compile()
    if path.exists():
        try:
            program = _read(path)
            os.utime(path)
            _count("hit")
            return program
        except Exception as e:  # noqa: BLE001 - any unreadable entry is traced again, never a crash
            warnings.warn(f"{path}: unreadable compiled program ({type(e).__name__}: {e}); removed, "
                          f"tracing and compiling {name} again", RuntimeWarning, stacklevel=2)
            path.unlink(missing_ok=True)
            _count("corrupt")
    program, fresh = _compile_fresh(jitted, args)
    _count("miss")
    if not fresh:
        _count("not kept")
        return program
    try:
        _write(path, program)
    except Exception as e:  # noqa: BLE001 - a program that cannot be kept still runs (a full disk, a backend
        warnings.warn(f"{path}: compiled program not kept ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
    return program


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_PERSISTENT_HIT = "/jax/compilation_cache/cache_hits"
_events = {"compiled": 0, "persistent": 0}


def _on_duration(event: str, *_a, **_k) -> None:
    if event == _BACKEND_COMPILE:
        _events["compiled"] += 1


def _on_event(event: str, *_a, **_k) -> None:
    if event == _PERSISTENT_HIT:
        _events["persistent"] += 1


@functools.lru_cache(maxsize=1)
def _listen() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def _compile_fresh(jitted: Callable, args: tuple):
    """(``jitted.lower(*args).compile()``, whether XLA compiled it here). Only such an executable is kept:
    XLA:CPU (jaxlib 0.10.2) serialises an executable it LOADED from JAX's persistent cache without its
    kernels ("Function wrapped_iota not found" when the copy runs; tests/ccpo/test_executables.py), so
    JAX's persistent cache is bypassed for this one compilation, and an executable that JAX's caches served
    anyway (seen by its monitoring events: no XLA compilation, or a persistent-cache hit) is not kept."""
    _listen()
    before = dict(_events)
    try:
        from jax._src import compilation_cache as jcc

        with jcc._cache_initialized_mutex:
            saved = jcc._cache_checked, jcc._cache_used
            jcc._cache_checked, jcc._cache_used = True, False
    except (ImportError, AttributeError):  # another jax: compile as usual; kept only if compiled here
        jcc = None
    try:
        program = jitted.lower(*args).compile()
    finally:
        if jcc is not None:
            with jcc._cache_initialized_mutex:
                jcc._cache_checked, jcc._cache_used = saved
    fresh = _events["compiled"] > before["compiled"] and _events["persistent"] == before["persistent"]
    return program, fresh
