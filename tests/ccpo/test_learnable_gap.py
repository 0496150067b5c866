"""experiments/learnable_gap.py: the conformal rank's coverage it reports (docs/results.md,
"How far from the best observable")."""
from fractions import Fraction

import pytest

from experiments.learnable_gap import rank_coverage


@pytest.mark.parametrize("n", [20, 100, 200])
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_rank_coverage_is_the_smallest_rank_of_the_conformal_guarantee(n, alpha):
    # oracle: the smallest k with k / (n + 1) >= 1 - alpha, in exact arithmetic
    target = 1 - Fraction(str(alpha))
    k = next(k for k in range(1, n + 2) if Fraction(k, n + 1) >= target)
    assert rank_coverage(n, alpha) == pytest.approx(k / n, abs=1e-12)


def test_rank_coverage_at_twenty_asks_for_19_of_20():
    assert rank_coverage(20, 0.1) == 19 / 20
