"""Train / calibration / test splits of the question ids, for many splits at once.

The CCPO paper (arXiv 2511.11828 §5; protocols: docs/reproduce.md) trains on n_train questions (1000 HotpotQA,
560 MMLU), batch-calibrates kappa on n_cal = 200 and tests on n_test = 200, and
reports box plots over 100 random evaluation splits. Two protocols:

``retrain``
    :func:`make_splits`: split s permutes all Q question ids with its own key
    (``jax.random.split(key, S)[s]``) and takes the first n_train as training,
    the next n_cal as calibration and the next n_test as test questions.
    Every split trains its own policy.

``recalibrate`` (default; the paper's box plots)
    :func:`make_recalibrate_splits`: ONE training set, drawn once (the first
    n_train of a permutation made with the first half of ``key``), is the same
    for every split (``train[s]`` is identical for all s), so each row trains
    one policy. Only calibration and test are redrawn: split s permutes the
    Q - n_train remaining (never-trained-on) questions with its own key and
    takes n_cal calibration then n_test test questions from them. The policy
    stays fixed; kappa is re-calibrated on each split's calibration set and
    evaluated on its test set.

In both, the three parts of a split are disjoint, all ids lie in [0, Q), and
the result depends only on ``key`` (no global state). Sizes are static Python
ints checked at the boundary (:func:`check_split_sizes`).
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from ccpo_jax.ccpo.settings import PROTOCOLS
from ccpo_jax.errors import UserError


@flax.struct.dataclass
class Splits:
    """Question ids of S splits (int32): train [S, n_train], cal [S, n_cal], test [S, n_test]."""

    train: jax.Array
    cal: jax.Array
    test: jax.Array

    @property
    def n_splits(self) -> int:
        return int(self.test.shape[0])

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (int(self.train.shape[1]), int(self.cal.shape[1]), int(self.test.shape[1]))


def parse_split_sizes(text: str) -> tuple[int, int, int]:
    """``"60,20,20"`` -> ``(60, 20, 20)`` (n_train, n_cal, n_test); a UserError (field ``split_sizes``) otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 3:
        raise UserError(
            f"split_sizes: expected three comma-separated integers n_train,n_cal,n_test (e.g. 60,20,20), got {text!r}",
            field="split_sizes",
        )
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"split_sizes: {text!r} holds a value that is not an integer (expected e.g. 60,20,20)",
                        field="split_sizes") from None
    if min(sizes) < 1:
        raise UserError(f"split_sizes: every size must be >= 1, got {text!r}", field="split_sizes")
    return sizes  # type: ignore[return-value]


def check_split_sizes(n_questions: int, n_train: int, n_cal: int, n_test: int, n_splits: int, where: str = "the cache") -> None:
    """UserError unless all sizes are >= 1, n_splits >= 1, and n_train + n_cal + n_test <= Q."""
    for name, v in (("n_train", n_train), ("n_cal", n_cal), ("n_test", n_test)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(f"split_sizes: {name} must be an integer >= 1, got {v!r}", field="split_sizes")
    if not isinstance(n_splits, int) or isinstance(n_splits, bool) or n_splits < 1:
        raise UserError(f"n_splits: the number of splits must be an integer >= 1, got {n_splits!r}", field="n_splits")
    need = n_train + n_cal + n_test
    if need > n_questions:
        raise UserError(
            f"split_sizes {n_train},{n_cal},{n_test} needs {need} questions but {where} has only "
            f"{n_questions}; choose smaller split sizes (e.g. {_fit(n_questions, n_train, n_cal, n_test)})",
            field="split_sizes",
        )


def _fit(q: int, a: int, b: int, c: int) -> str:
    """Proportional sizes that fit into ``q`` questions (a suggestion for the error message)."""
    total = a + b + c
    sizes = [max(1, (q * x) // total) for x in (a, b, c)]
    return ",".join(map(str, sizes))


def make_splits(key: jax.Array, n_questions: int, n_train: int, n_cal: int, n_test: int, n_splits: int) -> Splits:
    """``retrain`` splits: split s is a fresh permutation of all Q ids from ``split(key, S)[s]``.

    Returns :class:`Splits` with train [S, n_train], cal [S, n_cal], test [S, n_test], int32.
    """
    check_split_sizes(n_questions, n_train, n_cal, n_test, n_splits)
    return _make_splits(key, n_questions, n_train, n_cal, n_test, n_splits)


# The splits as one compiled program each (sizes static): run eagerly they were ~40 operations compiled one
# by one before a run's first line (integer permutations: the ids are the same either way).
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _make_splits(key, n_questions, n_train, n_cal, n_test, n_splits) -> Splits:
    keys = jax.random.split(key, n_splits)
    perms = jax.vmap(lambda k: jax.random.permutation(k, n_questions))(keys).astype(jnp.int32)  # [S, Q]
    a, b = n_train, n_train + n_cal
    return Splits(train=perms[:, :a], cal=perms[:, a:b], test=perms[:, b : b + n_test])


def make_recalibrate_splits(
    key: jax.Array, n_questions: int, n_train: int, n_cal: int, n_test: int, n_splits: int
) -> Splits:
    """``recalibrate`` splits: one fixed training set, calibration/test redrawn per split.

    ``key`` splits into (k_train, k_eval). The training ids are the first
    n_train of ``permutation(k_train, Q)``, repeated for every split. The
    remaining Q - n_train ids are permuted per split with ``split(k_eval, S)[s]``
    and the first n_cal become calibration, the next n_test test questions.
    """
    check_split_sizes(n_questions, n_train, n_cal, n_test, n_splits)
    return _make_recalibrate_splits(key, n_questions, n_train, n_cal, n_test, n_splits)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _make_recalibrate_splits(key, n_questions, n_train, n_cal, n_test, n_splits) -> Splits:
    k_train, k_eval = jax.random.split(key)
    perm = jax.random.permutation(k_train, n_questions).astype(jnp.int32)
    train, rest = perm[:n_train], perm[n_train:]  # rest: [Q - n_train]
    keys = jax.random.split(k_eval, n_splits)
    redrawn = jax.vmap(lambda k: jax.random.permutation(k, rest))(keys)  # [S, Q - n_train]
    return Splits(
        train=jnp.broadcast_to(train, (n_splits, n_train)),
        cal=redrawn[:, :n_cal],
        test=redrawn[:, n_cal : n_cal + n_test],
    )


def splits_for_protocol(
    protocol: str, key: jax.Array, n_questions: int, n_train: int, n_cal: int, n_test: int, n_splits: int
) -> Splits:
    """:func:`make_recalibrate_splits` for ``recalibrate``, :func:`make_splits` for ``retrain``."""
    if protocol == "recalibrate":
        return make_recalibrate_splits(key, n_questions, n_train, n_cal, n_test, n_splits)
    if protocol == "retrain":
        return make_splits(key, n_questions, n_train, n_cal, n_test, n_splits)
    raise UserError(f"protocol: unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}", field="protocol")
