"""Typed rows (issue 52, item 1): ``ccpo_jax.ccpo.rowid.RowId`` against the name parsing it replaces.

The oracle is the name-based code as it was before the change (``settings.row_order_key`` and
``twin_base``, ``calibration.is_calibrated_row``, ``frontier.row_lambda``, frontier's ``is_policy``),
copied here verbatim so that the RowId fields cannot drift from what results.json's order and entries
were built from."""
from __future__ import annotations

import re

import pytest

from ccpo_jax.ccpo import rowid
from ccpo_jax.ccpo.rowid import BEST_OBSERVABLE, BOUND, RowId, Twin
from ccpo_jax.ccpo.settings import SETTINGS

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
    assert (settings.KEPT_SEED, settings.ENSEMBLE, settings.MONDRIAN_TWIN) == tuple(t.value for t in Twin)
    assert settings.TWINS == _TWINS
