"""Every experiment setting runs end to end for a few training iterations (issue 4's smoke test).

Each setting runs on a small cache from its own synthetic profile, so the whole
pipeline (baselines, CPO/CCPO training, calibration, results.json, table.md,
plots) is exercised with that setting's alpha, lambdas and row names.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ccpo_jax.pipeline import reproduce
from envs.synthetic import generate
from experiments.settings import METRICS, SETTINGS, lambda_row_name


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_setting_runs_a_few_iterations(name, tmp_path):
    st = SETTINGS[name]
    cache = generate(st.profile, n_questions=100, seed=1)
    res = reproduce(
        name, cache=cache, n_splits=2, iterations=3, split_sizes="60,20,20",
        out_dir=tmp_path / "run", progress=False, echo=lambda *a, **k: None,
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["setting"] == name and results["alpha"] == pytest.approx(st.alpha)
    assert results["cache"]["provenance"]["kind"] == "synthetic"
    rows = results["policies"]
    expected = {"Random", "UALA", "CPO", "CPO batch", "CPO online", lambda_row_name(0.0)}
    expected |= {lambda_row_name(lam) for lam in st.lambdas}
    assert expected <= set(rows), sorted(rows)
    for row in rows.values():
        for m in METRICS:
            vals = np.asarray(row["per_split"][m], float)
            assert vals.shape == (2,) and np.isfinite(vals).all()
        assert 0.0 <= row["coverage"]["mean"] <= 1.0
    assert (tmp_path / "run" / "table.md").read_text().count("|") > 20
    assert res.out_dir == tmp_path / "run"
