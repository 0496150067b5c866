"""Typed rows (issue 52, item 1): ``ccpo_jax.ccpo.rowid.RowId`` against the name parsing it replaces.

The oracle is the name-based code as it was before the change (``settings.row_order_key`` and
``twin_base``, ``calibration.is_calibrated_row``, ``frontier.row_lambda``, frontier's ``is_policy``),
copied here verbatim so that the RowId fields cannot drift from what results.json's order and entries
were built from."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.ccpo import rowid
from ccpo_jax.ccpo.baselines import left_out_rows, non_learned_rows
from ccpo_jax.ccpo.registry import BASELINES, Baseline, register_baseline
from ccpo_jax.ccpo.rowid import BEST_OBSERVABLE, BOUND, Family, RowId, Twin, custom_row
from ccpo_jax.ccpo.settings import SETTINGS
from envs.cache.schema import A_GUIDE, round_cost_cents_of
from envs.replay.env import evaluate_actions

# -- the oracle: the code before issue 52 ------------------------------------------------------------------
_TWINS = (" [kept seed]", " [ensemble]", " [Mondrian]")


def _row_key(name):
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _twin_base(name):
    for suffix in _TWINS:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _row_order_key(name):
    if _twin_base(name) != name:
        k = _row_order_key(_twin_base(name))
        return (k[0], k[1] + chr(0x7d + [name.endswith(s) for s in _TWINS].index(True)))
    fixed = {"Random": 1, "UALA": 3, "CPO": 4, "CPO batch": 5, "CPO online": 6}
    guide = _row_key("GPT-4o")
    if name.endswith(" EXIT"):
        return (0, "" if _row_key(name).startswith(guide) else name)
    if name in fixed:
        return (fixed[name], "")
    if name.startswith("LLM policy ("):
        return (2, "" if guide in _row_key(name) else name)
    m = re.fullmatch(r"CCPO \(lambda=(.*)\)", name)
    if m:
        try:
            return (7, f"{float(m.group(1)):030.15f}")
        except ValueError:
            return (7, m.group(1))
    return (8, name)


def _is_calibrated_row(row):
    base = _twin_base(row)
    return base == "CPO batch" or base.startswith("CCPO (")


def _row_lambda(row):
    row = _twin_base(row)
    if row.startswith("CCPO (lambda=") and row.endswith(")"):
        return float(row[len("CCPO (lambda="):-1])
    return 0.0


# -- the names -----------------------------------------------------------------------------------------------
#: Every row name of the equality runs' results.json / frontier.json (issue 52's base run: default, mondrian,
#: retrain, pac, ltt, sweep; policies and left_out).
EQUALITY_NAMES = [
    "Best observable", "CCPO (lambda=0)", "CCPO (lambda=0) [Mondrian]", "CCPO (lambda=0) [ensemble]",
    "CCPO (lambda=0) [kept seed]", "CCPO (lambda=2e-4)", "CCPO (lambda=2e-4) [Mondrian]",
    "CCPO (lambda=2e-4) [ensemble]", "CCPO (lambda=2e-4) [kept seed]", "CPO", "CPO batch", "CPO batch [Mondrian]",
    "CPO batch [ensemble]", "CPO batch [kept seed]", "CPO online", "Clairvoyant bound", "LLM policy (gpt-4o)",
    "LLM policy (llama-2-7b)", "Random", "UALA", "gpt-4o EXIT", "llama-2-7b EXIT",
    "CCPO (lambda=1e-4)", "CCPO (lambda=1e-4) [kept seed]", "CCPO (lambda=1e-4) [ensemble]",
]
#: Crafted: lambdas far apart and by value (1e30 after 2e-4, 1e-30 before), custom EXIT models (the guide's
#: by the loose key), the ladder rows, a twin's twin, names no rule knows, a lambda that is no number.
CRAFTED = [
    "CCPO (lambda=1e30)", "CCPO (lambda=1e-30)", "CCPO (lambda=1.5e-4)", "CCPO (lambda=0.05)", "CCPO (lambda=1)",
    "CCPO (lambda=1e30) [kept seed]", "CCPO (lambda=abc)", "CCPO (other)", "GPT-4o EXIT", "gpt4o-mini EXIT",
    "My Model EXIT", "zz EXIT [kept seed]", "LLM policy (GPT-4o)", "LLM policy (Qwen 7B)", "Always rung 1 (tiny)",
    "Always rung 2 (small)", "Threshold cascade", "CCPO (lambda=0) [ensemble] [Mondrian]",
    "CPO batch [kept seed] [ensemble]", "Always guide", "zeta", "", "~", "Random [Mondrian]", "EXIT"]


def _all_names():
    paper = [r for s in SETTINGS.values() for r in s.paper]
    return list(dict.fromkeys(EQUALITY_NAMES + CRAFTED + paper))


@pytest.mark.parametrize("name", _all_names())
def test_parse_round_trips_and_matches_the_name_rules(name):
    row = RowId.parse(name)
    assert row.name == name and str(row) == name
    assert row.sort_key() == _row_order_key(name)
    if _twin_base(_twin_base(name)) == _twin_base(name):  # the old rule read one twin suffix only
        assert row.calibrated == _is_calibrated_row(name)
    assert row.is_policy == (name not in ("Clairvoyant bound", "Best observable"))
    assert row.base.name == _twin_base(name)
    if re.fullmatch(r"CCPO \(lambda=[-+.e0-9]+\)", _twin_base(name)):
        assert row.lam == _row_lambda(name)


def test_the_table_order_is_the_old_one():
    names = _all_names()
    assert sorted(names, key=lambda n: RowId.parse(n).sort_key()) == sorted(names, key=_row_order_key)
    paper_order = ["GPT-4o EXIT", "llama EXIT", "Random", "LLM policy (GPT-4o)", "LLM policy (x)", "UALA", "CPO",
                   "CPO batch", "CPO batch [kept seed]", "CPO batch [ensemble]", "CPO batch [Mondrian]",
                   "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)", "CCPO (lambda=1e30)", "Best observable"]
    assert sorted(reversed(paper_order), key=lambda n: RowId.parse(n).sort_key()) == paper_order


def test_constructors_are_what_parse_reads_back():
    made = [rowid.exit_row("GPT-4o"), rowid.exit_row("llama-2-7b"), rowid.llm_policy_row("gpt-4o"),
            rowid.lambda_row(0.0), rowid.lambda_row(2e-4), rowid.lambda_row(1e30), rowid.rung_row(2, "small"),
            rowid.RANDOM, rowid.UALA, rowid.CPO, rowid.CPO_BATCH, rowid.CPO_ONLINE, rowid.CASCADE, BOUND,
            BEST_OBSERVABLE, rowid.CPO_BATCH.twin_of(Twin.KEPT_SEED), rowid.lambda_row(1e-4).twin_of(Twin.MONDRIAN)]
    for row in made:
        back = RowId.parse(row.name)
        assert back == row and hash(back) == hash(row)
        assert (back.label, back.family, back.order, back.twin, back.calibrated, back.is_policy, back.lam) == (
            row.label, row.family, row.order, row.twin, row.calibrated, row.is_policy, row.lam)
    assert rowid.lambda_row(2e-4).name == "CCPO (lambda=2e-4)" and rowid.lambda_row(2e-4).lam == 2e-4
    assert rowid.exit_row("GPT-4o").family is rowid.Family.EXIT and not BOUND.is_policy


def test_twins_name_and_base():
    row = rowid.lambda_row(0.0)
    kept = row.twin_of(Twin.KEPT_SEED)
    assert kept.name == "CCPO (lambda=0) [kept seed]" and kept.base == row and kept.calibrated and kept != row
    assert [t.value for t in Twin] == list(_TWINS)  # the table order after the row
    nested = row.twin_of(Twin.ENSEMBLE).twin_of(Twin.MONDRIAN)
    assert nested.name == "CCPO (lambda=0) [ensemble] [Mondrian]" and nested.base.name == "CCPO (lambda=0) [ensemble]"
    assert {RowId.parse("CPO batch"): 1}[rowid.CPO_BATCH] == 1  # hashable, one row per name


def test_settings_suffixes_are_the_twins():
    from ccpo_jax.ccpo import settings
    assert not any(hasattr(settings, n) for n in ("KEPT_SEED", "ENSEMBLE", "MONDRIAN_TWIN", "TWINS"))
    assert not hasattr(settings, "row_order_key") and not hasattr(settings, "twin_base")  # RowId's now


# -- the baseline registry: a new baseline is one function and one registration -----------------------------------


def always_guide(params, data, key, cal, test, alpha, static):
    """The toy baseline: accept the guide's first answer on every question (one traced split)."""
    return evaluate_actions(jnp.full(params.available[test].shape[:-1], A_GUIDE, jnp.int32), params, test)


ALWAYS_GUIDE = custom_row("Always guide")
TOY = Baseline(Family.OTHER,
               left_out=lambda cache, used: {} if cache.manifest.has_guide else {"Always guide": "no guide"},
               rows=lambda cache, used: [(ALWAYS_GUIDE, None)] if cache.manifest.has_guide else [],
               metrics=always_guide)


@pytest.fixture
def toy_registered():
    register_baseline(TOY)
    try:
        yield TOY
    finally:
        BASELINES.remove(TOY)


def _synthetic(n=120):
    from envs.generators.synthetic import generate
    from envs.replay.env import make_env_params
    cache = generate("hotpotqa-llama2", n_questions=n, seed=3)
    return cache, make_env_params(cache)


def test_a_registered_baseline_is_a_row_of_non_learned_rows(toy_registered):
    cache, params = _synthetic()
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(120) for _ in range(3)])
    cal, test = idx[:, :60], idx[:, 60:]
    rows = non_learned_rows(cache, params, jax.random.PRNGKey(0), cal, test, 0.1)
    assert list(rows)[-1] == "Always guide"  # registration order: after the paper's rows
    # the oracle: round 1 only, the guide's answer kept; covered iff the guide was right or nothing was
    m = cache.manifest
    cost = round_cost_cents_of(cache.arrays, m.base, m.guide).astype(np.float64)[:, 0]
    ok = np.asarray(cache.arrays["guide_correct"])[:, 0] | np.asarray(params.unsolvable)
    np.testing.assert_allclose(rows["Always guide"]["cost_cents"], cost[test].sum(1), rtol=1e-5)
    np.testing.assert_allclose(rows["Always guide"]["coverage"], ok[test].mean(1), rtol=1e-6)
    np.testing.assert_array_equal(rows["Always guide"]["avg_len"], np.ones(3))
    np.testing.assert_array_equal(rows["Always guide"]["set_size"], np.ones(3))
    assert "Always guide" not in left_out_rows(cache, test)


def test_registered_baselines_are_traced_once_in_one_program():
    """Risk 1 of the plan: a registered baseline joins the ONE jitted program of every traced baseline (one
    new program for a new set of rows, its function traced once), and a second call recompiles nothing."""
    from ccpo_jax.ccpo import baselines

    traces = []

    def counted(params, data, key, cal, test, alpha, static):
        traces.append(static)
        return always_guide(params, data, key, cal, test, alpha, None)

    b = register_baseline(Baseline(Family.OTHER, left_out=lambda cache, used: {},
                                   rows=lambda cache, used: [(custom_row("Always guide (counted)"), "static")],
                                   metrics=counted))
    try:
        cache, params = _synthetic()
        rng = np.random.default_rng(1)
        before = baselines._rows_program.cache_info().misses
        for k in range(2):  # other splits and key, same shapes
            idx = np.stack([rng.permutation(120) for _ in range(2)])
            rows = non_learned_rows(cache, params, jax.random.PRNGKey(k), idx[:, :60], idx[:, 60:], 0.1)
            assert "Always guide (counted)" in rows and "Random" in rows
        assert traces == ["static"]
        assert baselines._rows_program.cache_info().misses == before + 1
    finally:
        BASELINES.remove(b)


def test_a_registered_baseline_runs_end_to_end(toy_registered, tmp_path):
    """``reproduce`` writes the toy row into results.json (in the table order) and table.md."""
    from ccpo_jax.ccpo.reproduce import reproduce
    from envs.cache.fast import save_fast
    from envs.generators.synthetic import generate

    save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path / "syn100")
    res = reproduce(cache=str(tmp_path / "syn100"), n_splits=2, split_sizes="60,20,20", out_dir=tmp_path / "out",
                    train=False, echo=None)
    names = list(json.loads((tmp_path / "out" / "results.json").read_text())["policies"])
    assert "Always guide" in names
    assert names == sorted(names, key=lambda n: RowId.parse(n).sort_key())
    assert any(ln.startswith("| Always guide") for ln in res.table.splitlines()), res.table


# -- a run's rows and the one results builder -------------------------------------------------------------------


def _metrics(seed, n=2, s=3):
    rng = np.random.default_rng(seed)
    return {"cost_cents": rng.uniform(1, 2, (n, s)), "coverage": rng.uniform(0.8, 1, (n, s)),
            "avg_len": rng.uniform(1, 3, (n, s)), "set_size": rng.uniform(1, 2, (n, s))}


def test_rowset_is_in_the_table_order_and_reads_names_once():
    from ccpo_jax.ccpo.registry import Row, RowSet, rows_from
    added = ["CCPO (lambda=0) [kept seed]", "Random", "CPO batch [ensemble]", "gpt-4o EXIT", "CPO batch",
             "CCPO (lambda=0)", "Clairvoyant bound"]
    rs = rows_from({n: _metrics(i) for i, n in enumerate(added)}, kept_seed={"CCPO (lambda=0) [kept seed]": {"seed": [1]},
                                                                          "no such row": {"seed": [0]}})
    assert rs.names() == sorted(added, key=_row_order_key)
    assert list(rs.metrics()) == added  # the order they came in (report.build_results sorts)
    assert rs.extra("kept_seed") == {"CCPO (lambda=0) [kept seed]": {"seed": [1]}}  # unknown names ignored
    assert rs.by_name("CPO batch").id == rowid.CPO_BATCH and rowid.CPO_BATCH in rs and "CPO batch" not in rs
    rs.add(Row(rowid.CPO_BATCH, _metrics(9)))  # one row per name: replaced in place
    assert len(rs) == len(added) and list(rs.metrics()) == added
    assert np.array_equal(rs[rowid.CPO_BATCH].metrics["coverage"], _metrics(9)["coverage"])
    assert isinstance(RowSet(), RowSet) and len(RowSet()) == 0


def test_one_builder_orders_keys_and_writes_the_table_once(tmp_path):
    """results.json's keys in the documented order, each row's fragments after its metrics (kept seed,
    ensemble, guarantee, below_target); table.md written once, holding every section."""
    from ccpo_jax.ccpo.registry import rows_from
    from ccpo_jax.ccpo.report import cache_info
    from ccpo_jax.ccpo.results import RunRecord, build_results, build_table, write_outputs
    from ccpo_jax.ccpo.settings import get_setting
    from ccpo_jax.core.guarantee import make_guarantee

    names = ["CPO batch", "CPO batch [kept seed]", "CPO batch [ensemble]", "Random"]
    rows = rows_from({n: _metrics(i) for i, n in enumerate(names)},
                     kept_seed={"CPO batch [kept seed]": {"seed": [0, 1, 0], "train_cost_cents": [[1.0, 2.0]] * 3}})
    run = RunRecord(setting="hotpotqa-llama2-a0.1", alpha=0.1, protocol="recalibrate", n_splits=3,
                    split_sizes=(60, 20, 20), seeds=2, preset="default", train_config={"iterations": 2},
                    cache=cache_info(_synthetic(20)[0]), timing={"total_s": 1.0}, cost_floor_cents=0.5,
                    left_out={"UALA": "no uncertainty"}, guarantee=make_guarantee("marginal"))
    res = build_results(run, rows, environment={"jax": "x", "backend": "cpu", "devices": ["cpu:0"]})
    assert list(res) == ["setting", "alpha", "protocol", "splits", "split_sizes", "seeds", "preset", "train_config",
                         "cache", "policies", "timing", "environment", "cost_floor_cents", "left_out", "guarantee"]
    pol = res["policies"]
    assert list(pol) == ["Random", "CPO batch", "CPO batch [kept seed]", "CPO batch [ensemble]"]
    assert list(pol["CPO batch [kept seed]"])[-3:] == ["kept_seed", "guarantee", "below_target"]
    assert list(pol["CPO batch [ensemble]"])[-3:] == ["ensemble", "guarantee", "below_target"]
    assert "guarantee" not in pol["Random"] and pol["CPO batch [ensemble]"]["ensemble"]["members"] == 2
    text, shown = build_table(res, get_setting("hotpotqa-llama2-a0.1"), (60, 20, 20), False)
    assert text.count("Rows left out:") == 1 and "- UALA: no uncertainty" in text
    assert shown.rstrip("\n") == text.rstrip("\n")
    out = write_outputs(tmp_path, res, get_setting("hotpotqa-llama2-a0.1"), (60, 20, 20), False, group_plot=False)
    assert out == shown and (tmp_path / "table.md").read_text() == text
    assert json.loads((tmp_path / "results.json").read_text())["left_out"] == {"UALA": "no uncertainty"}
