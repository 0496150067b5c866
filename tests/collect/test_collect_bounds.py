"""``data collect``'s bounds (issue 27 items 7, 8, 9, 11): a whole-attempt deadline, a reply body
cap, a bound on reported token counts, and replies holding a lone surrogate.

The client tests talk to a raw socket server on 127.0.0.1 that misbehaves on purpose (trickles,
sends too much); the end-to-end tests run ``data collect`` against ``ccpo_jax/testing/chat_server.py`` with
one reply altered.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, write_questions
from ccpo_jax.cli.main import main
from ccpo_jax.collect.calllog import CallLog
from ccpo_jax.collect.client import ChatClient
from ccpo_jax.llm.wire import AttemptOver, BoundedBody, EndpointError, RetryPolicy, TooLarge, parse_completion
from ccpo_jax.llm.wire import Endpoint

GOOD = {"choices": [{"message": {"role": "assistant", "content": "Yes"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


class RawServer:
    """Accepts connections on 127.0.0.1 and answers each request with ``respond(sock)``."""

    def __init__(self, respond):
        self.respond = respond
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.requests = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, _, body = buf.partition(b"\r\n\r\n")
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            while len(body) < n:
                body += conn.recv(65536)
            self.requests += 1
            try:
                self.respond(conn)
            except OSError:
                pass

    def close(self):
        self.sock.close()


def _client(url: str, **policy) -> ChatClient:
    return ChatClient(Endpoint(url=url, model="m"), RetryPolicy(**{"retries": 0, "backoff_s": 0.01, **policy}))


def _head(n: int | None) -> bytes:
    length = f"Content-Length: {n}\r\n" if n is not None else "Connection: close\r\n"
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode()


def test_a_trickling_reply_is_cut_at_the_attempt_deadline():
    """A byte every 0.2 s never trips the 5 s read timeout; the 1 s attempt deadline ends it.
    (Before: ``--timeout`` bounded each read only; a byte every 3 s held one attempt 97 s.)"""
    body = json.dumps(GOOD).encode()

    def trickle(conn):
        conn.sendall(_head(len(body)))
        for b in body:
            conn.sendall(bytes([b]))
            time.sleep(0.2)

    srv = RawServer(trickle)
    try:
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as e:
            _client(srv.url, timeout_s=5.0, attempt_timeout_s=1.0).chat({"model": "m", "messages": []})
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert "gave up after 1 attempts (last: attempt not complete within 1 s (--attempt-timeout))" in str(e.value)
    assert 1.0 <= took < 1.6, took


@pytest.mark.parametrize("declared", [True, False])
def test_a_reply_body_over_the_cap_fails_without_being_read_whole(declared):
    """A 64 MiB body against a 1 MiB cap: refused on the declared length, or after reading just
    past the cap when no length is declared; not retried (retries=3 makes one attempt)."""
    size = 64 << 20
    sent = []

    def big(conn):
        conn.sendall(_head(size if declared else None))
        chunk = b" " * (1 << 16)
        for _ in range(size // len(chunk)):
            conn.sendall(chunk)
            sent.append(len(chunk))

    srv = RawServer(big)
    try:
        with pytest.raises(EndpointError) as e:
            _client(srv.url, max_reply_bytes=1 << 20, retries=3).chat({"model": "m", "messages": []})
    finally:
        srv.close()
    msg = str(e.value)
    assert "reply body over 1048576 bytes" in msg and "--max-reply-bytes; not retried" in msg, msg
    assert ("Content-Length 67108864" in msg) == declared
    assert e.value.stats.attempts == 1 and srv.requests == 1


def test_token_counts_a_cache_cannot_hold_are_refused_and_not_retried():
    body = json.dumps(dict(GOOD, usage={"prompt_tokens": 10**12, "completion_tokens": 1})).encode()
    srv = RawServer(lambda conn: conn.sendall(_head(len(body)) + body))
    try:
        with pytest.raises(EndpointError) as e:
            _client(srv.url, retries=3).chat({"model": "m", "messages": []})
    finally:
        srv.close()
    assert "usage.prompt_tokens = 1000000000000, more than the 1e+07 tokens a call can have in a cache " \
           "(not retried)" in str(e.value)
    assert srv.requests == 1
    # the bound itself is allowed
    ok = parse_completion(dict(GOOD, usage={"prompt_tokens": 10**7, "completion_tokens": 10**7}))
    assert (ok.tokens_in, ok.tokens_out) == (10**7, 10**7)


def test_a_lone_surrogate_in_a_reply_becomes_u_fffd_and_the_log_takes_any_record(tmp_path):
    r = parse_completion(json.loads('{"choices": [{"message": {"content": "Ans\\ud800wer"}}]}'))
    assert r.text == "Ans\ufffdwer"
    log = CallLog(tmp_path / "x.calls")
    log.append({"key": "k", "text": "raw \udfff kept", "q": "q0"})  # escaped, not a UnicodeEncodeError
    log.close()
    assert json.loads((tmp_path / "x.calls").read_text())["text"] == "raw \udfff kept"


# -- end to end --------------------------------------------------------------------------------

def _args(url, questions, out, *extra):
    return ["data", "collect", "--round-protocol", "paper", "--questions", str(questions), "--base", f"{url},{BASE_MODEL}",
            "--guide", f"{url},{GUIDE_MODEL}", "--out", str(out), "--base-price", "0.5,1.5",
            "--guide-price", "2.5,10", "--no-progress", "--concurrency", "1", *extra]


def test_collect_records_a_reply_with_a_lone_surrogate(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    questions = tmp_path / "q.jsonl"
    write_questions(questions, 3)
    with FakeChatServer(make_scripts(3)) as srv:
        real = srv.completion

        def with_surrogate(body, **kw):
            out = real(body, **kw)
            if body["model"] == BASE_MODEL:
                out["choices"][0]["message"]["content"] += " \ud800"
            return out

        srv.completion = with_surrogate
        out = tmp_path / "c.jsonl"
        assert main(_args(srv.url, questions, out)) == 0, capsys.readouterr().err
    calls = [json.loads(x) for x in (tmp_path / "c.jsonl.calls").read_text().splitlines()]
    assert any(c.get("text", "").endswith(" \ufffd") for c in calls)
    from envs.cache.jsonl import read_jsonl, write_jsonl

    write_jsonl(read_jsonl(out), tmp_path / "e.jsonl")  # data check and export both take it


def test_collect_refuses_an_impossible_token_count_and_keeps_a_valid_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    questions = tmp_path / "q.jsonl"
    write_questions(questions, 3)
    with FakeChatServer(make_scripts(3)) as srv:
        real = srv.completion

        def huge(body, **kw):
            out = real(body, **kw)
            if "item number 2?" in json.dumps(body["messages"]):
                out["usage"]["completion_tokens"] = 10**12
            return out

        srv.completion = huge
        out = tmp_path / "c.jsonl"
        rc = main(_args(srv.url, questions, out))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "usage.completion_tokens = 1000000000000" in err[0] and "--resume" in err[0], err
    from envs.cache.jsonl import read_jsonl

    assert read_jsonl(out).n_questions == 2  # the questions before it; the file is a valid cache


# -- GET /models: the same bounded read as a chat call (issue 41 item 2) ------------------------

def test_a_dripping_model_list_is_cut_at_the_attempt_deadline(tmp_path, capsys):
    """The model list one byte every 30 ms (~18 s in all) never trips the 5 s read timeout; the
    1 s attempt deadline ends the run in under 3 s, nothing written. (Before: a plain GET read it
    to the end, ~18 s; a slower drip held ``data collect`` indefinitely.)"""
    questions = tmp_path / "q.jsonl"
    write_questions(questions, 3)
    out = tmp_path / "c.jsonl"
    with FakeChatServer(make_scripts(3), models_mode="drip", drip_s=0.03) as srv:
        t0 = time.monotonic()
        rc = main(_args(srv.url, questions, out, "--attempt-timeout", "1", "--timeout", "5"))
        took = time.monotonic() - t0
        sent = srv.models_bytes_sent
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert f"GET {srv.url}/models: not complete within 1 s (--attempt-timeout)" in err[0], err
    assert took < 3.0, took
    assert sent < 100  # of the 598 bytes of the listing
    assert not out.exists() and not (tmp_path / "c.jsonl.calls").exists()


@pytest.mark.parametrize("mode", ["huge", "huge-declared"])
def test_a_huge_model_list_is_refused_over_the_cap_not_read_whole(tmp_path, capsys, mode):
    """A valid 150 MB model list (listing both models) against a 1 MiB cap: refused as over the
    cap, by its declared length or after reading just past the cap; the server could send only a
    fraction of it. (Before: read whole, RSS 355 MB, then "not a model list (Unterminated string".)"""
    questions = tmp_path / "q.jsonl"
    write_questions(questions, 3)
    out = tmp_path / "c.jsonl"
    with FakeChatServer(make_scripts(3), models_mode=mode) as srv:
        rc = main(_args(srv.url, questions, out, "--max-reply-bytes", str(1 << 20)))
        time.sleep(0.2)  # the handler notices the hang-up
        sent = srv.models_bytes_sent
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert f"GET {srv.url}/models: reply body over 1048576 bytes" in err[0] and "--max-reply-bytes" in err[0], err
    assert ("Content-Length 15728" in err[0]) == (mode == "huge-declared"), err
    assert "not a model list" not in err[0]
    assert sent < 16 << 20, sent  # the client stopped reading (what remains sits in socket buffers)
    assert not out.exists()


def test_bounded_body_holds_a_reader_to_the_cap_and_the_deadline():
    """BoundedBody, the piece any reader (sync or async) feeds: a fake clock, no I/O."""
    now = [100.0]
    pol = RetryPolicy(attempt_timeout_s=2.0, max_reply_bytes=10)
    b = BoundedBody(pol, clock=lambda: now[0])
    b.start(httpx.Headers({"content-length": "10"}))
    b.feed(b"12345")
    now[0] = 101.9
    b.feed(b"67890")
    assert b.body() == b"1234567890"
    with pytest.raises(TooLarge, match="more than 10 bytes read"):
        b.feed(b"x")
    with pytest.raises(TooLarge, match="Content-Length 11"):
        BoundedBody(pol, clock=lambda: now[0]).start(httpx.Headers({"content-length": "11"}))
    late = BoundedBody(pol, clock=lambda: now[0])
    now[0] = 103.91  # 2.01 s after it started
    with pytest.raises(AttemptOver, match=r"not complete within 2 s \(--attempt-timeout\)"):
        late.feed(b"1")


# -- invalid log-probs are told apart from absent ones (issue 41 item 9b) -----------------------

def _with_logprobs(lp) -> dict:
    return {"choices": [{"message": {"content": " Yes no"}, "logprobs": lp}]}


@pytest.mark.parametrize("lp", [None, {"content": None}, {"content": []}, {"refusal": None}])
def test_absent_log_probs_are_absent_not_invalid(lp):
    r = parse_completion(_with_logprobs(lp))
    assert r.logprobs is None and r.logprobs_invalid is None


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
                                        (0.5, "0.5"), ("-0.1", "'-0.1'"), (True, "True"), (None, "None")])
def test_invalid_log_probs_void_the_reply_and_say_which(bad, shown):
    r = parse_completion(_with_logprobs({"content": [{"token": " Yes", "logprob": -0.1},
                                                     {"token": " no", "logprob": bad}]}))
    assert r.logprobs is None
    assert r.logprobs_invalid == (f"choices[0].logprobs.content[1].logprob = {shown} "
                                  "(a log-prob is a finite number <= 0)")


def test_malformed_log_prob_shapes_are_invalid():
    assert parse_completion(_with_logprobs({"content": [{"logprob": -0.1}]})).logprobs_invalid == \
        "choices[0].logprobs.content[0] has no string token"
    assert parse_completion(_with_logprobs({"content": "x"})).logprobs_invalid == \
        "choices[0].logprobs is not an object with a content list"
    ok = parse_completion(_with_logprobs({"content": [{"token": " Yes", "logprob": 0}]}))  # p = 1 is valid
    assert ok.logprobs == ((" Yes", 0.0),) and ok.logprobs_invalid is None


def test_collect_warns_of_invalid_log_probs_not_of_none(tmp_path, capsys):
    """The base endpoint's log-probs hold NaN (JSON's NaN literal) in the second token of every reply:
    the run warns that they are invalid, naming the model, URL, question and call, and the summary
    counts them apart. (Before: "returned no log-probs in its first reply".)"""
    questions = tmp_path / "q.jsonl"
    write_questions(questions, 3)
    with FakeChatServer(make_scripts(3)) as srv:
        real = srv.completion

        def nan_logprob(body, **kw):
            out = real(body, **kw)
            if body["model"] == BASE_MODEL:
                out["choices"][0]["logprobs"]["content"][1]["logprob"] = float("nan")
            return out

        srv.completion = nan_logprob
        out = tmp_path / "c.jsonl"
        assert main(_args(srv.url, questions, out)) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "returned no log-probs" not in text
    warn = [ln for ln in printed.err.splitlines() if "invalid log-probs" in ln]
    assert warn == [f"warning: the base endpoint ({BASE_MODEL} at {srv.url}/chat/completions) returned invalid "
                    "log-probs for question q0 (call r0.base): choices[0].logprobs.content[1].logprob = nan (a "
                    "log-prob is a finite number <= 0); base confidence will be missing wherever they are "
                    "invalid; the summary counts them (docs/collect.md)"], printed.err
    calls = [json.loads(x) for x in (tmp_path / "c.jsonl.calls").read_text().splitlines()]
    base = [c for c in calls if c.get("model") == BASE_MODEL and "text" in c]
    assert base and all(c["logprobs"] is None and "logprob = nan" in c["logprobs_invalid"] for c in base)
    assert (f"returned invalid log-probs (NaN, infinite, positive...; the call log's logprobs_invalid says which) "
            f"in {len(base)} of its {len(base)} replies: no base confidence") in printed.out
    assert not any("logprobs_invalid" in c for c in calls if c.get("model") == GUIDE_MODEL)
