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
