"""The baselines' registry: adding a baseline is one function and one :func:`register_baseline`.

A :class:`Baseline` says which rows a cache supports (:class:`ccpo_jax.ccpo.rowid.RowId` and a static
argument each), why the others are absent, and how one row is evaluated on one split: traced
(``metrics``, run for every split and every registered baseline inside ONE jitted, split-vmapped
program, ``ccpo_jax.ccpo.baselines.non_learned_rows``) or on the host (``host``, numpy over all splits).
Rows come out, and left-out rows are listed, in registration order (``baselines.py`` registers the
paper's: EXIT, Random, LLM policy, UALA, then the ladder rows), then sorted by ``RowId.sort_key``
where a table is written.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ccpo_jax.ccpo.rowid import Family, RowId

#: ``rows(cache, used)``: the rows the cache supports, given ``used`` (int [U], every test question of
#: every split), each with a hashable static argument the program is specialised on (a model index).
RowsFn = Callable[[Any, np.ndarray], Sequence[tuple[RowId, Hashable]]]
#: ``left_out(cache, used)``: {row name: why} of the rows the cache lists or could have but lacks.
LeftOutFn = Callable[[Any, np.ndarray], dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One non-learned baseline of the tables (a family of rows)."""

    family: Family
    left_out: LeftOutFn
    rows: RowsFn | None = None
    #: traced, one split: ``metrics(params, data, key, cal, test, alpha, static) -> SetMetrics``
    #: (``data``: ``baselines.BaselineData``; ``key``: this split's key; ``alpha``: f32 scalar).
    metrics: Callable[..., Any] | None = None
    #: host side, S splits: ``host(cache, params, train_idx, test_idx, alpha) -> {row name: {metric: [S]}}``.
    host: Callable[..., dict[str, dict[str, np.ndarray]]] | None = None

    def __post_init__(self) -> None:
        if (self.metrics is None) == (self.host is None) or (self.metrics is not None and self.rows is None):
            raise ValueError(f"a {self.family} baseline is traced (rows and metrics) or host-side (host), not both")


#: The registered baselines, in registration order (the order of their rows in non_learned_rows' output).
BASELINES: list[Baseline] = []


def register_baseline(b: Baseline) -> Baseline:
    """Add ``b`` to :data:`BASELINES` (last); returns it."""
    BASELINES.append(b)
    return b
