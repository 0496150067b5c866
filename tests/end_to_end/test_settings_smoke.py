"""Every experiment setting runs end to end (issue 4's smoke test).

Each setting runs on a small cache from its own synthetic profile, so the whole
pipeline (baselines, calibration, results.json, table.md, plots) is exercised with
that setting's alpha, lambdas and row names. The CPO/CCPO trainer runs for real, a few
iterations, on MMLU / LLaMA-3 at alpha 0.2 here; the default setting (HotpotQA / LLaMA-2
at 0.1) trains for real in tests/end_to_end/test_reproduce_cli.py (the CLI end to end) and
tests/end_to_end/test_coverage.py, and MMLU / LLaMA-2 at 0.1 on the real MMLU cache in
tests/end_to_end/test_coverage.py. On the other seven a stand-in trainer checks that the pipeline
asks for the setting's alpha and lambdas, and returns rows under the trainer's row names.
Compiling the trainer is most of a run's time (20-40 s of CPU each) and the trainer sees a
setting only through its alpha and lambdas, so more compilations would test nothing new.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ccpo_jax.ccpo.reproduce import reproduce
from envs.generators.synthetic import generate
from ccpo_jax.ccpo.settings import METRICS, SETTINGS, lambda_row_name


TRAINED = ("mmlu-llama3-a0.2",)


def _stand_in_trainer():
    from ccpo_jax.ccpo.rows import LearnedRows

    calls = []

    def learned_rows(run, data, execution):
        calls.append(dict(run=run, data=data, execution=execution))
        S = data.splits.test.shape[0]
        rng = np.random.default_rng(0)
        names = ["CPO", "CPO batch", "CPO online"] + [lambda_row_name(lam) for lam in (0.0, *run.lambdas)]
        return LearnedRows(rows={n: {m: rng.uniform(0.5, 1.0, S) for m in METRICS} for n in names})

    return learned_rows, calls


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in TRAINED else n for n in sorted(SETTINGS)])
def test_setting_runs_end_to_end(name, tmp_path):
    st = SETTINGS[name]
    cache = generate(st.profile, n_questions=100, seed=1)
    fake, calls = (None, []) if name in TRAINED else _stand_in_trainer()
    res = reproduce(
        name, cache=cache, n_splits=2, iterations=3, split_sizes="60,20,20", seeds=2,
        out_dir=tmp_path / "run", progress=False, echo=lambda *a, **k: None,
        **({} if fake is None else {"trainer": fake}),
    )
    if fake is not None:
        (kw,) = calls
        assert kw["run"].alpha == pytest.approx(st.alpha) and list(kw["run"].lambdas) == list(st.lambdas)
        assert kw["run"].train_config().iterations == 3 and kw["data"].splits.cal.shape == (2, 20)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["setting"] == name and results["alpha"] == pytest.approx(st.alpha)
    assert results["cache"]["provenance"]["kind"] == "synthetic"
    rows = results["policies"]
    expected = {"Random", "UALA", "CPO", "CPO batch", "CPO online", lambda_row_name(0.0)}
    expected |= {lambda_row_name(lam) for lam in st.lambdas}
    assert expected <= set(rows), sorted(rows)
    for row in rows.values():
        policy = row.get("is_policy", True)  # the clairvoyant bound has no length or set size
        for m in METRICS if policy else ("cost_cents", "coverage"):
            vals = np.asarray(row["per_split"][m], float)
            assert vals.shape == (2,) and np.isfinite(vals).all()
        assert 0.0 <= row["coverage"]["mean"] <= 1.0
    assert (tmp_path / "run" / "table.md").read_text().count("|") > 20
    assert res.out_dir == tmp_path / "run"
