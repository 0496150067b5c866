"""The reader and writer above both cache formats: :func:`load_cache` takes a
path to a fast-format directory (:mod:`envs.cache.schema`) or a human JSON Lines file
(:mod:`envs.cache.jsonl`) and returns the checksummed cache; :func:`save_cache`
writes either format, chosen by the path's suffix.

This module imports both formats; neither imports it, so ``envs.cache.schema`` (the
schema and the fast format) never depends on ``envs.cache.jsonl`` (which builds on
it).
"""
from __future__ import annotations

import os
from pathlib import Path

from envs.cache.fast import load_fast, save_fast
from envs.cache.schema import CacheError, ResponseCache
from envs.cache.jsonl import read_jsonl, write_jsonl


def load_cache(path: str | os.PathLike) -> ResponseCache:
    """Load a cache in either format: a fast-format directory or a human JSONL file."""
    path = Path(path)
    if not path.exists():
        raise CacheError(f"{path}: no such file or directory")
    if path.is_dir():
        return load_fast(path)
    return read_jsonl(path)


def save_cache(cache: ResponseCache, path: str | os.PathLike) -> Path:
    """Write ``cache`` to ``path`` in the format its name picks: ``*.jsonl`` -> the
    human format, anything else -> a fast-format directory. Returns the path written."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return write_jsonl(cache, path)
    return save_fast(cache, path)
