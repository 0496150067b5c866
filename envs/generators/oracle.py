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
``tests/ccpo/test_oracle.py``): a signal in the guide's uncertainty, a signal in the
base's confidence with no uncertainty given, an answer that needs two extra
rounds, unsolvable questions in every cache, and a single-round cascade (T = 1).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from envs.cache.schema import Manifest, ModelInfo, ResponseCache, empty_arrays
from envs.replay.features import build_features, feature_names

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
    whether the base and the guide answers are correct.

    ``obs_class`` is one class name, or ``((class, probability), ...)``: each question of the
    type shows one of those classes, drawn with those probabilities (noisy, overlapping
    classes). ``signal`` (specs with :attr:`OracleSpec.signal`): per round, None (the class's
    value) or a range ``(lo, hi)`` from which each question draws the signal uniformly, so a
    type is told apart from the others of its class only in distribution."""

    name: str
    obs_class: str | tuple[tuple[str, float], ...]
    weight: float
    correct: tuple[tuple[bool, bool], ...]  # per round (base correct, guide correct)
    signal: tuple[tuple[float, float] | None, ...] | None = None

    def class_probs(self) -> tuple[tuple[str, float], ...]:
        if isinstance(self.obs_class, str):
            return ((self.obs_class, 1.0),)
        return tuple(self.obs_class)

    def signal_range(self, t: int) -> tuple[float, float] | None:
        """The signal's range at round t (0-based), None = the class's fixed value."""
        if self.signal is None or t >= len(self.signal):
            return None
        return self.signal[t]


#: The observation field a continuous signal lives in, and the direction of "go on":
#: a policy continues when the guide is uncertain (high) or the base unsure (low).
SIGNALS = {"uncertainty": ("guide_uncertainty", +1), "confidence": ("base_confidence", -1)}


@dataclasses.dataclass(frozen=True)
class OracleSpec:
    name: str
    T: int
    classes: dict[str, tuple[Obs, ...]]  # class name -> its rounds' observations (len = rounds)
    types: tuple[QType, ...]
    description: str = ""
    signal: str | None = None  # a key of SIGNALS: the field the types' signal ranges draw into
    #: A base ladder: rung t's (price in, price out) USD per million tokens, T entries; empty =
    #: one free base model every round.
    base_prices: tuple[tuple[float, float], ...] = ()
    #: Every answer gets a new id (no two rounds' answers are "the same answer", right or wrong),
    #: so the answer-agreement features show nothing and only the signal tells types apart.
    fresh_ids: bool = False

    def round_cost_cents(self, t: int) -> float:
        """Round t (1-based): the guide's call (80 t prompt tokens, 4 completion tokens) plus, on a
        ladder, rung t's base call (200 prompt tokens, 30 completion tokens)."""
        p_in, p_out = GUIDE_PRICE
        base = 0.0
        if self.base_prices:
            b_in, b_out = self.base_prices[t - 1]
            base = 200.0 * b_in + 30.0 * b_out
        return (80.0 * t * p_in + 4.0 * p_out + base) / 1e6 * 100.0


def build(spec: OracleSpec, n_questions: int = 1000, seed: int = 0) -> ResponseCache:
    """A cache of ``n_questions`` questions: type counts proportional to the weights
    (largest remainders), in a random order (``seed``). Labelled synthetic."""
    w = np.array([t.weight for t in spec.types], float)
    w = w / w.sum()
    counts = np.floor(w * n_questions).astype(int)
    rest = n_questions - counts.sum()
    counts[np.argsort(-(w * n_questions - counts))[:rest]] += 1
    rng = np.random.default_rng(seed)
    kinds = rng.permutation(np.repeat(np.arange(len(spec.types)), counts))
    T = spec.T
    a = empty_arrays(n_questions, T)
    field = SIGNALS[spec.signal][0] if spec.signal else None
    drawn = []  # each question's observation class
    for i, k in enumerate(kinds):
        qt = spec.types[k]
        names, probs = zip(*qt.class_probs())
        cname = names[0] if len(names) == 1 else names[rng.choice(len(names), p=np.asarray(probs) / sum(probs))]
        drawn.append(cname)
        obs = spec.classes[cname]
        if len(qt.correct) != len(obs):
            raise ValueError(f"type {qt.name}: {len(qt.correct)} rounds, class {qt.obs_class} has {len(obs)}")
        next_id = 1
        for t, (o, (bc, gc)) in enumerate(zip(obs, qt.correct)):
            if o.agree and bc != gc:
                raise ValueError(f"type {qt.name} round {t + 1}: agreeing answers must be both right or both wrong")
            # The gold answer has id 0; every wrong answer is a new id (agreeing answers share one).
            b_id = 0 if bc and not spec.fresh_ids else next_id
            next_id += 0 if bc and not spec.fresh_ids else 1
            if o.agree:
                g_id = b_id
            else:
                g_id = 0 if gc and not spec.fresh_ids else next_id
                next_id += 0 if gc and not spec.fresh_ids else 1
            a["round_mask"][i, t] = True
            a["base_answer"][i, t], a["guide_answer"][i, t] = b_id, g_id
            a["base_correct"][i, t], a["guide_correct"][i, t] = bc, gc
            a["guide_verdict"][i, t] = o.verdict
            a["guide_uncertainty"][i, t] = np.nan if o.uncertainty is None else o.uncertainty
            a["base_confidence"][i, t] = np.nan if o.confidence is None else o.confidence
            rng_t = qt.signal_range(t)
            if rng_t is not None:
                if field is None:
                    raise ValueError(f"type {qt.name}: a signal range needs the spec's signal field")
                a[field][i, t] = rng.uniform(*rng_t)
            a["guide_tokens_in"][i, t] = 80.0 * (t + 1)
            a["guide_tokens_out"][i, t] = 4.0
            a["base_tokens_in"][i, t] = 200.0
            a["base_tokens_out"][i, t] = 30.0
    a["question_ids"] = np.array([f"{spec.types[k].name}@{c}-{i}" for i, (k, c) in enumerate(zip(kinds, drawn))])
    _check_classes(spec, a, kinds, np.array(drawn))
    ladder = tuple(ModelInfo(f"rung {k + 1}", *p) for k, p in enumerate(spec.base_prices))
    man = Manifest(
        name=f"oracle-{spec.name}", task="oracle", T=T, base=ModelInfo("base (free)"), base_ladder=ladder,
        guide=ModelInfo("guide", *GUIDE_PRICE),
        provenance={"kind": "synthetic", "generator": f"envs.oracle/{spec.name}", "seed": int(seed),
                    "note": "hand-designed cache with a brute-force optimum"},
    )
    return ResponseCache(man, a).with_checksum()


def _check_classes(spec: OracleSpec, arrays: dict, kinds: np.ndarray, drawn: np.ndarray) -> None:
    """Every question of an observation class must show identical features at every round,
    except the continuous signal's (else the brute force over classes and thresholds would not
    bound what a policy can do)."""

    raw = {k: arrays[k] for k in ("round_mask", "guide_verdict", "guide_uncertainty", "base_confidence",
                                  "base_answer", "guide_answer", "guide_tokens_in", "guide_tokens_out",
                                  "base_tokens_in", "base_tokens_out")}
    raw["round_cost_cents"] = np.where(arrays["round_mask"], arrays["guide_tokens_in"], 0.0)  # any per-round constant
    feats = np.asarray(build_features(raw, spec.T))
    if spec.signal:
        feats = np.delete(feats, feature_names(spec.T).index(SIGNALS[spec.signal][0]), axis=-1)
    first: dict[str, int] = {}
    for i, k in enumerate(kinds):
        c = drawn[i]
        j = first.setdefault(c, i)
        if not np.array_equal(feats[i], feats[j]):
            raise ValueError(f"oracle spec {spec.name}: class {c} shows different observations for "
                             f"types {spec.types[kinds[j]].name} and {spec.types[k].name}")


def type_of(cache: ResponseCache) -> np.ndarray:
    """[Q] type name of each question of a :func:`build` cache (ids are ``type@class-i``)."""
    return np.array([q.rsplit("-", 1)[0].split("@")[0] for q in cache.arrays["question_ids"]])


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
    Ties in cost go to the smaller sets. For specs whose questions show one fixed class each
    (no signal, no noisy classes); :func:`best_observable` covers every spec."""
    if spec.signal or any(not isinstance(t.obs_class, str) for t in spec.types):
        raise ValueError(f"oracle spec {spec.name}: signals or noisy classes; use best_observable")
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


# -- the best observable policy of specs with signals --------------------------------------

@dataclasses.dataclass(frozen=True)
class BestObservable:
    """The cheapest threshold policy whose population coverage >= 1 - alpha.

    ``thresholds[(class, round)]`` (round 0-based, rounds that have a next one): go on iff the
    signal passes it (>= for uncertainty, <= for confidence), or ``"always"`` / ``"never"``.
    Every reached round's base and guide answers are collected (the cheapest way to cover)."""

    cost_per_question: float
    coverage: float
    thresholds: dict

    def cost_of(self, n: int) -> float:
        """Expected total cost on ``n`` questions of the spec (e.g. one test split)."""
        return self.cost_per_question * n


def _slots(spec: OracleSpec, cname: str):
    """[(round, grid)] of a class: per round with a next one, the thresholds to try (floats;
    -inf/+inf are "always"/"never" for uncertainty, the reverse for confidence)."""
    R = len(spec.classes[cname])
    types = [t for t in spec.types if cname in dict(t.class_probs())]
    out = []
    for r in range(R - 1):
        ends = sorted({x for t in types for x in (t.signal_range(r) or ())})
        grid = [-np.inf, np.inf]
        if ends:
            grid += list(np.linspace(ends[0], ends[-1], _GRID)) + ends
        out.append((r, np.unique(np.asarray(grid))))
    return types, out


_GRID = 401


def _continue_prob(spec: OracleSpec, qt: QType, cname: str, r: int, theta: np.ndarray) -> np.ndarray:
    """P(a question of type qt, showing class cname, goes on at round r) for thresholds theta."""
    d = SIGNALS[spec.signal][1] if spec.signal else 1
    rng_r = qt.signal_range(r)
    if rng_r is not None:
        lo, hi = rng_r
        frac = (hi - theta) / (hi - lo) if d > 0 else (theta - lo) / (hi - lo)
        return np.clip(np.nan_to_num(frac, nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
    o = spec.classes[cname][r]
    v = getattr(o, spec.signal) if spec.signal else None
    v = 0.0 if v is None else float(v)
    return (d * v >= d * theta).astype(float)


def _class_table(spec: OracleSpec, cname: str, weight: dict):
    """Every threshold combination of one class: (thresholds [M, slots], cost [M], coverage [M]),
    each type's share weighted by its probability of showing this class."""
    types, slots = _slots(spec, cname)
    R = len(spec.classes[cname])
    grids = np.meshgrid(*[g for _, g in slots], indexing="ij") if slots else []
    thetas = np.stack([g.reshape(-1) for g in grids], -1) if slots else np.zeros((1, 0))
    M = thetas.shape[0]
    cost, cov = np.zeros(M), np.zeros(M)
    J = np.array([spec.round_cost_cents(t + 1) for t in range(R)])
    for qt in types:
        share = weight[qt.name] * dict(qt.class_probs())[cname]
        reach = np.ones((M, R))
        for k, (r, _) in enumerate(slots):
            reach[:, r + 1] = reach[:, r] * _continue_prob(spec, qt, cname, r, thetas[:, k])
        cost += share * reach @ J
        right = [b or g for b, g in qt.correct]
        if not any(right):
            cov += share
        else:
            cov += share * reach[:, right.index(True)]
    return thetas, [r for r, _ in slots], cost, cov


def _frontier(cost: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """Indices of the options not dominated (cheaper with at least the coverage), by cost ascending."""
    order = np.lexsort((-cov, cost))
    best, keep = -np.inf, []
    for i in order:
        if cov[i] > best + 1e-15:
            keep.append(i)
            best = cov[i]
    return np.asarray(keep, int)


def best_observable(spec: OracleSpec, alpha: float) -> BestObservable:
    """Brute force over per-(class, round) thresholds on the signal (a grid of 401 values between
    the signal ranges' ends plus the ends, "always" and "never"), with exact expected cost and
    coverage from the types' uniform signal ranges: the cheapest combination with coverage
    >= 1 - alpha. Plain NumPy, independent of the replay environment and the learners.

    Questions of different classes never share an observation, so cost and coverage add over
    classes: each class's options are reduced to their cost-coverage frontier, and the classes
    are combined exhaustively (the last one by a sorted search)."""
    wsum = sum(t.weight for t in spec.types)
    weight = {t.name: t.weight / wsum for t in spec.types}
    tables = {c: _class_table(spec, c, weight) for c in spec.classes}
    names = sorted(tables, key=lambda c: len(tables[c][2]))
    fronts = {c: _frontier(tables[c][2], tables[c][3]) for c in names}
    last = names[-1]
    lf = fronts[last]
    l_cost, l_cov = tables[last][2][lf], tables[last][3][lf]  # cost and coverage both ascending
    target = 1.0 - alpha - 1e-12
    best = None
    for combo in itertools.product(*(fronts[c] for c in names[:-1])):
        c_sum = sum(tables[c][2][i] for c, i in zip(names[:-1], combo))
        v_sum = sum(tables[c][3][i] for c, i in zip(names[:-1], combo))
        j = int(np.searchsorted(l_cov, target - v_sum - 1e-15, side="left"))
        if j >= len(lf):
            continue
        total = c_sum + l_cost[j]
        if best is None or total < best[0] - 1e-15:
            best = (total, v_sum + l_cov[j], dict(zip(names[:-1], combo)) | {last: lf[j]})
    if best is None:
        raise ValueError(f"oracle spec {spec.name}: no policy reaches coverage {1 - alpha:g}")
    d = SIGNALS[spec.signal][1] if spec.signal else 1
    thresholds = {}
    for c, i in best[2].items():
        thetas, rounds = tables[c][0], tables[c][1]
        for k, r in enumerate(rounds):
            th = float(thetas[i, k])
            thresholds[(c, r)] = ("always" if d * th < 0 else "never") if not np.isfinite(th) else th
    return BestObservable(cost_per_question=float(best[0]), coverage=float(best[1]), thresholds=thresholds)


def threshold_sets(spec: OracleSpec, cache: ResponseCache, classes: np.ndarray, thresholds: dict) -> np.ndarray:
    """[Q, T, 3] bool action sets of a threshold policy on a built cache (every reached round's
    base and guide answers, "next" where the signal passes the threshold), given each question's
    observation class (:func:`class_of`). For checking :func:`best_observable` through the env."""
    a = cache.arrays
    Q, T = a["round_mask"].shape
    field, d = SIGNALS[spec.signal] if spec.signal else (None, 1)
    sets = np.zeros((Q, T, 3), bool)
    sets[:, :, 0] = sets[:, :, 1] = a["round_mask"]
    for i in range(Q):
        for r in range(T - 1):
            th = thresholds.get((classes[i], r), "never")
            if th == "always":
                go = True
            elif th == "never":
                go = False
            else:
                go = bool(d * a[field][i, r] >= d * th)
            sets[i, r, 2] = go
    return sets


def class_of(cache: ResponseCache) -> np.ndarray:
    """[Q] the observation class each question of a :func:`build` cache shows."""
    return np.array([q.rsplit("-", 1)[0].split("@")[1] for q in cache.arrays["question_ids"]])


# -- the built-in specs ---------------------------------------------------------------------

_R, _W = (True, False), (False, False)  # base right / both wrong
_G = (False, True)  # guide right


def builtin() -> dict[str, OracleSpec]:
    """The learner-check caches (module docstring). Each optimum is derived by hand in
    ``tests/ccpo/test_oracle.py`` and by :func:`optimum`."""
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


def partial() -> dict[str, OracleSpec]:
    """Caches whose optimum spends the alpha slack: a type covered only in part, told apart from
    an unsolvable look-alike only by a continuous, overlapping signal (guide uncertainty, base
    confidence), over one or two extra rounds, and with a noisy guide verdict. Covering
    everything costs 1.23-1.91x their optimum. Each best observable policy is derived by hand in
    ``tests/ccpo/test_oracle.py`` and by :func:`best_observable`."""
    hard = (Obs(False, 0.5), Obs(True, 0.1))  # round 1's uncertainty is drawn per question
    unc = OracleSpec(
        name="partial-uncertainty", T=2, signal="uncertainty",
        description="60 % easy; 25 % need round 2 and 15 % are unsolvable, both judged wrong at round 1 with "
                    "overlapping guide uncertainty: only 15 of the 25 % need covering",
        classes={"easy": (Obs(True, 0.1),) * 2, "hard": hard},
        types=(
            QType("easy", "easy", 0.60, (_R, _R)),
            QType("deep", "hard", 0.25, (_W, _R), signal=((0.3, 1.0), None)),
            QType("unsolvable", "hard", 0.15, (_W, _W), signal=((0.0, 0.6), None)),
        ),
    )
    doubt = (Obs(True, None, 0.5, agree=True), Obs(True, None, 0.9, agree=True))
    conf = OracleSpec(
        name="partial-confidence", T=2, signal="confidence",
        description="no guide uncertainty; a fooled guide agrees with the base on 40 %: the base's confidence "
                    "(overlapping) tells the 30 % that round 2 fixes from the 10 % unsolvable",
        classes={"sure": (Obs(True, None, 0.9, agree=True),) * 2, "doubt": doubt},
        types=(
            QType("sure", "sure", 0.60, ((True, True),) * 2),
            QType("deep", "doubt", 0.30, (_W, (True, True)), signal=((0.0, 0.7), None)),
            QType("unsolvable", "doubt", 0.10, (_W, _W), signal=((0.3, 1.0), None)),
        ),
    )
    deep3 = (Obs(False, 0.5), Obs(False, 0.5), Obs(True, 0.1))
    two = OracleSpec(
        name="partial-two-extra-rounds", T=3, signal="uncertainty",
        description="30 % are answered right only at round 3 (two extra rounds of growing price), 10 % never; "
                    "round 1's uncertainty overlaps, round 2's tells nothing",
        classes={"easy": (Obs(True, 0.1),) * 3, "deep": deep3},
        types=(
            QType("easy", "easy", 0.60, (_R,) * 3),
            QType("deep", "deep", 0.30, (_W, _W, _R), signal=((0.3, 1.0), (0.2, 0.9), None)),
            QType("unsolvable", "deep", 0.10, (_W, _W, _W), signal=((0.0, 0.6), (0.2, 0.9), None)),
        ),
    )
    noisy = OracleSpec(
        name="noisy-verdict", T=2, signal="uncertainty",
        description="the guide's round-1 verdict is noisy (each type shows 'yes' or 'no' with its own odds) and "
                    "the uncertainty overlaps across all three types",
        classes={"yes": (Obs(True, 0.5), Obs(True, 0.1)), "no": (Obs(False, 0.5), Obs(True, 0.1))},
        types=(
            QType("easy", (("yes", 0.8), ("no", 0.2)), 0.60, (_R, _W), signal=((0.0, 0.6), None)),
            QType("deep", (("yes", 0.3), ("no", 0.7)), 0.30, (_W, _R), signal=((0.3, 1.0), None)),
            QType("unsolvable", (("yes", 0.5), ("no", 0.5)), 0.10, (_W, _W), signal=((0.0, 1.0), None)),
        ),
    )
    return {s.name: s for s in (unc, conf, two, noisy)}


def ladder() -> dict[str, OracleSpec]:
    """A base ladder of three rungs of growing price (issue 37) whose best observable policy stops
    at different rungs for different question types, told apart only by the base confidence,
    which overlaps between types (answers carry no agreement signal: ``fresh_ids``; the guide is
    always wrong, so only the ladder's answers count).

    Types (confidence ranges at rungs 1, 2; uniform): easy 50 % (right at every rung; U(0.4, 1),
    U(0.5, 1)), mid 30 % (right from rung 2; U(0, 0.6), U(0.5, 1)), hard 15 % (right only at
    rung 3; U(0, 0.6), U(0, 0.7)), unsolvable 5 % (U(0, 0.6), U(0, 0.7)). Prices: rung 1
    $0.1 / $0.4, rung 2 $1 / $4, rung 3 $10 / $40 per million tokens (200 in, 30 out), plus the
    guide's call: J = (0.0272, 0.076, 0.384) cents.

    Best observable policy at alpha = 0.1 (by hand; ``tests/ccpo/test_ladder_oracle.py``): go on at
    rung 1 iff confidence <= 0.6 and at rung 2 iff confidence <= 0.7 / 3. Unsolvable is covered
    free, so 0.10 of the 0.15 hard may go uncovered. Coverage bought at rung 2 costs
    J3 x (hard + unsolvable) / hard = 0.512 cents a unit; at rung 1's margin (confidence near 0.6,
    easy and the rest equally dense) (5/3 J2 + 1/9 J3) / (0.5 + 0.25 / 3) = 0.29. So rung 1
    takes every non-easy question on (theta 0.6: every mid covered; easy above 0.6, two thirds of
    them, stop at rung 1) and rung 2 takes a third of the hard ones on (theta 0.7 / 3; easy and
    mid, confidence >= 0.5, stop at rung 2). Cost J1 + 2/3 J2 + 0.2 / 3 J3 = 0.1035 cents,
    coverage 0.9; covering everything (rung 2's theta 0.7) costs 2.2x."""
    q = (Obs(False, None, 0.5),) * 3
    spec = OracleSpec(
        name="ladder", T=3, signal="confidence", fresh_ids=True,
        base_prices=((0.1, 0.4), (1.0, 4.0), (10.0, 40.0)),
        description="three base rungs of growing price; the base confidence (overlapping) says where to stop",
        classes={"q": q},
        types=(
            QType("easy", "q", 0.50, (_R, _R, _R), signal=((0.4, 1.0), (0.5, 1.0), None)),
            QType("mid", "q", 0.30, (_W, _R, _R), signal=((0.0, 0.6), (0.5, 1.0), None)),
            QType("hard", "q", 0.15, (_W, _W, _R), signal=((0.0, 0.6), (0.0, 0.7), None)),
            QType("unsolvable", "q", 0.05, (_W, _W, _W), signal=((0.0, 0.6), (0.0, 0.7), None)),
        ),
    )
    return {spec.name: spec}
