"""table.md explains itself (issue 51, items 1-4): units in every header, the cost per question beside the
split total, the unsolvable share and one line defining coverage, Avg. Len. and Set Size defined, the row
``export`` would pick marked with why, the preset's changes in words, a short provenance line, and a run
whose learned rows all sit at the bound says there was nothing to save.

Oracles: the cells computed by hand from the rows' arrays (mean / n_test), the cache's unsolvable flags
counted directly, and ``choose_default_row`` (the export code) on saved policies.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.pick import choose_default_row, export_default
from ccpo_jax.ccpo.prepare import PROVENANCE_CHARS, describe_cache
from ccpo_jax.ccpo.settings import METRICS
from ccpo_jax.ccpo.table import COVERAGE_RULE, EXPORT_MARK, format_table
from envs.generators.synthetic import generate
from envs.replay.bound import BOUND_ROW

S = 5


def _rows(costs: dict[str, float], bound: float) -> dict:
    rows = {}
    for name, c in costs.items():
        rows[name] = {"cost_cents": np.full((2, S), c), "coverage": np.full((2, S), 0.9),
                      "avg_len": np.full((2, S), 1.5), "set_size": np.full((2, S), 1.1)}
    rows[BOUND_ROW] = {"cost_cents": np.full(S, bound), "coverage": np.full(S, 0.9),
                       "avg_len": np.full(S, np.nan), "set_size": np.full(S, np.nan)}
    return rows


def _results(costs, bound, cache=None, **kw):
    cache = cache or {"name": "c", "provenance": {"kind": "real", "source": "x"}, "checksum": "sha256:0",
                      "n_questions": 400, "unsolvable_share": 0.555}
    return report.build_results(setting="s", alpha=0.1, protocol="recalibrate", n_splits=S, cache=cache,
                                rows=_rows(costs, bound), timing={}, environment={"backend": "cpu"}, seeds=2,
                                split_sizes=(200, 100, 100), **kw)


def test_units_cost_per_question_unsolvable_and_definitions():
    res = _results({"CPO batch": 6.0, "CCPO (lambda=0)": 5.0}, 4.0)
    text = format_table(res)
    head = next(ln for ln in text.splitlines() if ln.startswith("| Policy"))
    assert "Cost (cents per test split)" in head and "Cost (cents per question)" in head
    assert "Avg. Len. (rounds)" in head and "Set Size (answers)" in head
    row = next(ln for ln in text.splitlines() if ln.startswith("| CCPO (lambda=0) |")).split(" | ")
    assert row[1].startswith("5 [5, 5]") and row[2] == "0.05"  # 5 cents over 100 test questions
    assert "unsolvable (no model answers correctly): 55.5%" in text
    cov = [ln for ln in text.splitlines() if ln.startswith("- Coverage:")]
    assert len(cov) == 1 and COVERAGE_RULE in cov[0] and "55.5% of this cache" in cov[0]
    assert any(ln.startswith("- Avg. Len.: rounds run per question") and "Set Size: distinct answers" in ln
               for ln in text.splitlines())
    assert "Nothing to save" not in text
    assert res["split_sizes"] == [200, 100, 100] and res["cache"]["unsolvable_share"] == 0.555


def test_learned_rows_at_the_bound_say_there_was_nothing_to_save():
    text = format_table(_results({"CPO batch": 4.0, "CCPO (lambda=0)": 4.0, "GPT-4o EXIT": 80.0}, 4.0))
    assert "- Nothing to save here: every learned row already costs what the clairvoyant bound costs" in text


def test_a_bound_at_the_round_one_floor_says_there_was_nothing_to_save():
    res = _results({"CPO": 4.4, "CCPO (lambda=0)": 4.0}, 4.0)
    assert "Nothing to save" not in format_table(res)
    res["cost_floor_cents"] = 4.0  # every test question answered at round 1 costs what the bound costs
    line = next(ln for ln in format_table(res).splitlines() if ln.startswith("- Nothing to save here"))
    assert "is what answering every test question at round 1 costs" in line


def test_preset_changes_are_said_in_words_with_a_link():
    from ccpo_jax.ccpo.config import TrainConfig
    import dataclasses

    res = _results({"CCPO (lambda=0)": 5.0}, 4.0, train_config=dataclasses.asdict(TrainConfig()))
    line = next(ln for ln in format_table(res).splitlines() if ln.startswith("- learned rows:"))
    assert "100 training iterations instead of 1500" in line and "docs/results.md#presets-paper-and-default" in line
    assert "backtrack_steps" not in line and "->" not in line


def test_unsolvable_share_is_the_caches_own_count():
    cache = generate("hotpotqa-llama2", 300, 0)
    info = report.cache_info(cache)
    assert info["unsolvable_share"] == pytest.approx(np.mean(np.asarray(cache.unsolvable)))
    assert f"{100 * info['unsolvable_share']:.1f}% unsolvable" in describe_cache(cache)


def test_a_long_provenance_is_one_short_line():
    import dataclasses

    cache = generate("hotpotqa-llama2", 50, 0)
    prov = dict(cache.manifest.provenance, note="x" * 1500)
    cache = dataclasses.replace(cache, manifest=dataclasses.replace(cache.manifest, provenance=prov))
    line = describe_cache(cache)
    assert len(line) < PROVENANCE_CHARS + 200 and "in full: results.json cache.provenance" in line


def _save(pdir, row, cost, seed_rule, ok=True):
    d = pdir / row.replace(" ", "-").replace("(", "").replace(")", "").replace("=", "-")
    d.mkdir(parents=True)
    cal = {"n": 100, "kappa": 0.3, "coverage": 0.91 if ok else 0.8, "target": 0.9, "full_set_fraction": 0.1,
           "degenerate": False, "test_cost_cents_mean": cost, "test_coverage_mean": 0.9}
    (d / "policy.json").write_text(json.dumps({"row": row, "seed_rule": seed_rule, "calibration": cal}))


def test_the_table_marks_the_row_export_picks_by_one_name(tmp_path):
    pdir = tmp_path / "policies"
    _save(pdir, "CCPO (lambda=0)", 5.0, "the kept seed: ...")
    _save(pdir, "CCPO (lambda=0) [ensemble]", 5.2, "all 5 seeds as one policy: ...")
    _save(pdir, "CPO batch", 4.0, "the kept seed: ...", ok=False)  # cheaper, but its coverage fails
    d, why = choose_default_row(pdir, n_test=100)
    pick = export_default(pdir, 100)
    assert pick["row"] == "CCPO (lambda=0) [kept seed]" and pick["policy"] == d.name
    assert "'CCPO (lambda=0) [kept seed]' (test cost 5 cents per test split, 0.05 cents a question" in why
    res = _results({"CCPO (lambda=0)": 5.0, "CCPO (lambda=0) [kept seed]": 5.0, "CCPO (lambda=0) [ensemble]": 5.2},
                   4.0)
    res["export_default"] = pick
    text = format_table(res)
    marked = [ln for ln in text.splitlines() if EXPORT_MARK in ln and ln.startswith("|")]
    assert len(marked) == 1 and marked[0].startswith("| **CCPO (lambda=0) [kept seed]** (export's default) |")
    assert f"- {EXPORT_MARK}: the row `ccpo-jax export RUN_DIR` serves when no `--row` is given" in text
    assert "a user would deploy" not in text and "export --row 'ROW [kept seed]'" in text


def test_the_marginal_guarantee_section_says_what_it_promises_and_names_pac():
    from ccpo_jax.ccpo.guarantee_results import format_guarantees

    res = {"guarantee": {"kind": "marginal", "alpha": 0.1, "statement": "P(covered) >= 0.9 on average"},
           "policies": {"CPO batch": {"below_target": {"count": 199, "n": 500, "fraction": 0.398,
                                                       "ci": [0.355, 0.442]}}}}
    text = format_guarantees(res)
    assert "--guarantee pac" in text and "what a marginal guarantee" in text
    assert all(m in METRICS for m in ("cost_cents", "coverage"))


def test_frontier_styles_one_colour_per_family_and_misses_by_hand():
    from ccpo_jax.ccpo.frontier import row_styles
    from ccpo_jax.ccpo.table import misses_target

    rows = ["Random", "UALA", "CPO", "CPO batch", "CPO batch [kept seed]", "CPO batch [ensemble]", "CCPO (lambda=0)",
            "CCPO (lambda=0) [kept seed]", "CCPO (lambda=0) [ensemble]", "CCPO (lambda=1e-4)", "CCPO (lambda=1e-4) [ensemble]"]
    learned = {r for r in rows if r not in ("Random", "UALA")}
    st = row_styles(rows, learned)
    fam = {"CPO": ["CPO"], "CPO batch": rows[3:6], "CCPO (lambda=0)": rows[6:9], "CCPO (lambda=1e-4)": rows[9:]}
    colours = {f: {st[r]["color"] for r in rs} for f, rs in fam.items()}
    assert all(len(c) == 1 for c in colours.values())  # a row and its twins share a colour
    assert len({next(iter(c)) for c in colours.values()} | {st["Random"]["color"], st["UALA"]["color"]}) == 6
    assert len({(st[r]["ls"], st[r]["marker"]) for r in fam["CCPO (lambda=0)"]}) == 3  # the twins told apart
    assert st["Random"]["ls"] == ":" and st["CPO"]["ls"] == "-"
    # 0.786 over 20 splits with sd 0.05: se 0.0112, 0.80 - 2 se = 0.7776 -> meets; 0.76 misses
    v = 0.786 + 0.05 * np.array([1, -1] * 10) * np.sqrt(19 / 20)
    assert not misses_target(v, 0.2) and misses_target(v - 0.026, 0.2)
