"""The compiled programs kept on disk without tracing (``ccpo_jax.runtime.executables``): a hit is the same
executable (outputs bit for bit those of a fresh trace, and nothing traced); a changed static value, argument
shape or weak type, or changed source misses; a corrupted entry is traced again with a warning, never a crash;
the trainer's call site keys its configuration and env by content. Speed: benchmarks/perf.py, not here."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.runtime import compile_cache as cc
from ccpo_jax.runtime import executables as ex


@pytest.fixture
def store(tmp_path, monkeypatch):
    folder = tmp_path / "executables"
    monkeypatch.setenv(ex.ENV, str(folder))
    ex.stats.clear()
    return folder


def _program(table, traces: list):
    """A scan closing over ``table`` (a constant baked into the program), counting its traces."""

    def f(x, n):
        traces.append(1)
        out, _ = jax.lax.scan(lambda c, t: (jnp.tanh(c @ table + t * n), None), x, jnp.arange(6, dtype=x.dtype))
        return {"y": out, "s": jnp.sum(out * n)}

    return jax.jit(f)


def test_a_hit_is_the_same_executable_and_traces_nothing(store):
    """With JAX's persistent cache on (tests/conftest.py) the fresh call below leaves the program in it; an
    executable loaded from there serialises without its kernels on XLA:CPU, and the copy failed when run
    ("Function wrapped_iota not found") before :func:`ex._compile_fresh` bypassed that cache."""
    assert jax.config.jax_compilation_cache_dir
    table = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
    args = (jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32), jnp.int32(5))
    traces: list = []
    fresh = _program(table, traces)(*args)
    first = ex.compile("toy", _program(table, traces), args, table)(*args)
    assert ex.stats == {"miss": 1} and len(list(store.glob("toy-*.exe"))) == 1
    n = len(traces)
    again = ex.compile("toy", _program(table, traces), args, table)(*args)
    assert ex.stats == {"miss": 1, "hit": 1} and len(traces) == n  # read back: not traced
    for out in (first, again):
        for k in fresh:
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(fresh[k]), strict=True)


def test_key_changes_miss(store, monkeypatch):
    table = jnp.ones((8, 8), jnp.float32) * 0.1
    x = jnp.ones((4, 8), jnp.float32)
    base = ex.program_key("toy", (x, jnp.int32(5)), table)
    assert ex.program_key("toy", (jnp.ones((4, 8), jnp.float32) * 7, jnp.int32(9)), table) == base  # values of args
    others = [
        ex.program_key("toy", (x, jnp.int32(5)), table.at[0, 0].set(0.2)),  # a closed-over value
        ex.program_key("toy", (x, jnp.int32(5)), (table, 1)),  # another static argument
        ex.program_key("toy", (jnp.ones((5, 8), jnp.float32), jnp.int32(5)), table),  # a shape
        ex.program_key("toy", (x, 5), table),  # a weak-typed Python int instead of an int32
        ex.program_key("toy", (x.astype(jnp.bfloat16), jnp.int32(5)), table),  # a dtype
        ex.program_key("other", (x, jnp.int32(5)), table),  # the name
    ]
    assert len({base, *others}) == len(others) + 1
    traces: list = []
    ex.compile("toy", _program(table, traces), (x, jnp.int32(5)), table)
    monkeypatch.setattr(ex, "source_digest", lambda: "edited")  # any edit of ccpo_jax or envs
    assert ex.program_key("toy", (x, jnp.int32(5)), table) != base
    ex.compile("toy", _program(table, traces), (x, jnp.int32(5)), table)
    assert ex.stats == {"miss": 2}


def test_an_executable_served_by_jax_caches_is_not_kept(store):
    table, args = jnp.eye(8, dtype=jnp.float32), (jnp.ones((4, 8), jnp.float32), jnp.int32(2))
    program = _program(table, [])
    program.lower(*args).compile()  # in JAX's in-memory cache now: the next compile of it is no compilation
    np.testing.assert_array_equal(np.asarray(ex.compile("toy", program, args, table)(*args)["y"]),
                                  np.asarray(program(*args)["y"]))
    assert ex.stats == {"miss": 1, "not kept": 1} and not list(store.glob("*.exe"))


def test_source_digest_covers_the_library():
    assert len(ex.source_digest()) == 64 and ex.source_digest() == ex.source_digest()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_corrupted_entry_is_traced_again_with_a_warning(store, damage):
    table = jnp.eye(8, dtype=jnp.float32)
    args = (jnp.ones((4, 8), jnp.float32), jnp.int32(3))
    traces: list = []
    want = ex.compile("toy", _program(table, traces), args, table)(*args)
    (entry,) = store.glob("toy-*.exe")
    data = entry.read_bytes()
    entry.write_bytes({"flip": data[:-100] + bytes([data[-100] ^ 1]) + data[-99:], "truncate": data[: len(data) // 2],
                       "empty": b""}[damage])
    with pytest.warns(RuntimeWarning, match="unreadable compiled program"):
        got = ex.compile("toy", _program(table, traces), args, table)(*args)
    assert ex.stats == {"miss": 2, "corrupt": 1}
    np.testing.assert_array_equal(np.asarray(got["y"]), np.asarray(want["y"]))
    ex.compile("toy", _program(table, traces), args, table)  # rewritten whole
    assert ex.stats["hit"] == 1


def test_uncacheable_statics_and_off(store, monkeypatch):
    args = (jnp.ones((4, 8), jnp.float32), jnp.int32(3))
    ex.compile("toy", _program(jnp.eye(8), []), args, object())  # no deterministic key: traced, never kept
    assert ex.stats == {"uncacheable": 1} and not store.exists()
    monkeypatch.setenv(ex.ENV, "off")
    ex.compile("toy", _program(jnp.eye(8), []), args, None)
    assert ex.stats == {"uncacheable": 1} and not store.exists()


def test_configure_turns_the_layer_on_beside_the_jax_cache(tmp_path):
    env = {cc.ENV: str(tmp_path / "xla")}
    cc.configure(env)
    assert ex.directory(env) == tmp_path / "xla" / "executables"
    env = {cc.ENV: "off", ex.ENV: str(tmp_path / "stale")}
    cc.configure(env)
    assert ex.directory(env) is None
    env = {cc.ENV: str(tmp_path / "xla"), ex.ENV: "off"}  # this layer alone off
    cc.configure(env)
    assert ex.directory(env) is None
    assert ex.directory({}) is None  # Python imports: off unless the command line turned it on
    env = {cc.ENV: str(tmp_path / "xla")}
    cc.configure(env, executables=False)
    assert ex.directory(env) is None


def test_main_called_in_a_python_process_leaves_the_layer_off(monkeypatch):
    """``main([...])`` in a Python process (the tests' in-process CLI) may run traced code patched at run time,
    which no key sees: only the process's own command line (``main()``) turns the layer on."""
    from tests.helpers import run_cli

    monkeypatch.delenv(ex.ENV, raising=False)
    assert run_cli(["reproduce", "--list-settings"]).returncode == 0
    assert ex.directory() is None


def test_the_trainer_keys_its_configuration_and_env_by_content(monkeypatch):
    """train_many's programs close over the configuration and the env (make_train): a change of either, even of
    a field used only inside the chunk, is another key; the same inputs are the same key."""
    from ccpo_jax.ccpo import members
    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from envs.generators.synthetic import generate
    from envs.replay.env import make_env_params

    class Stop(Exception):
        pass

    keys: list = []

    def record(name, jitted, args, static=None):
        keys.append((name, ex.program_key(name, args, static)))
        raise Stop  # the key is all this test needs: nothing is traced or compiled

    monkeypatch.setattr(ex, "compile", record)
    params = make_env_params(generate("hotpotqa-llama2", n_questions=30, seed=0))
    idx = np.arange(20, dtype=np.int32).reshape(2, 10)
    variants = [Variant(name="CCPO", conformal=True, lam=0.0, alpha=0.1)]

    def init_key(config, p):
        members.clear_program_cache()
        with pytest.raises(Stop):
            members.train_many(config, p, variants, idx, jax.random.PRNGKey(0))
        return keys[-1]

    cfg = TrainConfig(iterations=2, chunk=2)
    base = init_key(cfg, params)
    assert base[0] == "train-init" and init_key(cfg, params) == base
    assert init_key(TrainConfig(iterations=2, chunk=2, critic_lr=2e-3), params) != base
    assert init_key(cfg, params.replace(cost=params.cost * 2)) != base


def test_the_non_learned_rows_key_their_plan_or_are_traced():
    """The baselines' program closes over its plan: the key names each baseline's family, ``metrics`` function
    and rows; a ``metrics`` from outside the library (or with a closure) makes it uncacheable, never a guess."""
    from ccpo_jax.ccpo.baselines import _plan_key
    from ccpo_jax.ccpo.registry import BASELINES, Baseline
    from ccpo_jax.ccpo.rowid import Family

    traced = [b for b in BASELINES if b.metrics is not None]
    plan = tuple((b, ((f"{b.family} row", None),)) for b in traced)
    key = ex.digest(_plan_key(plan))
    assert ex.digest(_plan_key(plan)) == key
    assert ex.digest(_plan_key(plan[:-1])) != key
    assert ex.digest(_plan_key(plan[:-1] + ((plan[-1][0], (("another row", 1),)),))) != key
    outside = Baseline(Family.RANDOM, lambda cache, used: {}, lambda cache, used: [], lambda *a: None)
    with pytest.raises(ex.Uncacheable):
        ex.digest(_plan_key(plan + ((outside, (("x", None),)),)))


def test_exit_now_runs_the_atexit_handlers_and_flushes():
    import subprocess
    import sys

    code = ("import atexit; from ccpo_jax.cli.main import exit_now; "
            "atexit.register(lambda: print(' handler', end='')); print('output', end=''); exit_now(3)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (3, "output handler")


def test_a_kept_program_runs_on_its_own_device_among_several(tmp_path):
    """With several devices (``--devices 2`` forces two host devices) an executable is loaded onto the devices it
    was compiled for: loaded onto all of them, a one-device program failed when called ("Expected args to
    execute_sharded_on_local_devices to have 2 shards")."""
    import subprocess
    import sys

    code = f"""
import os, warnings
os.environ["{ex.ENV}"] = {str(tmp_path)!r}
import jax, jax.numpy as jnp
from ccpo_jax.runtime import executables as ex
assert len(jax.devices()) == 2
warnings.simplefilter("error")
make = lambda: jax.jit(lambda x: jnp.tanh(x) * 2)
for x in (jnp.ones(4), jax.device_put(jnp.ones(4), jax.devices()[1])):
    want = make()(x)
    for _ in range(2):
        got = ex.compile("two", make(), (x,), None)(x)
        assert (got == want).all() and got.devices() == want.devices()
print(sorted(ex.stats.items()))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[('hit', 2), ('miss', 2)]"
