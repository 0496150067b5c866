"""results.json schema (docs/reproduce.md, "Outputs"), summary statistics vs numpy, table.md, box plots, TensorBoard."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.settings import METRICS, get_setting
from ccpo_jax.runtime.scalars import ScalarWriter

S = 21
SCHEMA_TOP = {"setting", "alpha", "protocol", "splits", "seeds", "preset", "train_config", "cache", "policies",
              "timing", "environment"}
STATS = {"mean", "median", "q05", "q95"}


def _rows(rng) -> dict[str, dict[str, np.ndarray]]:
    rows = {}
    # deliberately out of the paper's order
    for name in ("CCPO (lambda=2e-4)", "Random", "CPO", "GPT-4o EXIT", "UALA", "CCPO (lambda=0)"):
        rows[name] = {
            "cost_cents": rng.gamma(2.0, 3.0, S),
            "coverage": rng.uniform(0.8, 1.0, S),
            "avg_len": rng.uniform(1, 3, S),
            "set_size": rng.uniform(1, 3, S),
        }
    return rows


@pytest.fixture(scope="module")
def results() -> dict:
    rng = np.random.default_rng(0)
    rows = _rows(rng)
    rows["UALA"]["coverage"][3] = np.nan  # a split without a value
    cache = {"name": "synthetic-hotpotqa-llama2", "provenance": {"kind": "synthetic", "profile": "hotpotqa-llama2", "seed": 0},
             "checksum": "sha256:abc", "n_questions": 1400}
    return report.build_results(
        setting="hotpotqa-llama2-a0.1", alpha=0.1, protocol="recalibrate", n_splits=S, cache=cache, rows=rows,
        timing={"total_s": 3.0, "compile_s": 1.0, "train_s": 1.5, "eval_s": 0.5},
        environment={"jax": "x", "backend": "cpu", "devices": ["cpu:0 (cpu)"]},
    ), rows


def test_results_schema_matches_design(tmp_path, results):
    res, rows = results
    path = report.write_results(tmp_path, res)
    assert path == tmp_path / "results.json"
    # strict JSON (no NaN tokens)
    back = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert set(back) == SCHEMA_TOP
    assert isinstance(back["setting"], str) and isinstance(back["alpha"], float)
    assert back["protocol"] in ("retrain", "recalibrate") and back["splits"] == S
    assert set(back["cache"]) == {"name", "provenance", "checksum", "n_questions"}
    assert set(back["timing"]) == {"total_s", "compile_s", "train_s", "eval_s"}
    assert set(back["environment"]) == {"jax", "backend", "devices"}
    assert set(back["policies"]) == set(rows)
    for name, entry in back["policies"].items():
        assert set(entry) == set(METRICS) | {"per_split", "per_seed", "seeds"}
        assert set(entry["per_split"]) == set(METRICS) == set(entry["per_seed"])
        for m in METRICS:
            assert set(entry[m]) == STATS | {"seed_sd", "seed_min", "seed_max"}
            assert len(entry["per_split"][m]) == S
    # rows in the paper's order
    assert list(back["policies"]) == ["GPT-4o EXIT", "Random", "UALA", "CPO", "CCPO (lambda=0)", "CCPO (lambda=2e-4)"]
    assert not list(tmp_path.glob(".*"))  # no temp files left


def test_summary_stats_agree_with_numpy(results):
    res, rows = results
    for name, ms in rows.items():
        for m in METRICS:
            v = np.asarray(ms[m], float)
            v = v[np.isfinite(v)]
            got = res["policies"][name][m]
            assert got["mean"] == pytest.approx(np.mean(v), rel=1e-12)
            assert got["median"] == pytest.approx(np.median(v), rel=1e-12)
            assert got["q05"] == pytest.approx(np.quantile(v, 0.05), rel=1e-12)
            assert got["q95"] == pytest.approx(np.quantile(v, 0.95), rel=1e-12)
            np.testing.assert_allclose(
                [x for x in res["policies"][name]["per_split"][m] if x is not None], v, rtol=0, atol=0)
    assert res["policies"]["UALA"]["per_split"]["coverage"][3] is None


def test_summary_stats_hand_computed():
    # 0..20: linear-interpolated 5% quantile at position 0.05 * 20 = 1 -> 1.0; 95% -> 19.0
    s = report.summary_stats(np.arange(21.0)[::-1])
    assert s == {"mean": 10.0, "median": 10.0, "q05": 1.0, "q95": 19.0}
    s = report.summary_stats([1.0, 2.0])  # position 0.05 -> 1.05
    assert s["q05"] == pytest.approx(1.05) and s["q95"] == pytest.approx(1.95) and s["median"] == 1.5
    assert report.summary_stats([np.nan]) == {"mean": None, "median": None, "q05": None, "q95": None}


def test_missing_metric_or_wrong_length_rejected():
    with pytest.raises(ValueError, match="set_size"):
        report.policy_entry({"cost_cents": [1], "coverage": [1], "avg_len": [1]}, 1, "X")
    with pytest.raises(ValueError, match="3 values for 2 splits"):
        report.policy_entry({m: [1, 2, 3] for m in METRICS}, 2, "X")


def test_table_layout_synthetic_label_and_paper_values(tmp_path, results):
    res, rows = results
    st = get_setting("hotpotqa-llama2-a0.1")
    path = report.write_table(tmp_path, res, st, (1000, 200, 200), compare_paper=True)
    text = path.read_text()
    assert "SYNTHETIC" in text and "hotpotqa-llama2-a0.1" in text and "Table 2" in text
    assert ("| Policy | Cost (cents per test split) | Cost (cents per question) | Coverage | Avg. Len. (rounds) | "
            "Set Size (answers) |") in text
    assert "recalibrate" in text and "1000/200/200" in text and "alpha: 0.1" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| CCPO (lambda=2e-4) |"))
    cov = res["policies"]["CCPO (lambda=2e-4)"]["coverage"]
    assert f"{cov['mean']:.3f} [{cov['q05']:.3f}, {cov['q95']:.3f}] (paper 0.903)" in line
    assert "(paper 827)" in next(ln for ln in text.splitlines() if ln.startswith("| GPT-4o EXIT |"))
    # rows absent from the run are named, not faked
    assert "CPO batch" in text.split("absent here")[1]
    plain = report.format_table(res, st, (1000, 200, 200), compare_paper=False)
    assert "(paper" not in plain and "SYNTHETIC" in plain
    real = dict(res, cache=dict(res["cache"], provenance={"kind": "real", "source": "x"}))
    assert "SYNTHETIC" not in report.format_table(real, st)


def test_boxplots_are_pngs(tmp_path, results):
    res, _ = results
    paths = report.write_boxplots(tmp_path, res)
    assert [p.name for p in paths] == [report.COST_PNG, report.COVERAGE_PNG]
    import matplotlib.image

    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert not list(tmp_path.glob(".*"))


def _read_events(logdir: Path) -> list:
    """Parse TFRecord event files (length, crc, data, crc) with tensorboardX's protobuf."""
    from tensorboardX.proto import event_pb2

    events = []
    for f in sorted(logdir.rglob("events.out.tfevents.*")):
        buf = f.read_bytes()
        i = 0
        while i < len(buf):
            (n,) = struct.unpack("<Q", buf[i : i + 8])
            data = buf[i + 12 : i + 12 + n]
            i += 12 + n + 4
            ev = event_pb2.Event()
            ev.ParseFromString(data)
            events.append(ev)
    return events


def test_scalar_writer_roundtrip(tmp_path):
    with ScalarWriter(tmp_path / "tb", ".x") as w:
        w.add_scalar("CCPO (lambda=0)/kappa", 0.3, 1)
        w.add_scalar("CCPO (lambda=0)/kappa", 0.25, 2)
    got = {(v.tag, ev.step): v.simple_value for ev in _read_events(tmp_path / "tb") for v in ev.summary.value}
    assert got == pytest.approx({("CCPO__lambda_0_/kappa", 1): 0.3, ("CCPO__lambda_0_/kappa", 2): 0.25})


def test_titles_name_a_custom_cache_honestly(tmp_path, results):
    res, _ = results
    st = get_setting("hotpotqa-llama2-a0.1")
    real = dict(res, cache=dict(res["cache"], name="uala-hotpotqa", provenance={"kind": "real", "source": "x"}))
    title = report.format_table(real, st).splitlines()[0]
    assert title == ("# hotpotqa-llama2-a0.1: custom cache `uala-hotpotqa` with the Table 2 setting's alpha and "
                     "lambdas (alpha=0.1, lambda=0, 2e-4)")
    assert "paper Table" not in report.format_table(real, st)
    own = report.format_table(res, st, (1000, 200, 200), compare_paper=True).splitlines()[0]
    assert own.startswith("# hotpotqa-llama2-a0.1: paper Table 2: HotpotQA, LLaMA-2-7B")
    other_alpha = dict(real, alpha=0.2)
    assert "lambdas (lambda=0, 2e-4) and alpha=0.2" in report.run_title(other_alpha, st, own_cache=False)
    assert "alpha=0.2 (the paper's: 0.1)" in report.run_title(dict(res, alpha=0.2), st, own_cache=True)


def test_cost_plot_puts_exit_rows_in_their_own_panel():
    rows = ["gpt-4o EXIT", "llama-2-7b EXIT", "Random", "CPO", "CCPO (lambda=0)"]
    assert report.cost_panels(rows) == [(["gpt-4o EXIT", "llama-2-7b EXIT"], True),
                                        (["Random", "CPO", "CCPO (lambda=0)"], False)]
    assert report.cost_panels(["Random", "CPO"]) == [(["Random", "CPO"], False)]


# -- issue 48 item 14: exact per-split values ----------------------------------------------------------


def test_exact_totals_recover_every_count_from_the_float32_means_jax_computes():
    """Oracle: the integer counts themselves. For every count k of n questions (n from 1 to 1000, and the
    averages of rounds up to 4 per question), ``summarise``'s float32 mean (jnp.mean, as every row computes
    it, with two roundings: 5 of 3 reads 1.6666667) gives back k exactly, and the written value is the
    float64 k / n (180 of 200: 0.9)."""
    import jax.numpy as jnp

    for n in (*range(1, 33), 199, 200, 201, 560, 997, 1000):
        k = np.arange(4 * n + 1)
        per_q = (np.arange(n)[None, :] < k[:, None] % (n + 1)).astype(np.int32) + (k // (n + 1))[:, None]
        per_q[:, 0] += k - per_q.sum(axis=1)  # rows of n integers summing to k (each row's total is exactly k)
        mean32 = np.asarray(jnp.mean(jnp.asarray(per_q, jnp.float32), axis=-1))
        assert mean32.dtype == np.float32
        tot = report.exact_totals(mean32, n)
        assert tot is not None and np.array_equal(tot, k), n
    v = np.asarray(jnp.mean(jnp.asarray(np.arange(200) < 180, jnp.float32)))
    assert float(v) == 0.8999999761581421 and report.exact_totals(v[None], 200)[0] / 200 == 0.9


def test_exact_totals_leave_what_is_not_a_mean_of_counts_alone():
    rng = np.random.default_rng(1)
    assert report.exact_totals(rng.uniform(0.8, 1.0, 21), 200) is None  # float64, not k / 200
    assert report.exact_totals(rng.uniform(0.8, 1.0, 21).astype(np.float32), 200) is None
    assert report.exact_totals(np.float32([0.9, 0.905]), 200) is not None  # 181 / 200 = 0.905
    assert report.exact_totals(np.float32([0.9, 0.9025]), 200) is None  # 180.5 of 200: not a count
    assert report.exact_totals(np.array([0.9, np.nan]), 200)[0] == 180  # NaN (a split without a value) passes
    # as float64 copies of the float32 means (prepare.as_rows): recovered alike
    assert np.array_equal(report.exact_totals(np.float64(np.float32([0.91, 5 / 3])), 200 * 3), [546, 1000])
    assert report.exact_totals(np.int32([1, 2]), 200) is None and report.exact_totals(np.float32([0.5]), 0) is None


def test_per_split_values_exact_and_counted_with_every_other_value_unchanged():
    """180 of 200 covered reads 0.9 in per_split (it read 0.8999999761581421), ``per_split_covered`` has
    the counts (summed over seeds, out of n_test x seeds); the summary, per-seed and cost values are the
    ones written without ``n_test`` (computed from the values given, as before)."""
    k = np.array([[180, 199, 171], [180, 200, 169]])  # [seeds, splits] covered of 200
    rounds = np.array([[250, 400, 333], [260, 401, 300]])
    m = {"cost_cents": np.float32([[1.1, 2.2, 3.3], [1.2, 2.1, 3.0]]),
         "coverage": (k.astype(np.float32) / np.float32(200)), "avg_len": rounds.astype(np.float32) / np.float32(200),
         "set_size": np.float32(rounds / 200)}
    old = report.policy_entry(m, 3, "x")
    new = report.policy_entry(m, 3, "x", n_test=200)
    assert old["per_split"]["coverage"][0] == 0.8999999761581421
    assert new["per_split"]["coverage"] == [0.9, 399 / 400, 340 / 400]  # k / (200 x 2 seeds), one division
    assert new["per_split"]["avg_len"] == [510 / 400, 801 / 400, 633 / 400]
    assert new["per_split_covered"] == {"covered": [360, 399, 340], "of": 400}
    assert new["per_split"]["cost_cents"] == old["per_split"]["cost_cents"]
    for key in set(old) - {"per_split"}:
        assert new[key] == old[key], key
    for metric in METRICS:  # the float32 values, rounded back: the same numbers
        assert np.array_equal(np.float32(new["per_split"][metric]), np.float32(old["per_split"][metric]))
    assert json.dumps(new["per_split"]["coverage"][0]) == "0.9"
    one = report.policy_entry({**m, "coverage": m["coverage"][0]}, 3, "x", n_test=200)
    assert one["per_split_covered"] == {"covered": [180, 199, 171], "of": 200}
    # reproduce hands the rows over as float64 copies of the float32 means (prepare.as_rows): the same entry
    assert report.policy_entry({k: np.float64(v) for k, v in m.items()}, 3, "x", n_test=200) == new
