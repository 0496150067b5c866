"""The per-row statistics of results.json (docs/reproduce.md, "Outputs"): the summary over seeds x splits,
the spread over seeds, the ``per_split`` and ``per_seed`` lists, and the exact per-split values of the
metrics that are means of counts (:func:`exact_totals`). ``ccpo_jax.ccpo.report`` builds the file from them.

Summary statistics over splits (as the CCPO paper's box plots over 100 random evaluation splits, arXiv
2511.11828 §5, Figs. 2-9): mean, median and the 5 % / 95 % quantiles (``numpy.quantile``'s default
linear interpolation); non-finite values are written as JSON ``null`` and left out of the statistics.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ccpo_jax.ccpo.settings import METRICS


def summary_stats(values: Any) -> dict[str, float | None]:
    """mean, median, q05, q95 of the finite values (None where there are none)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"mean": None, "median": None, "q05": None, "q95": None}
    return {
        "mean": float(np.mean(v)),
        "median": float(np.median(v)),
        "q05": float(np.quantile(v, 0.05)),
        "q95": float(np.quantile(v, 0.95)),
    }


def _json_float(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def seed_stats(per_seed: Any) -> dict[str, float | None]:
    """Spread over training seeds of the per-seed means: sd (ddof 1), min, max (None for one seed)."""
    v = np.asarray(per_seed, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    if v.size < 2:
        return {"seed_sd": None, "seed_min": None, "seed_max": None}
    return {"seed_sd": float(np.std(v, ddof=1)), "seed_min": float(v.min()), "seed_max": float(v.max())}


def _nanmean(v: np.ndarray, axis: int) -> np.ndarray:
    finite = np.isfinite(v)
    n = finite.sum(axis=axis)
    tot = np.where(finite, v, 0.0).sum(axis=axis)
    return np.where(n > 0, tot / np.maximum(n, 1), np.nan)


#: The metrics that are a mean over the test questions of an integer per question (covered 0/1, the
#: rounds reached, the answers collected): their per-split values are written exactly (:func:`exact_totals`).
COUNT_METRICS = ("coverage", "avg_len", "set_size")


def exact_totals(values: Any, n: int) -> np.ndarray | None:
    """The integer totals behind means of ``n`` integers each, or None when ``values`` are not such means.

    ``envs.replay.env.summarise`` computes a split's coverage (average length, set size) in float32: the
    sum of the questions' integers (exact below 2^24) times 1/n (XLA's mean: two roundings, so 5 of 3
    reads 1.6666667, not the nearest float32 1.6666666), within 2 ulps of ``total / n`` (180 of 200
    covered reads 0.8999999762). An ulp there is at most (total / n) * 2^-23, so ``value * n`` is within
    total * 2^-22 < 1/2 of the total for totals below 2^21: ``rint(value * n)`` recovers it exactly.
    Every finite value must be within 2 float32 ulps of ``total / n`` (whatever its dtype: the rows arrive
    as float64 copies of those float32 means, ``ccpo_jax.ccpo.prepare.as_rows``), else None and the values
    are written as they are: anything but such a mean (a cost, a random test value) is left alone.
    """
    v = np.asarray(values)
    if not n or v.dtype.kind != "f":
        return None
    finite = np.isfinite(v)
    x = np.where(finite, v, 0.0).astype(np.float64)
    k = np.rint(x * n)
    ulp = np.spacing(np.abs(k / n).astype(np.float32)).astype(np.float64)
    if not (finite.any() and np.all(~finite | ((np.abs(x - k / n) <= 2 * ulp) & (k >= 0) & (k < 2**21)))):
        return None
    return np.where(finite, k, np.nan)


def policy_entry(metrics: Mapping[str, Any], n_splits: int | None = None, row: str = "?",
                 n_test: int | None = None) -> dict[str, Any]:
    """One row of ``policies``: summary stats per metric, the per-split and the per-seed lists.

    ``metrics`` maps every name in METRICS to an array [S] (one seed) or [N seeds, S splits].
    The summary is over all seeds x splits, plus the spread of the per-seed means
    (:func:`seed_stats`); ``per_split`` holds the mean over seeds of each split and
    ``per_seed`` the mean over splits of each seed. With ``n_test`` (the test questions of a split),
    the per-split values of :data:`COUNT_METRICS` are exact: total / (n_test x seeds) in float64 from the
    integer totals (:func:`exact_totals`), so 180 of 200 covered reads 0.9, not 0.8999999761581421;
    and ``per_split_covered`` gives the covered test questions of each split (summed over seeds) and
    ``of`` (n_test x seeds). The summary and per-seed values are computed as before, from the values given.
    """
    missing = [m for m in METRICS if m not in metrics]
    if missing:
        raise ValueError(f"row {row!r}: missing metric(s) {missing}")
    entry: dict[str, Any] = {}
    per_split: dict[str, list] = {}
    per_seed: dict[str, list] = {}
    covered = None
    for m in METRICS:
        raw = np.asarray(metrics[m])
        v = raw.astype(np.float64)
        v = v.reshape(1, -1) if v.ndim <= 1 else v.reshape(v.shape[0], -1)
        if n_splits is not None and v.shape[1] != n_splits:
            raise ValueError(f"row {row!r}, metric {m}: {v.shape[1]} values for {n_splits} splits")
        seeds_mean = _nanmean(v, axis=1)
        entry[m] = {**summary_stats(v), **seed_stats(seeds_mean)}
        totals = exact_totals(raw.reshape(v.shape), n_test) if n_test and m in COUNT_METRICS else None
        if totals is None:
            per_split[m] = [_json_float(x) for x in _nanmean(v, axis=0)]
        else:  # one division of exact integers: the float64 nearest the true mean
            seen = np.isfinite(totals).sum(axis=0)
            exact = np.where(seen > 0, np.nansum(totals, axis=0) / np.maximum(seen * n_test, 1), np.nan)
            per_split[m] = [_json_float(x) for x in exact]
            if m == "coverage" and bool(np.all(seen == v.shape[0])):
                covered = {"covered": [int(x) for x in np.sum(totals, axis=0)], "of": int(n_test * v.shape[0])}
        per_seed[m] = [_json_float(x) for x in seeds_mean]
    entry["per_split"] = per_split
    if covered is not None:
        entry["per_split_covered"] = covered
    entry["per_seed"] = per_seed
    entry["seeds"] = int(len(per_seed[METRICS[0]]))
    return entry
