"""Settings (one per paper table) and the train/cal/test splits."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from ccpo_jax.errors import UserError
from ccpo_jax.ccpo.splits import (
    Splits,
    check_split_sizes,
    make_recalibrate_splits,
    make_splits,
    parse_split_sizes,
    splits_for_protocol,
)
from ccpo_jax.ccpo.rowid import RowId
from ccpo_jax.ccpo.settings import (
    DEFAULT_SETTING,
    METRICS,
    SETTINGS,
    format_lambda,
    get_setting,
    lambda_row_name,
)

# The paper's tables (arXiv 2511.11828, Tables 2-9), written out independently of settings.py.
EXPECTED = {
    "hotpotqa-llama2-a0.1": (2, "hotpotqa", 0.1, 2e-4, 1000),
    "hotpotqa-llama3-a0.1": (3, "hotpotqa", 0.1, 1e-4, 1000),
    "mmlu-llama2-a0.1": (4, "mmlu", 0.1, 2e-4, 560),
    "mmlu-llama3-a0.1": (5, "mmlu", 0.1, 1e-4, 560),
    "hotpotqa-llama2-a0.2": (6, "hotpotqa", 0.2, 1e-4, 1000),
    "hotpotqa-llama3-a0.05": (7, "hotpotqa", 0.05, 1e-4, 1000),
    "mmlu-llama2-a0.2": (8, "mmlu", 0.2, 2e-4, 560),
    "mmlu-llama3-a0.2": (9, "mmlu", 0.2, 2e-4, 560),
}


def test_every_paper_table_has_a_setting_with_its_parameters():
    assert set(SETTINGS) == set(EXPECTED)
    assert DEFAULT_SETTING == "hotpotqa-llama2-a0.1" and SETTINGS[DEFAULT_SETTING].table == 2
    for name, (table, task, alpha, lam, n_train) in EXPECTED.items():
        s = get_setting(name)
        assert (s.table, s.task, s.alpha, s.lambdas) == (table, task, alpha, (lam,))
        assert s.split_sizes == (n_train, 200, 200)
        assert s.n_questions == n_train + 400
        assert s.profile == name.rsplit("-a", 1)[0]
        for f in dataclasses.fields(s):
            assert getattr(s, f.name) is not None, (name, f.name)


def test_paper_numbers_copied_from_the_brief():
    # spot checks against arXiv 2511.11828 Tables 2-9, one per table, plus row naming (docs/reproduce.md)
    t2 = get_setting("hotpotqa-llama2-a0.1").paper
    assert dict(t2["CCPO (lambda=2e-4)"]) == dict(zip(METRICS, (7.026, 0.903, 1.48, 2.22)))
    assert t2["GPT-4o EXIT"]["cost_cents"] == 827.0
    assert t2["LLM policy (GPT-4o)"]["coverage"] == 0.780
    assert t2["LLaMA-2-7B EXIT"]["coverage"] == 0.653
    assert get_setting("hotpotqa-llama3-a0.1").paper["CPO online"]["avg_len"] == 1.856
    assert get_setting("mmlu-llama2-a0.1").paper["CPO batch"]["set_size"] == 4.20
    assert get_setting("mmlu-llama3-a0.1").paper["CCPO (lambda=1e-4)"]["cost_cents"] == 10.90
    assert get_setting("hotpotqa-llama2-a0.2").paper["UALA"]["coverage"] == 0.850
    assert get_setting("hotpotqa-llama3-a0.05").paper["LLM policy (LLaMA-3.2-3B)"]["cost_cents"] == 4.495
    assert get_setting("mmlu-llama2-a0.2").paper["CPO online"]["set_size"] == 0.95
    assert get_setting("mmlu-llama3-a0.2").paper["CCPO (lambda=2e-4)"]["set_size"] == 0.89
    # tables 6-9 have no EXIT rows; 2-5 have 11 rows, 6-9 have 9
    for s in SETTINGS.values():
        assert len(s.paper) == (11 if s.table <= 5 else 9)
        assert ("GPT-4o EXIT" in s.paper) == (s.table <= 5)
        for row in s.paper.values():
            assert set(row) == set(METRICS)


def test_unknown_setting_lists_valid_names():
    with pytest.raises(UserError) as e:
        get_setting("hotpotqa-gpt5")
    for name in SETTINGS:
        assert name in str(e.value)


def test_lambda_formatting_is_stable():
    assert [format_lambda(x) for x in (0, 0.0, 2e-4, 1e-4, 1.5e-4, 0.05, 1.0)] == [
        "0", "0", "2e-4", "1e-4", "1.5e-4", "0.05", "1"]
    assert lambda_row_name(2e-4) == "CCPO (lambda=2e-4)"
    assert lambda_row_name(0) == "CCPO (lambda=0)"
    assert lambda_row_name(float("2e-4")) == lambda_row_name(0.0002)
    # a huge lambda (finite in float32) is named in scientific notation, not in 31 digits, without a '+'
    # (a policy directory keeps letters, digits and dashes: 1e+30 would be named as 1e-30)
    assert [format_lambda(x) for x in (999999.5, 1e6, 1.5e7, 1e30, 3.4e38)] == ["999999.5", "1e6", "1.5e7", "1e30", "3.4e38"]
    assert all(float(format_lambda(x)) == x for x in (1e6, 1.5e7, 1e30, 3.4e38, 1.2345678e-7))
    from ccpo_jax.ccpo.policy_store import policy_slug

    assert policy_slug(lambda_row_name(1e30)) == "ccpo-lambda-1e30" != policy_slug(lambda_row_name(1e-30))


def test_row_order_follows_the_paper():
    paper = list(get_setting("hotpotqa-llama2-a0.1").paper)
    assert sorted(reversed(paper), key=lambda n: RowId.parse(n).sort_key()) == paper


# -- splits -----------------------------------------------------------------------

Q, SIZES, S = 50, (20, 10, 8), 6


@pytest.fixture(scope="module")
def retrain_splits() -> Splits:
    return make_splits(jax.random.PRNGKey(3), Q, *SIZES, S)


@pytest.fixture(scope="module")
def recal_splits() -> Splits:
    return make_recalibrate_splits(jax.random.PRNGKey(3), Q, *SIZES, S)


def _check_disjoint_in_range(sp: Splits):
    tr, ca, te = (np.asarray(x) for x in (sp.train, sp.cal, sp.test))
    assert tr.shape == (S, SIZES[0]) and ca.shape == (S, SIZES[1]) and te.shape == (S, SIZES[2])
    assert tr.dtype == ca.dtype == te.dtype == np.int32
    for s in range(S):
        allids = np.concatenate([tr[s], ca[s], te[s]])
        assert len(np.unique(allids)) == allids.size  # disjoint parts, no repeats
        assert allids.min() >= 0 and allids.max() < Q


def test_retrain_splits_disjoint_and_distinct(retrain_splits):
    _check_disjoint_in_range(retrain_splits)
    tr = np.asarray(retrain_splits.train)
    assert len({tuple(r) for r in tr}) == S  # each split its own permutation


def test_recalibrate_splits_fix_train_and_redraw_cal_test(recal_splits):
    _check_disjoint_in_range(recal_splits)
    tr, ca, te = (np.asarray(x) for x in (recal_splits.train, recal_splits.cal, recal_splits.test))
    assert (tr == tr[0]).all()  # one training set for every split
    assert len({tuple(r) for r in ca}) == S and len({tuple(r) for r in te}) == S
    rest = np.setdiff1d(np.arange(Q), tr[0])
    assert np.isin(ca, rest).all() and np.isin(te, rest).all()


def test_splits_deterministic_per_key_and_follow_the_key():
    a = make_splits(jax.random.PRNGKey(1), Q, *SIZES, S)
    b = make_splits(jax.random.PRNGKey(1), Q, *SIZES, S)
    c = make_splits(jax.random.PRNGKey(2), Q, *SIZES, S)
    np.testing.assert_array_equal(np.asarray(a.test), np.asarray(b.test))
    assert not np.array_equal(np.asarray(a.test), np.asarray(c.test))
    # documented derivation: split s is permutation(split(key, S)[s], Q)
    k = jax.random.split(jax.random.PRNGKey(1), S)[4]
    perm = np.asarray(jax.random.permutation(k, Q))
    np.testing.assert_array_equal(np.asarray(a.cal[4]), perm[SIZES[0] : SIZES[0] + SIZES[1]])
    r = splits_for_protocol("recalibrate", jax.random.PRNGKey(1), Q, *SIZES, S)
    r2 = make_recalibrate_splits(jax.random.PRNGKey(1), Q, *SIZES, S)
    np.testing.assert_array_equal(np.asarray(r.test), np.asarray(r2.test))


def test_every_question_used_when_sizes_fill_the_cache():
    sp = make_splits(jax.random.PRNGKey(0), 12, 6, 3, 3, 2)
    for s in range(2):
        ids = np.concatenate([np.asarray(sp.train[s]), np.asarray(sp.cal[s]), np.asarray(sp.test[s])])
        np.testing.assert_array_equal(np.sort(ids), np.arange(12))


def test_split_size_errors_name_the_field_and_the_cli_maps_it_to_the_flag():
    from ccpo_jax.ccpo.run_config import REPRODUCE_FLAGS as FLAGS

    assert parse_split_sizes("60,20,20") == (60, 20, 20)
    assert parse_split_sizes(" 6, 2 ,2") == (6, 2, 2)
    for bad in ("60,20", "a,b,c", "60,0,20", "60,-1,20", "1,2,3,4", ""):
        with pytest.raises(UserError, match="^split_sizes: ") as e:
            parse_split_sizes(bad)
        assert e.value.field == "split_sizes" and str(e.value.for_cli(FLAGS)).startswith("--split-sizes: ")
    with pytest.raises(UserError, match="^split_sizes 60,20,30 needs 110 questions") as e:
        check_split_sizes(100, 60, 20, 30, 5)
    assert str(e.value.for_cli(FLAGS)).startswith("--split-sizes 60,20,30 needs 110 questions")
    with pytest.raises(UserError, match="^n_splits: ") as e:
        check_split_sizes(100, 60, 20, 20, 0)
    assert str(e.value.for_cli(FLAGS)).startswith("--splits: ")
    with pytest.raises(UserError, match="^split_sizes"):
        make_splits(jax.random.PRNGKey(0), 10, 8, 2, 2, 1)
    with pytest.raises(UserError, match="^protocol: ") as e:
        splits_for_protocol("bogus", jax.random.PRNGKey(0), 10, 2, 2, 2, 1)
    assert str(e.value.for_cli(FLAGS)).startswith("--protocol: ")
    # a field the command does not know keeps its name; a message that starts with the value gets the flag
    assert str(UserError("x: bad", field="x").for_cli(FLAGS)) == "x: bad"
    e = UserError("/tmp/o: already exists; pass `resume` or choose another `out_dir`", field="out_dir")
    assert str(e.for_cli(FLAGS)) == "--out /tmp/o: already exists; pass --resume or choose another --out"


def test_settings_match_the_synthetic_profiles():
    """Each setting's profile exists, and the baseline rows it yields match the paper's row names
    (so table.md can put the paper's numbers beside them)."""
    from envs.generators.synthetic import PROFILES

    from ccpo_jax.ccpo.settings import exit_row_name, llm_policy_row_name, row_key

    for s in SETTINGS.values():
        assert s.profile in PROFILES, s.name
        prof = PROFILES[s.profile]
        assert prof.task == s.task
        for model in prof.models:
            for row in (llm_policy_row_name(model),) + ((exit_row_name(model),) if s.table <= 5 else ()):
                assert s.paper_row(row) is not None, (s.name, row)
                assert row_key(row) in {row_key(r) for r in s.paper}
