"""The splits (``ccpo_jax.ccpo.splits``) as one compiled program per protocol and sizes: the same ids as the
same functions run op by op (``jax.disable_jit``, what they computed before), and another key traces and
compiles nothing (eagerly, each of ~40 operations was compiled before a run's first line)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from ccpo_jax.ccpo.splits import make_recalibrate_splits, make_splits

SIZES = (1400, 1000, 200, 200, 100)  # the default reproduce's: Q, train, cal, test, splits


@pytest.mark.parametrize("fn", [make_splits, make_recalibrate_splits])
def test_compiled_splits_equal_the_op_by_op_ones(fn):
    for seed in (0, 7):
        got = fn(jax.random.PRNGKey(seed), *SIZES)
        with jax.disable_jit():
            want = fn(jax.random.PRNGKey(seed), *SIZES)
        for part in ("train", "cal", "test"):
            a, b = np.asarray(getattr(got, part)), np.asarray(getattr(want, part))
            assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b), part


@pytest.mark.parametrize("fn, q", [(make_splits, 1397), (make_recalibrate_splits, 1398)])
def test_one_program_per_sizes_and_none_for_another_key(fn, q):
    """Sizes no other test uses, so nothing is in this process's caches yet: one program at most (none when
    the persistent cache has it), where op by op every operation not cached yet was compiled (here 5 and 7)."""
    sizes = (q, 1000, 150, 150, 7)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if name.endswith("backend_compile_duration") else None)
    try:
        jax.block_until_ready(fn(jax.random.PRNGKey(0), *sizes).test)
        first = len(events)
        jax.block_until_ready(fn(jax.random.PRNGKey(1), *sizes).test)
    finally:
        jax.monitoring.clear_event_listeners()
    assert first <= 1 and len(events) == first
