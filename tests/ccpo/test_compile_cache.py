"""The command line's persistent compilation cache (``ccpo_jax.runtime.compile_cache``): where it lives,
how it is turned off, and that a second ``ccpo-jax reproduce`` reads the first one's programs and
writes the same results.json, value for value (speed is measured in benchmarks/perf.py, not here)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ccpo_jax.runtime import compile_cache as cc
from tests.helpers import run_cli


def test_default_folder_is_per_host_under_the_user_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path = cc.configure(env)
    assert path == str(tmp_path / "ccpo-jax" / "xla" / cc.host_key())
    assert env["JAX_COMPILATION_CACHE_DIR"] == path
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"  # eager operations too
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) == cc.MAX_BYTES
    assert len(cc.host_key()) == 12 and cc.host_key() == cc.host_key()


@pytest.mark.parametrize("word", ["off", "0", "False", "no"])
def test_off_disables_jax_cache_even_with_a_jax_folder(word):
    env = {cc.ENV: word, "JAX_COMPILATION_CACHE_DIR": "/somewhere"}
    assert cc.configure(env) is None
    assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"


def test_a_folder_given_and_jax_own_variable(tmp_path):
    env = {cc.ENV: str(tmp_path / "mine")}
    assert cc.configure(env) == str(tmp_path / "mine")
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), cc.ENV: str(tmp_path / "mine")}
    assert cc.configure(env) == str(tmp_path / "jax")  # JAX's own variable wins
    assert "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    path = tmp_path_factory.mktemp("cache") / "syn100"
    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), path)
    return path


ARGS = ["--splits", "2", "--split-sizes", "60,20,20", "--iterations", "3", "--seeds", "2", "--no-progress"]


def _run(tmp_path, small_cache, name, cache_value):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env[cc.ENV] = cache_value
    r = run_cli(["reproduce", "--cache", str(small_cache), *ARGS, "--out", str(tmp_path / name)], cwd=tmp_path,
                in_subprocess=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / name / "results.json").read_text())
    res.pop("timing")
    return res


@pytest.mark.slow
def test_second_run_reads_the_cache_and_equals_the_first(tmp_path, small_cache):
    folder = tmp_path / "xla"
    first = _run(tmp_path, small_cache, "a", str(folder))
    entries = sorted(p.name for p in folder.iterdir())
    assert len(entries) > 10  # the trainer, the evaluations and the eager operations
    kept = sorted(p.name for p in (folder / "executables").iterdir())  # ccpo_jax.runtime.executables
    assert {k.rsplit("-", 1)[0] for k in kept} == {"train-init", "train-chunk", "evaluate-members", "non-learned-rows"}
    second = _run(tmp_path, small_cache, "b", str(folder))
    assert second == first
    assert sorted(p.name for p in folder.iterdir()) == entries  # nothing new compiled: every program was read
    assert sorted(p.name for p in (folder / "executables").iterdir()) == kept  # the big ones without tracing
