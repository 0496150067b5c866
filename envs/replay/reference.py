"""Plain-Python reference of the replay env and the set-valued evaluator.

Written independently of :mod:`envs.replay.features` and :mod:`envs.replay.env`
(loops over rounds, recursion over rollout branches) with the same
semantics. Tests use it as the oracle; ``benchmarks/env_throughput.py`` uses
it as the unaccelerated baseline. Slow on purpose: clarity over speed.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from envs.cache.schema import ResponseCache

BASE, GUIDE, NEXT = 0, 1, 2


def _f(x: Any) -> float:
    return float(x)


def reference_features(cache: ResponseCache, q: int) -> list[list[float]]:
    """Features of every round of question q as T lists of floats (order: ``envs.replay.features.feature_names``)."""
    a, T = cache.arrays, cache.T
    cost = cache.round_cost_cents()
    n = int(sum(bool(x) for x in a["round_mask"][q]))
    # a ladder's rung prices: round t's price_in + price_out over the role's dearest rung (0 if all free)
    man = cache.manifest
    rung = []
    for lad in (man.base_ladder, man.guide_ladder):
        if lad:
            top = max(m.price_in + m.price_out for m in lad)
            rung.append([(m.price_in + m.price_out) / top if top > 0 else 0.0 for m in lad])
    rows = []
    seen: list[int] = []
    cum = {"gi": 0.0, "go": 0.0, "bi": 0.0, "bo": 0.0, "c": 0.0}
    for t in range(T):
        if t >= n:
            rows.append([0.0] * (T + 15 + len(rung)))
            continue
        b, g = int(a["base_answer"][q, t]), int(a["guide_answer"][q, t])
        for x in (b, g):
            if x >= 0 and x not in seen:  # a cascade's guide id -1: no answer
                seen.append(x)
        cum["gi"] += _f(a["guide_tokens_in"][q, t])
        cum["go"] += _f(a["guide_tokens_out"][q, t])
        cum["bi"] += _f(a["base_tokens_in"][q, t])
        cum["bo"] += _f(a["base_tokens_out"][q, t])
        cum["c"] += _f(cost[q, t])
        u = _f(a["guide_uncertainty"][q, t])
        c = _f(a["base_confidence"][q, t])
        row = [1.0 if s == t else 0.0 for s in range(T)]
        row += [
            1.0 if t == n - 1 else 0.0,
            1.0 if a["guide_verdict"][q, t] else 0.0,
            0.5 if math.isnan(u) else u,
            0.0 if math.isnan(u) else 1.0,
            0.5 if math.isnan(c) else c,
            0.0 if math.isnan(c) else 1.0,
            1.0 if b == g else 0.0,
            1.0 if t > 0 and b == int(a["base_answer"][q, t - 1]) else 0.0,
            1.0 if t > 0 and g >= 0 and g == int(a["guide_answer"][q, t - 1]) else 0.0,
            len(seen) / (2 * T),
            math.log1p(cum["gi"] / 1000.0),
            math.log1p(cum["go"] / 100.0),
            math.log1p(cum["bi"] / 1000.0),
            math.log1p(cum["bo"] / 100.0),
            math.log1p(cum["c"] * 10.0),
        ]
        row += [r[t] for r in rung]
        rows.append(row)
    return rows


class ReferenceEnv:
    """One episode at a time, plain Python; same semantics as ``envs.replay.env.OrchestrationEnv``."""

    def __init__(self, cache: ResponseCache):
        self.cache = cache
        self.T = cache.T
        self.cost = cache.round_cost_cents()
        self.n_rounds = [int(x) for x in cache.n_rounds]
        self.unsolvable = [bool(x) for x in cache.unsolvable]
        self.feats = [reference_features(cache, q) for q in range(cache.n_questions)]
        self.q = 0
        self.t = 0
        self.done = True

    def reset(self, question: int) -> list[float]:
        self.q, self.t, self.done = int(question), 0, False
        return self.feats[self.q][0]

    def step(self, action: int) -> tuple[list[float], float, bool, bool, dict[str, Any]]:
        a = self.cache.arrays
        q, t = self.q, self.t
        if self.done:
            info = {"correct": False, "constraint": 0.0, "cost_cents": 0.0, "round": t + 1, "answer": -1}
            return self.feats[q][t], 0.0, True, False, info
        j = float(self.cost[q, t])
        last = t == self.n_rounds[q] - 1
        correct, answer = False, -1
        if action == NEXT and not last:
            self.t += 1
        else:
            self.done = True
            if action == BASE:
                correct, answer = bool(a["base_correct"][q, t]), int(a["base_answer"][q, t])
            elif action == GUIDE and self.cache.manifest.has_guide:  # a cascade: no guide, no answer
                correct, answer = bool(a["guide_correct"][q, t]), int(a["guide_answer"][q, t])
            # anything else (next at the last round, bad ids): no answer
        constraint = 1.0 if self.done and (correct or self.unsolvable[q]) else 0.0
        info = {"correct": correct, "constraint": constraint, "cost_cents": j, "round": t + 1, "answer": answer}
        return self.feats[q][self.t], -j, self.done, False, info


def reference_evaluate_set(cache: ResponseCache, q: int, in_set: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """Set-valued rollout of question q by recursion over branches (arXiv 2511.11828, Eq. 1).

    ``in_set[t][a]``: action a is in the set at round t. Returns cost,
    covered, length, set_size, unsolvable for this question.
    """
    a = cache.arrays
    n = int(cache.n_rounds[q])
    cost = cache.round_cost_cents()
    answers: set[int] = set()
    correct_any = [False]
    deepest = [1]

    def visit(t: int) -> None:
        deepest[0] = max(deepest[0], t + 1)
        if in_set[t][BASE]:
            answers.add(int(a["base_answer"][q, t]))
            correct_any[0] |= bool(a["base_correct"][q, t])
        if in_set[t][GUIDE] and cache.manifest.has_guide:
            answers.add(int(a["guide_answer"][q, t]))
            correct_any[0] |= bool(a["guide_correct"][q, t])
        if in_set[t][NEXT] and t + 1 < n:
            visit(t + 1)

    visit(0)
    unsolvable = bool(cache.unsolvable[q])
    return {
        "cost_cents": float(sum(float(cost[q, t]) for t in range(deepest[0]))),
        "covered": correct_any[0] or unsolvable,
        "length": deepest[0],
        "set_size": len(answers),
        "unsolvable": unsolvable,
    }


def random_cache(
    Q: int,
    T: int = 4,
    seed: int = 0,
    n_exit: int = 0,
    n_llm_policy: int = 0,
    with_uncertainty: bool = True,
) -> ResponseCache:
    """A small random cache for tests (labelled synthetic; not calibrated to anything).

    Answer ids come from a small per-question vocabulary so that repeats,
    agreements and shared ids across rounds all occur; one id per question is
    the gold one (or none: about 1/4 of questions are unsolvable), and the
    correct flags follow the ids. Rounds per question are uniform in 1..T;
    about 1/5 of the confidences/uncertainties are NaN.
    """
    from envs.cache.schema import Manifest, ModelInfo, empty_arrays

    rng = np.random.default_rng(seed)
    a = empty_arrays(Q, T, n_exit, n_llm_policy)
    n = rng.integers(1, T + 1, size=Q)
    mask = np.arange(T)[None, :] < n[:, None]
    vocab = rng.integers(1, 2 * T + 1, size=Q)  # ids in [0, vocab)
    gold = np.where(rng.random(Q) < 0.75, rng.integers(0, 2 * T, size=Q) % vocab, -1)
    b = rng.integers(0, 2 * T, size=(Q, T)) % vocab[:, None]
    g = np.where(rng.random((Q, T)) < 0.4, b, rng.integers(0, 2 * T, size=(Q, T)) % vocab[:, None])
    a["round_mask"] = mask
    a["base_answer"] = np.where(mask, b, -1).astype(np.int32)
    a["guide_answer"] = np.where(mask, g, -1).astype(np.int32)
    a["base_correct"] = mask & (b == gold[:, None])
    a["guide_correct"] = mask & (g == gold[:, None])
    a["guide_verdict"] = mask & (rng.random((Q, T)) < 0.5)
    for k, hi in (("base_tokens_in", 900), ("base_tokens_out", 80), ("guide_tokens_in", 200), ("guide_tokens_out", 12)):
        a[k] = np.where(mask, rng.integers(1, hi, size=(Q, T)), 0).astype(np.float32)
    for k in ("base_confidence", "guide_uncertainty"):
        v = rng.random((Q, T)).astype(np.float32)
        nan = (rng.random((Q, T)) < 0.2) | ~mask
        if k == "guide_uncertainty" and not with_uncertainty:
            nan[:] = True
        a[k] = np.where(nan, np.nan, v).astype(np.float32)
    a["gold"] = np.array([f"g{x}" if x >= 0 else "" for x in gold])
    a["answer_text"] = np.array([[f"g{i}" for i in range(2 * T)]] * Q) if Q else a["answer_text"]
    if n_exit:
        a["exit_correct"] = rng.random((Q, n_exit)) < 0.6
        a["exit_rounds"] = rng.integers(1, T + 1, size=(Q, n_exit)).astype(np.int32)
        a["exit_cost_cents"] = (rng.random((Q, n_exit)) * np.array([0.0] + [4.0] * (n_exit - 1))).astype(np.float32)
        a["exit_mask"] = np.ones((Q, n_exit), bool)
    if n_llm_policy:
        acts = rng.integers(0, 3, size=(Q, n_llm_policy, T)).astype(np.int32)
        # -1 after the first answer action (a replay stops there), sometimes -1 from the start of a round
        stop = np.cumsum(acts != NEXT, axis=-1) - (acts != NEXT) > 0
        acts = np.where(stop | (rng.random(acts.shape) < 0.05), -1, acts)
        a["llm_policy_actions"] = acts
    man = Manifest(
        name=f"random-{Q}x{T}-seed{seed}",
        task="test",
        T=T,
        base=ModelInfo("base-model", 0.0, 0.0),
        guide=ModelInfo("guide-model", 2.5, 10.0),
        provenance={"kind": "synthetic", "generator": "envs.reference.random_cache", "seed": seed},
        exit_models=tuple(f"exit-model-{i}" for i in range(n_exit)),
        llm_policy_models=tuple(f"policy-model-{i}" for i in range(n_llm_policy)),
    )
    from envs.cache.schema import check_arrays

    # Structure only: the LLM-policy rows deliberately include what a cache file may not hold
    # (gaps, actions past the last round, no answering action), so that the replay's handling
    # of them is tested; the value rules of real caches (envs.cache.values) would refuse them.
    check_arrays(man, a, "random_cache", values=False)
    return ResponseCache(man, a).with_checksum()
