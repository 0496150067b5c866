"""Which finite-sample guarantee a calibrated threshold gives, and the order statistic that gives it.

Score convention (:mod:`ccpo_jax.core.conformal`): a question with score kappa_i is covered at
threshold kappa iff kappa <= kappa_i, and the calibrated kappa-hat is the k-th LARGEST of the n
calibration scores. Two rules choose k:

* ``marginal`` (split conformal): k = ceil((n+1)(1-alpha)). A fresh question is covered with
  probability >= 1 - alpha *on average over calibration draws*; one drawn threshold may cover less.
* ``pac`` (training-conditional; Vovk 2012, "Conditional validity of inductive conformal
  predictors", Prop. 2a; Bates et al. 2021, "Distribution-free, risk-controlling prediction
  sets"): with probability >= 1 - delta over the calibration draw, the threshold's coverage
  P(kappa-hat <= kappa_test | calibration) is >= 1 - alpha.

Why the PAC rank is what :func:`pac_rank` computes: for continuous scores, the coverage of the
k-th largest of n i.i.d. scores is 1 - U_(n-k+1) (U_(j) the j-th smallest of n uniforms), which is
Beta(k, n-k+1) distributed, and P(Beta(k, n-k+1) >= 1-alpha) = P(Binomial(n, 1-alpha) <= k-1).
So k is the smallest rank with binom.cdf(k-1; n, 1-alpha) >= 1 - delta. Ties in the scores (the
+/-inf of unsolvable/uncoverable questions, repeated probabilities) only raise coverage, because
covered is ``kappa_i >= kappa-hat``. The largest rank k = n is enough iff (1-alpha)^n <= delta,
which gives :func:`pac_min_n` in closed form.

Host-side float64 (scipy): the rank depends on n, alpha and delta only, and calibration sets
are small, so it is chosen on the host and handed to the jitted calibration as a rank table
(:func:`rank_table`, one rank per possible calibration count, as Mondrian groups need).
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Mapping

import numpy as np


class Guarantee(abc.ABC):
    """A calibrated row's guarantee: which order statistic of the calibration scores is its threshold
    (:meth:`rank`), what it promises (:meth:`statement`), and the run-level choices that follow from it
    (the Mondrian group minimum, ``within_delta``). Frozen dataclasses, hashable and never traced; a new
    guarantee is a subclass registered with :func:`register_guarantee` (``--guarantee`` reads
    :data:`GUARANTEES`), the habit of MAPIE's conformity-score classes.

    Fields (today's, on every kind): ``delta`` (the failure probability; ``pac`` only, else None) and
    (``pac`` only) ``guide_cap`` and/or ``cost_cap``: also cap the guide-call rate and/or the mean cost per
    question (cents), by Learn then Test (two or three risks, family-wise delta)."""

    #: The ``--guarantee`` name, results.json's and the manifest's ``guarantee.kind``.
    kind: ClassVar[str]
    #: Whether ``--delta`` applies (and is required to be in (0, 1)).
    uses_delta: ClassVar[bool] = False
    #: Whether ``--guide-cap`` / ``--cost-cap`` apply (Learn then Test needs a delta).
    takes_caps: ClassVar[bool] = False

    delta: float | None
    guide_cap: float | None
    cost_cap: float | None

    @abc.abstractmethod
    def rank(self, n: int, alpha: float) -> int | None:
        """k for n calibration scores: the threshold is the k-th largest; None when no k <= n gives the
        guarantee (the calibration then returns the trivial threshold, :meth:`ranks`)."""

    @abc.abstractmethod
    def statement(self, alpha: float) -> str:
        """What the threshold promises, in words (results.json, policy.json, the router manifest)."""

    @property
    def jit_ranks(self) -> bool:
        """Whether the jitted calibration takes its ranks from :meth:`ranks` (else it computes the marginal
        rank itself in float32, :func:`ccpo_jax.core.conformal.conformal_rank`: the same numbers, the
        program traced since the first release)."""
        return True

    def ranks(self, n_max: int, alpha: float) -> np.ndarray:
        """``[n_max + 1]`` int32: the rank k for every calibration count n = 0..n_max. A count too small for
        a threshold gets n + 1, which the calibration turns into kappa-hat = 0 (every available action in
        every set: coverage 1, so the guarantee holds trivially)."""
        out = np.empty(n_max + 1, np.int32)
        for n in range(n_max + 1):
            k = self.rank(n, alpha)
            out[n] = n + 1 if k is None else k
        return out

    def group_min(self, asked: int, alpha: float) -> int:
        """The smallest Mondrian group with a threshold of its own, given ``--group-min`` ``asked``."""
        return int(asked)

    def below_target(self, coverage: np.ndarray, alpha: float) -> dict:
        """:func:`below_target` of the splits' test coverages (``within_delta`` added where it means something)."""
        return below_target(coverage, alpha)

    @property
    def capped(self) -> bool:
        """A second (or third) risk is capped: the threshold is chosen by Learn then Test."""
        return self.guide_cap is not None or self.cost_cap is not None

    @property
    def families(self) -> int:
        """The number of risks tested: coverage, plus one per cap (delta is split evenly, Bonferroni)."""
        return 1 + (self.guide_cap is not None) + (self.cost_cap is not None)

    def ltt_counts(self, n: int, alpha: float) -> tuple[int, int]:
        """The critical counts of miscoverage (<= alpha) and guide calls (<= guide_cap; n, i.e. never
        binding, without a guide cap), each tested at delta / :attr:`families`."""
        d = self.delta / self.families
        return (ltt_critical_count(n, alpha, d),
                n if self.guide_cap is None else ltt_critical_count(n, self.guide_cap, d))

    def cost_critical(self, n: int, cost_max: float) -> float:
        """The largest mean cost (cents per question) at which the null "mean cost > cost_cap" is rejected
        at delta / :attr:`families` (Hoeffding-Bentkus, losses cost / cost_max in [0, 1]); +inf without a
        cost cap, -1 when no calibration outcome rejects it. A cap >= cost_max caps nothing (+inf)."""
        if self.cost_cap is None or self.cost_cap >= cost_max:
            return math.inf
        r = hb_critical_mean(n, self.cost_cap / cost_max, self.delta / self.families)
        return -1.0 if r < 0 else r * cost_max

    def describe(self, alpha: float) -> dict:
        """The JSON form results.json, policy.json and the router manifest carry (read back by
        :func:`guarantee_from_json`)."""
        out = {"kind": self.kind, "alpha": float(alpha), "delta": None if self.delta is None else float(self.delta),
               "statement": self.statement(alpha)}
        if self.guide_cap is not None:
            out["guide_cap"] = float(self.guide_cap)
        if self.cost_cap is not None:
            out["cost_cap"] = float(self.cost_cap)
        return out


@dataclasses.dataclass(frozen=True)
class Marginal(Guarantee):
    """Split conformal: k = ceil((n+1)(1-alpha)); a fresh question is covered with probability >= 1 - alpha
    on average over calibration draws (module doc). No delta, no caps."""

    kind: ClassVar[str] = "marginal"
    delta: None = None
    guide_cap: None = None
    cost_cap: None = None

    def __post_init__(self) -> None:
        if (self.delta, self.guide_cap, self.cost_cap) != (None, None, None):
            raise ValueError(f"{self.kind}: takes no delta or caps")

    def rank(self, n: int, alpha: float) -> int | None:
        return marginal_rank(n, alpha)

    def statement(self, alpha: float) -> str:
        return f"P(covered) >= {1 - alpha:g} on average over calibration draws (marginal)"

    @property
    def jit_ranks(self) -> bool:
        # marginal_rank is conformal_rank's float32 arithmetic: the jitted calibration computes it in the
        # program (no rank table traced); a subclass with its own rank hands its table in
        return type(self).rank is not Marginal.rank


@dataclasses.dataclass(frozen=True)
class PAC(Guarantee):
    """Training-conditional: with probability >= 1 - delta over the calibration draw, the threshold's
    coverage is >= 1 - alpha (Vovk 2012, Prop. 2a; module doc). With ``guide_cap`` / ``cost_cap`` the
    threshold is chosen by Learn then Test over every capped risk, delta split evenly."""

    kind: ClassVar[str] = "pac"
    uses_delta: ClassVar[bool] = True
    takes_caps: ClassVar[bool] = True
    delta: float
    guide_cap: float | None = None
    cost_cap: float | None = None

    def rank(self, n: int, alpha: float) -> int | None:
        return pac_rank(n, alpha, self.delta)

    def statement(self, alpha: float) -> str:
        caps = ([f"guide-call rate <= {self.guide_cap:g}"] if self.guide_cap is not None else []) + (
            [f"mean cost <= {self.cost_cap:g} cents a question"] if self.cost_cap is not None else [])
        if caps:
            return (f"P(coverage >= {1 - alpha:g} and {' and '.join(caps)}) >= {1 - self.delta:g} over "
                    f"the calibration draw (Learn then Test, {self.families} risks)")
        return f"P(coverage >= {1 - alpha:g}) >= {1 - self.delta:g} over the calibration draw (training-conditional)"

    def group_min(self, asked: int, alpha: float) -> int:
        """``asked`` raised to the fewest calibration questions that have a PAC threshold at (alpha, delta),
        so that no group gets the trivial "every action" threshold of its own (smaller groups are pooled)."""
        return max(int(asked), pac_min_n(alpha, self.delta))

    def below_target(self, coverage: np.ndarray, alpha: float) -> dict:
        """As the base, with ``within_delta``: the fraction of splits below target is <= delta."""
        out = below_target(coverage, alpha)
        if out["fraction"] is not None:
            out["within_delta"] = bool(out["fraction"] <= self.delta)
        return out


#: ``--guarantee``'s choices: kind -> class, in the order the help lists them.
GUARANTEES: dict[str, type[Guarantee]] = {}


def register_guarantee(cls: type[Guarantee]) -> type[Guarantee]:
    """Make ``cls`` a ``--guarantee`` choice under ``cls.kind`` (a class decorator); a kind is registered once."""
    if cls.kind in GUARANTEES and GUARANTEES[cls.kind] is not cls:
        raise ValueError(f"guarantee {cls.kind!r} is already registered ({GUARANTEES[cls.kind].__name__})")
    GUARANTEES[cls.kind] = cls
    return cls


register_guarantee(Marginal)
register_guarantee(PAC)


def make_guarantee(kind: str, delta: float | None = None, guide_cap: float | None = None,
                   cost_cap: float | None = None) -> Guarantee:
    """The one lookup from a kind and its numbers to the guarantee object (a kind not registered: KeyError)."""
    cls = GUARANTEES[kind]
    if not cls.uses_delta:
        return cls()
    return cls(delta, guide_cap, cost_cap) if cls.takes_caps else cls(delta)


def guarantee_from_json(d: Mapping[str, Any] | None) -> Guarantee:
    """The guarantee of a :meth:`Guarantee.describe` dict (results.json, policy.json, a manifest); None or
    an empty dict (written before ``--guarantee``): marginal."""
    if not d:
        return Marginal()
    return make_guarantee(d["kind"], d.get("delta"), d.get("guide_cap"), d.get("cost_cap"))


def marginal_rank(n: int, alpha: float) -> int:
    """ceil((n+1)(1-alpha)) in the float32 arithmetic of :func:`ccpo_jax.core.conformal.conformal_rank`."""
    return int(np.ceil(np.float32(n + 1) * (np.float32(1.0) - np.float32(alpha)) - np.float32(1e-4)))


def pac_rank(n: int, alpha: float, delta: float) -> int | None:
    """The smallest k in 1..n with P(Binomial(n, 1-alpha) <= k-1) >= 1 - delta; None when no k <= n
    works (n < :func:`pac_min_n`). The k-th largest score is then a PAC threshold (module doc)."""
    from scipy import stats  # here, not at import: the command line's vocabulary imports this module

    if n < 1:
        return None
    ks = np.arange(1, n + 1)
    ok = stats.binom.cdf(ks - 1, n, 1.0 - alpha) >= 1.0 - delta
    return int(ks[np.argmax(ok)]) if ok.any() else None


def pac_min_n(alpha: float, delta: float) -> int:
    """The fewest calibration questions with a PAC threshold: the smallest n with (1-alpha)^n <= delta
    (k = n, the lowest score, is then enough), i.e. ceil(log(delta) / log(1-alpha))."""
    n = max(1, math.ceil(math.log(delta) / math.log1p(-alpha)))
    while n > 1 and (1.0 - alpha) ** (n - 1) <= delta:  # guard the float rounding of the logs
        n -= 1
    while (1.0 - alpha) ** n > delta:
        n += 1
    return n


def rank_table(n_max: int, alpha: float, guarantee: Guarantee) -> np.ndarray:
    """``[n_max + 1]`` int32: ``guarantee``'s rank for every calibration count 0..n_max (:meth:`Guarantee.ranks`)."""
    return guarantee.ranks(n_max, alpha)


def below_target(coverage: np.ndarray, alpha: float, level: float = 0.95) -> dict:
    """How often a split's test coverage is below 1 - alpha: the count, the number of splits, the
    fraction and its Clopper-Pearson (exact binomial) ``level`` interval. NaN coverages are skipped."""
    from scipy import stats

    c = np.asarray(coverage, np.float64).ravel()
    c = c[np.isfinite(c)]
    n = int(c.size)
    x = int(np.sum(c < 1.0 - alpha - 1e-6))  # float32 means: 90/100 is 0.89999998, not below 0.9
    if n == 0:
        return {"count": 0, "n": 0, "fraction": None, "ci": None, "level": level}
    ci = stats.binomtest(x, n).proportion_ci(confidence_level=level, method="exact")
    return {"count": x, "n": n, "fraction": x / n, "ci": [float(ci.low), float(ci.high)], "level": level}


def ltt_critical_count(n: int, cap: float, delta_part: float) -> int:
    """The largest count c with P(Binomial(n, cap) <= c) <= ``delta_part``: the null "risk > cap" of a
    0/1 loss is rejected at level ``delta_part`` when at most c of n calibration questions incur it
    (the exact binomial p-value of Learn then Test for 0/1 losses); -1 when no count is rejected."""
    from scipy import stats

    cs = np.arange(0, n + 1)
    ok = stats.binom.cdf(cs, n, cap) <= delta_part
    return int(cs[ok].max()) if ok.any() else -1


#: Learn-then-Test's threshold grid: fixed before the data (fixed-sequence testing needs that).
LTT_GRID = np.linspace(0.0, 1.0, 1001, dtype=np.float32)


def hb_pvalue(mean: float, n: int, cap: float) -> float:
    """Hoeffding-Bentkus p-value of the null "mean loss > cap" for n i.i.d. losses in [0, 1] with sample
    mean ``mean`` (Bates, Angelopoulos, Lei, Malik and Jordan 2021, "Distribution-free, risk-controlling
    prediction sets", Prop. 5; Angelopoulos et al. 2021, "Learn then Test", section 3):
    min(exp(-n h1(min(mean, cap), cap)), e P(Binomial(n, cap) <= ceil(n mean))), with
    h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)). Non-decreasing in ``mean``."""
    from scipy import stats

    a = min(mean, cap)
    h1 = (a * math.log(a / cap) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - cap))
    k = math.ceil(n * mean - 1e-9)  # n * mean is a count for 0/1 losses: no float ceil past it
    return float(min(math.exp(-n * h1), math.e * stats.binom.cdf(k, n, cap)))


def hb_critical_mean(n: int, cap: float, delta_part: float) -> float:
    """The largest sample mean r in [0, cap] with :func:`hb_pvalue` (r) <= ``delta_part``: the null is
    rejected iff the mean is <= r (the p-value is non-decreasing); -1 when even a mean of 0 is not.

    The rejection set is the union of the two terms' sets: Hoeffding's [0, r_h] (r_h the root of
    n h1(r, cap) = log(1/delta_part), by bisection) and Bentkus's [0, k/n] (k the largest count with
    e P(Binomial(n, cap) <= k) <= delta_part)."""
    from scipy import optimize, stats

    log_d = math.log(delta_part)
    h1 = lambda r: (r * math.log(r / cap) if r > 0 else 0.0) + (1 - r) * math.log((1 - r) / (1 - cap))  # noqa: E731
    r_h = -1.0
    if -n * h1(0.0) <= log_d:  # exp(-n h1(0, cap)) = (1-cap)^n <= delta_part: some mean is rejected
        r_h = 0.0 if -n * h1(0.0) == log_d else optimize.brentq(lambda r: -n * h1(r) - log_d, 0.0, cap, xtol=1e-14)
        while r_h > 0 and -n * h1(r_h) > log_d:  # the root's float side: stay inside the rejection set
            r_h = math.nextafter(r_h, 0.0)
    ks = np.arange(0, n + 1)
    ok = math.e * stats.binom.cdf(ks, n, cap) <= delta_part
    r_b = float(ks[ok].max()) / n if ok.any() else -1.0
    return max(r_h, r_b)
