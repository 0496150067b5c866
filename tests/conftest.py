"""Shared fixtures. Tests that need the real data read ``../shared/data`` and fail
loudly (never skip) when it is missing, as CI requires."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

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
