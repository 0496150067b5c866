"""Rows as typed records (:class:`Row`, :class:`RowSet`) and the baselines' registry: adding a baseline is
one function and one :func:`register_baseline`.

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
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

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


# -- a run's rows ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One row of a run: its identity, its metrics and what results.json says of it besides them."""

    id: RowId
    metrics: dict[str, np.ndarray]
    """``ccpo_jax.ccpo.settings.METRICS`` -> float [N seeds, S splits] (``prepare.as_rows``)."""
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``kept_seed`` (how a kept-seed twin chose its seed), ``ltt`` (a capped row's Learn then Test
    outcome), ``groups`` (per-group outcomes, Mondrian), ``reference`` (how the best observable reference
    was fitted): each present only where it applies."""


class RowSet(Mapping[RowId, Row]):
    """A run's rows, one per name, iterated in the table order (``RowId.sort_key``; rows whose keys tie keep
    the order they were added in). Indexed by RowId; :meth:`by_name` at the boundaries."""

    def __init__(self, rows: Sequence[Row] = ()) -> None:
        self._rows: dict[RowId, Row] = {}
        for r in rows:
            self.add(r)

    def add(self, row: Row) -> None:
        """Add ``row`` (a row of the same name replaces the old one in its place)."""
        self._rows[row.id] = row

    def __getitem__(self, key: RowId) -> Row:
        return self._rows[key]

    def __iter__(self) -> Iterator[RowId]:
        return iter(sorted(self._rows, key=RowId.sort_key))

    def __len__(self) -> int:
        return len(self._rows)

    def names(self) -> list[str]:
        """The row names in the table order."""
        return [r.name for r in self]

    def by_name(self, name: str) -> Row:
        """The row called ``name`` (KeyError when there is none)."""
        return self._rows[RowId.parse(name)]

    def metrics(self) -> dict[str, dict[str, np.ndarray]]:
        """``{row name: {metric: [N, S]}}`` in the order the rows were added."""
        return {r.name: row.metrics for r, row in self._rows.items()}

    def extra(self, key: str) -> dict[str, Any]:
        """``{row name: extras[key]}`` of the rows that have it, in the table order."""
        return {r.name: self._rows[r].extras[key] for r in self if key in self._rows[r].extras}

    def attach(self, key: str, per_row: Mapping[str, Any] | None) -> None:
        """Put ``per_row[name]`` into ``extras[key]`` of every row named there (names of no row: ignored, as
        results.json never had an entry for them)."""
        for name, value in (per_row or {}).items():
            rid = RowId.parse(name)
            if rid in self._rows:
                self._rows[rid].extras[key] = value


def rows_from(metrics: Mapping[str, dict[str, np.ndarray]], **extras: Mapping[str, Any] | None) -> RowSet:
    """A RowSet of ``{row name: {metric: [N, S]}}`` (names read once here), each ``extras`` mapping
    (``kept_seed=``, ``ltt=``, ``groups=``, ...: ``{row name: value}``) attached to its rows."""
    out = RowSet([Row(RowId.parse(name), dict(m)) for name, m in metrics.items()])
    for key, per_row in extras.items():
        out.attach(key, per_row)
    return out
