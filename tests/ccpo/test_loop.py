"""The shared chunked host loop (ccpo_jax.runtime.loop): exact iteration counts, TensorBoard steps,
checkpoint resume bit-identical to an uninterrupted run, configuration check on resume."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.errors import UserError
from ccpo_jax.runtime import loop
from ccpo_jax.runtime.scalars import ScalarWriter


def _toy(programs: list | None = None):
    """A random walk per member: state {x [M], key}; metrics x [M, n] per chunk. ``programs``
    collects (n, StableHLO text) of every compiled chunk."""
    def run(state, n):
        def body(s, _):
            key, k = jax.random.split(s["key"])
            x = s["x"] + jax.random.normal(k, s["x"].shape)
            return {"x": x, "key": key}, x

        s, xs = jax.lax.scan(body, state, None, length=n)
        return s, {"x": xs.T}

    def compile_chunk(n, placed):
        lowered = jax.jit(lambda s: run(s, n)).lower(placed)
        if programs is not None:
            programs.append((n, lowered.as_text()))
        program = lowered.compile()
        return lambda s: (lambda out: (out[0], jax.tree.map(np.asarray, out[1])))(program(s))

    state = {"x": jnp.zeros(3), "key": jax.random.PRNGKey(0)}
    return compile_chunk, state


def _events(logdir):
    from tensorboardX.proto import event_pb2

    out: dict[str, list[int]] = {}
    for f in sorted(logdir.rglob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            n = int.from_bytes(data[i:i + 8], "little")
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append(ev.step)
    return out


def test_chunk_sizes_are_exact():
    assert loop.chunk_sizes(10, 4) == [4, 4, 2]
    assert loop.chunk_sizes(300, 30) == [30] * 10
    assert sum(loop.chunk_sizes(7, 100)) == 7
    with pytest.raises(UserError):
        loop.chunk_sizes(0, 4)


def test_resume_equals_uninterrupted_and_tensorboard_steps_once(tmp_path):
    programs = []
    compile_chunk, state = _toy(programs)
    meta = {"run": "toy"}
    full = loop.run_chunks(compile_chunk, state, iterations=10, chunk=4, desc="toy", progress=False)
    assert full.finished and full.metrics["x"].shape == (3, 10)

    tb = tmp_path / "tb"
    with ScalarWriter(tb, ".a") as w:
        part = loop.run_chunks(compile_chunk, state, iterations=10, chunk=4, desc="toy", ckpt_dir=tmp_path / "ck",
                               meta=meta, tensorboard=w, scalars=loop.mean_scalars("toy"), progress=False,
                               stop_after_chunks=1)
    assert not part.finished and part.metrics["x"].shape == (3, 4)
    with ScalarWriter(tb, ".b") as w:
        res = loop.run_chunks(compile_chunk, state, iterations=10, chunk=4, desc="toy", ckpt_dir=tmp_path / "ck",
                              meta=meta, tensorboard=w, scalars=loop.mean_scalars("toy"), progress=False)
    assert res.finished
    np.testing.assert_array_equal(res.metrics["x"], full.metrics["x"])
    np.testing.assert_array_equal(np.asarray(res.state["x"]), np.asarray(full.state["x"]))
    assert _events(tb) == {"toy/x": list(range(1, 11))}  # every iteration once, numbered 1..10
    # The resumed run compiles the very program of the fresh one (the persistent compilation cache
    # then serves it): a restored state that lowers differently would cost a second compilation.
    assert [n for n, _ in programs] == [4, 2, 4, 4, 2]  # full run, killed run, resumed run
    assert len({text for n, text in programs if n == 4}) == 1 and len({text for n, text in programs if n == 2}) == 1

    # a finished run resumed again runs nothing and returns the same metrics
    again = loop.run_chunks(compile_chunk, state, iterations=10, chunk=4, desc="toy", ckpt_dir=tmp_path / "ck",
                            meta=meta, progress=False)
    np.testing.assert_array_equal(again.metrics["x"], full.metrics["x"])


def test_resume_refuses_another_configuration(tmp_path):
    compile_chunk, state = _toy()
    loop.run_chunks(compile_chunk, state, iterations=4, chunk=2, desc="toy", ckpt_dir=tmp_path, meta={"lr": 1},
                    progress=False, stop_after_chunks=1)
    with pytest.raises(UserError, match=r"different configuration \(lr differ\)"):
        loop.run_chunks(compile_chunk, state, iterations=4, chunk=2, desc="toy", ckpt_dir=tmp_path, meta={"lr": 2},
                        progress=False)


def test_variant_scalars_tag_each_variant(tmp_path):
    from ccpo_jax.ccpo.config import Variant
    from ccpo_jax.ccpo.members import variant_scalars

    variants = [Variant("CPO", False), Variant("CCPO (lambda=0)", True)]
    m = {"kappa": np.arange(2 * 3 * 4, dtype=float).reshape(6, 4)}  # V=2 x S=3 members, 4 iterations
    got = variant_scalars(variants, 3)(m)
    assert set(got) == {"CPO/kappa", "CCPO (lambda=0)/kappa"}
    np.testing.assert_allclose(got["CPO/kappa"], m["kappa"][:3].mean(0))
    np.testing.assert_allclose(got["CCPO (lambda=0)/kappa"], m["kappa"][3:].mean(0))
