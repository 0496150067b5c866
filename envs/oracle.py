"""Hand-designed SYNTHETIC caches whose cost-optimal conformal policy is known (learner checks).

A cache here is a mixture of a few *question types*. Types are grouped into
*observation classes*: every question of a class shows exactly the same
observation at every round (same guide verdict, uncertainty, base confidence,
answer-agreement pattern and token counts), so no policy can tell its types
apart; only correctness differs between the types of a class. A policy that
sees only observations is therefore a choice, per class and round, of an
action set, and the cost-optimal conformal policy

    min E[cost]   s.t.   Pr[Y* in C(Q) or Y* unreachable] >= 1 - alpha

is found by brute force over those choices (:func:`optimum`): plain Python over
the class chains, independent of the replay environment it checks. Guide
prices grow with the round (the guide's prompt carries the earlier rounds), so
going on costs more each round.

:func:`builtin` holds the caches of the learner tests (docs/results.md and
``tests/test_oracle.py``): a signal in the guide's uncertainty, a signal in the
base's confidence with no uncertainty given, an answer that needs two extra
rounds, unsolvable questions in every cache, and a single-round cascade (T = 1).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from envs.cache import Manifest, ModelInfo, ResponseCache, empty_arrays
from envs.features import build_features

GUIDE_PRICE = (2.5, 10.0)  # USD per million tokens in / out (GPT-4o list price)


@dataclasses.dataclass(frozen=True)
class Obs:
    """What the policy sees at one round of an observation class."""

    verdict: bool  # guide judged the base answer correct
    uncertainty: float | None = None  # guide uncertainty (None = not given)
    confidence: float | None = None  # base confidence (None = not given)
    agree: bool = False  # base and guide answers are the same answer


@dataclasses.dataclass(frozen=True)
class QType:
    """A question type: its observation class, its share of the cache, and per round
    whether the base and the guide answers are correct."""

    name: str
    obs_class: str
    weight: float
    correct: tuple[tuple[bool, bool], ...]  # per round (base correct, guide correct)


@dataclasses.dataclass(frozen=True)
class OracleSpec:
    name: str
    T: int
    classes: dict[str, tuple[Obs, ...]]  # class name -> its rounds' observations (len = rounds)
    types: tuple[QType, ...]
    description: str = ""

    def round_cost_cents(self, t: int) -> float:
        """Guide call of round t (1-based): 80 t prompt tokens, 4 completion tokens."""
        p_in, p_out = GUIDE_PRICE
        return (80.0 * t * p_in + 4.0 * p_out) / 1e6 * 100.0


def build(spec: OracleSpec, n_questions: int = 1000, seed: int = 0) -> ResponseCache:
    """A cache of ``n_questions`` questions: type counts proportional to the weights
    (largest remainders), in a random order (``seed``). Labelled synthetic."""
    w = np.array([t.weight for t in spec.types], float)
    w = w / w.sum()
    counts = np.floor(w * n_questions).astype(int)
    rest = n_questions - counts.sum()
    counts[np.argsort(-(w * n_questions - counts))[:rest]] += 1
    kinds = np.repeat(np.arange(len(spec.types)), counts)
    kinds = np.random.default_rng(seed).permutation(kinds)
    T = spec.T
    a = empty_arrays(n_questions, T)
    for i, k in enumerate(kinds):
        qt = spec.types[k]
        obs = spec.classes[qt.obs_class]
        if len(qt.correct) != len(obs):
            raise ValueError(f"type {qt.name}: {len(qt.correct)} rounds, class {qt.obs_class} has {len(obs)}")
        next_id = 1
        for t, (o, (bc, gc)) in enumerate(zip(obs, qt.correct)):
            if o.agree and bc != gc:
                raise ValueError(f"type {qt.name} round {t + 1}: agreeing answers must be both right or both wrong")
            # The gold answer has id 0; every wrong answer is a new id (agreeing answers share one).
            b_id = 0 if bc else next_id
            next_id += 0 if bc else 1
            if o.agree:
                g_id = b_id
            else:
                g_id = 0 if gc else next_id
                next_id += 0 if gc else 1
            a["round_mask"][i, t] = True
            a["base_answer"][i, t], a["guide_answer"][i, t] = b_id, g_id
            a["base_correct"][i, t], a["guide_correct"][i, t] = bc, gc
            a["guide_verdict"][i, t] = o.verdict
            a["guide_uncertainty"][i, t] = np.nan if o.uncertainty is None else o.uncertainty
            a["base_confidence"][i, t] = np.nan if o.confidence is None else o.confidence
            a["guide_tokens_in"][i, t] = 80.0 * (t + 1)
            a["guide_tokens_out"][i, t] = 4.0
            a["base_tokens_in"][i, t] = 200.0
            a["base_tokens_out"][i, t] = 30.0
    a["question_ids"] = np.array([f"{spec.types[k].name}-{i}" for i, k in enumerate(kinds)])
    _check_classes(spec, a, kinds)
    man = Manifest(
        name=f"oracle-{spec.name}", task="oracle", T=T, base=ModelInfo("base (free)"),
        guide=ModelInfo("guide", *GUIDE_PRICE),
        provenance={"kind": "synthetic", "generator": f"envs.oracle/{spec.name}", "seed": int(seed),
                    "note": "hand-designed cache with a brute-force optimum"},
    )
    return ResponseCache(man, a).with_checksum()


def _check_classes(spec: OracleSpec, arrays: dict, kinds: np.ndarray) -> None:
    """Every question of an observation class must show identical features at every round
    (else the brute force over classes would not bound what a policy can do)."""

    raw = {k: arrays[k] for k in ("round_mask", "guide_verdict", "guide_uncertainty", "base_confidence",
                                  "base_answer", "guide_answer", "guide_tokens_in", "guide_tokens_out",
                                  "base_tokens_in", "base_tokens_out")}
    raw["round_cost_cents"] = np.where(arrays["round_mask"], arrays["guide_tokens_in"], 0.0)  # any per-round constant
    feats = np.asarray(build_features(raw, spec.T))
    first: dict[str, int] = {}
    for i, k in enumerate(kinds):
        c = spec.types[k].obs_class
        j = first.setdefault(c, i)
        if not np.array_equal(feats[i], feats[j]):
            raise ValueError(f"oracle spec {spec.name}: class {c} shows different observations for "
                             f"types {spec.types[kinds[j]].name} and {spec.types[k].name}")


def type_of(cache: ResponseCache) -> np.ndarray:
    """[Q] type name of each question of a :func:`build` cache."""
    return np.array([q.rsplit("-", 1)[0] for q in cache.arrays["question_ids"]])


@dataclasses.dataclass(frozen=True)
class Optimum:
    cost_per_question: float  # expected cents per question of the optimal conformal policy
    coverage: float
    plan: dict[str, tuple[frozenset, ...]]  # class -> action set ("base", "guide", "next") per reached round
    type_cost: dict[str, float]  # type name -> its cost under the plan

    def cost_of(self, types: Sequence[str]) -> float:
        """Total cost of the plan on questions of the given types (e.g. one test split)."""
        return float(sum(self.type_cost[t] for t in types))


def _class_options(spec: OracleSpec, cname: str):
    """Every set policy along one class chain: (plan, cost, {type: covered})."""
    n = len(spec.classes[cname])
    types = [t for t in spec.types if t.obs_class == cname]
    answer_sets = [frozenset(s) for s in ((), ("base",), ("guide",), ("base", "guide"))]
    for depth in range(1, n + 1):  # rounds reached: "next" in the set at rounds 1..depth-1
        for picks in itertools.product(answer_sets, repeat=depth):
            plan = tuple(p | {"next"} if t < depth - 1 else p for t, p in enumerate(picks))
            cost = sum(spec.round_cost_cents(t + 1) for t in range(depth))
            cov = {}
            for qt in types:
                unsolvable = not any(b or g for b, g in qt.correct)
                hit = any(("base" in picks[t] and qt.correct[t][0]) or ("guide" in picks[t] and qt.correct[t][1])
                          for t in range(depth))
                cov[qt.name] = unsolvable or hit
            yield plan, cost, cov


def optimum(spec: OracleSpec, alpha: float) -> Optimum:
    """Brute force: the cheapest per-class set policies whose population coverage >= 1 - alpha.
    Ties in cost go to the smaller sets."""
    wsum = sum(t.weight for t in spec.types)
    weight = {t.name: t.weight / wsum for t in spec.types}
    per_class = []
    for cname in spec.classes:
        best: dict[tuple, tuple] = {}  # covered-types signature -> cheapest option
        for plan, cost, cov in _class_options(spec, cname):
            sig = tuple(sorted(k for k, v in cov.items() if v))
            size = sum(len(p - {"next"}) for p in plan)
            if sig not in best or (cost, size) < (best[sig][1], best[sig][3]):
                best[sig] = (plan, cost, cov, size)
        per_class.append((cname, list(best.values())))
    best_total = None
    for combo in itertools.product(*(opts for _, opts in per_class)):
        coverage = sum(weight[t] for _, _, cov, _ in combo for t, ok in cov.items() if ok)
        if coverage < 1.0 - alpha - 1e-12:
            continue
        cost = 0.0
        for (cname, _), (_, c, cov, _) in zip(per_class, combo):
            cost += c * sum(weight[t] for t in cov)
        size = sum(s for *_, s in combo)
        if best_total is None or (cost, size) < best_total[:2]:
            best_total = (cost, size, coverage, combo)
    cost, _, coverage, combo = best_total
    plan = {cname: opt[0] for (cname, _), opt in zip(per_class, combo)}
    class_cost = {cname: opt[1] for (cname, _), opt in zip(per_class, combo)}
    type_cost = {t.name: class_cost[t.obs_class] for t in spec.types}
    return Optimum(cost_per_question=cost, coverage=coverage, plan=plan, type_cost=type_cost)


# -- the built-in specs ---------------------------------------------------------------------

_R, _W = (True, False), (False, False)  # base right / both wrong
_G = (False, True)  # guide right


def builtin() -> dict[str, OracleSpec]:
    """The learner-check caches (module docstring). Each optimum is derived by hand in
    ``tests/test_oracle.py`` and by :func:`optimum`."""
    uncertainty = OracleSpec(
        name="uncertainty", T=4,
        description="guide uncertainty tells easy (base right), guide-fixable and one-more-round questions apart",
        classes={
            "easy": (Obs(True, 0.1), Obs(True, 0.1), Obs(True, 0.1), Obs(True, 0.1)),
            "fix": (Obs(False, 0.2), Obs(False, 0.2), Obs(False, 0.2), Obs(False, 0.2)),
            "retry": (Obs(False, 0.9), Obs(True, 0.1)),
        },
        types=(
            QType("easy", "easy", 0.50, (_R, _R, _R, _R)),
            QType("fix", "fix", 0.25, (_G, _W, _W, _W)),
            QType("retry", "retry", 0.15, (_W, _R)),
            QType("unsolvable", "retry", 0.10, (_W, _W)),
        ),
    )
    confidence = OracleSpec(
        name="confidence", T=4,
        description="no guide uncertainty; the base's confidence separates right answers from a fooled guide",
        classes={
            "sure": (Obs(True, None, 0.9, agree=True),) * 4,
            "unsure": (Obs(True, None, 0.2, agree=True), Obs(True, None, 0.9, agree=True)),
        },
        types=(
            QType("sure", "sure", 0.50, ((True, True),) * 4),
            QType("unsure", "unsure", 0.30, (_W, (True, True))),
            QType("unsolvable", "unsure", 0.20, (_W, _W)),
        ),
    )
    two_rounds = OracleSpec(
        name="two-extra-rounds", T=4,
        description="a third of the questions are answered right only at round 3",
        classes={
            "easy": (Obs(True, 0.1),) * 4,
            "deep": (Obs(False, 0.9), Obs(False, 0.8), Obs(True, 0.1)),
        },
        types=(
            QType("easy", "easy", 0.60, (_R,) * 4),
            QType("deep", "deep", 0.30, (_W, _W, _R)),
            QType("unsolvable", "deep", 0.10, (_W,) * 3),
        ),
    )
    cascade = OracleSpec(
        name="cascade-T1", T=1,
        description="one round (a cascade): the guide's uncertainty says whose answer to take",
        classes={"easy": (Obs(True, 0.1),), "fix": (Obs(False, 0.2),), "mixed": (Obs(False, 0.6),)},
        types=(
            QType("easy", "easy", 0.55, (_R,)),
            QType("fix", "fix", 0.25, (_G,)),
            QType("mixed-base", "mixed", 0.075, (_R,)),
            QType("mixed-guide", "mixed", 0.075, (_G,)),
            QType("unsolvable", "fix", 0.05, (_W,)),
        ),
    )
    return {s.name: s for s in (uncertainty, confidence, two_rounds, cascade)}
