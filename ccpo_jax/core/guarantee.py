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

import math
from typing import NamedTuple

import numpy as np

#: ``--guarantee`` values.
GUARANTEES = ("marginal", "pac")


class Guarantee(NamedTuple):
    """A calibrated row's guarantee: ``kind`` in :data:`GUARANTEES`, ``delta`` (pac only, else None), and
    (pac only) ``guide_cap`` and/or ``cost_cap``: also cap the guide-call rate and/or the mean cost per
    question (cents), by Learn then Test (two or three risks, family-wise delta)."""

    kind: str = "marginal"
    delta: float | None = None
    guide_cap: float | None = None
    cost_cap: float | None = None

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
        """The JSON form results.json, policy.json and the router manifest carry."""
        out = {"kind": self.kind, "alpha": float(alpha), "delta": None if self.delta is None else float(self.delta)}
        out["statement"] = (
            f"P(coverage >= {1 - alpha:g}) >= {1 - self.delta:g} over the calibration draw (training-conditional)"
            if self.kind == "pac" else f"P(covered) >= {1 - alpha:g} on average over calibration draws (marginal)")
        caps = []
        if self.guide_cap is not None:
            out["guide_cap"] = float(self.guide_cap)
            caps.append(f"guide-call rate <= {self.guide_cap:g}")
        if self.cost_cap is not None:
            out["cost_cap"] = float(self.cost_cap)
            caps.append(f"mean cost <= {self.cost_cap:g} cents a question")
        if caps:
            out["statement"] = (f"P(coverage >= {1 - alpha:g} and {' and '.join(caps)}) >= {1 - self.delta:g} over "
                                f"the calibration draw (Learn then Test, {self.families} risks)")
        return out


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
    """``[n_max + 1]`` int32: the rank k for every calibration count n = 0..n_max. A count too small for
    a threshold gets n + 1, which the calibration turns into kappa-hat = 0 (every available action in
    every set: coverage 1, so the guarantee holds trivially)."""
    out = np.empty(n_max + 1, np.int32)
    for n in range(n_max + 1):
        if guarantee.kind == "pac":
            k = pac_rank(n, alpha, guarantee.delta)
            out[n] = n + 1 if k is None else k
        else:
            out[n] = marginal_rank(n, alpha)
    return out


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
