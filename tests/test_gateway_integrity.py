"""The gateway's journal is never lost and every client is bounded (issue 48, docs/gateway.md).

Each test reproduces one probe of the issue against the gateway served by uvicorn in front of
the scripted upstream (tests/chat_server.py), and after each probe the journal must pass the
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

from chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts  # noqa: E402
from conftest import run_cli  # noqa: E402
from gateway_harness import GatewayThread, build_artefact, post  # noqa: E402

from ccpo_jax.collect.client import Endpoint, RetryPolicy  # noqa: E402
from ccpo_jax.gateway.app import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402

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
    takes 50 ms here (as it does for a large record), which widens the window between the check of
    the outcome and its write that a small record leaves to chance (4 of 8 got through in the issue's
    probe, at normal speed)."""
    import ccpo_jax.gateway.journal as J

    real_label = J.label

    def slow_label(*a, **k):
        time.sleep(0.05)
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
    import numpy as np

    from ccpo_jax.serving import Router

    load = Router.load

    def mondrian(path):
        r = load(path)
        r.group_kappas, r.rest_kappa = {"g1": np.float32(0.05)}, np.float32(0.9)
        return r
    monkeypatch.setattr(Router, "load", staticmethod(mondrian))
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
