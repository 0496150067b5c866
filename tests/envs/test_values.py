"""One validation of a cache's values for every format (issue 27, envs/cache/values.py).

Each bad value is written twice, by hand: as a JSONL line and as a fast-format directory
whose checksums are recomputed (the way docs/integrity.md documents), so only the value
rules can refuse it. Both readers must refuse with the same ``FIELD: problem`` text; the
expected text is written out here, not taken from the code. The writers (``write_jsonl``,
``save_fast``) refuse the same in-memory cache, and ``data export`` / ``data check`` print one
``error:`` line with exit status 2.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

from envs.cache.fast import ARRAYS_FILE, MANIFEST_FILE, load_fast, save_fast, write_fast_dir
from envs.cache.schema import CacheError, arrays_checksum, manifest_checksum
from envs.cache.jsonl import read_jsonl, write_jsonl
from tests.helpers import run_cli

MANIFEST = {
    "name": "v", "task": "hotpotqa", "T": 2,
    "models": {"base": {"name": "small", "price_in": 0.1, "price_out": 0.2},
               "guide": {"name": "big", "price_in": 2.5, "price_out": 10.0}},
    "provenance": {"kind": "real", "source": "hand-written", "license": "CC0"},
}


def _r(answer, correct, tin=10, tout=2):
    return {"answer": answer, "correct": correct, "tokens_in": tin, "tokens_out": tout}


def _questions():
    return [
        {"id": "q-1", "gold": "Paris",
         "rounds": [{"base": _r("Lyon", False), "guide": dict(_r("Paris", True), verdict=False)}],
         "baselines": {"exit": {"big": {"correct": True, "rounds": 1, "cost_cents": 0.5}},
                       "llm_policy": {"big": [1]}}},
        {"id": "q-2",
         "rounds": [{"base": _r("a", False), "guide": dict(_r("b", False), verdict=True)},
                    {"base": _r("c", True), "guide": dict(_r("c", True), verdict=True)}],
         "baselines": {"exit": {"big": {"correct": False, "rounds": 2, "cost_cents": 1.0}},
                       "llm_policy": {"big": [2, 0]}}},
    ]


def _write_jsonl(path: Path, manifest: dict, questions: list) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in [{"manifest": manifest}, *questions]) + "\n")
    return path


def _write_fast_rehashed(path: Path, mdict: dict, arrays: dict) -> Path:
    """A fast-format directory with both checksums recomputed over whatever it holds."""
    asum = arrays_checksum(arrays)
    fields = {k: v for k, v in mdict.items() if k not in ("checksum", "arrays_checksum")}
    mdict = dict(mdict, arrays_checksum=asum, checksum=manifest_checksum(asum, fields))
    return write_fast_dir(path, mdict, arrays)


# Each case: (what, JSONL edit of (manifest, questions), fast edit of (manifest dict, arrays),
#             location in the JSONL message, location in the fast message, the shared FIELD: problem).
CASES = [
    ("exit rounds -5",
     lambda m, q: q[1]["baselines"]["exit"]["big"].update(rounds=-5),
     lambda m, a: a["exit_rounds"].__setitem__((1, 0), -5),
     "3", "question 'q-2'", "baselines.exit.big.rounds: expected an integer in [1, 2], got -5"),
    ("exit cost -1e30",
     lambda m, q: q[0]["baselines"]["exit"]["big"].update(cost_cents=-1e30),
     lambda m, a: a["exit_cost_cents"].__setitem__((0, 0), -1e30),
     "2", "question 'q-1'", "baselines.exit.big.cost_cents: expected a number >= 0 and <= 1e+09, got -1e+30"),
    ("exit cost 3e38",
     lambda m, q: q[0]["baselines"]["exit"]["big"].update(cost_cents=3e38),
     lambda m, a: a["exit_cost_cents"].__setitem__((0, 0), 3e38),
     "2", "question 'q-1'", "baselines.exit.big.cost_cents: expected a number >= 0 and <= 1e+09, got 3e+38"),
    ("llm policy action 7",
     lambda m, q: q[0]["baselines"]["llm_policy"].update(big=[7]),
     lambda m, a: a["llm_policy_actions"].__setitem__((0, 0, 0), 7),
     "2", "question 'q-1'",
     "baselines.llm_policy.big[0]: expected an action 0 (base), 1 (guide) or 2 (next), got 7"),
    ("llm policy answers early",
     lambda m, q: q[1]["baselines"]["llm_policy"].update(big=[1, 0]),
     lambda m, a: a["llm_policy_actions"].__setitem__((1, 0, 0), 1),
     "3", "question 'q-2'",
     "baselines.llm_policy.big[0]: action 1 answers and ends the episode, but more actions follow"),
    ("tokens 1e12",
     lambda m, q: q[1]["rounds"][1]["guide"].update(tokens_out=10**12),
     lambda m, a: a["guide_tokens_out"].__setitem__((1, 1), 1e12),
     "3", "question 'q-2'", "rounds[1].guide.tokens_out: expected a number >= 0 and <= 1e+07, got 1000000000000"),
    ("negative tokens",
     lambda m, q: q[0]["rounds"][0]["base"].update(tokens_in=-3),
     lambda m, a: a["base_tokens_in"].__setitem__((0, 0), -3),
     "2", "question 'q-1'", "rounds[0].base.tokens_in: expected a number >= 0 and <= 1e+07, got -3"),
    ("confidence 1.5",
     lambda m, q: q[0]["rounds"][0]["base"].update(confidence=1.5),
     lambda m, a: a["base_confidence"].__setitem__((0, 0), 1.5),
     "2", "question 'q-1'", "rounds[0].base.confidence: expected a number in [0, 1] or null, got 1.5"),
    ("contradicting flags",
     lambda m, q: q[1]["rounds"][1]["guide"].update(correct=False),
     lambda m, a: a["guide_correct"].__setitem__((1, 1), False),
     "3", "question 'q-2'",
     "rounds[1].guide.correct: false contradicts rounds[1].base.correct = true for the same normalised answer 'c'"),
    ("lone surrogate in gold",
     lambda m, q: q[0].update(gold="Par\ud800is"),
     lambda m, a: a.__setitem__("gold", np.array(["Par\ud800is", ""])),
     "2", "question 'q-1'", "gold: holds a lone surrogate U+D800 at character 3 (not Unicode text)"),
    ("guide price 1e300",
     lambda m, q: m["models"]["guide"].update(price_out=1e300),
     lambda m, a: m["models"]["guide"].update(price_out=1e300),
     "1", None,
     "manifest.models.guide.price_out: expected a number >= 0 and <= 1e+05 (USD per million tokens), got 1e+300"),
    ("exit_models a string",
     lambda m, q: m.update(exit_models="big"),
     lambda m, a: m.update(exit_models="big"),
     "1", None, 'manifest.exit_models: expected an array of model names, got string "big"'),
    ("exit_models a number",
     lambda m, q: m.update(exit_models=5),
     lambda m, a: m.update(exit_models=5),
     "1", None, "manifest.exit_models: expected an array of model names, got number 5"),
]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    cache = read_jsonl(_write_jsonl(d / "good.jsonl", MANIFEST, _questions()))
    save_fast(cache, d / "fast")
    return cache


def _bad_fast(tmp_path, good, fast_edit) -> Path:
    mdict = copy.deepcopy(good.manifest.to_dict())
    arrays = {k: v.copy() for k, v in good.arrays.items()}
    fast_edit(mdict, arrays)
    return _write_fast_rehashed(tmp_path / "fast", mdict, arrays)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_both_formats_refuse_a_bad_value_alike(tmp_path, good, case):
    _, jsonl_edit, fast_edit, line, question, problem = case
    m, q = copy.deepcopy(MANIFEST), _questions()
    jsonl_edit(m, q)
    src = _write_jsonl(tmp_path / "bad.jsonl", m, q)
    with pytest.raises(CacheError) as e:
        read_jsonl(src)
    assert str(e.value) == f"{src}:{line}: {problem}"

    fast = _bad_fast(tmp_path, good, fast_edit)
    with pytest.raises(CacheError) as e:
        load_fast(fast)
    where = f"{fast / ARRAYS_FILE}: {question}" if question else f"{fast / MANIFEST_FILE}"
    assert str(e.value) == f"{where}: {problem}"


@pytest.mark.parametrize("case", [c for c in CASES if c[4] is not None], ids=[c[0] for c in CASES if c[4]])
def test_writers_refuse_what_the_readers_refuse(tmp_path, good, case):
    """``write_jsonl`` (data export, data collect) and ``save_fast`` check before writing; nothing is left."""
    _, _, fast_edit, _, question, problem = case
    arrays = {k: v.copy() for k, v in good.arrays.items()}
    fast_edit({}, arrays)
    from envs.cache.schema import ResponseCache

    bad = ResponseCache(good.manifest, arrays)
    for write, out in ((write_jsonl, tmp_path / "o.jsonl"), (save_fast, tmp_path / "o")):
        with pytest.raises(CacheError) as e:
            write(bad, out)
        assert str(e.value) == f"{out} (not written): {question}: {problem}"
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_data_check_and_export_give_one_error_line(tmp_path, good):
    """The issue's probe: a rehashed fast cache with ``exit_rounds = -5`` used to print a table with
    EXIT Avg. Len. -5.0, and ``data export`` wrote a JSONL file that ``data check`` then refused."""
    fast = _bad_fast(tmp_path, good, CASES[0][2])
    out = tmp_path / "e.jsonl"
    for argv, sub in ((["data", "check", str(fast)], False), (["data", "export", str(fast), "--out", str(out)], True)):
        r = run_cli(argv, in_subprocess=sub)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"error: {fast / ARRAYS_FILE}: question 'q-2': baselines.exit.big.rounds: expected an integer in [1, 2], got -5"]
    assert not out.exists()


def test_lone_surrogate_anywhere_in_a_line_is_refused_before_export(tmp_path):
    """A JSONL cache with ``"\\ud800"`` passed ``data check`` and ``data export`` raised UnicodeEncodeError.
    An escaped backslash (``"\\\\ud800"``, six characters of text) is fine."""
    q = _questions()
    src = tmp_path / "s.jsonl"
    text = _write_jsonl(src, MANIFEST, q).read_text()
    src.write_text(text.replace('"answer": "Lyon"', '"answer": "Ly\\ud800on"', 1))
    r = run_cli(["data", "export", str(src), "--out", str(tmp_path / "o.jsonl")])
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: {src}:2: rounds[0].base.answer: holds a lone surrogate U+D800 at "
                                "character 2 (not Unicode text)")
    src.write_text(text.replace('"answer": "Lyon"', '"answer": "Ly\\\\ud800on"', 1).replace(
        '"manifest": {', '"manifest": {"note": "\\ud83d\\ude00", ', 1))  # a valid pair is text
    assert read_jsonl(src).n_questions == 2
    m = dict(MANIFEST, provenance=dict(MANIFEST["provenance"], source="x\udfffy"))
    with pytest.raises(CacheError, match=r"s.jsonl:1: manifest.provenance.source: holds a lone surrogate U\+DFFF"):
        read_jsonl(_write_jsonl(src, m, q))


def test_the_good_cache_passes_every_path(tmp_path, good):
    """The rules refuse nothing the format allows: the hand-written cache round-trips."""
    out = write_jsonl(good, tmp_path / "g.jsonl")
    again = read_jsonl(out)
    assert again.manifest.checksum == good.manifest.checksum
    assert load_fast(save_fast(again, tmp_path / "g")).manifest.checksum == good.manifest.checksum


def test_the_largest_allowed_values_stay_finite_without_warnings(tmp_path, good):
    """At every bound at once (1e7 tokens per call, 1e5 USD per million tokens, 1e9 cents per EXIT
    run), ``data check`` computes finite costs with no NumPy overflow warning (a guide price of
    1e300 used to print overflow warnings and 'inf cents'). Hand oracle: a round costs
    4 x 1e7 x 1e5 / 1e6 x 100 = 4e8 cents."""
    import warnings

    from envs.replay.report import describe

    mdict = copy.deepcopy(good.manifest.to_dict())
    for role in ("base", "guide"):
        mdict["models"][role].update(price_in=1e5, price_out=1e5)
    arrays = {k: v.copy() for k, v in good.arrays.items()}
    for k in ("base_tokens_in", "base_tokens_out", "guide_tokens_in", "guide_tokens_out"):
        arrays[k][arrays["round_mask"]] = 1e7
    arrays["exit_cost_cents"][arrays["exit_mask"]] = 1e9
    fast = _write_fast_rehashed(tmp_path / "max", mdict, arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = load_fast(fast)
        np.testing.assert_array_equal(cache.round_cost_cents()[cache.round_mask], np.float32(4e8))
        text = describe(cache, source=str(fast))
    assert not re.search(r"\b(inf|nan)\b", text.lower()), text


def test_a_line_over_the_limit_is_refused_before_it_is_parsed(tmp_path):
    """Issue 27 item 10: a 266 MB line took 1.7 GB and 49 s; the reader now reads at most
    MAX_LINE_BYTES + 1 bytes of a line and stops there (the file is streamed line by line)."""
    from envs.cache.jsonl import MAX_LINE_BYTES

    src = _write_jsonl(tmp_path / "long.jsonl", MANIFEST, _questions())
    with open(src, "a") as f:
        f.write('{"id": "x", "pad": "' + "a" * MAX_LINE_BYTES + '"}\n')
    with pytest.raises(CacheError) as e:
        read_jsonl(src)
    assert str(e.value) == (f"{src}:4: line longer than 16 MiB (one question per line is a few kB; "
                            "is this a JSON Lines cache?)")
    r = run_cli(["data", "check", str(src)])
    assert r.returncode == 2 and r.stderr.strip() == f"error: {e.value}"


# -- guide-less cascades (ladders): every slot of the contradiction rule, every rung's price -----------

LADDER = {
    "name": "lad", "task": "qa", "T": 2,
    "models": {"base": [{"name": "small", "price_in": 0.1, "price_out": 0.2},
                        {"name": "big", "price_in": 1.0, "price_out": 2.0}], "guide": None},
    "provenance": {"kind": "real", "source": "hand-written", "license": "CC0"},
}


def _ladder_questions():
    return [{"id": "q-1", "rounds": [{"base": _r("Paris", True)}, {"base": _r("Lyon", False)}]},
            {"id": "q-2", "rounds": [{"base": _r("a", False)}, {"base": _r("b", True)}]}]


LADDER_CASES = [
    # Issue 48 item 9: the vectorised rule stopped at a cascade's first guide slot (no answer, id -1), so
    # rung 2 repeating rung 1's answer with the other flag passed the fast reader and the writers.
    ("rungs contradict",
     lambda m, q: q[0]["rounds"][1]["base"].update(answer="paris"),
     lambda m, a: a["base_answer"].__setitem__((0, 1), 0),
     "2", "question 'q-1'",
     "rounds[1].base.correct: false contradicts rounds[0].base.correct = true for the same normalised answer 'paris'"),
    # Issue 48 item 10: only the first rung's price was checked on write; every reader refused rung 2's.
    ("rung 2 price 1e7",
     lambda m, q: m["models"]["base"][1].update(price_in=1e7),
     lambda m, a: m["models"]["base"][1].update(price_in=1e7),
     "1", None,
     "manifest.models.base[1].price_in: expected a number >= 0 and <= 1e+05 (USD per million tokens), got 10000000.0"),
]


@pytest.fixture(scope="module")
def good_ladder(tmp_path_factory):
    return read_jsonl(_write_jsonl(tmp_path_factory.mktemp("lad") / "lad.jsonl", LADDER, _ladder_questions()))


@pytest.mark.parametrize("case", LADDER_CASES, ids=[c[0] for c in LADDER_CASES])
def test_a_ladder_is_refused_alike_by_both_readers_and_both_writers(tmp_path, good_ladder, case):
    """The hand-written ladder edited as a JSONL file, as a rehashed fast directory and in memory: the
    readers and the writers (``data import``, ``data export``) give the same ``FIELD: problem``."""
    import dataclasses

    from envs.cache.schema import ModelInfo, ResponseCache

    _, jsonl_edit, fast_edit, line, question, problem = case
    m, q = copy.deepcopy(LADDER), _ladder_questions()
    jsonl_edit(m, q)
    src = _write_jsonl(tmp_path / "bad.jsonl", m, q)
    with pytest.raises(CacheError) as e:
        read_jsonl(src)
    assert str(e.value) == f"{src}:{line}: {problem}"

    mdict = copy.deepcopy(good_ladder.manifest.to_dict())
    arrays = {k: v.copy() for k, v in good_ladder.arrays.items()}
    fast_edit(mdict, arrays)
    fast = _write_fast_rehashed(tmp_path / "fast", mdict, arrays)
    with pytest.raises(CacheError) as e:
        load_fast(fast)
    where = f"{fast / ARRAYS_FILE}: {question}" if question else f"{fast / MANIFEST_FILE}"
    assert str(e.value) == f"{where}: {problem}"

    rungs = tuple(ModelInfo(**r) for r in mdict["models"]["base"])  # past the manifest reader's own check
    bad = ResponseCache(dataclasses.replace(good_ladder.manifest, base=rungs[0], base_ladder=rungs), arrays)
    for write, out in ((write_jsonl, tmp_path / "o.jsonl"), (save_fast, tmp_path / "o")):
        with pytest.raises(CacheError) as e:
            write(bad, out)
        assert str(e.value) == f"{out} (not written): {question + ': ' if question else ''}{problem}"
        assert not out.exists()
