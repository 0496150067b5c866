"""Guarantees are objects (issue 52, item 2): ``Marginal`` and ``PAC`` state themselves, give their ranks and
their run-level choices, are looked up in one registry, and a new guarantee is a subclass plus one
``register_guarantee``: the toy ``Conservative(Marginal)`` (one rank more than marginal) runs ``reproduce`` end
to end, its threshold checked against the calibration scores' order statistic."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from ccpo_jax.core import guarantee as G
from ccpo_jax.errors import UserError

SIZES = "100,60,40"


def test_statements_and_json_are_todays():
    # the literal text of results.json / policy.json / the manifest before the objects (refactor-base)
    assert G.Marginal().describe(0.1) == {
        "kind": "marginal", "alpha": 0.1, "delta": None,
        "statement": "P(covered) >= 0.9 on average over calibration draws (marginal)"}
    assert G.PAC(0.1).describe(0.2) == {
        "kind": "pac", "alpha": 0.2, "delta": 0.1,
        "statement": "P(coverage >= 0.8) >= 0.9 over the calibration draw (training-conditional)"}
    d = G.PAC(0.2, 0.9, 0.05).describe(0.5)
    assert list(d) == ["kind", "alpha", "delta", "statement", "guide_cap", "cost_cap"]
    assert d["statement"] == ("P(coverage >= 0.5 and guide-call rate <= 0.9 and mean cost <= 0.05 cents a question) "
                              ">= 0.8 over the calibration draw (Learn then Test, 3 risks)")
    for g in (G.Marginal(), G.PAC(0.1), G.PAC(0.2, 0.9), G.PAC(0.2, None, 0.05)):
        assert G.guarantee_from_json(g.describe(0.3)) == g
    assert G.guarantee_from_json(None) == G.Marginal() == G.make_guarantee("marginal")


def test_ranks_against_the_binomial_by_hand():
    # PAC: the smallest k with P(Binomial(n, 1 - alpha) <= k - 1) >= 1 - delta, by a loop over k (scipy's pmf summed)
    for n, alpha, delta in ((60, 0.1, 0.1), (30, 0.2, 0.05), (10, 0.1, 0.1)):
        cdf = np.cumsum([stats.binom.pmf(j, n, 1 - alpha) for j in range(n + 1)])
        ks = [k for k in range(1, n + 1) if cdf[k - 1] >= 1 - delta - 1e-12]
        want = ks[0] if ks else n + 1
        assert int(G.PAC(delta).ranks(n, alpha)[n]) == want
    # marginal: ceil((n + 1)(1 - alpha))
    m = G.Marginal().ranks(100, 0.1)
    assert all(int(m[n]) == math.ceil((n + 1) * 0.9 - 1e-9) for n in range(101))


def test_group_min_and_within_delta_follow_the_kind():
    # the fewest questions with a PAC threshold: (1 - alpha)^n <= delta, by search
    n = next(n for n in range(1, 1000) if 0.9 ** n <= 0.1)
    assert G.PAC(0.1).group_min(5, 0.1) == n == 22 and G.PAC(0.1).group_min(40, 0.1) == 40
    assert G.Marginal().group_min(5, 0.1) == 5
    cov = np.array([0.95, 0.85, 0.91, 0.7])
    assert "within_delta" not in G.Marginal().below_target(cov, 0.1)
    assert G.PAC(0.6).below_target(cov, 0.1)["within_delta"] is True  # 2 of 4 below: 0.5 <= 0.6
    assert G.PAC(0.4).below_target(cov, 0.1)["within_delta"] is False
    assert G.Marginal().jit_ranks is False and G.PAC(0.1).jit_ranks is True


def test_registry_refuses_a_second_class_under_a_kind_and_marginal_refuses_a_delta():
    assert list(G.GUARANTEES) == ["marginal", "pac"]

    @dataclasses.dataclass(frozen=True)
    class Other(G.Marginal):
        kind = "marginal"

    with pytest.raises(ValueError, match="already registered"):
        G.register_guarantee(Other)
    with pytest.raises(ValueError, match="no delta"):
        G.Marginal(0.1)
    with pytest.raises(KeyError):
        G.make_guarantee("made-up")


@dataclasses.dataclass(frozen=True)
class Conservative(G.Marginal):
    """The "must show" toy: the marginal rank plus one (a lower threshold, a larger set)."""

    kind = "conservative"

    def rank(self, n: int, alpha: float) -> int | None:
        k = G.marginal_rank(n, alpha) + 1
        return k if k <= n else None

    def statement(self, alpha: float) -> str:
        return f"P(covered) >= {1 - alpha:g}, one rank to spare (a toy)"


@pytest.fixture()
def conservative():
    G.register_guarantee(Conservative)
    yield Conservative
    del G.GUARANTEES[Conservative.kind]


def test_unknown_guarantee_is_refused_until_registered(conservative):
    from ccpo_jax.ccpo.run_config import ReproduceConfig

    cfg = ReproduceConfig(guarantee="conservative", split_sizes=SIZES)
    assert cfg.guarantee == "conservative"
    with pytest.raises(UserError, match="delta: only with"):
        ReproduceConfig(guarantee="conservative", delta=0.1, split_sizes=SIZES)
    with pytest.raises(UserError, match="guide_cap: a cap on a second risk needs"):
        ReproduceConfig(guarantee="conservative", guide_cap=0.5, split_sizes=SIZES)
    del G.GUARANTEES["conservative"]
    try:
        with pytest.raises(UserError, match="unknown guarantee 'conservative'; valid: marginal, pac"):
            ReproduceConfig(guarantee="conservative")
    finally:
        G.register_guarantee(Conservative)


@pytest.mark.slow
def test_a_registered_toy_guarantee_runs_reproduce_end_to_end(conservative, tmp_path):
    """A subclass and a registration are the whole diff: the run calibrates every row with the toy's rank."""
    from ccpo_jax.ccpo.reproduce import reproduce
    from tests.end_to_end.test_mondrian_run import _grouped_cache
    from tests.end_to_end.test_pac_run import _cal_scores

    path, _ = _grouped_cache(tmp_path)
    res = reproduce(cache=str(path), n_splits=3, split_sizes=SIZES, seeds=1, iterations=4, guarantee="conservative",
                    out_dir=tmp_path / "run", echo=None, progress=False)
    g = res.results["guarantee"]
    assert g == {"kind": "conservative", "alpha": 0.1, "delta": None,
                 "statement": "P(covered) >= 0.9, one rank to spare (a toy)"}
    assert res.results["policies"]["CPO batch"]["guarantee"] == g
    scores, _, meta = _cal_scores(res, path, "ccpo-lambda-0")
    assert meta["guarantee"] == g
    k = math.ceil(61 * 0.9) + 1  # marginal's 55th largest of 60 calibration scores, plus one
    assert meta["kappa"] == pytest.approx(float(np.clip(np.sort(scores)[::-1][k - 1], 0.0, 1.0)), abs=0)


def test_calibration_inputs_are_the_guarantees_host_side():
    """evaluate_members' host side (issue 52 G3): per variant the guarantee's rank table (or none when the program
    computes marginal's rank), Learn then Test's critical counts and the cost cap's critical sum."""
    from ccpo_jax.ccpo.evaluation import CalibrationInputs

    m = CalibrationInputs.of(G.Marginal(), [0.1, 0.2], 60, None)
    assert m.ranks.shape == (2, 1) and not m.ranks.any() and not m.counts.any() and np.isinf(m.crit_sums).all()
    p = CalibrationInputs.of(G.PAC(0.1), [0.1, 0.2], 60, None)
    assert [int(p.ranks[v, 60]) for v in range(2)] == [G.pac_rank(60, 0.1, 0.1), G.pac_rank(60, 0.2, 0.1)] == [58, 53]
    assert not p.counts.any() and np.isinf(p.crit_sums).all()  # no cap: no Learn then Test
    c = CalibrationInputs.of(G.PAC(0.2, 0.9, 0.05), [0.5], 60, 1.0)
    # delta split over three risks: each test at 0.2 / 3; the critical counts are the largest c with
    # P(Binomial(60, cap) <= c) <= 0.2 / 3, by a scan
    crit = lambda cap: max(x for x in range(61) if stats.binom.cdf(x, 60, cap) <= 0.2 / 3)  # noqa: E731
    assert c.counts.tolist() == [[crit(0.5), crit(0.9)]]
    assert c.crit_sums[0] == np.float32(G.PAC(0.2, 0.9, 0.05).cost_critical(60, 1.0) * 60 * (1 - 1e-5))
    assert int(c.ranks[0, 60]) == G.pac_rank(60, 0.5, 0.2)


def test_results_ask_the_object_not_its_kind():
    """A registered guarantee with a delta gets ``within_delta`` in results.json (row and per-group summary)
    because it has a delta, not because it is called ``pac``."""
    from ccpo_jax.ccpo.guarantee_results import add_group_guarantees, add_guarantees

    @dataclasses.dataclass(frozen=True)
    class Strict(G.PAC):
        kind = "strict"

    cov = np.array([[0.95, 0.85, 0.91, 0.7]])  # [N, S]: 2 of 4 splits below 0.9
    for g, has in ((Strict(0.6), True), (G.Marginal(), False)):
        res = {"policies": {"CPO batch": {"groups": {"a": {}, "b": {}}}}}
        add_guarantees(res, {"CPO batch": {"coverage": cov}}, 0.1, g)
        assert ("within_delta" in res["policies"]["CPO batch"]["below_target"]) == has
        per = {"names": ["a", "b"], "rows": {"CPO batch": {"coverage": np.stack([cov, cov], axis=-1)}}}
        add_group_guarantees(res, per, 0.1, g)
        summ = res["policies"]["CPO batch"]["group_below_target"]
        assert summ.get("within_delta") == (2 if has else None)  # both groups' 0.5 <= 0.6


def test_table_section_follows_the_guarantee_not_its_name():
    """table.md's guarantee section: the delta column for any guarantee with a delta, marginal's paragraph only
    under marginal (a registered kind states itself in its statement)."""
    from ccpo_jax.ccpo.guarantee_results import add_guarantees, format_guarantees

    @dataclasses.dataclass(frozen=True)
    class Strict(G.PAC):
        kind = "strict"

    cov = np.array([[0.95, 0.85, 0.91, 0.7]])
    text = {}
    for g in (Strict(0.6), G.PAC(0.6), G.Marginal(), Conservative()):
        res = {"policies": {"CPO batch": {}}}
        add_guarantees(res, {"CPO batch": {"coverage": cov}}, 0.1, g)
        text[g.kind] = format_guarantees(res)
    assert "## Guarantee: strict (delta 0.6)" in text["strict"] and "| CPO batch | 2 of 4 |" in text["strict"]
    assert text["strict"].replace("strict", "pac") == text["pac"]
    assert "what a marginal guarantee gives" in text["marginal"]
    assert "marginal" not in text["conservative"] and "one rank to spare" in text["conservative"]
