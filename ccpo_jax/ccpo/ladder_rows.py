"""Baselines of a model ladder (issue 37, item 6; docs/reproduce.md "Ladder rows").

* **Always rung k (<model>)**, k = 1..T, only on a cache with a base ladder
  (``manifest.base_ladder``): go on through rounds 1..k-1 without collecting
  anything and take round k's base answer (rung k's model), a singleton set.
  The guide's answer is NOT collected: the row reads "always use model k".
  Its cost is the env's J_1 + ... + J_k, i.e. the cache's per-round cost,
  which prices the guide's calls of those rounds like every other row does.
  A question with fewer than k rounds takes its last round's base answer.
* **Threshold cascade** (FrugalGPT's rule, arXiv 2305.05176): at round t take
  the base answer and stop when its confidence >= tau_t, else go on; a
  question's last round always accepts. A missing (NaN) confidence never
  accepts (except at the last round). The taus are fitted on the TRAINING
  split: the cheapest taus whose training coverage >= 1 - alpha (ties: the
  higher coverage); when none reaches it, the taus of the highest coverage.
  Each tau_t is searched over {+inf (never accept)} and the 0, 1/40, ..., 1
  quantiles of the training confidences at round t (the 0 quantile accepts
  every given confidence). With at most :data:`EXHAUSTIVE_MAX` combinations
  (T <= 3 at 42 candidates a rung) the search is exhaustive; above, a
  pairwise coordinate search (two taus at a time, exhaustive over their full
  grids, the others fixed, until no pair improves; one tau at a time moves
  too little: it cannot trade coverage between rungs) starts from the best
  point of a coarse exhaustive grid (the candidates thinned evenly).
  Present on a ladder (``manifest.base_ladder``) or a guide-less cascade with a
  base confidence; absent with a note on such a cache without one, or when the
  caller passes no training split. A one-model cache with a guide gets no row:
  there the rule would ignore the guide and stop on the base answers alone (on
  the Table 2 setting's synthetic cache it reached coverage 0.514 at 3.55x the
  bound), which is not a baseline of that setting.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.ccpo.registry import Baseline
from ccpo_jax.ccpo.rowid import CASCADE, Family, rung_row
from envs.cache.schema import A_BASE, A_NEXT, ResponseCache
from envs.replay.env import EnvParams, evaluate_sets, summarise

CASCADE_ROW = CASCADE.name
#: Quantile levels of the candidate thresholds per rung (plus +inf).
QUANTILES = np.linspace(0.0, 1.0, 41)
#: Largest number of tau combinations searched exhaustively.
EXHAUSTIVE_MAX = 2000
#: Tolerance of the float comparison coverage >= 1 - alpha.
COVERAGE_EPS = 1e-6


def rung_row_name(k: int, model: str) -> str:
    """Row of "always use base rung k" (1-based)."""
    return rung_row(k, model).name


def has_confidence(cache: ResponseCache) -> bool:
    a = cache.arrays
    return bool(np.isfinite(a["base_confidence"][a["round_mask"]]).any())


# -- Always rung k ------------------------------------------------------------------------------


def rung_sets(round_mask: np.ndarray, k: int) -> np.ndarray:
    """[Q, T, 3] bool: "next" at rounds before min(k, n_rounds), the base answer there."""
    Q, T = round_mask.shape
    stop = np.minimum(k, round_mask.sum(-1)) - 1  # 0-based stopping round
    t = np.arange(T)[None, :]
    sets = np.zeros((Q, T, 3), bool)
    sets[..., A_NEXT] = t < stop[:, None]
    sets[..., A_BASE] = t == stop[:, None]
    return sets


# -- the threshold cascade ----------------------------------------------------------------------


def cascade_stop(conf: np.ndarray, n_rounds: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """[M, n] 0-based stopping round for M tau vectors ``taus`` [M, T] on ``conf`` [n, T] (NaN never
    accepts; a question's last round always does)."""
    T = conf.shape[1]
    c = np.where(np.isnan(conf), -np.inf, conf)
    accept = c[None] >= taus[:, None, :]  # [M, n, T]
    accept |= (np.arange(T)[None, :] == (n_rounds - 1)[:, None])[None]
    return np.argmax(accept, axis=-1)


def cascade_metrics(conf, correct, cost, n_rounds, unsolvable, taus):
    """(total cost [M], coverage [M]) of M tau vectors on n questions."""
    stop = cascade_stop(conf, n_rounds, taus)  # [M, n]
    cum = np.cumsum(cost, axis=-1)  # [n, T]
    n = conf.shape[0]
    rows = np.arange(n)[None, :]
    tot = cum[rows, stop].sum(-1)
    cov = (correct[rows, stop] | unsolvable[None]).mean(-1)
    return tot, cov


def _key(cost: float, cov: float, target: float) -> tuple:
    return (0, cost, -cov) if cov >= target - COVERAGE_EPS else (1, -cov, cost)


def _candidates(conf: np.ndarray, n_rounds: np.ndarray) -> list[np.ndarray]:
    """Per round with a next one, the candidate taus; the last round of the cache: +inf only (unused)."""
    T = conf.shape[1]
    out = []
    for t in range(T):
        v = conf[:, t][np.isfinite(conf[:, t]) & (n_rounds > t + 1)]
        q = np.quantile(v, QUANTILES) if (t < T - 1 and v.size) else np.zeros(0)
        out.append(np.unique(np.concatenate([q, [np.inf]])))
    return out


def fit_cascade(conf, correct, cost, n_rounds, unsolvable, alpha: float) -> np.ndarray:
    """f64 [T] taus of the threshold cascade on the training questions (module doc)."""
    cand = _candidates(conf, n_rounds)
    target = 1.0 - alpha
    args = (conf, correct, cost, n_rounds, unsolvable)
    if np.prod([len(c) for c in cand]) <= EXHAUSTIVE_MAX:
        taus = np.array(list(itertools.product(*cand)), float)
        tot, cov = cascade_metrics(*args, taus)
        best = min(range(len(taus)), key=lambda i: _key(tot[i], cov[i], target))
        return taus[best]
    # start from the best point of a coarse exhaustive grid (every rung's candidates thinned to
    # at most EXHAUSTIVE_MAX combinations), then refine one tau at a time on the full grid
    free = sum(len(c) > 1 for c in cand)
    per = max(2, int(EXHAUSTIVE_MAX ** (1.0 / max(free, 1))))
    coarse = [c if len(c) <= per else np.unique(np.concatenate([c[np.linspace(0, len(c) - 1, per - 1).astype(int)],
                                                                [np.inf]])) for c in cand]
    starts = np.array(list(itertools.product(*coarse)), float)
    tot, cov = cascade_metrics(*args, starts)
    i0 = min(range(len(starts)), key=lambda i: _key(tot[i], cov[i], target))
    cur, cur_key = starts[i0], _key(tot[i0], cov[i0], target)
    pairs = list(itertools.combinations([t for t, c in enumerate(cand) if len(c) > 1], 2)) or \
        [(t,) for t, c in enumerate(cand) if len(c) > 1]
    for _ in range(20):  # sweeps; each move strictly improves the key
        moved = False
        for pair in pairs:
            combos = np.array(list(itertools.product(*(cand[t] for t in pair))), float)
            trial = np.repeat(cur[None], len(combos), 0)
            trial[:, list(pair)] = combos
            tot, cov = cascade_metrics(*args, trial)
            i = min(range(len(trial)), key=lambda j: _key(tot[j], cov[j], target))
            if _key(tot[i], cov[i], target) < cur_key:
                cur, cur_key, moved = trial[i], _key(tot[i], cov[i], target), True
        if not moved:
            break
    return cur


def cascade_sets(conf: np.ndarray, n_rounds: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """[n, T, 3] singleton sets: "next" before the stopping round, the base answer at it."""
    stop = cascade_stop(conf, n_rounds, taus[None])[0]
    t = np.arange(conf.shape[1])[None, :]
    sets = np.zeros(conf.shape + (3,), bool)
    sets[..., A_NEXT] = t < stop[:, None]
    sets[..., A_BASE] = t == stop[:, None]
    return sets


# -- rows for S splits --------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _evaluate_program():
    def one(sets, params, idx):
        return summarise(evaluate_sets(sets, params, idx))

    return jax.jit(jax.vmap(one, in_axes=(0, None, 0)))


def _evaluate(sets: np.ndarray, params: EnvParams, test_idx: np.ndarray) -> dict[str, np.ndarray]:
    out = _evaluate_program()(jnp.asarray(sets), params, jnp.asarray(test_idx))
    return {k: np.asarray(v) for k, v in out.items()}


def ladder_rows(cache: ResponseCache, params: EnvParams, train_idx: Any, test_idx: Any,
                alpha: float) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, list]]:
    """The "Always rung k" rows (base ladder caches) and the threshold cascade (caches with a base
    confidence, given ``train_idx``) for S splits: ``({row: {metric: [S]}}, {row: taus per split})``."""
    a, man = cache.arrays, cache.manifest
    test_idx = np.asarray(test_idx, np.int64)
    mask = np.asarray(a["round_mask"], bool)
    rows: dict[str, dict[str, np.ndarray]] = {}
    fitted: dict[str, list] = {}
    for k, m in enumerate(man.base_ladder, start=1):
        sets = rung_sets(mask, k)[test_idx]  # [S, n, T, 3]
        rows[rung_row_name(k, m.name)] = _evaluate(sets, params, test_idx)
    if train_idx is None or not applies(cache) or not has_confidence(cache):
        return rows, fitted
    train_idx = np.asarray(train_idx, np.int64)
    conf = np.where(mask, a["base_confidence"], np.nan).astype(np.float64)
    correct = np.asarray(a["base_correct"], bool) & mask
    cost = np.asarray(params.cost, np.float64)
    n_rounds = mask.sum(-1)
    unsolvable = np.asarray(params.unsolvable, bool)
    memo: dict[bytes, np.ndarray] = {}  # the recalibrate protocol shares one training set
    taus = []
    for tr in train_idx:
        key = tr.tobytes()
        if key not in memo:
            memo[key] = fit_cascade(conf[tr], correct[tr], cost[tr], n_rounds[tr], unsolvable[tr], alpha)
        taus.append(memo[key])
    sets = np.stack([cascade_sets(conf[te], n_rounds[te], tau) for te, tau in zip(test_idx, taus)])
    rows[CASCADE_ROW] = _evaluate(sets, params, test_idx)
    fitted[CASCADE_ROW] = [[None if not np.isfinite(x) else float(x) for x in tau] for tau in taus]
    return rows, fitted


def applies(cache: ResponseCache) -> bool:
    """The threshold cascade is a baseline of a ladder or a guide-less cascade (see the module docstring)."""
    return cache.manifest.is_ladder or not cache.manifest.has_guide


def left_out_ladder_rows(cache: ResponseCache) -> dict[str, str]:
    """{row: why} of the ladder rows :func:`ladder_rows` leaves out on a cache where they apply."""
    out = {}
    if applies(cache) and not has_confidence(cache):
        out[CASCADE_ROW] = "no round of the cache has a base confidence (the cascade thresholds it)"
    return out


#: The ladder rows as a registered baseline (host side; ``ccpo_jax.ccpo.baselines`` registers it after the
#: paper's rows).
LADDER = Baseline(Family.LADDER, lambda cache, used: left_out_ladder_rows(cache),
                  host=lambda cache, params, train_idx, test_idx, alpha: ladder_rows(cache, params, train_idx,
                                                                                     test_idx, alpha)[0])
