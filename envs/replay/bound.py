"""The clairvoyant bound: the cheapest cost at coverage >= 1 - alpha when every answer is known.

No router can beat it on a test set, so a learned router's cost / bound is its room
for improvement (docs/results.md). On a set of n questions:

* every question pays its first round (the policy's first observation is the round-1
  base answer and guide judgement, ``J_1``);
* an unsolvable question (no cached answer is right) counts as covered for free;
* a solvable question is covered by paying its rounds up to the first round whose base
  or guide answer is right; its *extra* cost is that minus ``J_1`` (0 when round 1 is right);
* coverage >= 1 - alpha needs ``ceil((1 - alpha) n)`` covered questions: the unsolvable
  ones, then the solvable ones with the smallest extra cost.

The bound's coverage is that count over n. Pure NumPy (one sort per split), independent of
the replay environment and of every policy it is compared with.
"""
from __future__ import annotations

import math

import numpy as np

#: Row name of the bound in results.json and table.md (not a policy).
BOUND_ROW = "Clairvoyant bound"


def required_covered(n: int, alpha: float) -> int:
    """The smallest number of covered questions among ``n`` with coverage >= 1 - alpha."""
    return int(math.ceil((1.0 - alpha) * n - 1e-9))


def cover_costs(cost: np.ndarray, base_correct: np.ndarray, guide_correct: np.ndarray,
                round_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per question [Q]: (first-round cost, extra cost to cover, solvable).

    ``cost`` [Q, T] cents of each round; correctness and ``round_mask`` [Q, T] bool. The extra
    cost of an unsolvable question is +inf."""
    cost = np.where(round_mask, np.asarray(cost, np.float64), 0.0)
    right = (np.asarray(base_correct) | np.asarray(guide_correct)) & np.asarray(round_mask)
    solvable = right.any(axis=1)
    first_right = np.argmax(right, axis=1)  # 0 when none (masked below)
    upto = np.cumsum(cost, axis=1)[np.arange(cost.shape[0]), first_right]
    extra = np.where(solvable, upto - cost[:, 0], np.inf)
    return cost[:, 0], extra, solvable


def clairvoyant(cost, base_correct, guide_correct, round_mask, idx, alpha: float) -> dict[str, np.ndarray]:
    """The bound on each question set ``idx`` ([n] or [S, n] indices): ``cost_cents`` (summed over
    the set's questions, like the rows' metric) and ``coverage``, each [S] (or scalar for one set)."""
    first, extra, solvable = cover_costs(cost, base_correct, guide_correct, round_mask)
    idx = np.asarray(idx)
    one = idx.ndim == 1
    idx = np.atleast_2d(idx)
    n = idx.shape[1]
    need = required_covered(n, alpha)
    ex = np.sort(extra[idx], axis=1)  # unsolvable (+inf) last
    n_unsolvable = (~solvable[idx]).sum(axis=1)
    k = np.maximum(need - n_unsolvable, 0)  # solvable questions that must be covered
    csum = np.concatenate([np.zeros((idx.shape[0], 1)), np.cumsum(np.where(np.isfinite(ex), ex, 0.0), axis=1)], 1)
    if np.any(k > n - n_unsolvable):  # cannot happen: unsolvable count as covered
        raise AssertionError("bound: more questions needed than exist")
    total = first[idx].sum(axis=1) + csum[np.arange(idx.shape[0]), k]
    out = {"cost_cents": total, "coverage": (n_unsolvable + k) / n}
    return {key: (v[0] if one else v) for key, v in out.items()}


def bound_of_params(params, idx, alpha: float) -> dict[str, np.ndarray]:
    """:func:`clairvoyant` on a replay env's params (``envs.replay.env.EnvParams``)."""
    return clairvoyant(np.asarray(params.cost), np.asarray(params.base_correct), np.asarray(params.guide_correct),
                       np.asarray(params.round_mask), idx, alpha)


def bound_of_cache(cache, idx, alpha: float) -> dict[str, np.ndarray]:
    """:func:`clairvoyant` on a response cache (``envs.cache.schema.ResponseCache``)."""
    a = cache.arrays
    return clairvoyant(cache.round_cost_cents(), a["base_correct"], a["guide_correct"], a["round_mask"], idx, alpha)
