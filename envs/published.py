"""The papers' published results: the CCPO paper's (arXiv 2511.11828, Tables 2-9) and the
Stackelberg governance paper's (arXiv 2606.23026, :data:`STACKELBERG_TABLE4` and below). Pure data, no
logic beyond lookups. The one copy of these numbers in the package: ``ccpo_jax.ccpo.settings``
puts them beside a run's results (table.md), ``envs.generators.synthetic`` calibrates its
synthetic caches to them (Tables 2-5).

Each table's rows are listed in the paper's order as ``(kind, cost cents, coverage,
avg len, set size)`` (:data:`COLUMNS`; cost over the 200 test questions of a split).
Kinds: ``"GX"`` the guide's (GPT-4o) LLM-EXIT row, ``"BX"`` the base model's,
``"GP"`` / ``"BP"`` the LLM-policy rows of guide / base, ``"L0"`` CCPO with
lambda = 0, ``"L"`` CCPO with the table's nonzero lambda; every other kind is the
paper's row name itself (``Random``, ``UALA``, ``CPO``, ``CPO batch``, ``CPO online``).
Tables 2-5 are at alpha = 0.1 (HotpotQA / MMLU x LLaMA-2-7B / LLaMA-3.2-3B base),
Tables 6-9 the same four at other alphas (no EXIT rows).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

PAPER = "arXiv 2511.11828"

#: The numeric columns of every row, in order.
COLUMNS = ("cost_cents", "coverage", "avg_len", "set_size")

Row = tuple[str, float, float, float, float]

#: Table number -> its rows in the paper's order.
TABLES: Mapping[int, tuple[Row, ...]] = MappingProxyType({
    2: (("GX", 827.0, 0.908, 2.39, 2.39), ("BX", 0.000, 0.653, 2.55, 2.55),
        ("Random", 6.811, 0.578, 1.44, 1.00), ("GP", 18.65, 0.780, 1.20, 1.00),
        ("BP", 4.551, 0.675, 1.03, 1.00), ("UALA", 9.153, 0.923, 2.00, 2.00),
        ("CPO", 4.704, 0.832, 1.004, 1.00), ("CPO batch", 7.835, 0.905, 1.70, 2.19),
        ("CPO online", 7.484, 0.897, 1.58, 2.38), ("L0", 6.552, 0.902, 1.34, 2.35),
        ("L", 7.026, 0.903, 1.48, 2.22)),
    3: (("GX", 827.0, 0.908, 2.39, 2.39), ("BX", 0.000, 0.718, 4.00, 4.00),
        ("Random", 1.411, 0.61, 1.51, 1.00), ("GP", 18.09, 0.850, 1.15, 1.00),
        ("BP", 4.449, 0.615, 1.00, 1.00), ("UALA", 8.012, 0.923, 2.00, 2.00),
        ("CPO", 4.655, 0.829, 1.00, 1.00), ("CPO batch", 8.007, 0.932, 1.79, 3.58),
        ("CPO online", 8.829, 0.875, 1.856, 3.11), ("L0", 7.061, 0.901, 1.59, 3.18),
        ("L", 7.397, 0.902, 1.66, 2.78)),
    4: (("GX", 104.6, 0.960, 1.39, 1.39), ("BX", 0.000, 0.790, 3.14, 3.14),
        ("Random", 12.99, 0.545, 1.53, 1.00), ("GP", 25.35, 0.930, 1.08, 1.00),
        ("BP", 8.682, 0.660, 1.11, 1.00), ("UALA", 16.99, 0.920, 2.00, 2.00),
        ("CPO", 9.174, 0.70, 1.195, 1.00), ("CPO batch", 22.25, 0.902, 2.86, 4.20),
        ("CPO online", 19.07, 0.901, 2.48, 3.46), ("L0", 7.949, 0.920, 1.08, 2.14),
        ("L", 8.071, 0.907, 1.11, 1.48)),
    5: (("GX", 104.6, 0.960, 1.39, 1.39), ("BX", 0.000, 0.840, 3.97, 3.97),
        ("Random", 12.74, 0.607, 1.55, 1.00), ("GP", 26.87, 0.913, 1.19, 1.00),
        ("BP", 8.540, 0.580, 1.03, 1.00), ("UALA", 16.10, 0.893, 2.00, 2.00),
        ("CPO", 6.846, 0.860, 1.01, 1.00), ("CPO batch", 12.12, 0.917, 1.51, 2.36),
        ("CPO online", 11.76, 0.878, 1.51, 2.53), ("L0", 10.82, 0.901, 1.34, 2.66),
        ("L", 10.90, 0.900, 1.35, 2.70)),
    6: (("Random", 6.811, 0.578, 1.44, 1.00), ("GP", 19.25, 0.810, 1.16, 1.00),
        ("BP", 4.524, 0.685, 1.02, 1.00), ("UALA", 4.635, 0.850, 1.00, 1.00),
        ("CPO", 4.711, 0.840, 1.00, 1.00), ("CPO batch", 4.663, 0.841, 1.00, 1.00),
        ("CPO online", 4.709, 0.819, 1.00, 1.00), ("L0", 4.640, 0.862, 1.00, 1.00),
        ("L", 4.647, 0.815, 1.00, 1.00)),
    7: (("Random", 1.411, 0.610, 1.51, 1.00), ("GP", 18.77, 0.845, 1.12, 1.00),
        ("BP", 4.495, 0.605, 1.00, 1.00), ("UALA", 13.25, 0.970, 3.00, 3.00),
        ("CPO", 4.722, 0.846, 1.02, 1.00), ("CPO batch", 8.717, 0.979, 1.97, 3.66),
        ("CPO online", 10.02, 0.894, 2.11, 3.68), ("L0", 8.126, 0.954, 1.86, 3.39),
        ("L", 8.575, 0.951, 1.95, 3.20)),
    8: (("Random", 12.99, 0.545, 1.53, 1.00), ("GP", 27.15, 0.887, 1.31, 1.00),
        ("BP", 8.712, 0.520, 1.12, 1.00), ("UALA", 7.612, 0.889, 1.00, 1.00),
        ("CPO", 7.521, 0.860, 1.00, 1.00), ("CPO batch", 8.024, 0.886, 1.00, 1.00),
        ("CPO online", 7.643, 0.828, 1.00, 0.95), ("L0", 7.612, 0.801, 1.00, 0.90),
        ("L", 7.670, 0.805, 1.00, 0.90)),
    9: (("Random", 12.74, 0.607, 1.55, 1.00), ("GP", 26.87, 0.913, 1.19, 1.00),
        ("BP", 8.547, 0.580, 1.03, 1.00), ("UALA", 7.755, 0.839, 1.00, 1.00),
        ("CPO", 7.121, 0.805, 1.00, 1.00), ("CPO batch", 7.767, 0.805, 1.00, 0.91),
        ("CPO online", 7.620, 0.818, 1.00, 0.98), ("L0", 7.735, 0.806, 1.00, 1.02),
        ("L", 7.742, 0.806, 1.00, 0.89)),
})


def row(table: int, kind: str) -> dict[str, float]:
    """``{column: value}`` of row ``kind`` of Table ``table``; ``KeyError`` if there is none."""
    for k, *vals in TABLES[table]:
        if k == kind:
            return dict(zip(COLUMNS, vals))
    raise KeyError(f"{PAPER} Table {table} has no row {kind!r}")


def value(table: int, kind: str, column: str) -> float:
    """One published number: ``column`` (in :data:`COLUMNS`) of row ``kind`` of Table ``table``."""
    return row(table, kind)[column]


# -- arXiv 2606.23026 (Stackelberg resource governance); ccpo_jax.stackelberg puts these beside a run's
# results (results.json, table.md). Read-only mappings.

#: Table 4 (§10.2): strategy -> (tokens per turn, quality, efficiency Q/T x 1e3).
STACKELBERG_TABLE4: Mapping[str, tuple[float, float, float]] = MappingProxyType({
    "Middle": (933.7, 0.888, 0.951), "Conservative": (703.8, 0.899, 1.278), "Task-aware raw": (263.5, 0.824, 3.127),
    "Scalar+R": (581.1, 0.894, 1.694), "Task-aware+R": (817.2, 0.904, 1.106),
})

#: Table 3: the surrogate payoff oracle on its held-out split (n = samples).
STACKELBERG_SURROGATE: Mapping[str, float] = MappingProxyType(
    {"n": 2400, "token_r2": 0.912, "token_mae": 65.5, "quality_r2": 0.427, "quality_mae": 0.050})

#: The sim-to-real token correction T_corr = a T_sim + b and the surrogate-vs-replay correlations.
STACKELBERG_SIM_TO_REAL: Mapping[str, float] = MappingProxyType(
    {"a": 0.3167, "b": 85.4, "token_pearson_r": 0.355, "quality_pearson_r": 0.028})

#: Coding-aware tool repair: the low-tool miss rate with projection only and with the repair.
STACKELBERG_TOOL_REPAIR: Mapping[str, float] = MappingProxyType(
    {"miss_rate_projection_only": 0.641, "miss_rate_repaired": 0.010})
