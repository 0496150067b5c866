"""The fast format of a response cache: ``DIR/manifest.json`` and ``DIR/arrays.npz``, written
atomically and verified on read (docs/caches.md). Also the directory reader/writer and checksum
check that the governance grid (``envs.governance.grid``) stores its own arrays with."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from envs.cache.atomic import atomic_dir
from envs.cache.schema import (CacheError, Manifest, ResponseCache, arrays_checksum, check_arrays, check_values,
                               manifest_checksum)

MANIFEST_FILE = "manifest.json"
ARRAYS_FILE = "arrays.npz"


def save_fast(cache: ResponseCache, path: str | os.PathLike) -> Path:
    """Write ``path/manifest.json`` and ``path/arrays.npz`` atomically.

    The directory is built under a temporary name beside ``path`` and renamed
    into place, so a killed write leaves no half-written cache. An existing
    cache at ``path`` is replaced.
    """
    path = Path(path)
    cache = cache.with_checksum()
    check_arrays(cache.manifest, cache.arrays, f"{path} (not written)")
    return write_fast_dir(path, cache.manifest.to_dict(), cache.arrays)


def write_fast_dir(path: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    """Atomically write ``path/manifest.json`` and ``path/arrays.npz`` (shared by every fast format).

    Built in a temporary directory beside ``path`` and renamed into place; an existing
    fast-format directory is replaced, anything else at ``path`` is refused.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CacheError(f"{path}: exists and is not a directory (a fast-format cache is a directory)")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST_FILE).is_file():
        # Never replace a directory that holds something other than a cache.
        raise CacheError(f"{path}: exists and is not a fast-format cache; refusing to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(path) as tmp:  # an existing cache is moved aside, then removed
            with open(tmp / ARRAYS_FILE, "wb") as f:
                np.savez_compressed(f, **arrays)
            with open(tmp / MANIFEST_FILE, "w") as f:
                json.dump(manifest, f, indent=2, sort_keys=True)
                f.write("\n")
    except OSError as e:
        raise CacheError(f"{path}: cannot write ({e.strerror or e})") from None
    return path


def read_fast_dir(path: Path, what: str = "cache") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read ``path/manifest.json`` (a JSON object) and ``path/arrays.npz`` of any fast format.

    Structural checks and the checksum are the caller's (:func:`verify_checksum`).
    """
    mpath, apath = path / MANIFEST_FILE, path / ARRAYS_FILE
    for p in (mpath, apath):
        if not p.is_file():
            raise CacheError(f"{path}: not a fast-format {what} (missing {p.name})")
    mdict = read_json_object(mpath)
    try:
        with np.load(apath, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # zipfile / format errors: the file is damaged
        raise CacheError(f"{apath}: cannot read arrays ({type(e).__name__}: {e})") from None
    return mdict, arrays


#: Largest manifest.json read (a manifest is a few kB; anything near this is not one).
MAX_MANIFEST_BYTES = 64 << 20


def read_json_object(path: Path, what: str = "manifest") -> dict[str, Any]:
    """Parse ``path`` as one JSON object; every way it can fail is a CacheError naming the file.

    Invalid UTF-8, invalid JSON, nesting too deep for the parser (e.g. 100,000
    nested lists), an oversized file or a non-object all become one line.
    """
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CacheError(f"{path}: {path.stat().st_size} bytes, too large for a {what} (limit {MAX_MANIFEST_BYTES})")
        raw = path.read_bytes()
    except OSError as e:
        raise CacheError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise CacheError(f"{path}: line {line}: not UTF-8 text (byte {e.start}); the {what} is damaged") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CacheError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise CacheError(f"{path}: JSON nested too deeply; the {what} is damaged") from None
    except ValueError as e:  # e.g. an integer with more than 4300 digits
        raise CacheError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CacheError(f"{path}: must hold a JSON object")
    return obj


def verify_checksum(path: Path, mdict: dict[str, Any], arrays: dict[str, np.ndarray], fields: dict[str, Any],
                    what: str = "cache", reimport: str = "ccpo-jax data import --format FORMAT SRC --out PATH") -> None:
    """Refuse a fast-format directory whose arrays or manifest differ from its checksums.

    ``mdict`` is ``manifest.json`` as read, ``fields`` the parsed manifest's
    hashed fields (:meth:`Manifest.hashed_fields`). Three refusals: the arrays
    differ from ``arrays_checksum`` (damaged ``arrays.npz``); the manifest
    fields differ from ``checksum`` (an edited ``manifest.json``); or the
    directory predates manifest checksums (no ``arrays_checksum``: re-import).
    """
    mpath, apath = path / MANIFEST_FILE, path / ARRAYS_FILE
    expected = mdict.get("checksum")
    if not expected or not isinstance(expected, str):
        raise CacheError(f"{mpath}: missing field 'checksum'")
    got_arrays = arrays_checksum(arrays)
    stored_arrays = mdict.get("arrays_checksum")
    if stored_arrays is None:  # written before the checksum covered the manifest
        if expected != got_arrays:
            raise CacheError(f"{apath}: checksum mismatch (manifest says {expected}, arrays hash to {got_arrays}); "
                             f"the {what} is damaged or was edited")
        raise CacheError(
            f"{path}: an old {what} whose checksum covers only the arrays, not the manifest (prices, models, T, "
            f"provenance); re-import it to upgrade ({reimport})"
        )
    if stored_arrays != got_arrays:
        raise CacheError(
            f"{apath}: checksum mismatch (manifest says {stored_arrays}, arrays hash to {got_arrays}); "
            f"the {what} is damaged or was edited"
        )
    got = manifest_checksum(got_arrays, fields)
    if got != expected:
        raise CacheError(
            f"{mpath}: checksum mismatch (manifest says {expected}, manifest + {ARRAYS_FILE} hash to {got}); "
            f"a manifest field that changes results or labels ({', '.join(sorted(fields))}) was edited; "
            f"restore the {what} or re-import it"
        )


def load_fast(path: str | os.PathLike) -> ResponseCache:
    """Read a fast-format directory and verify its checksum."""
    path = Path(path)
    mdict, arrays = read_fast_dir(path)
    manifest = Manifest.from_dict(mdict, where=f"{path / MANIFEST_FILE}: manifest")
    check_arrays(manifest, arrays, str(path / ARRAYS_FILE), values=False)
    verify_checksum(path, mdict, arrays, manifest.hashed_fields())  # damage first, then the value rules
    check_values(manifest, arrays, str(path / ARRAYS_FILE))
    return ResponseCache(manifest, arrays)
