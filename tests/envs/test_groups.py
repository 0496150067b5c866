"""Per-question groups (issue 24): the optional ``group`` field, its validation, round trips, importers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from envs.cache.fast import load_fast, save_fast
from envs.cache.schema import CacheError
from envs.cache.jsonl import read_jsonl, write_jsonl
from envs.replay.report import describe
from envs.generators.synthetic import generate

DATA = Path(os.environ.get("CCPO_SHARED_DATA", "/work/shared/data"))


def _with_groups(cache, groups):
    from envs.cache.schema import ResponseCache

    return ResponseCache(cache.manifest, {**cache.arrays, "group": np.array(groups, dtype=str)}).with_checksum()


def test_group_round_trips_jsonl_and_fast(tmp_path):
    c = generate(n_questions=12, seed=1)
    groups = ["chemistry"] * 5 + ["history"] * 4 + ["law"] * 3
    g = _with_groups(c, groups)
    p = write_jsonl(g, tmp_path / "c.jsonl")
    lines = [json.loads(x) for x in p.read_text().splitlines()[1:]]
    assert [r["group"] for r in lines] == groups
    back = read_jsonl(p)
    assert back.arrays["group"].tolist() == groups
    assert back.manifest.checksum == g.manifest.checksum
    out = save_fast(back, tmp_path / "fast")
    fast = load_fast(out)
    assert fast.arrays["group"].tolist() == groups
    assert fast.manifest.checksum == g.manifest.checksum
    # a cache without groups keeps its checksum (the field is optional, not an empty array)
    assert "group" not in read_jsonl(write_jsonl(c, tmp_path / "n.jsonl")).arrays
    text = describe(fast, "x")
    assert "groups:      3   smallest group: 'law' with 3 question(s)" in text
    assert "groups:      none" in describe(c, "x")


def _lines(tmp_path, mutate):
    c = generate(n_questions=3, seed=2)
    p = write_jsonl(_with_groups(c, ["a", "b", "c"]), tmp_path / "c.jsonl")
    rows = p.read_text().splitlines()
    recs = [json.loads(r) for r in rows[1:]]
    mutate(recs)
    p.write_text("\n".join([rows[0]] + [json.dumps(r) for r in recs]) + "\n")
    return p


@pytest.mark.parametrize("value, message", [
    (7, "expected a non-empty string, got int"),
    ("", "got an empty string"),
    (None, "got null"),
    ("x" * 201, "at most 200 characters, got 201"),
    # issue 41 item 6: control characters (Unicode Cc), shown quoted
    ("a\x00", r"'a\x00' contains the control character U+0000 at index 1"),
    ("\x00", r"'\x00' contains the control character U+0000 at index 0"),
    ("\x1b[31mred\x1b[0m", r"'\x1b[31mred\x1b[0m' contains the control character U+001B at index 0"),
    ("new\nline", r"'new\nline' contains the control character U+000A at index 3"),
    ("tab\t", "U+0009 at index 3"),
    ("del\x7f", "U+007F at index 3"),
    ("c1\x85", "U+0085 at index 2"),
])
def test_bad_group_is_refused_naming_line_and_question(tmp_path, value, message):
    def mutate(recs):
        recs[1]["group"] = value
    p = _lines(tmp_path, mutate)
    with pytest.raises(CacheError) as e:
        read_jsonl(p)
    assert f"{p}:3: group:" in str(e.value) and message in str(e.value) and "s2-q1'" in str(e.value)


def test_printable_unicode_and_markdown_characters_are_group_names(tmp_path):
    names = ["Ünïcode 数学", "a|b", "*x* `y` <z>", "a b"]

    def mutate(recs):
        for r, n in zip(recs, names):
            r["group"] = n
    assert read_jsonl(_lines(tmp_path, mutate)).arrays["group"].tolist() == names[:3]


def test_a_group_differing_only_by_nul_is_refused_by_check_import_and_export_alike(tmp_path):
    """Issue 41 item 6: "a" and "a\x00" were one group (NumPy drops trailing NULs); a "\x00" group
    passed `data check` but `data import` / `data export` refused it as empty."""
    from tests.helpers import run_cli

    for bad in ("a\x00", "\x00"):
        def mutate(recs):
            recs[0]["group"], recs[1]["group"] = "a", bad
        p = _lines(tmp_path, mutate)
        lines = []
        for argv in (["data", "check", str(p)], ["data", "import", "--format", "jsonl", str(p), "--out",
                     str(tmp_path / "f")], ["data", "export", str(p), "--out", str(tmp_path / "e.jsonl")]):
            r = run_cli(argv)
            err = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert r.returncode == 2 and len(err) == 1, (argv, r.returncode, r.stderr)
            lines.append(err[0])
        assert lines[0] == lines[1] == lines[2] and f"{p}:3: group: {bad!r} contains the control character" \
            in lines[0], lines
        assert not (tmp_path / "f").exists() and not (tmp_path / "e.jsonl").exists()


def test_fast_format_refuses_control_characters_on_save_and_load(tmp_path):
    from envs.cache.fast import write_fast_dir

    c = generate(n_questions=3, seed=2)
    bad = _with_groups(c, ["a", "b\x1bc", "c"])
    with pytest.raises(CacheError, match=r"fast \(not written\): question '\S+-q1': group: 'b\\x1bc' contains the "
                                         r"control character U\+001B"):
        save_fast(bad, tmp_path / "fast")
    assert not (tmp_path / "fast").exists()
    # a fast cache written before the rule (no check on the way out) is refused on load
    write_fast_dir(tmp_path / "old", bad.manifest.to_dict(), bad.arrays)
    with pytest.raises(CacheError, match=r"arrays.npz: question '\S+-q1': group: 'b\\x1bc' contains"):
        load_fast(tmp_path / "old")


def test_importers_refuse_a_control_character_before_numpy_drops_it():
    from envs.importers import Side, build_cache
    from envs.cache.schema import ModelInfo

    side = Side("x", True, 1, 1)
    kw = dict(name="t", task="t", base=ModelInfo("b", 0.0, 0.0), guide=ModelInfo("g", 1.0, 1.0),
              provenance={"kind": "real", "source": "test"}, question_ids=["q0", "q1"], gold=["x", "x"],
              rounds=[[(side, side)], [(side, side)]], T=1)
    assert build_cache(**kw, groups=["a", "b"]).arrays["group"].tolist() == ["a", "b"]
    with pytest.raises(CacheError, match=r"^t: question 'q1': group: 'a\\x00' contains the control character U\+0000"):
        build_cache(**kw, groups=["a", "a\x00"])


def test_some_questions_without_a_group_are_refused(tmp_path):
    def mutate(recs):
        del recs[2]["group"]
    p = _lines(tmp_path, mutate)
    with pytest.raises(CacheError, match=r":4: group: question '\S+-q2' has no group"):
        read_jsonl(p)


def test_group_of_200_characters_is_accepted(tmp_path):
    def mutate(recs):
        recs[0]["group"] = "y" * 200
    assert read_jsonl(_lines(tmp_path, mutate)).arrays["group"][0] == "y" * 200


def test_collect_questions_file_group_column(tmp_path):
    from ccpo_jax.errors import UserError
    from ccpo_jax.llm.questions import load_questions

    p = tmp_path / "q.csv"
    p.write_text("id,question,gold,group\n1,What?,alpha,physics\n2,Why?,beta,law\n")
    qs, _ = load_questions(p)
    assert [q.group for q in qs] == ["physics", "law"]
    p.write_text("id,question,gold,group\n1,What?,alpha,physics\n2,Why?,beta,\n")
    with pytest.raises(UserError, match=r"q.csv:3: group: expected a non-empty string"):
        load_questions(p)
    p2 = tmp_path / "q.jsonl"
    p2.write_text('{"id": 1, "question": "What?", "gold": "alpha"}\n')
    assert load_questions(p2)[0][0].group is None
    # control characters are refused, even where stripping would have removed them
    p2.write_text('{"id": 1, "question": "What?", "gold": "alpha", "group": "a"}\n'
                  '{"id": 2, "question": "Why?", "gold": "beta", "group": "a\\u0000"}\n')
    with pytest.raises(UserError, match=r"q.jsonl:2: group: 'a\\x00' contains the control character U\+0000"):
        load_questions(p2)
    p.write_text("id,question,gold,group\n1,What?,alpha,ph\x1bysics\n")
    with pytest.raises(UserError, match=r"q.csv:2: group: 'ph\\x1bysics' contains the control character U\+001B"):
        load_questions(p)
    p.write_text("id,question,gold,group\n1,What?,alpha, physics \n")
    assert load_questions(p)[0][0].group == "physics"


needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="shared public data not present")


@needs_data
@pytest.mark.parametrize("fmt, src, expected", [
    ("routellm-gsm8k", "routellm/gsm8k", {"gsm8k": 1319}),
    ("uala-hotpotqa", "uala", {"bridge": 396, "comparison": 104}),
])
def test_importers_fill_groups(fmt, src, expected):
    from envs.importers import import_cache

    c = import_cache(fmt, DATA / src)
    names, counts = np.unique(c.arrays["group"], return_counts=True)
    assert dict(zip(names.tolist(), counts.tolist())) == expected


@needs_data
def test_mmlu_groups_are_the_57_subject_files():
    from envs.importers import import_cache

    c = import_cache("routellm-mmlu", DATA / "routellm/mmlu")
    g = c.arrays["group"]
    assert len(np.unique(g)) == 57 == len(list((DATA / "routellm/mmlu").glob("*.csv")))
    # the group is the subject of the question id (independent of the importer's grouping code)
    assert all(str(qid).split("/")[0] == str(s) for qid, s in zip(c.arrays["question_ids"], g))
