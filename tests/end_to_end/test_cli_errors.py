"""Malformed caches through the real CLI (docs/caches.md, "Validation"): a non-zero exit, one
``error:`` line naming the file, line and field, no traceback, and no output (nor temporary
leftovers) beside the requested output path.

The CLI runs in-process (``ccpo_jax.cli.main`` with stdout and stderr captured: an escaping
exception would fail the test, the in-process form of a traceback); one case per command
runs through ``python -m ccpo_jax.cli`` in a subprocess, the way a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.helpers import REPO, run_cli


MANIFEST = {
    "name": "cli", "task": "hotpotqa", "T": 2,
    "models": {"base": {"name": "small", "price_in": 0.0, "price_out": 0.0},
               "guide": {"name": "big", "price_in": 2.5, "price_out": 10.0}},
    "provenance": {"kind": "real", "source": "test", "license": "CC0"},
}


def _round(**over):
    r = {"base": {"answer": "Paris", "correct": True, "tokens_in": 100, "tokens_out": 5, "confidence": 0.7},
         "guide": {"verdict": True, "answer": "Paris", "correct": True, "tokens_in": 80, "tokens_out": 3,
                   "uncertainty": 0.2}}
    for path, value in over.items():
        role, key = path.split("__")
        if value is _DROP:
            del r[role][key]
        else:
            r[role][key] = value
    return r


_DROP = object()


def _q(qid="q-1", rounds=None, **extra):
    return {"id": qid, "gold": "Paris", "rounds": [_round()] if rounds is None else rounds, **extra}


def _lines(*records, manifest=MANIFEST) -> str:
    out = [json.dumps({"manifest": manifest})] if manifest is not None else []
    out += [r if isinstance(r, str) else json.dumps(r) for r in records]
    return "\n".join(out) + "\n"


GOOD = _q("q-0")

# name -> (file text, substrings the error line must hold). The file is data.jsonl.
CASES = {
    "truncated_json": (_lines(GOOD, json.dumps(_q())[:-25]), ["data.jsonl:3:", "not valid JSON"]),
    "non_object_line": (_lines(GOOD, "[1, 2, 3]"), ["data.jsonl:3:", "expected a JSON object, got array"]),
    "missing_correct": (_lines(GOOD, _q(rounds=[_round(base__correct=_DROP)])),
                        ["data.jsonl:3:", "rounds[0].base.correct", "missing"]),
    "string_tokens": (_lines(GOOD, _q(rounds=[_round(guide__tokens_in="88")])),
                      ["data.jsonl:3:", "rounds[0].guide.tokens_in", "got string"]),
    "nan_tokens": (_lines(GOOD, json.dumps(_q(rounds=[_round(base__tokens_out=7)])).replace(
        '"tokens_out": 7', '"tokens_out": NaN')), ["data.jsonl:3:", "rounds[0].base.tokens_out", "NaN"]),
    "negative_tokens": (_lines(GOOD, _q(rounds=[_round(), _round(guide__tokens_in=-3)])),
                        ["data.jsonl:3:", "rounds[1].guide.tokens_in", "got -3"]),
    "absurd_tokens": (_lines(_q(rounds=[_round(base__tokens_in=2e9)])),
                      ["data.jsonl:2:", "rounds[0].base.tokens_in", "<= 1e+07"]),
    "huge_integer_tokens": (_lines(json.dumps(_q()).replace('"tokens_in": 100', '"tokens_in": 1' + '0' * 400)),
                            ["data.jsonl:2:", "rounds[0].base.tokens_in", "<= 1e+07"]),
    "too_many_rounds": (_lines(GOOD, _q(rounds=[_round()] * 3)),
                        ["data.jsonl:3:", "rounds", "3 rounds, more than the manifest's T = 2"]),
    "zero_rounds": (_lines(GOOD, _q(rounds=[])), ["data.jsonl:3:", "rounds", "at least one round"]),
    "duplicate_id": (_lines(GOOD, _q("q-5"), _q("q-5")), ["data.jsonl:4:", "id", "duplicate", "line 3"]),
    "empty_file": ("", ["data.jsonl", "empty file"]),
    "blank_lines_only": ("\n  \n\n", ["data.jsonl", "empty file"]),
    "negative_price": (_lines(GOOD, manifest={**MANIFEST, "models": {
        "base": {"name": "small", "price_in": -1.0}, "guide": {"name": "big"}}}),
        ["data.jsonl:1:", "manifest.models.base.price_in", ">= 0"]),
    "unknown_provenance": (_lines(GOOD, manifest={**MANIFEST, "provenance": {"kind": "made-up"}}),
                           ["data.jsonl:1:", "manifest.provenance.kind", "made-up"]),
    "bad_T": (_lines(GOOD, manifest={**MANIFEST, "T": 0}), ["data.jsonl:1:", "manifest.T"]),
    "missing_models": (_lines(GOOD, manifest={k: v for k, v in MANIFEST.items() if k != "models"}),
                       ["data.jsonl:1:", "manifest.models", "missing"]),
    "uncertainty_above_1": (_lines(GOOD, _q(rounds=[_round(guide__uncertainty=1.5)])),
                            ["data.jsonl:3:", "rounds[0].guide.uncertainty", "[0, 1]", "1.5"]),
    "infinite_confidence": (_lines(json.dumps(_q()).replace('"confidence": 0.7', '"confidence": -Infinity')),
                            ["data.jsonl:2:", "rounds[0].base.confidence", "-Infinity"]),
    "correct_contradicts_gold": (_lines(GOOD, _q(rounds=[_round(base__answer="Lyon", base__correct=False,
                                                                    guide__answer="the paris!", guide__correct=False)])),
                                 ["data.jsonl:3:", "rounds[0].guide.correct", "gold"]),
    "correct_contradicts_same_answer": (_lines(_q(rounds=[_round(), _round(base__answer="Lyon", base__correct=False,
                                                                           guide__answer="lyon.", guide__correct=True)])),
                                        ["data.jsonl:2:", "rounds[1].guide.correct", "contradicts rounds[1].base.correct"]),
    "bad_llm_policy_action": (_lines(_q(baselines={"llm_policy": {"big": [7]}})),
                              ["data.jsonl:2:", "baselines.llm_policy.big[0]", "got 7"]),
    "mistyped_verdict": (_lines(_q(rounds=[_round(guide__verdict="yes")])),
                         ["data.jsonl:2:", "rounds[0].guide.verdict", "expected true or false"]),
    "manifest_not_first": (_lines(GOOD, {"manifest": MANIFEST}, manifest=None),
                           ["data.jsonl:2:", "manifest", "first line"]),
    "not_utf8": (None, ["data.jsonl:3:", "not UTF-8"]),
}

JSONL_OUT_CASES = {"truncated_json", "nan_tokens", "duplicate_id", "negative_price", "empty_file"}


def _cli(*args: str, in_subprocess: bool = False) -> subprocess.CompletedProcess:
    """``ccpo-jax data ARGS``: in-process (default) or through a real subprocess (tests.helpers.run_cli)."""
    return run_cli(["data", *args], cwd=REPO if in_subprocess else None, in_subprocess=in_subprocess)


SUBPROCESS_CASES = {"truncated_json"}  # also through `python -m ccpo_jax.cli` (check and import)


def _assert_user_error(res: subprocess.CompletedProcess, needles: list[str]) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert res.stdout == ""


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_jsonl_check_and_import(tmp_path, name):
    text, needles = CASES[name]
    src_dir, out_dir = tmp_path / "in", tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    src = src_dir / "data.jsonl"
    if text is None:  # a Latin-1 byte on line 2
        src.write_bytes(_lines(GOOD).encode() + b'{"id": "caf\xe9"}\n')
    else:
        src.write_text(text)
    sub = name in SUBPROCESS_CASES
    _assert_user_error(_cli("check", str(src), in_subprocess=sub), needles)
    # fast-format output for every case; JSONL output for a few (same reader, keeps the suite fast)
    outs = [out_dir / "cache"] + ([out_dir / "cache.jsonl"] if name in JSONL_OUT_CASES else [])
    for out in outs:
        _assert_user_error(_cli("import", "--format", "jsonl", str(src), "--out", str(out), in_subprocess=sub), needles)
        assert os.listdir(out_dir) == [], os.listdir(out_dir)  # no output, no temp leftovers
    assert os.listdir(src_dir) == ["data.jsonl"]


@pytest.fixture()
def fast_cache(tmp_path) -> Path:
    src = tmp_path / "good.jsonl"
    src.write_text(_lines(GOOD, _q("q-1", rounds=[_round(), _round()])))
    res = _cli("import", "--format", "jsonl", str(src), "--out", str(tmp_path / "fast"))
    assert res.returncode == 0, res.stderr
    return tmp_path / "fast"


def _export_fails(fast: Path, needles: list[str], in_subprocess: bool = False) -> None:
    out_dir = fast.parent / "exported"
    out_dir.mkdir()
    _assert_user_error(_cli("check", str(fast)), needles)
    _assert_user_error(_cli("export", str(fast), "--out", str(out_dir / "x.jsonl"), in_subprocess=in_subprocess), needles)
    assert os.listdir(out_dir) == []


def test_tampered_arrays_checksum(fast_cache):
    with np.load(fast_cache / "arrays.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["guide_tokens_in"][0, 0] += 1
    np.savez_compressed(fast_cache / "arrays.npz", **arrays)
    _export_fails(fast_cache, [str(fast_cache / "arrays.npz"), "checksum mismatch"], in_subprocess=True)


def test_tampered_manifest_checksum(fast_cache):
    man = json.loads((fast_cache / "manifest.json").read_text())
    man["checksum"] = "sha256:" + "f" * 64
    (fast_cache / "manifest.json").write_text(json.dumps(man))
    _export_fails(fast_cache, ["arrays.npz", "checksum mismatch"])


def test_truncated_manifest_json(fast_cache):
    text = (fast_cache / "manifest.json").read_text()
    (fast_cache / "manifest.json").write_text(text[: len(text) // 2])
    _export_fails(fast_cache, [str(fast_cache / "manifest.json"), "not valid JSON"])


def test_missing_arrays_npz(fast_cache):
    (fast_cache / "arrays.npz").unlink()
    _export_fails(fast_cache, [str(fast_cache), "missing arrays.npz"])


def test_damaged_arrays_npz(fast_cache):
    (fast_cache / "arrays.npz").write_bytes(b"not a zip file")
    _export_fails(fast_cache, ["arrays.npz", "cannot read arrays"])


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    _assert_user_error(_cli("check", str(missing)), [str(missing), "no such file"])
    _assert_user_error(_cli("import", "--format", "jsonl", str(missing), "--out", str(tmp_path / "o")),
                       [str(missing), "no such file"])
    _assert_user_error(_cli("export", str(tmp_path / "nodir"), "--out", str(tmp_path / "o.jsonl")),
                       ["nodir", "no such file"])
    assert os.listdir(tmp_path) == []


def test_import_refuses_to_overwrite_a_non_cache_directory(tmp_path):
    src = tmp_path / "good.jsonl"
    src.write_text(_lines(GOOD))
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    _assert_user_error(_cli("import", "--format", "jsonl", str(src), "--out", str(tmp_path / "project")),
                       ["project", "not a fast-format cache"])
    assert os.listdir(tmp_path / "project") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl", "project"]


def test_good_cache_check_import_export(tmp_path):
    """The happy path through the CLI, so the error tests above cannot pass by always failing."""
    src = tmp_path / "good.jsonl"
    src.write_text(_lines(GOOD, _q("q-1", rounds=[_round(), _round(base__answer="Lyon", base__correct=False)])))
    res = _cli("check", str(src), in_subprocess=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "questions:   2" in res.stdout and "checksum:    sha256:" in res.stdout
    assert _cli("import", "--format", "jsonl", str(src), "--out", str(tmp_path / "fast")).returncode == 0
    assert _cli("export", str(tmp_path / "fast"), "--out", str(tmp_path / "back.jsonl")).returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["back.jsonl", "fast", "good.jsonl"]
    check_fast = _cli("check", str(tmp_path / "fast"))
    check_back = _cli("check", str(tmp_path / "back.jsonl"))
    checksum = [ln for ln in res.stdout.splitlines() if ln.startswith("checksum")]
    assert checksum and all(checksum[0] in r.stdout for r in (check_fast, check_back))


def test_a_closed_stdout_pipe_ends_quietly(tmp_path):
    """`ccpo-jax data check FILE | head`: the reader goes away; no BrokenPipeError traceback."""
    from envs.cache.jsonl import write_jsonl
    from envs.generators.synthetic import generate

    path = write_jsonl(generate("hotpotqa-llama2", n_questions=30, seed=0), tmp_path / "s.jsonl")
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # every write to stdout now fails with EPIPE, as after `head` has exited
    try:
        p = subprocess.run([sys.executable, "-m", "ccpo_jax.cli", "data", "check", str(path)],
                           stdout=w_fd, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w_fd)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def test_unterminated_string_message_reads_once_at(tmp_path):
    from envs.cache.schema import CacheError
    from envs.cache.jsonl import read_jsonl

    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "q1", "gold": "unterminated\n', encoding="utf-8")
    with pytest.raises(CacheError) as e:
        read_jsonl(p)
    assert "Unterminated string starting at column 22" in str(e.value) and "at at" not in str(e.value)
