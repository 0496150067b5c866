"""``data collect`` of a guide-less cascade (``--guide none``) and of a ladder given as a file
(``--ladder FILE``), issue 37 item 4.

Oracles: the scripted server's own record of each request (which model, which prompt), its
script (rung k answers the question alone with the script's round-k answer: ``rung_of``), the
call log's tokens times the rung's prices, the cache reader, and the sha256 of the file the
repeated flags write.
"""
from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, write_questions
from tests.helpers import run_cli

EPOCH = "1796083200"
SCRIPTS = make_scripts(10)
RUNGS = [(BASE_MODEL, 0.1, 0.2), ("mid-base", 1.0, 2.0), ("top-base", 3.0, 5.0)]
FLAG_PRICES = ["0.1,0.2", "1,2", "3,5"]  # RUNGS' prices as the flags write them


@pytest.fixture(autouse=True)
def _fixed_date(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


@pytest.fixture(scope="module")
def server():
    with FakeChatServer(SCRIPTS, served=[m for m, *_ in RUNGS] + [GUIDE_MODEL],
                        rung_of={m: t for t, (m, *_) in enumerate(RUNGS)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("q") / "questions.jsonl"
    write_questions(p, len(SCRIPTS))
    return p


def _args(server, questions_file, out, *extra, guide=("--guide", "none"), rungs=True):
    # (--base-max-tokens 16: the replies' 13 words fit, and a call's worst case, which the budget
    # reserves, is a small part of the run's cost)
    a = ["data", "collect", "--round-protocol", "paper", "--questions", str(questions_file), "--out", str(out), "--no-progress",
         "--base-max-tokens", "16", *guide]
    if rungs:
        a += ["--rounds", "3"]
        for (m, *_), p in zip(RUNGS, FLAG_PRICES):
            a += ["--base", f"{server.url},{m}", "--base-price", p]
    return a + list(extra)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _calls(out: Path) -> list[dict]:
    return [json.loads(x) for x in Path(str(out) + ".calls").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def cascade(server, questions_file, tmp_path_factory):
    """An uninterrupted 3-rung cascade: (its file, the CLI's result, the requests the server saw)."""
    out = tmp_path_factory.mktemp("cascade") / "cache.jsonl"
    n0, t0 = len(server.seen), len(server.asked)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        r = run_cli(_args(server, questions_file, out))
    assert r.returncode == 0, r.stderr
    # every rung is asked at the first round's temperature (0 by default; the gateway's rule too)
    assert {a["temperature"] for a in server.asked[t0:]} == {0.0}
    return out, r, server.seen[n0:]


def test_each_round_is_its_rung_alone_and_no_guide_is_called(cascade):
    from envs.cache.formats import load_cache

    out, r, seen = cascade
    # the server: per question, each rung asked once with the question alone, and nothing else
    asked = collections.Counter((m, msgs[0]["content"]) for m, msgs in seen)
    assert len(seen) == 3 * len(SCRIPTS) and set(asked.values()) == {1}
    assert all(len(msgs) == 1 and not msgs[0]["content"].startswith("Evaluate the answer.") for _, msgs in seen)
    assert {m for m, _ in seen} == {m for m, *_ in RUNGS}
    # the call log: round t's call named rung t's model and paid rung t's prices
    calls = [c for c in _calls(out) if "text" in c]
    assert sorted(c["call"] for c in calls) == sorted(f"r{t}.base" for t in range(3) for _ in SCRIPTS)
    for c in calls:
        m, p_in, p_out = RUNGS[int(c["call"][1])]
        assert c["model"] == m
        assert c["cost_usd"] == pytest.approx((c["tokens_in"] * p_in + c["tokens_out"] * p_out) / 1e6)
    # the budget meter counted these calls and nothing else
    paid = sum(c["cost_usd"] for c in calls)
    assert f"cost: ${paid:.6f} this run, ${paid:.6f} in total" in r.stdout
    # the cache: no guide anywhere, round t = rung t's scripted answer, at rung t's prices
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["manifest"]["models"]["guide"] is None
    for q, (text, s) in zip(lines[1:], SCRIPTS.items()):
        assert [list(rd) for rd in q["rounds"]] == [["base"]] * 3
        want = [s.base[min(t, len(s.base) - 1)] for t in range(3)]
        assert [rd["base"]["answer"] for rd in q["rounds"]] == ["" if s.no_answer_line and t == 0 else want[t]
                                                                for t in range(3)]
    cache = load_cache(out)
    assert not cache.manifest.has_guide
    assert [(m.name, m.price_in, m.price_out) for m in cache.manifest.base_ladder] == RUNGS
    a, cents = cache.arrays, cache.round_cost_cents()
    for t, (_, p_in, p_out) in enumerate(RUNGS):
        want = (a["base_tokens_in"][:, t] * p_in + a["base_tokens_out"][:, t] * p_out) / 1e4
        assert cents[:, t] == pytest.approx(want, rel=1e-5)
    assert cents.sum() / 100 == pytest.approx(paid, rel=1e-5)


def test_data_check_passes_on_the_collected_cascade(cascade):
    out, _, _ = cascade
    r = run_cli(["data", "check", str(out)])
    assert r.returncode == 0, r.stderr
    assert "guide model: none (a cascade" in r.stdout


def test_a_budget_stopped_cascade_resumes_to_the_same_bytes(server, questions_file, cascade, tmp_path):
    ref, _, _ = cascade
    paid = sum(c["cost_usd"] for c in _calls(ref) if "text" in c)
    out = tmp_path / "cache.jsonl"  # (the same name as the reference's: the manifest holds it)
    r = run_cli(_args(server, questions_file, out, "--max-cost-usd", f"{paid / 2:.6f}", "--concurrency", "2"))
    assert r.returncode == 3, r.stderr
    assert 0 < len(out.read_text().splitlines()) - 1 < len(SCRIPTS)
    n0 = len(server.seen)
    r = run_cli(_args(server, questions_file, out, "--resume", "--max-cost-usd", "1"))
    assert r.returncode == 0, r.stderr
    assert _sha(out) == _sha(ref)
    assert len(server.seen) - n0 < 3 * len(SCRIPTS)  # the calls paid before the stop were not sent again


def _ladder_file(server, path: Path, guide) -> Path:
    doc = {"rungs": [{"url": server.url, "model": m, "price_in": p_in, "price_out": p_out} for m, p_in, p_out in RUNGS]}
    if guide is not False:
        doc["guide"] = guide
    path.write_text(json.dumps(doc, indent=1))
    return path


@pytest.mark.parametrize("in_file", [False, True], ids=["guide-flag", "guide-in-file"])
@pytest.mark.parametrize("with_guide", [False, True], ids=["cascade", "guided"])
def test_a_ladder_file_writes_the_repeated_flags_cache_byte_for_byte(server, questions_file, cascade, tmp_path,
                                                                     with_guide, in_file):
    guide_flags = ("--guide", f"{server.url},{GUIDE_MODEL}", "--guide-price", "2.5,10") if with_guide else ("--guide", "none")
    guide_entry = {"url": server.url, "model": GUIDE_MODEL, "price_in": 2.5, "price_out": 10} if with_guide else None
    if with_guide:
        ref = tmp_path / "flags" / "cache.jsonl"
        assert run_cli(_args(server, questions_file, ref, guide=guide_flags)).returncode == 0
    else:
        ref = cascade[0]
    lad = _ladder_file(server, tmp_path / "ladder.json", guide_entry if in_file else False)
    out = tmp_path / "cache.jsonl"
    r = run_cli(_args(server, questions_file, out, "--ladder", str(lad), guide=() if in_file else guide_flags,
                      rungs=False))  # (no --rounds: the file's 3 rungs)
    assert r.returncode == 0, r.stderr
    assert _sha(out) == _sha(ref)


def _bad_rung(i: int, **change):
    def edit(doc):
        doc["rungs"][i].update(change)
        for k, v in change.items():
            if v is None:
                del doc["rungs"][i][k]
    return edit


@pytest.mark.parametrize("edit, match", [
    (_bad_rung(2, price_out=None), "ladder.json: rungs[2]: missing field 'price_out'"),
    (_bad_rung(1, price_in=-1), "ladder.json: rungs[1].price_in: expected a number >= 0 and <= 1e+05 (USD per million tokens), got -1"),
    (_bad_rung(1, price_in=1e7),  # issue 48 item 10: a rung price every cache reader refuses
     "ladder.json: rungs[1].price_in: expected a number >= 0 and <= 1e+05 (USD per million tokens), got 10000000.0"),
    (_bad_rung(0, price="1"), "ladder.json: rungs[0]: unknown field 'price' (the fields are url, model, price_in, price_out)"),
    (_bad_rung(0, url="ftp://x/v1"), "ladder.json: rungs[0]: 'ftp://x/v1' is not an http(s) URL"),
    (_bad_rung(1, model=""), "ladder.json: rungs[1].model: expected a non-empty string"),
    (lambda doc: doc.update(rungs=[]), "ladder.json: rungs: expected a list of the base models"),
    (lambda doc: doc.update(guide={"url": "http://127.0.0.1:1/v1", "model": "g"}),
     "ladder.json: guide: missing field 'price_in'"),
    ("not json", "ladder.json:1: not valid JSON"),
])
def test_a_malformed_ladder_file_is_one_error_naming_file_and_field(server, questions_file, tmp_path, edit, match):
    lad = _ladder_file(server, tmp_path / "ladder.json", None)
    if callable(edit):
        doc = json.loads(lad.read_text())
        edit(doc)
        lad.write_text(json.dumps(doc))
    else:
        lad.write_text(edit)
    out = tmp_path / "bad.jsonl"
    n0 = server.requests
    r = run_cli(_args(server, questions_file, out, "--ladder", str(lad), guide=(), rungs=False))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: --ladder {lad}"), r.stderr
    assert match in r.stderr, r.stderr
    assert not out.exists() and not Path(str(out) + ".calls").exists() and server.requests == n0



def test_a_ladder_file_and_a_different_rounds_count_name_the_file(server, questions_file, tmp_path):
    lad = _ladder_file(server, tmp_path / "ladder.json", None)  # 3 rungs
    out = tmp_path / "bad.jsonl"
    r = run_cli(_args(server, questions_file, out, "--ladder", str(lad), "--rounds", "2", guide=(), rungs=False))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --ladder {lad}: 3 rungs, but --rounds 2"), r.stderr  # not '--base', never given
    assert not out.exists()

MIXED = [
    ("ladder+base", "give the base models and their prices either in the file or as --base / --base-price, not both (--base given)"),
    ("ladder+base-price", "not both (--base-price given)"),
    ("ladder-guide+guide", "the file gives the guide (\"guide\": null); give it either there or as --guide / "
                           "--guide-price, not both (--guide given)"),
    ("no-guide", "error: --guide: missing; give --guide URL,MODEL, or --guide none for a guide-less cascade"),
    ("no-base", "error: --base: missing; give --base URL,MODEL"),
    ("none+guide-price", "error: --guide-price: --guide none: a guide-less cascade has no guide model"),
    ("none+policy", "error: --policy-baselines: the LLM-as-policy chooses between a base and a guide answer"),
    ("none+exit-guide", "error: --exit-baselines: guide: --guide none: a guide-less cascade has no guide model"),
    ("none+one-base", "error: --guide none: a guide-less cascade of one base model would ask it the same question "
                      "every round; give --base once per round"),
]


@pytest.mark.parametrize("case, match", MIXED, ids=[c for c, _ in MIXED])
def test_mixed_or_missing_flags_are_one_error_line(server, questions_file, tmp_path, case, match):
    out = tmp_path / "bad.jsonl"
    lad = _ladder_file(server, tmp_path / "ladder.json", None)
    base = ("--base", f"{server.url},{BASE_MODEL}")
    args = {
        "ladder+base": _args(server, questions_file, out, "--ladder", str(lad), *base, guide=(), rungs=False),
        "ladder+base-price": _args(server, questions_file, out, "--ladder", str(lad), "--base-price", "1,1", guide=(),
                                   rungs=False),
        "ladder-guide+guide": _args(server, questions_file, out, "--ladder", str(lad), rungs=False),
        "no-guide": _args(server, questions_file, out, guide=()),
        "no-base": _args(server, questions_file, out, rungs=False),
        "none+guide-price": _args(server, questions_file, out, "--guide-price", "1,1"),
        "none+policy": _args(server, questions_file, out, "--policy-baselines", "guide"),
        "none+exit-guide": _args(server, questions_file, out, "--exit-baselines", "guide"),
        "none+one-base": _args(server, questions_file, out, "--rounds", "3", *base, "--base-price", "0,0",
                               rungs=False),
    }[case]
    n0 = server.requests
    r = run_cli(args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert match in r.stderr, r.stderr
    assert not out.exists() and server.requests == n0


def test_the_process_exits_2_on_a_malformed_ladder_file(server, questions_file, tmp_path):
    lad = tmp_path / "ladder.json"
    lad.write_text(json.dumps({"rungs": [{"url": server.url, "model": BASE_MODEL, "price_in": 0}]}))
    out = tmp_path / "bad.jsonl"
    r = run_cli(_args(server, questions_file, out, "--ladder", str(lad), guide=("--guide", "none"), rungs=False),
                in_subprocess=True)
    assert r.returncode == 2 and r.stderr == f"error: --ladder {lad}: rungs[0]: missing field 'price_out'\n"
    assert not out.exists()
