"""Shared fixtures. Tests that need the real data read ``../shared/data`` and fail
loudly (never skip) when it is missing, as CI requires."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# A persistent compilation cache: the trainer's chunk program is compiled by several
# tests with identical shapes; the cache turns the repeats into a disk read.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "ccpo-jax-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("CCPO_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of ``../shared/data``; a missing folder is an error, not a skip."""
    if not (SHARED_DATA / "SOURCES.md").is_file():
        pytest.fail(
            f"real-data tests need {SHARED_DATA} (the shared/ folder beside the repository); "
            "it is missing. Set CCPO_SHARED_DATA to its location.",
            pytrace=False,
        )
    return SHARED_DATA
