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
    ``guide_cap`` (pac only): also cap the guide-call rate, by Learn then Test (two risks, family-wise delta)."""

    kind: str = "marginal"
    delta: float | None = None
    guide_cap: float | None = None

    def ltt_counts(self, n: int, alpha: float) -> tuple[int, int]:
        """The critical counts of the two risks (miscoverage <= alpha, guide calls <= guide_cap), each
        tested at delta / 2 (Bonferroni over the two families)."""
        return (ltt_critical_count(n, alpha, self.delta / 2), ltt_critical_count(n, self.guide_cap, self.delta / 2))

    def describe(self, alpha: float) -> dict:
        """The JSON form results.json, policy.json and the router manifest carry."""
        out = {"kind": self.kind, "alpha": float(alpha), "delta": None if self.delta is None else float(self.delta)}
        out["statement"] = (
            f"P(coverage >= {1 - alpha:g}) >= {1 - self.delta:g} over the calibration draw (training-conditional)"
            if self.kind == "pac" else f"P(covered) >= {1 - alpha:g} on average over calibration draws (marginal)")
        if self.guide_cap is not None:
            out["guide_cap"] = float(self.guide_cap)
            out["statement"] = (f"P(coverage >= {1 - alpha:g} and guide-call rate <= {self.guide_cap:g}) >= "
                                f"{1 - self.delta:g} over the calibration draw (Learn then Test, two risks)")
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
