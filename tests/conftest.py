"""Shared fixtures.

Real data comes in two sizes:

- ``tests/fixtures/data``: a few hundred questions of each public source, shipped in the
  repository (``tests/fixtures/SOURCES.md``), so the suite passes on a fresh clone;
- the full data folder, ``$CCPO_SHARED_DATA`` or else ``../shared/data`` beside the
  repository. Tests that need it run whenever it is there and are skipped otherwise;
  with ``CI=true`` (CI has the folder) a missing folder fails those tests loudly instead.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.helpers import FIXTURE_DATA, IN_CI, REPO, SHARED_DATA

# A persistent compilation cache: the trainer's chunk program is compiled by several
# tests with identical shapes; the cache turns the repeats into a disk read.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "ccpo-jax-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


#: The default command's heaviest files, by CPU seconds in one cold run (2026-12-01: 91, 51, 44,
#: 36, 28, 23, 20, 19): xdist hands whole files to its workers (``--dist loadfile``) in
#: collection order (``--no-loadscope-reorder``, pyproject.toml), so these start first and the
#: last minutes are not one long file on one core while the other idles. Only the order
#: changes; a file left off this list runs after them, in the usual order.
HEAVY_FIRST = ("test_oracle.py", "test_train.py", "test_trust_region.py", "test_stackelberg.py",
               "test_conformal.py", "test_env.py", "test_export.py", "test_reproduce_cli.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order


class RealData(NamedTuple):
    """A real-data folder in the ``shared/data`` layout; ``full`` is False for the fixtures."""

    root: Path
    full: bool


def _have_shared() -> bool:
    return (SHARED_DATA / "SOURCES.md").is_file()


def _require_shared() -> Path:
    if _have_shared():
        return SHARED_DATA
    msg = (f"full real data not found at {SHARED_DATA} (set CCPO_SHARED_DATA to the data folder, "
           "the one holding SOURCES.md, or put shared/ beside the repository)")
    if IN_CI:
        pytest.fail(f"CI=true and the {msg}", pytrace=False)
    pytest.skip(msg)


def pytest_report_header(config):
    where = "found" if _have_shared() else ("MISSING: CI=true, its tests fail" if IN_CI else "missing: its tests skip")
    return f"full real data: {SHARED_DATA} ({where}); fixtures: {FIXTURE_DATA.relative_to(REPO)}"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The full data folder; skips without it (fails under CI=true)."""
    return _require_shared()


@pytest.fixture(scope="session")
def largest_real_data() -> RealData:
    """The full data when it is there (always under CI=true, which fails without it), else the
    shipped fixtures: for the expensive end-to-end runs, which need not run on both."""
    if _have_shared() or IN_CI:
        return RealData(_require_shared(), full=True)
    return RealData(FIXTURE_DATA, full=False)


@pytest.fixture(scope="session", params=["fixtures", "shared"])
def real_data(request) -> RealData:
    """Each real-data folder in turn: the shipped fixtures, then the full data (if present)."""
    if request.param == "fixtures":
        return RealData(FIXTURE_DATA, full=False)
    return RealData(_require_shared(), full=True)


class Mechanics(NamedTuple):
    """One small training problem for the tests of the trainer's mechanics (resume, refusal of
    another configuration, damaged checkpoints, saving): a random 80-question cache, the three
    rows CPO / CCPO (lambda=0) / CCPO (lambda=2e-4) on two splits of 60 questions, 6 iterations
    in chunks of 2. The tests that use it compile one chunk program, which the persistent
    compilation cache above serves to all of them after the first."""

    cache: Any
    params: Any
    config: Any
    variants: list
    train_idx: Any
    key: Any


@pytest.fixture(scope="session")
def mechanics() -> Mechanics:
    import jax
    import numpy as np

    from ccpo_jax.ccpo.config import TrainConfig
    from ccpo_jax.ccpo.rows import row_variants
    from envs.replay.env import make_env_params
    from envs.replay.reference import random_cache

    cache = random_cache(80, T=4, seed=3)
    return Mechanics(cache=cache, params=make_env_params(cache), config=TrainConfig(iterations=6, chunk=2, batch_size=4),
                     variants=row_variants((2e-4,)), train_idx=np.tile(np.arange(60)[None], (2, 1)),
                     key=jax.random.PRNGKey(7))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """After each test module, drop JAX's in-memory caches of traced and compiled programs.

    A module's programs are rarely reused by the next one (and the persistent compilation
    cache above serves those that are), while keeping every module's executables alive
    made the pytest process grow past 4 GB over the suite. Modules that never import jax
    are left alone.
    """
    yield
    import sys

    if "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        if "ccpo_jax.ccpo.members" in sys.modules:
            sys.modules["ccpo_jax.ccpo.members"].clear_program_cache()
        gc.collect()


def _log_compile_times(path: str) -> None:
    """``CCPO_COMPILE_LOG=FILE``: append one line per JAX compilation event (the running test,
    the event, seconds) to ``FILE.<worker>``, to find which tests pay for which programs."""
    import jax

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out = open(f"{path}.{worker}", "a", buffering=1)

    def test() -> str:
        return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]

    def on_duration(event: str, seconds: float, fun_name: str = "", **_):
        if event.startswith("/jax/core/compile/") or "compilation_cache" in event:
            out.write(f"{test()}\t{event.rsplit('/', 1)[-1]}\t{seconds:.3f}\t{fun_name}\n")

    def on_event(event: str, **_):
        if event.endswith(("cache_hits", "cache_misses")):
            out.write(f"{test()}\t{event.rsplit('/', 1)[-1]}\t0\t\n")

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


if os.environ.get("CCPO_COMPILE_LOG"):
    _log_compile_times(os.environ["CCPO_COMPILE_LOG"])
