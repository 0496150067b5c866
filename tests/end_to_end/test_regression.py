"""The default preset against the clairvoyant bound (envs.replay.bound), end to end: a guard that the
learned rows stay near the best possible on realistic data (docs/results.md, "The default preset
against the bound").

Measured with the default preset, 5 seeds x 100 splits (docs/results.md, 2026-12-02): on the built-in
synthetic Table 2 cache CCPO (lambda=0) costs 1.21x the bound and CPO batch 1.23x; on the UALA
HotpotQA cache CCPO (lambda=0) and CPO batch cost 1.00x (the full 500 questions, 300/100/100, and
the shipped 200-question subset, 120/40/40). The previous default (a 3-standard-error margin on
every row) cost 1.64x / 1.63x (CPO batch / CCPO) on the synthetic cache (CHANGELOG.md, 2026-12-02).
"""
from __future__ import annotations

import pytest

from ccpo_jax.ccpo.reproduce import reproduce
from envs.replay.bound import BOUND_ROW
from envs.importers import import_cache

pytestmark = pytest.mark.slow  # two default reproduce runs with 5 training seeds


def _ratios(results):
    pol = results["policies"]
    assert pol[BOUND_ROW]["is_policy"] is False
    return {r: pol[r]["cost_vs_bound"]["mean"] for r in ("CPO batch", "CCPO (lambda=0)")}, pol


def test_synthetic_table2_near_the_bound(tmp_path):
    res = reproduce("hotpotqa-llama2-a0.1", seeds=5, out_dir=tmp_path / "run", progress=False, echo=None)
    ratio, pol = _ratios(res.results)
    assert ratio["CCPO (lambda=0)"] <= 1.25, ratio
    assert ratio["CCPO (lambda=0)"] <= ratio["CPO batch"], ratio
    assert pol["CCPO (lambda=0)"]["coverage"]["mean"] >= 0.89


def test_uala_near_the_bound(tmp_path, largest_real_data):
    cache = import_cache("uala-hotpotqa", largest_real_data.root / "uala")
    sizes = "300,100,100" if largest_real_data.full else "120,40,40"
    res = reproduce("hotpotqa-llama2-a0.1", cache=cache, split_sizes=sizes, seeds=5, out_dir=tmp_path / "run",
                    progress=False, echo=None)
    ratio, pol = _ratios(res.results)
    assert ratio["CCPO (lambda=0)"] <= 1.05 and ratio["CPO batch"] <= 1.05, ratio
    assert pol["CCPO (lambda=0)"]["coverage"]["mean"] >= 0.88
