"""The conformal guarantee end to end (issue 4): over 100 calibration/test redraws, the
batch-calibrated rows' mean coverage is >= 1 - alpha - 0.01, on the default synthetic
cache and on the imported real UALA HotpotQA and RouteLLM MMLU caches (the full data when
present, as in CI; else the subsets shipped in tests/fixtures). The fixtures' import is
checked against the raw files in test_importers, so the runs here need not repeat on both.

Split-conformal calibration guarantees E[coverage] >= 1 - alpha for ANY fixed
policy, so a short training run (30 iterations) is enough to test the guarantee; the mean
over 100 splits has a standard error of about 0.003 here, well inside the 0.01 slack.
Vanilla CPO (pointwise, no calibration) stays below 1 - alpha, as in the paper.
"""
from __future__ import annotations

import numpy as np
import pytest

from ccpo_jax.ccpo.reproduce import reproduce
from envs.importers import import_cache
from envs.generators.synthetic import generate

pytestmark = pytest.mark.slow  # 100 splits on three caches, one trainer compile each

CALIBRATED = ("CPO batch", "CCPO (lambda=0)")


def _run(tmp_path, setting, cache, sizes):
    res = reproduce(
        setting, cache=cache, n_splits=100, iterations=30, split_sizes=sizes, seeds=2,
        out_dir=tmp_path / "run", progress=False, echo=lambda *a, **k: None,
    )
    return res.results


def _check(results, alpha):
    pol = results["policies"]
    rows = [r for r in pol if r in CALIBRATED or r.startswith("CCPO (lambda=")]
    assert len(rows) >= 3
    for r in rows:
        cov = np.mean(pol[r]["per_split"]["coverage"])
        assert cov >= 1 - alpha - 0.01, (r, cov)
    return pol


def test_default_synthetic_cache(tmp_path):
    results = _run(tmp_path, "hotpotqa-llama2-a0.1", generate("hotpotqa-llama2", 1400, 0), None)
    pol = _check(results, 0.1)
    # Vanilla CPO (pointwise) satisfies its own constraint on this cache with the default
    # preset (the old sampled trainer left it at 0.848, below its target; CHANGELOG.md, 2026-12-01).
    assert np.mean(pol["CPO"]["per_split"]["coverage"]) >= 0.9 - 0.02


@pytest.mark.parametrize(
    "fmt, sub, setting, sizes, fixture_sizes",
    [("uala-hotpotqa", "uala", "hotpotqa-llama2-a0.1", "300,100,100", "120,40,40"),
     ("routellm-mmlu", "routellm/mmlu", "mmlu-llama2-a0.1", "560,200,200", "338,100,100")],
)
def test_imported_real_caches(tmp_path, largest_real_data, fmt, sub, setting, sizes, fixture_sizes):
    """On the full data (500 UALA / 14,042 MMLU questions), else on the shipped subsets (200 / 538)."""
    real_data = largest_real_data
    cache = import_cache(fmt, real_data.root / sub)
    sizes = sizes if real_data.full else fixture_sizes
    results = _run(tmp_path, setting, cache, sizes)
    assert results["cache"]["provenance"]["kind"] == "real"
    _check(results, 0.1)
