"""The gateway's journal is never lost and every client is bounded (issue 48, docs/gateway.md).

Each test reproduces one probe of the issue against the gateway served by uvicorn in front of
the scripted upstream (ccpo_jax/testing/chat_server.py), and after each probe the journal must pass the
code path of ``ccpo-jax data check`` (``run_cli(["data", "check", ...])``).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact, post  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

from ccpo_jax.errors import UserError  # noqa: E402
from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint, RetryPolicy  # noqa: E402
from tests.helpers import REPO

FAST = RetryPolicy(retries=0, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=5.0, timeout_s=2.0,
                   attempt_timeout_s=5.0)
SCRIPTS = make_scripts(6)
QS = list(SCRIPTS)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return build_artefact(tmp_path_factory.mktemp("gwi"))


def _gateway(art, up, journal=None, **kw):
    kw.setdefault("max_batch", 2)
    cfg = GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=FAST,
                        journal=None if journal is None else str(journal), **kw)
    return GatewayThread(load_gateway(art, cfg))


def _chat(q: str, **extra) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": q}], **extra}


def _checked(journal: Path) -> str:
    """``data check``'s output on the journal; the test fails if the command refuses it."""
    res = run_cli(["data", "check", str(journal)])
    assert res.returncode == 0, res.stderr
    return res.stdout


def _metric(url: str, name: str) -> float:
    """The sum of a metric's series on ``GET /metrics``."""
    text = httpx.get(url.replace("/v1", "/metrics")).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("n", [8, 64])
def test_concurrent_feedback_for_one_id_is_recorded_once(art, tmp_path, n, monkeypatch):
    """Item 1: N identical feedbacks at once: one 200, N-1 409, one labelled line, one count. Labelling
    takes 0.3 s here (a slow disk or a large record), which widens the window between the check of the
    outcome and its write that a small record leaves to chance (4 of 8 got through in the issue's probe;
    1 run in 6 here at normal speed, 3 in 6 with 50 ms)."""
    import ccpo_jax.gateway.journal as J

    real_label = J.label

    def slow_label(*a, **k):
        time.sleep(0.3)
        return real_label(*a, **k)
    monkeypatch.setattr(J, "label", slow_label)
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        st, r = post(g.url, "/chat/completions", _chat(QS[0]))
        assert st == 200
        start = threading.Barrier(n)

        def one(_):
            start.wait()
            return post(g.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})[0]

        with ThreadPoolExecutor(n) as ex:
            statuses = sorted(ex.map(one, range(n)))
        assert statuses == [200] + [409] * (n - 1)
        lines = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
        assert [x["id"] for x in lines] == [r["id"]] * 2 and "gold" in lines[1] and "gold" not in lines[0]
        assert _metric(g.url, "ccpo_gateway_feedback_total") == 1.0
        assert g.gw.coverage.seen == 1
    _checked(journal)


@pytest.mark.parametrize("where", ["question", "group", "gold"])
def test_a_lone_surrogate_is_a_400_before_any_upstream_call(art, tmp_path, where, caplog):
    """Item 5: ``\\ud800`` in a question, a group or a feedback gold: 400 in OpenAI's shape, no upstream
    call, no log line, and the journal stays readable."""
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        if where == "gold":
            st, r = post(g.url, "/chat/completions", _chat(QS[1]))
            assert st == 200
            raw = b'{"id": "%s", "gold": "x\\ud800"}' % r["id"].encode()
            path, want_param = "/feedback", "gold"
        else:
            body = _chat("Q \\ud800?") if where == "question" else _chat(QS[1], group="g\\ud800")
            raw = json.dumps(body).replace("\\\\ud800", "\\ud800").encode()
            path, want_param = "/chat/completions", "messages[0].content" if where == "question" else "group"
        n0 = up.requests
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway"):
            st, err = post(g.url, path, raw)
        assert st == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["param"] == want_param and "lone surrogate U+D800" in err["error"]["message"]
        assert err["error"]["code"] == "invalid_text"
        assert up.requests == n0
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    _checked(journal)


def test_an_unexpected_error_is_one_log_line_without_traceback(art, tmp_path, caplog, monkeypatch):
    """Item 5: a bug in a chat completion or a feedback is a 500 in OpenAI's shape and one log line."""
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        st, r = post(g.url, "/chat/completions", _chat(QS[2]))
        assert st == 200

        def boom(*a, **k):
            raise KeyError("a bug\nover two lines")
        monkeypatch.setattr(g.gw, "journal_line", boom)
        monkeypatch.setattr(g.gw.journal, "feedback", boom)
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway"):
            st1, e1 = post(g.url, "/chat/completions", _chat(QS[3]))
            st2, e2 = post(g.url, "/feedback", {"id": r["id"], "gold": "x"})
    for st, e in ((st1, e1), (st2, e2)):
        assert st == 500 and e["error"]["code"] == "internal_error" and e["error"]["type"] == "server_error", e
    errs = [x for x in caplog.records if x.levelno >= logging.ERROR]
    assert len(errs) == 2 and all(x.exc_info is None and "\n" not in x.getMessage() for x in errs)
    assert all("KeyError" in x.getMessage() and "test_gateway_integrity.py:" in x.getMessage() for x in errs)
    _checked(journal)


def _mondrian(th: GatewayThread) -> GatewayThread:
    """``th``'s router with per-group thresholds (a Mondrian artefact's), before it is served."""
    import numpy as np

    r = th.gw.router
    r.group_kappas, r.rest_kappa = {"g1": np.float32(0.05)}, np.float32(0.9)
    return th


@pytest.mark.parametrize("group,problem", [
    ("g1\u001b[2J\nevil", "contains the control character U+001B at index 2"),
    ("", "expected a non-empty string, got an empty string"),
    ("g" * 201, "at most 200 characters, got 201"),
    (3, "expected a non-empty string, got int"),
])
def test_a_group_the_cache_refuses_is_a_400_before_any_upstream_call(art, tmp_path, group, problem):
    """Item 2 (and 13's ``group.group:``): the request's group goes through the cache's own rule
    (envs.cache.values.group_problem) before any upstream call; the journal stays readable."""
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _mondrian(_gateway(art, up, journal)) as g:
        st, ok = post(g.url, "/chat/completions", _chat(QS[0], group="g1"))
        assert st == 200 and ok["ccpo"]["decisions"][0]["kappa_source"] == "group 'g1'"
        n0 = up.requests
        st, err = post(g.url, "/chat/completions", _chat(QS[0], group=group))
        assert up.requests == n0
    assert st == 400 and err["error"]["param"] == "group", err
    assert err["error"]["message"].startswith("group: ") and problem in err["error"]["message"]
    lines = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
    assert [x["group"] for x in lines] == ["g1"]
    _checked(journal)


def test_online_kappa_on_a_mondrian_artefact_names_the_flag_once(art, tmp_path, monkeypatch):
    """Item 13: the CLI's message names ``--online-kappa`` once (it said ``--online-kappa --online-kappa:``)."""
    _mondrian_load(monkeypatch)
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g",
                   "--online-kappa", "1"], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: --online-kappa: a Mondrian router"), res.stderr
    assert res.stderr.count("--online-kappa") == 1 and len(res.stderr.strip().splitlines()) == 1


def _mondrian_load(monkeypatch):
    """``Router.load`` gives routers with per-group thresholds (a Mondrian artefact's)."""
    import numpy as np

    from ccpo_jax.serving import Router

    load = Router.load

    def mondrian(path):
        r = load(path)
        r.group_kappas, r.rest_kappa = {"g1": np.float32(0.05)}, np.float32(0.9)
        return r
    monkeypatch.setattr(Router, "load", staticmethod(mondrian))


def _args(art, up, journal) -> list[str]:
    return ["gateway", str(art), "--base", f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}",
            "--journal", str(journal), "--max-batch", "1", "--port", "0"]


@pytest.mark.parametrize("old_manifest", ["current", "without groups"])
def test_a_journal_of_another_router_is_refused_at_start(art, tmp_path, monkeypatch, old_manifest):
    """Item 3: a marginal router's journal reopened by a Mondrian router (group use) or by another
    artefact (the router's hash) is refused at start-up, naming what differs, and left as it was.
    ``without groups``: a journal written before the manifest said its group use (read off its lines)."""
    import uvicorn

    def serve(self, sockets=None):
        raise AssertionError("the gateway started on another router's journal")
    monkeypatch.setattr(uvicorn.Server, "run", serve)
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up:
        with _gateway(art, up, journal) as g:
            assert post(g.url, "/chat/completions", _chat(QS[0]))[0] == 200
        if old_manifest == "without groups":
            lines = journal.read_text().splitlines()
            man = json.loads(lines[0])
            del man["manifest"]["provenance"]["journal"]["groups"]
            journal.write_text("\n".join([json.dumps(man)] + lines[1:]) + "\n")
        before = journal.read_bytes()
        other = build_artefact(tmp_path / "other", seed=9)
        res = run_cli(_args(other, up, journal))
        assert res.returncode == 2 and res.stderr.startswith(f"error: --journal {journal}:1: written by another "
                                                             "router (the router"), res.stderr
        assert "group use" not in res.stderr and "give a new --journal file" in res.stderr
        _mondrian_load(monkeypatch)
        res = run_cli(_args(art, up, journal))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "(group use (a Mondrian router's journal has a group on every line): false in the journal, true " \
           "here)" in res.stderr, res.stderr
    assert journal.read_bytes() == before
    _checked(journal)


def test_a_journal_with_another_T_or_models_is_refused(art, tmp_path):
    """Item 3: T and the models (names and prices) are compared too; the same router reopens its journal."""
    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.journal import Journal

    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        assert post(g.url, "/chat/completions", _chat(QS[0]))[0] == 200
    man = json.loads(journal.read_text().splitlines()[0])["manifest"]
    Journal(journal, man).close()  # the same router: appended to
    other = json.loads(json.dumps(man))
    T = man["T"]
    other["T"] = T + 1
    other["models"]["guide"]["price_out"] = 99.0
    with pytest.raises(UserError, match=rf"j.jsonl:1: written by another router \(T: {T} in the journal, {T + 1} "
                       r"here; models.guide.price_out: 10.0 in the journal, 99.0 here\); a journal holds"):
        Journal(journal, other)
    _checked(journal)


@pytest.mark.parametrize("calls", [1, 2])
def test_a_huge_upstream_answer_is_cut_counted_and_the_journal_stays_readable(art, tmp_path, calls):
    """Item 4: an upstream that ignores max_tokens (100,000 characters of answer; 8 MB in the issue's probe):
    each answer (``calls`` 2: the guide's unreadable reply too) is journaled and returned cut to
    MAX_ANSWER_CHARS, marked, and counted in /metrics; the line stays far below the reader's bound."""
    from ccpo_jax.gateway.engine import MAX_ANSWER_CHARS

    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        up.fault(QS[3], "huge", times=calls)  # the base call of round 1 (and the guide call after it)
        st, r = post(g.url, "/chat/completions", _chat(QS[3], max_rounds=1))
        assert st == 200, r
        truncated = _metric(g.url, "ccpo_gateway_truncated_texts_total")
    rec = json.loads(journal.read_text().splitlines()[1])
    base, guide = rec["rounds"][0]["base"], rec["rounds"][0]["guide"]
    assert len(base["answer"]) == MAX_ANSWER_CHARS and base["answer_truncated"] is True
    assert base["answer"] == ("x\x01\"\u00e9" * MAX_ANSWER_CHARS)[:MAX_ANSWER_CHARS]
    if calls == 2:
        assert guide["verdict_parsed"] is False and len(guide["raw"]) == MAX_ANSWER_CHARS and guide["raw_truncated"]
    assert truncated == calls
    assert all(len(a["answer"]) <= MAX_ANSWER_CHARS for a in r["ccpo"]["answer_set"])
    assert len(r["choices"][0]["message"]["content"]) <= MAX_ANSWER_CHARS
    assert len(journal.read_text().splitlines()[1].encode()) < 60_000
    _checked(journal)


def test_the_pending_feedback_table_is_bounded_by_bytes(art, tmp_path, monkeypatch):
    """Item 8: requests with large lines (100 kB questions here; 300 kB answers in the issue's probe) are
    kept for feedback up to MAX_PENDING_BYTES, the oldest forgotten first (404, saying so); the newest
    still take feedback; a restart reloads within the same bound."""
    import sys

    import ccpo_jax.gateway.journal as J

    monkeypatch.setattr(J, "MAX_PENDING_BYTES", 1 << 20)
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        ids = []
        for i in range(30):
            st, r = post(g.url, "/chat/completions", _chat(f"{QS[0]} {i:02d}" + " pad" * 20_000, max_rounds=1))
            assert st == 200
            ids.append(r["id"])
        j = g.gw.journal
        kept = list(j.pending)
        assert 5 <= len(kept) < 30 and kept == ids[-len(kept):]  # the newest, in order
        assert j.pending_bytes == sum(sys.getsizeof(x) for x in j.pending.values()) <= 1 << 20
        st, err = post(g.url, "/feedback", {"id": ids[0], "gold": "x"})
        assert st == 404 and "keeps the latest 100000 requests, at most 1 MiB" in err["error"]["message"]
        assert post(g.url, "/feedback", {"id": ids[-1], "gold": "x"})[0] == 200
    man = json.loads(journal.read_text().splitlines()[0])["manifest"]
    again = J.Journal(journal, man)
    again.close()
    assert list(again.pending) == kept[:-1][-len(again.pending):] and again.pending_bytes <= 1 << 20
    _checked(journal)


# -- the server's bounds on every client (items 6 and 7) -------------------------------------------------

LIMITS = dict(read_timeout_s=0.5, keep_alive_s=1, max_clients=8, max_header_bytes=4096)


def _bounded(art, up):
    from ccpo_jax.serving.server import ServerLimits

    return _gateway(art, up, server=ServerLimits(**LIMITS))


def _port(g) -> int:
    return int(g.url.split(":")[-1].split("/")[0])


def _until_closed(s, limit_s: float = 5.0) -> tuple[float | None, bytes]:
    """(seconds until the server closed ``s``, what it sent), None when still open after ``limit_s``."""
    import socket

    s.settimeout(limit_s)
    t0, got = time.monotonic(), b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return time.monotonic() - t0, got
            got += chunk
    except socket.timeout:
        return None, got
    except ConnectionResetError:
        return time.monotonic() - t0, got


def test_idle_and_half_sent_connections_are_bounded_and_new_clients_served(art):
    """Item 6: 20 connections that send nothing (the gateway keeps 8): each new one closes the oldest idle
    one, a new client is answered at once, and the rest are closed at the read timeout (408)."""
    import socket

    with FakeChatServer(SCRIPTS) as up, _bounded(art, up) as g:
        idle = [socket.create_connection(("127.0.0.1", _port(g))) for _ in range(20)]
        t0 = time.monotonic()
        st, r = post(g.url, "/chat/completions", _chat(QS[0], max_rounds=1), timeout=5)
        assert st == 200 and time.monotonic() - t0 < 2.0
        time.sleep(0.1)
        assert len(g.server.server_state.connections) <= LIMITS["max_clients"]
        closed = [_until_closed(s, 3.0) for s in idle]
        assert all(dt is not None for dt, _ in closed)  # none left open
        said = {got.split(b"\r\n", 1)[0] for _, got in closed}
        assert said <= {b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 408 Request Timeout", b""}, said
        assert b"HTTP/1.1 408 Request Timeout" in said and b"HTTP/1.1 503 Service Unavailable" in said
        for s in idle:
            s.close()


def test_a_trickled_head_an_idle_keep_alive_and_a_slow_body_are_cut(art):
    """Item 6: a head sent a byte every 0.1 s is answered 408 at the read timeout (bytes do not extend it);
    an idle keep-alive connection is closed after keep_alive_s; a body that stops is a 408 in OpenAI's shape."""
    import socket

    with FakeChatServer(SCRIPTS) as up, _bounded(art, up) as g:
        s = socket.create_connection(("127.0.0.1", _port(g)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        s.settimeout(0.1)
        t0, got = time.monotonic(), b""
        while time.monotonic() - t0 < 3 and not got:
            try:
                s.sendall(b"x")
                got = s.recv(65536)
            except socket.timeout:
                pass
        assert got.startswith(b"HTTP/1.1 408 Request Timeout") and 0.4 < time.monotonic() - t0 < 1.5
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        s.close()
        s = socket.create_connection(("127.0.0.1", _port(g)))
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        dt, _ = _until_closed(s, 5.0)
        # (the server's 0.5 s idle timer starts when it writes the reply, before this client reads it: 0.4995 s seen)
        assert dt is not None and 0.4 < dt < 2.0
        s.close()
        s = socket.create_connection(("127.0.0.1", _port(g)))
        s.sendall(b"POST /v1/feedback HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"id\": ")
        dt, got = _until_closed(s, 5.0)
        assert got.startswith(b"HTTP/1.1 408"), got
        err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout" and "body did not arrive within 0.5 s" in err["message"]
        s.close()


def test_a_huge_header_is_431_and_the_gateway_serves_on(art):
    """Item 7: request line and headers past max_header_bytes: 431 in OpenAI's shape, the connection closed
    after a few kB were read (not the 16 MiB sent), and the next client is served."""
    import socket

    with FakeChatServer(SCRIPTS) as up, _bounded(art, up) as g:
        s = socket.create_connection(("127.0.0.1", _port(g)))
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        try:
            for _ in range(256):
                s.sendall(b"a" * (64 << 10))
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 256  # the gateway stopped reading
        s.settimeout(5)
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            got = b""  # (the reset can overtake the 431 when unread bytes remain)
        if got:
            assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
        s.close()
        s = socket.create_connection(("127.0.0.1", _port(g)))  # a head just past the bound, read whole: the 431
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5000 + b"\r\n\r\n")
        _, got = _until_closed(s, 5.0)
        assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
        s.close()
        assert httpx.get(g.url.replace("/v1", "/healthz"), timeout=5).status_code == 200


@pytest.mark.parametrize("flag,value,msg", [
    ("--read-timeout", "0", "--read-timeout: expected a number of seconds > 0, got 0.0"),
    ("--max-clients", "0", "--max-clients: expected an integer >= 1, got 0"),
    ("--max-header-bytes", "10", "--max-header-bytes: expected an integer >= 1024, got 10"),
    ("--keep-alive", "0", "--keep-alive: expected an integer >= 1, got 0"),
])
def test_server_limit_flags_are_checked(art, tmp_path, flag, value, msg):
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g",
                   flag, value], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == f"error: {msg}", res.stderr


@pytest.mark.slow
def test_a_gateway_process_under_a_low_descriptor_limit_serves_past_idle_sockets(art, tmp_path):
    """Item 6 end to end: ``ccpo-jax gateway`` under ``ulimit -n 64`` (its default --max-clients is then 4)
    and 80 connections that send nothing: a new client is answered, and the idle ones are all closed
    by the read timeout (before: the process ran out of descriptors and new clients were reset)."""
    import os
    import resource
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with FakeChatServer(SCRIPTS) as up:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ccpo_jax.cli", "gateway", str(art), "--base", f"{up.url},{BASE_MODEL}", "--guide",
             f"{up.url},{GUIDE_MODEL}", "--port", str(port), "--max-batch", "1", "--no-access-log",
             "--read-timeout", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
        try:
            t0 = time.monotonic()
            while True:  # (the banner is printed before uvicorn listens)
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except ConnectionRefusedError:
                    assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stdout.read()
                    time.sleep(0.2)
            idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(80)]
            time.sleep(0.3)
            url = f"http://127.0.0.1:{port}/v1"
            st, r = post(url, "/chat/completions", _chat(QS[0], max_rounds=1), timeout=10)
            assert st == 200, r
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) < 64
            assert all(_until_closed(x, 5.0)[0] is not None for x in idle)
            for x in idle:
                x.close()
            assert post(url, "/chat/completions", _chat(QS[1], max_rounds=1), timeout=10)[0] == 200
        finally:
            proc.terminate()
            proc.wait(20)


def test_a_feedback_line_the_reader_would_refuse_is_not_written(art, tmp_path, monkeypatch, caplog):
    """Items 1-5's last line of defence: a feedback line goes through the cache reader's own check
    (``check_question``, data check's code path) before it is written; a line it refuses (a labelling bug,
    simulated here) is a 500, one log line, nothing written, and the request still awaits feedback."""
    import ccpo_jax.gateway.journal as J

    journal = tmp_path / "j.jsonl"
    real_label = J.label

    def bad_label(*a, **k):
        out = real_label(*a, **k)
        out["rounds"][0]["base"]["tokens_in"] = -1
        return out
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        st, r = post(g.url, "/chat/completions", _chat(QS[0]))
        before = journal.read_bytes()
        monkeypatch.setattr(J, "label", bad_label)
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway"):
            st, err = post(g.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})
        assert st == 500 and err["error"]["code"] == "internal_error", err
        assert journal.read_bytes() == before
        errs = [x.getMessage() for x in caplog.records if x.levelno >= logging.ERROR]
        assert len(errs) == 1 and "JournalLineRefused" in errs[0] and "rounds[0].base.tokens_in" in errs[0], errs
        monkeypatch.setattr(J, "label", real_label)
        assert post(g.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})[0] == 200
    _checked(journal)


@pytest.mark.parametrize("lines, where", [
    ([{"manifest": {"T": 3, "models": {}, "provenance": {"journal": True}}}], ":1: not a gateway journal"),
    ([[1, 2]], ":1: not a gateway journal"),
    ([{"manifest": {"T": 3, "provenance": ["journal"]}}], ":1: not a gateway journal"),
    (["JOURNAL", [1, 2]], ":2: not a gateway journal line"),
    (["JOURNAL", {"id": "x", "rounds": 3}], ":2: not a gateway journal line"),
    (["JOURNAL", {"rounds": []}], ":2: not a gateway journal line"),
], ids=["journal not an object", "line 1 a list", "provenance a list", "line 2 a list", "rounds a number", "no id"])
def test_a_file_that_is_not_a_journal_is_one_error_line_and_left_alone(art, tmp_path, lines, where):
    """A careless --journal (another JSONL file, a hand-edited journal): one line naming FILE:LINE, exit 2,
    the file untouched (before: an AttributeError traceback from the journal's reopening)."""
    good = tmp_path / "good.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, good) as g:  # a real journal's manifest line
        pass
    journal = tmp_path / "j.jsonl"
    journal.write_text("".join((good.read_text().splitlines()[0] if x == "JOURNAL" else json.dumps(x)) + "\n"
                               for x in lines))
    before = journal.read_bytes()
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,a", "--guide", "http://127.0.0.1:9/v1,b",
                   "--journal", str(journal)])
    assert res.returncode == 2 and f"{journal}{where}" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and journal.read_bytes() == before


def test_a_journal_this_router_wrote_before_the_served_models_were_named_reopens(art, tmp_path):
    """A journal written before the manifest named the upstream models that served (its ``models``: the
    router's trained names, no ``provenance.journal.router_models`` or ``groups``) is this router's: the
    gateway reopens it and takes feedback for its earlier requests (before: refused as 'written by another
    router', models.base.name differing). Served at other prices (--price), it is still refused."""
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up:
        with _gateway(art, up, journal) as g:
            st, r = post(g.url, "/chat/completions", _chat(QS[0]))
        lines = journal.read_text().splitlines()
        man = json.loads(lines[0])["manifest"]
        j = man["provenance"]["journal"]
        assert man["models"]["base"]["name"] != j["router_models"]["base"]["name"]  # (the case under test)
        man["models"] = j.pop("router_models")
        j.pop("groups")
        journal.write_text("\n".join([json.dumps({"manifest": man}), *lines[1:]]) + "\n")
        before = journal.read_bytes()
        with pytest.raises(UserError, match=r"models\.guide\.price_in: 2\.5 in the journal, 1\.0 here"):
            _gateway(art, up, journal, prices=((GUIDE_MODEL, 1.0, 3.0),))
        assert journal.read_bytes() == before
        with _gateway(art, up, journal) as g:
            st, fb = post(g.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})
            assert st == 200 and fb["labelled"], fb
    _checked(journal)
