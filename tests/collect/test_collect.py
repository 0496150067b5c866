"""``ccpo-jax data collect`` against a real local HTTP server (``ccpo_jax/testing/chat_server.py``, 127.0.0.1 only).

The server is deterministic (a reply is a function of the request), so every
run of the same collection must write the same file: the reference run's sha256
is what the runs with faults, a kill, a budget stop and a failure must end with.
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts
from ccpo_jax.cli.main import main
from ccpo_jax.llm import paper as P
from ccpo_jax.llm.wire import parse_completion, retry_after_s

N_QUESTIONS = 20
EPOCH = "1796083200"  # SOURCE_DATE_EPOCH: 2026-12-01, so the provenance dates do not depend on today
SCRIPTS = make_scripts(N_QUESTIONS)


@pytest.fixture(autouse=True)
def _fixed_date(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


@pytest.fixture(scope="module")
def server():
    with FakeChatServer(SCRIPTS) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_leftover_faults(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        left = [f for f in srv.faults if f[2] > 0]
        srv.faults.clear()
        srv.delay_s = 0.0
        assert not left, f"faults not consumed: {left}"


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("q") / "questions.jsonl"
    with open(p, "w") as f:
        for i, (q, s) in enumerate(SCRIPTS.items()):
            f.write(json.dumps({"id": f"q{i}", "question": q, "gold": s.gold}) + "\n")
    return p


def _args(server, questions_file, out, *extra):
    return ["data", "collect", "--round-protocol", "paper", "--questions", str(questions_file), "--base", f"{server.url},{BASE_MODEL}",
            "--guide", f"{server.url},{GUIDE_MODEL}", "--out", str(out), "--base-price", "0.5,1.5",
            "--guide-price", "2.5,10", "--exit-baselines", "base,guide", "--policy-baselines", "guide",
            "--no-progress", *extra]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _calls(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out.parent / (out.name + ".calls")).read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def reference(server, questions_file, tmp_path_factory):
    """An uninterrupted run: (cache path, sha256, requests it sent, USD it paid)."""
    os.environ["SOURCE_DATE_EPOCH"] = EPOCH
    out = tmp_path_factory.mktemp("ref") / "cache.jsonl"
    before = server.requests
    assert main(_args(server, questions_file, out)) == 0
    paid = sum(c.get("cost_usd", 0.0) for c in _calls(out))
    return out, _sha(out), server.requests - before, paid


# -- a normal run ------------------------------------------------------------------------------


def test_normal_run_writes_a_cache_that_data_check_reads(reference, capsys):
    from envs.cache.jsonl import read_jsonl

    out, sha, sent, paid = reference
    cache = read_jsonl(out)
    assert cache.n_questions == N_QUESTIONS and cache.T == 4
    man = cache.manifest
    assert (man.base.name, man.guide.name) == (BASE_MODEL, GUIDE_MODEL)
    assert (man.guide.price_in, man.guide.price_out) == (2.5, 10.0)
    assert man.exit_models == (BASE_MODEL, GUIDE_MODEL) and man.llm_policy_models == (GUIDE_MODEL,)
    prov = man.provenance
    assert prov["kind"] == "real" and prov["collected"] == {"started": "2026-12-01", "finished": "2026-12-01"}
    assert prov["endpoints"]["guide"]["url"].startswith("http://127.0.0.1:")
    assert set(prov["prompts_sha256"]) == set(P.PROMPTS) and "collector" in prov

    lines = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    assert [r["id"] for r in lines] == [f"q{i}" for i in range(N_QUESTIONS)]  # questions-file order
    calls = [c for c in _calls(out) if "text" in c]
    assert len(calls) == sent
    # tokens are the server's usage; cost = tokens x prices
    q0 = lines[0]["rounds"][0]
    first_base = next(c for c in calls if c["q"] == "q0" and c["call"] == "r0.base")
    assert (q0["base"]["tokens_in"], q0["base"]["tokens_out"]) == (first_base["tokens_in"], first_base["tokens_out"])
    assert first_base["cost_usd"] == pytest.approx((first_base["tokens_in"] * 0.5 + first_base["tokens_out"] * 1.5) / 1e6)
    assert all(c["latency_s"] > 0 for c in calls)
    # log-prob measures: the fake's verdict token "Yes" has logprob -0.35 -> uncertainty 1 - e^-0.35
    assert q0["guide"]["verdict"] is True and q0["guide"]["uncertainty"] == pytest.approx(1 - 2.718281828 ** -0.35, abs=1e-6)
    assert 0 < q0["base"]["confidence"] < 1
    # question 2: base wrong, guide says No [gold] -> guide answer correct
    r = lines[2]["rounds"][0]
    assert r["base"]["correct"] is False and r["guide"] == {**r["guide"], "verdict": False, "answer": "answer 2", "correct": True}
    # question 7: the guide's reply is not a verdict -> recorded as unreadable, not guessed
    g = lines[7]["rounds"][0]["guide"]
    assert g["verdict_parsed"] is False and g["raw"] == "Hmm, that is hard to tell."
    assert g["verdict"] is False and g["answer"] == "" and g["correct"] is False and "uncertainty" not in g
    # question 11: the base gave no "Answer:" line -> no answer, no confidence
    b = lines[11]["rounds"][0]["base"]
    assert b["answer_parsed"] is False and b["answer"] == "" and "confidence" not in b
    # baselines: EXIT of both models and the LLM-as-policy of the guide
    ex = lines[1]["baselines"]["exit"]
    assert ex[BASE_MODEL]["rounds"] == 2 and ex[BASE_MODEL]["correct"] is True and ex[GUIDE_MODEL]["rounds"] == 1
    assert lines[0]["baselines"]["llm_policy"][GUIDE_MODEL] == [0]
    assert lines[2]["baselines"]["llm_policy"][GUIDE_MODEL] == [2, 1]
    # the protocol's first base call and the base model's first EXIT round are one request, sent once
    assert not any(c["call"] == "exit.base.r0" for c in calls)

    capsys.readouterr()
    assert main(["data", "check", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"questions:   {N_QUESTIONS}" in shown and f"{BASE_MODEL} EXIT" in shown and "guide uncertainty given" in shown


@pytest.mark.slow
def test_reproduce_runs_on_the_collected_cache(reference, tmp_path):
    """``reproduce --cache`` on the collected file: every row the cache supports (the learned rows are
    skipped here to keep the test short; the compiled baselines are most of its time)."""
    from ccpo_jax.ccpo.reproduce import reproduce

    out = reference[0]

    res = reproduce(cache=str(out), n_splits=2, split_sizes="8,6,6", out_dir=tmp_path / "run",
                    train=False, echo=None, progress=False)
    rows = res.results["policies"]
    assert {f"{BASE_MODEL} EXIT", f"{GUIDE_MODEL} EXIT", "Random", f"LLM policy ({GUIDE_MODEL})", "UALA"} <= set(rows)
    assert res.results["cache"]["provenance"]["kind"] == "real"
    assert (tmp_path / "run" / "table.md").is_file()


# -- faults ------------------------------------------------------------------------------------


def test_faults_are_retried_and_the_file_is_unchanged(server, questions_file, reference, tmp_path):
    """A timeout, a 429 with Retry-After, two 500s, a 503 and a malformed body: each is retried
    (the waits are in the call log) and the cache equals the reference byte for byte."""
    server.timeout_sleep_s = 1.0
    server.fault("item number 3?", "timeout")
    server.fault("item number 5?", "429", retry_after="1")
    server.fault("item number 6?", "500", times=2)
    server.fault("item number 9?", "503")
    server.fault("item number 8?", "malformed")
    out = tmp_path / "cache.jsonl"
    t0 = time.perf_counter()
    assert main(_args(server, questions_file, out, "--timeout", "0.5", "--backoff", "0.01")) == 0
    assert time.perf_counter() - t0 >= 1.0  # the Retry-After was honoured
    assert _sha(out) == reference[1]
    # (a loaded machine may add a timeout elsewhere: check that each injected fault is there)
    waits: dict[str, list] = {}
    for c in _calls(out):
        waits.setdefault(c["q"], []).extend(c.get("waits") or [])
    assert any(w[0] == "timeout after 0.5 s" for w in waits["q3"])
    assert any(w[0] == "HTTP 429, Retry-After 1 s" and w[1] >= 1.0 for w in waits["q5"])
    # backoff 0.01 x 2^k at the k-th retry (0-based), with jitter; a load-induced timeout before the
    # 500s moves them one retry later, so bound each by its own position
    q6 = waits["q6"]
    fives = [k for k, w in enumerate(q6) if w[0] == "HTTP 500"]
    assert len(fives) == 2 and all(q6[k][1] <= 0.01 * 2.0 ** k + 1e-9 for k in fives), q6
    assert any(w[0] == "HTTP 503" for w in waits["q9"]) and any(w[0] == "malformed JSON body" for w in waits["q8"])


def test_failure_after_retries_stops_cleanly_and_resume_completes(server, questions_file, reference, tmp_path, capsys):
    server.fault("item number 4?", "500", times=3)
    out = tmp_path / "cache.jsonl"
    rc = main(_args(server, questions_file, out, "--retries", "2", "--backoff", "0.01", "--concurrency", "1"))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "gave up after 3 attempts (last: HTTP 500)" in err
    assert "--resume" in err and "Traceback" not in err
    from envs.cache.jsonl import read_jsonl

    assert read_jsonl(out).n_questions == 4  # q0..q3 finished before the failing q4; the partial file is a cache
    assert main(_args(server, questions_file, out, "--resume")) == 0
    assert _sha(out) == reference[1]


def test_kill_and_resume_gives_the_identical_file(server, questions_file, reference, tmp_path):
    """SIGKILL a CLI run mid-collection, resume it: the same bytes as the uninterrupted run, and only
    the calls in flight at the kill are sent twice (the rest are replayed from the call log)."""
    out = tmp_path / "cache.jsonl"
    server.delay_s = 0.02
    before = server.requests
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "ccpo_jax.cli", *_args(server, questions_file, out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len(out.read_bytes().splitlines()) >= 1 + 6:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    server.delay_s = 0.0
    n_killed = len(out.read_bytes().splitlines()) - 1
    assert 6 <= n_killed < N_QUESTIONS
    assert main(_args(server, questions_file, out, "--resume")) == 0
    assert _sha(out) == reference[1]
    sent = server.requests - before
    assert reference[2] <= sent <= reference[2] + 8  # at most one in-flight call per worker is paid twice
    assert any(c.get("replayed") for c in _calls(out))


def test_resume_drops_lines_cut_by_a_kill(server, questions_file, reference, tmp_path):
    """A kill in the middle of a write leaves a last line without its newline, in the cache or the
    call log: resume drops it and re-collects that question (its calls come from the log)."""
    ref, ref_sha = reference[0], reference[1]
    out = tmp_path / "cache.jsonl"
    lines = ref.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:6]) + lines[6][:40])
    log = (ref.parent / (ref.name + ".calls")).read_bytes().splitlines(keepends=True)
    (tmp_path / "cache.jsonl.calls").write_bytes(b"".join(log[:-1]) + log[-1][:25])
    before = server.requests
    assert main(_args(server, questions_file, out, "--resume")) == 0
    assert _sha(out) == ref_sha
    assert server.requests - before <= 1  # only the call whose log line was cut is sent again


def test_pilot_with_limit_then_the_rest(server, questions_file, reference, tmp_path):
    """A pilot of 5 questions (a complete 5-question cache), then --resume without --limit: the full file."""
    from envs.cache.jsonl import read_jsonl

    out = tmp_path / "cache.jsonl"
    assert main(_args(server, questions_file, out, "--limit", "5")) == 0
    assert read_jsonl(out).n_questions == 5
    assert main(_args(server, questions_file, out, "--resume", "--concurrency", "3")) == 0
    assert _sha(out) == reference[1]


def test_a_second_writer_is_refused(server, questions_file, reference, tmp_path, capsys):
    import fcntl
    import shutil

    out = tmp_path / "cache.jsonl"
    shutil.copy(reference[0], out)
    shutil.copy(str(reference[0]) + ".calls", str(out) + ".calls")
    with open(str(out) + ".calls", "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running collection holds it
        assert main(_args(server, questions_file, out, "--resume")) == 2
    assert "another 'ccpo-jax data collect' is writing this collection" in capsys.readouterr().err
    assert _sha(out) == reference[1]
    assert main(_args(server, questions_file, out, "--resume")) == 0  # once it is released


def test_budget_stop_then_resume(server, questions_file, reference, tmp_path, capsys):
    out = tmp_path / "cache.jsonl"
    cap = reference[3] * 0.5
    rc = main(_args(server, questions_file, out, "--max-cost-usd", f"{cap:.6f}", "--concurrency", "2"))
    cap_r = float(f"{cap:.6f}")
    cap_out = capsys.readouterr()
    assert rc == 3 and "stopped by --max-cost-usd" in cap_out.err
    assert cap_out.out.startswith(f"cost bound for {N_QUESTIONS} question(s)")
    paid = sum(c.get("cost_usd", 0.0) for c in _calls(out))
    assert 0 < paid <= cap_r
    from envs.cache.jsonl import read_jsonl

    assert 0 < read_jsonl(out).n_questions < N_QUESTIONS
    assert main(_args(server, questions_file, out, "--resume", "--max-cost-usd", "1")) == 0
    assert _sha(out) == reference[1]
    assert "already paid" in capsys.readouterr().out


def test_without_usage_or_logprobs_nothing_is_invented(server, questions_file, tmp_path, capsys):
    """No log-probs asked: no confidence / uncertainty fields. A reply without usage: tokens
    estimated and flagged (and counted in the summary), never silently made up."""
    server.fault("item number 0?", "no_usage")
    out = tmp_path / "plain.jsonl"
    assert main(_args(server, questions_file, out, "--limit", "2", "--no-logprobs")) == 0
    assert "1 repl(ies) had no usage" in capsys.readouterr().out
    lines = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    rounds = [r for q in lines for r in q["rounds"]]
    assert not any("confidence" in r["base"] or "uncertainty" in r["guide"] for r in rounds)
    assert lines[0]["rounds"][0]["base"]["tokens_estimated"] is True
    assert sum("tokens_estimated" in r["base"] or "tokens_estimated" in r["guide"] for r in rounds) == 1
    assert json.loads(out.read_text().splitlines()[0])["manifest"]["provenance"]["requests"]["logprobs"] is False


def test_csv_questions_and_pricing_file(server, tmp_path):
    import argparse

    from ccpo_jax.collect.command import resolve_prices
    from ccpo_jax.errors import UserError
    from ccpo_jax.llm.questions import load_questions

    csv_file = tmp_path / "q.csv"
    csv_file.write_text('id,question,gold,extra\n1,"Who wrote ""Hamlet""?",Shakespeare,x\n2,"2+2?",4,y\n')
    qs, sha = load_questions(csv_file)
    assert [(q.id, q.question, q.golds) for q in qs] == [("1", 'Who wrote "Hamlet"?', ("Shakespeare",)), ("2", "2+2?", ("4",))]
    (tmp_path / "dup.csv").write_text("id,question,gold\n1,a,b\n1,c,d\n")
    with pytest.raises(UserError, match="dup.csv:3: id: duplicate"):
        load_questions(tmp_path / "dup.csv")
    pricing = tmp_path / "prices.yaml"
    pricing.write_text("big-guide: {price_in: 3, price_out: 12}\n")
    args = argparse.Namespace(pricing=str(pricing), base_price=["0,0"], guide_price=None)
    prices, sources = resolve_prices(args, {"base": BASE_MODEL, "guide": GUIDE_MODEL})
    assert prices == {"base": (0.0, 0.0), "guide": (3.0, 12.0)} and sources["guide"] == "--pricing prices.yaml"
    args = argparse.Namespace(pricing=None, base_price=["0,0"], guide_price=None)
    prices, sources = resolve_prices(args, {"base": BASE_MODEL, "guide": "gpt-4o"})
    assert prices["guide"] == (2.5, 10.0) and sources["guide"].startswith("envs/importers/pricing.py")


# -- keys --------------------------------------------------------------------------------------


def test_api_key_is_sent_but_never_written(questions_file, tmp_path, monkeypatch, capfd):
    secret = "sk-test-THIS-IS-SECRET-0123456789"
    with FakeChatServer(SCRIPTS, key=secret) as srv:
        monkeypatch.setenv("CCPO_TEST_KEY", secret)
        out = tmp_path / "keyed.jsonl"
        keys = ["--base-key-env", "CCPO_TEST_KEY", "--guide-key-env", "CCPO_TEST_KEY"]
        assert main(_args(srv, questions_file, out, "--limit", "3", *keys)) == 0
        assert srv.auth_seen == {f"Bearer {secret}"}
        # a wrong key: the server echoes it in its 401 body; the error must not repeat it
        wrong = "sk-test-WRONG-KEY-9876543210"
        monkeypatch.setenv("CCPO_TEST_KEY", wrong)
        out2 = tmp_path / "wrong.jsonl"
        assert main(_args(srv, questions_file, out2, "--limit", "1", *keys)) == 2
        assert not out2.exists()  # nothing was paid or finished: no files left to block the corrected rerun
    printed = capfd.readouterr()
    assert "HTTP 401 (not retried)" in printed.err and "***" in printed.err
    for text in [printed.out, printed.err] + [p.read_text() for p in tmp_path.iterdir() if p.is_file()]:
        assert secret not in text and wrong not in text
    # a key variable that is not set is an error before any call
    monkeypatch.delenv("CCPO_TEST_KEY")
    assert main(_args(srv, questions_file, tmp_path / "nokey.jsonl", *keys)) == 2
    assert "CCPO_TEST_KEY" in capfd.readouterr().err


# -- user errors ---------------------------------------------------------------------------------


def test_bad_input_is_one_error_line(server, questions_file, reference, tmp_path, capsys):
    def err(args):
        assert main(args) == 2
        e = capsys.readouterr().err
        assert e.startswith("error: ") and e.count("\n") == 1, e
        return e

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "question": "Q?", "gold": "x"}\n{"id": "b", "question": "Q2?"}\n')
    assert "bad.jsonl:2: gold" in err(_args(server, bad, tmp_path / "o.jsonl"))
    assert "already exists" in err(_args(server, questions_file, reference[0]))
    assert "T differ" in err(_args(server, questions_file, reference[0], "--resume", "--rounds", "3"))
    assert "no price for the guide model" in err([a for a in _args(server, questions_file, tmp_path / "o.jsonl")
                                                  if a not in ("--guide-price", "2.5,10")])
    args = _args(server, questions_file, tmp_path / "o.jsonl")
    args[args.index("--base") + 1] = "http://user:pw@127.0.0.1:1/v1,m"
    assert "--base: put credentials in an environment variable" in err(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_dry_run_prints_the_bound_and_calls_nothing(server, questions_file, tmp_path, capsys):
    before = server.requests
    out = tmp_path / "cache.jsonl"
    assert main(_args(server, questions_file, out, "--dry-run")) == 0
    text = capsys.readouterr().out
    assert f"cost bound for {N_QUESTIONS} question(s), T=4" in text and "at most $" in text
    assert server.requests == before and not out.exists()


# -- parsers and measures (no server) --------------------------------------------------------------


@pytest.mark.parametrize("reply, verdict, correction", [
    ("Yes", True, None), ("yes.", True, None), ("**Yes**", True, None), ("Response: Yes", True, None),
    ("No [Paris]", False, "Paris"), ("No [answer 2]", False, "answer 2"), ("No, the correct answer is Paris.", False, "Paris"),
    ("NO: Rome", False, "Rome"), ("No", False, None), ("No [correct answer]", False, None),
    ("Nope", None, None), ("Correct", None, None), ("I think the answer is right", None, None), ("", None, None),
])
def test_parse_verdict(reply, verdict, correction):
    assert P.parse_verdict(reply) == P.Verdict(verdict, correction)


def test_parse_answers_and_decisions():
    text = "Step 1 ... so it is big.\nAnswer: **Indiana University**."
    ans, (s, e) = P.parse_base_answer(text)
    assert ans == "Indiana University" and text[s:e] == ans
    assert P.parse_base_answer("Answer: A\nmore thinking\nFinal answer: B")[0] == "B"
    assert P.parse_base_answer("no answer here") is None and P.parse_base_answer("Answer:   ") is None
    assert P.parse_exit("[EXIT]") is True and P.parse_exit("continue") is False and P.parse_exit("stop") is None
    assert P.parse_policy_action("2", last_round=False) == 1 and P.parse_policy_action("3", last_round=False) == 2
    assert P.parse_policy_action("3", last_round=True) is None and P.parse_policy_action("12", last_round=False) is None
    assert P.is_correct("The Paris!", ["paris"]) and not P.is_correct("", ["x"])
    assert P.is_correct("Indiana University Bloomington", ["Indiana University"], f1_threshold=0.8)
    assert not P.is_correct("Indiana University Bloomington", ["Indiana University"])


def test_logprob_measures_and_usage():
    lps = (("**", -0.1), ("Yes", -0.2), ("**", -0.0))
    assert P.verdict_uncertainty(lps) == pytest.approx(1 - 2.718281828 ** -0.2, abs=1e-6)
    assert P.verdict_uncertainty(None) is None
    text = "ok\nAnswer: Paris"
    toks = (("ok", -1.0), ("\n", -1.0), ("Answer", -1.0), (":", -1.0), (" Par", -0.1), ("is", -0.3))
    assert P.answer_confidence(toks, text, P.parse_base_answer(text)[1]) == pytest.approx(2.718281828 ** -0.2, abs=1e-6)
    assert P.answer_confidence(toks[:-1], text, (11, 16)) is None  # tokens do not spell the text
    body = {"choices": [{"message": {"content": "Yes"}, "finish_reason": "stop"}]}
    r = parse_completion(body)
    assert r.tokens_in is None and r.logprobs is None  # no usage, no logprobs: absent, not invented
    with pytest.raises(ValueError):
        parse_completion({"choices": []})


def test_retry_after_forms():
    import httpx

    assert retry_after_s(httpx.Headers({"Retry-After": "7"})) == 7.0
    assert retry_after_s(httpx.Headers({"retry-after-ms": "250"})) == 0.25
    assert retry_after_s(httpx.Headers({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}), now=1792567670.0) == pytest.approx(10.0)
    assert retry_after_s(httpx.Headers({"Retry-After": "soon"})) is None


# -- replies cut at max_tokens, sampled requests ------------------------------------------------------


def test_cut_replies_are_counted_per_kind_of_call(server, questions_file, reference, tmp_path, capsys):
    """EXIT decisions cut at --decision-max-tokens (they stay readable) are not reported as base
    answers; base answers cut before their 'Answer:' line are, with how many lost it."""
    import re

    server.fault("rounds and must decide", "verbose", times=2)  # two EXIT decisions ramble past 8 tokens
    out = tmp_path / "cut.jsonl"
    assert main(_args(server, questions_file, out, "--limit", "2", "--concurrency", "1")) == 0
    shown = capsys.readouterr().out
    assert "note: 2 EXIT / policy decision(s) stopped at --decision-max-tokens 8 (read from their start: " \
           "2 readable, 0 unreadable)" in shown
    assert "base answer(s) stopped" not in shown
    # the cut decisions read as the uncut ones did: the reference run's rounds and EXIT outcomes (only
    # the EXIT cost differs: 8 tokens per cut decision instead of 1)
    got = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    ref = [json.loads(x) for x in reference[0].read_text().splitlines()[1:3]]
    strip = lambda e: {m: {k: v for k, v in r.items() if k != "cost_cents"} for m, r in e.items()}  # noqa: E731
    assert [q["rounds"] for q in got] == [q["rounds"] for q in ref]
    assert [strip(q["baselines"]["exit"]) for q in got] == [strip(q["baselines"]["exit"]) for q in ref]

    out2 = tmp_path / "cut-base.jsonl"
    assert main(_args(server, questions_file, out2, "--limit", "1", "--base-max-tokens", "5")) == 0
    m = re.search(r"note: (\d+) base answer\(s\) stopped at --base-max-tokens 5 \(finish_reason 'length'\), "
                  r"(\d+) of them unreadable \(no Answer: line\); raise --base-max-tokens", capsys.readouterr().out)
    assert m and int(m.group(1)) == int(m.group(2)) >= 4  # every base answer of q0 was cut before its last line


def test_sampled_guide_calls_are_not_reused_but_resume_replays_them(server, questions_file, tmp_path):
    """--seed none --guide-temperature 1: each guide call is its own sample (no reuse of an identical
    earlier request); a --resume still answers every paid call from the call log."""
    out = tmp_path / "sampled.jsonl"
    args = _args(server, questions_file, out, "--limit", "5", "--seed", "none", "--guide-temperature", "1")
    assert main(args) == 0
    calls = _calls(out)
    guide_sent = [c for c in calls if "text" in c and c["call"].endswith(".guide")]
    assert len(guide_sent) == 5 * 4  # every round's guide call was sent
    assert not any(c.get("replayed") and c["call"].endswith(".guide") for c in calls)
    # the same collection at guide temperature 0 sends fewer: identical verdict requests are sent once
    out0 = tmp_path / "greedy.jsonl"
    assert main(_args(server, questions_file, out0, "--limit", "5", "--seed", "none")) == 0
    assert sum(1 for c in _calls(out0) if "text" in c and c["call"].endswith(".guide")) < 5 * 4
    # resume after the question lines are lost: nothing is sent again
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0])
    before = server.requests
    assert main(args[:] + ["--resume"]) == 0
    assert server.requests == before


# -- log-probs from the servers people run ---------------------------------------------------------


def _lp_rounds(out: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    return lines, [r for q in lines for r in q["rounds"]]


def test_llama_cpp_python_returns_log_probs_for_the_request_sent(server, questions_file, tmp_path, capsys):
    """A guide on a llama-cpp-python-like server (log-probs only when top_logprobs is sent too): the
    collector's request gets them for every reply; the uncertainty is 1 - p(verdict token) of the
    server's designed token probabilities, and the summary gives the share of rounds with each signal."""
    from ccpo_jax.testing.chat_server import token_logprob

    with FakeChatServer(SCRIPTS, flavour="llama-cpp-python", served=[GUIDE_MODEL]) as lcp:
        out = tmp_path / "lcp.jsonl"
        args = _args(server, questions_file, out, "--limit", "10")
        args[args.index("--guide") + 1] = f"{lcp.url},{GUIDE_MODEL}"
        assert main(args) == 0
    printed = capsys.readouterr()
    assert "log-probs: base confidence given for 100% (40/40) of the rounds collected in this run, " \
           "guide uncertainty for 90% (36/40)" in printed.out  # q7's verdicts are unreadable: no uncertainty
    assert "returned no log-probs" not in printed.out + printed.err
    guide_calls = [c for c in _calls(out) if "text" in c and c["endpoint"].startswith(lcp.url)]
    assert guide_calls and all(c["logprobs"] for c in guide_calls)
    lines, rounds = _lp_rounds(out)
    g0 = lines[0]["rounds"][0]["guide"]  # "Yes"
    g2 = lines[2]["rounds"][0]["guide"]  # "No [answer 2]"
    assert g0["uncertainty"] == pytest.approx(1 - math.exp(token_logprob("Yes")), abs=1e-6)
    assert g2["uncertainty"] == pytest.approx(1 - math.exp(token_logprob("No")), abs=1e-6)
    # the body the collector sends, replayed through that server's rule: without top_logprobs, no log-probs
    assert lcp.completion({"model": GUIDE_MODEL, "messages": [{"role": "user", "content": "x"}],
                           "logprobs": True})["choices"][0]["logprobs"] is None


def test_an_endpoint_without_log_probs_is_warned_about_at_once_and_in_the_summary(server, questions_file, tmp_path,
                                                                                  capsys):
    with FakeChatServer(SCRIPTS, logprobs=False) as bare:
        out = tmp_path / "bare.jsonl"
        args = _args(server, questions_file, out, "--limit", "3", "--concurrency", "1")
        args[args.index("--guide") + 1] = f"{bare.url},{GUIDE_MODEL}"
        assert main(args) == 0
    printed = capsys.readouterr()
    warn = [x for x in printed.err.splitlines() if "returned no log-probs in its first reply" in x]
    assert len(warn) == 1 and warn[0].startswith(f"warning: the guide endpoint ({GUIDE_MODEL} at {bare.url}")
    assert "guide uncertainty for 0% (0/12)" in printed.out and "base confidence given for 100% (12/12)" in printed.out
    calls = _calls(out)
    guide_keys = {c["key"] for c in calls if "text" in c and c["endpoint"].startswith(bare.url)}
    n_guide = sum(1 for c in calls if c.get("key") in guide_keys)  # sent and answered from the log
    assert f"returned no log-probs in {n_guide} of its {n_guide} replies: no guide uncertainty" in printed.out
    _, rounds = _lp_rounds(out)
    assert not any("uncertainty" in r["guide"] for r in rounds)
    assert main(["data", "check", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "guide uncertainty given: 0% of rounds" in shown
    assert "warning: no round has a guide uncertainty: reproduce leaves out the UALA row" in shown
    assert "the collection asked for log-probs (provenance.requests.logprobs) and the endpoint returned none" in shown


def test_data_check_accepts_a_collection_killed_before_its_first_question(server, questions_file, reference,
                                                                           tmp_path, capsys):
    """The cache of a run killed before any question finished is its manifest line alone: a valid
    cache with no questions (exit 0); a bad manifest is still an error."""
    out = tmp_path / "early.jsonl"
    out.write_text(reference[0].read_text().splitlines(keepends=True)[0])
    capsys.readouterr()
    assert main(["data", "check", str(out)]) == 0
    assert "a valid manifest and no questions yet" in capsys.readouterr().out
    out.write_text('{"manifest": {"name": "x"}}\n')
    assert main(["data", "check", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_reproduce_lists_the_rows_it_leaves_out(server, questions_file, tmp_path, capsys):
    """A cache collected without log-probs: reproduce leaves out UALA and says so, with the reason,
    on screen, in results.json and in table.md."""
    from ccpo_jax.ccpo.reproduce import reproduce

    out = tmp_path / "plain.jsonl"
    assert main(_args(server, questions_file, out, "--no-logprobs")) == 0
    lines = []
    res = reproduce(cache=str(out), n_splits=2, split_sizes="8,6,6", out_dir=tmp_path / "run",
                    train=False, echo=lines.append, progress=False)
    why = "no round of the cache has a guide uncertainty (UALA thresholds it)"
    assert "UALA" not in res.results["policies"] and "Threshold cascade" not in res.results["policies"]
    assert res.results["left_out"] == {"UALA": why}  # (the threshold cascade is a ladder's baseline)
    assert f"- UALA: {why}" in (tmp_path / "run" / "table.md").read_text()
    assert any(f"- UALA: {why}" in x for x in lines)
    print("\n".join(lines))


def test_a_model_the_server_does_not_list_is_an_error_before_any_call(questions_file, tmp_path, capsys):
    """llama-cpp-python answers any model name with its loaded model and echoes the name asked for:
    GET /v1/models catches the wrong name before anything is paid; --allow-unlisted-model calls it
    anyway, and a reply naming another model is flagged."""
    with FakeChatServer(SCRIPTS, flavour="llama-cpp-python", served=["models/guide-q8_0.gguf"]) as lcp, \
            FakeChatServer(SCRIPTS, flavour="llama.cpp", served=["guide-alias"]) as native:
        out = tmp_path / "wrong.jsonl"
        args = _args(lcp, questions_file, out, "--limit", "1")
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: the base endpoint {lcp.url}/chat/completions does not serve the model "
                              f"'{BASE_MODEL}'; it lists: 'models/guide-q8_0.gguf'") and err.count("\n") == 1
        assert lcp.requests == 0 and not out.exists()
        args2 = _args(native, questions_file, tmp_path / "anyway.jsonl", "--limit", "1", "--allow-unlisted-model")
        assert main(args2) == 0
        printed = capsys.readouterr()
        assert "called anyway (--allow-unlisted-model)" in printed.out
        assert f"answered as model 'guide-alias', not '{BASE_MODEL}'" in printed.err
        assert "named another model than the one asked for" in printed.out
        assert {c["served_model"] for c in _calls(tmp_path / "anyway.jsonl") if "text" in c} == {"guide-alias"}
