"""The gateway says what it does (issue 51, item 6): an access line per request, the prices its costs
are counted at (and ``--price`` for an upstream's own), no rolling coverage before any feedback, the
journal naming the models that served, and a line when SIGTERM stops it.

Oracles: the scripted upstream's token counts (ccpo_jax/testing/chat_server.py) times the prices given by hand,
the journal file read back, the process's own output.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact, post  # noqa: E402
from tests.helpers import REPO, run_cli  # noqa: E402

from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint, RetryPolicy  # noqa: E402

FAST = RetryPolicy(retries=1, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=5.0, timeout_s=2.0,
                   attempt_timeout_s=5.0)
SCRIPTS = make_scripts(4)
QS = list(SCRIPTS)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return build_artefact(tmp_path_factory.mktemp("says"))


def _cfg(up, journal=None, **kw):
    return GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=FAST,
                         journal=None if journal is None else str(journal), max_batch=1, **kw)


def _ask(client, q):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}])


def _rolling(url: str) -> list[str]:
    text = httpx.get(url.replace("/v1", "/metrics")).text
    return [x for x in text.splitlines() if x.startswith("ccpo_gateway_rolling_coverage ")]


def test_access_log_prices_rolling_coverage_and_served_models(art, tmp_path, caplog):
    journal = tmp_path / "journal.jsonl"
    # the guide served at its own price (the router was trained at GPT-4o's $2.50 / $10)
    with FakeChatServer(SCRIPTS) as up, GatewayThread(load_gateway(art, _cfg(
            up, journal, prices=((GUIDE_MODEL, 1.0, 3.0),)))) as g:
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
        assert _rolling(g.url) == []  # no value before any feedback (0.0 would read as a failure)
        # the lines of the requests made in the window only: the server thread logs a request's line after
        # its response, so _rolling's GET /metrics line above sometimes landed inside the window, and the
        # 404's line after it (the window stays open until two POST lines came, at most 10 s)
        def lines() -> list[str]:
            return [m for m in (r.getMessage() for r in caplog.records if r.name == "ccpo_jax.gateway.access")
                    if not m.startswith("GET /metrics ")]
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway.access"):
            reply = _ask(client, QS[0])
            assert post(g.url, "/chat/completions", {"model": "nope", "messages": []})[0] == 404
            t0 = time.monotonic()
            while len(lines()) < 2 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            time.sleep(0.1)  # (a third line, were one logged, would come now)
        lines = lines()
        assert len(lines) == 2, lines
        assert lines[0].startswith("POST /v1/chat/completions 200 ") and reply.id in lines[0]
        assert f"rounds {reply.ccpo['rounds']} " in lines[0] and " cents" in lines[0]
        assert lines[1].startswith("POST /v1/chat/completions 404 ")
        st, _ = post(g.url, "/feedback", {"id": reply.id, "gold": SCRIPTS[QS[0]].gold})
        assert st == 200 and len(_rolling(g.url)) == 1
    tokens = reply.ccpo["tokens"]
    base_price = json.loads((art / "manifest.json").read_text())["models"]["base"]
    want = (tokens["guide"]["tokens_in"] * 1.0 + tokens["guide"]["tokens_out"] * 3.0
            + tokens["base"]["tokens_in"] * base_price["price_in"]
            + tokens["base"]["tokens_out"] * base_price["price_out"]) / 1e6 * 100
    assert reply.ccpo["cost_cents"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    manifest = json.loads(journal.read_text().splitlines()[0])["manifest"]
    assert manifest["models"]["guide"] == {"name": GUIDE_MODEL, "price_in": 1.0, "price_out": 3.0}
    assert manifest["models"]["base"]["name"] == BASE_MODEL
    trained = manifest["provenance"]["journal"]["router_models"]
    assert trained["guide"]["name"] != GUIDE_MODEL and trained["guide"]["price_in"] == 2.5


def test_no_access_log_flag_turns_the_lines_off(art, caplog):
    with FakeChatServer(SCRIPTS) as up, GatewayThread(load_gateway(art, _cfg(up, access_log=False))) as g:
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
        with caplog.at_level(logging.INFO, logger="ccpo_jax.gateway.access"):
            _ask(client, QS[1])
    assert [r for r in caplog.records if r.name == "ccpo_jax.gateway.access"] == []


@pytest.mark.parametrize("spec, msg", [
    ("gpt-x", "expected MODEL=IN,OUT"), ("g=1", "expected MODEL=IN,OUT"), ("g=-1,2", "expected MODEL=IN,OUT"),
    ("nope=1,2", "'nope' is not an upstream model"),
])
def test_bad_price_flag_is_one_error_line(art, tmp_path, spec, msg):
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g",
                   "--price", spec], cwd=tmp_path)
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_sigterm_says_it_stopped_and_what_it_kept(art, tmp_path):
    journal, port = tmp_path / "journal.jsonl", _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with FakeChatServer(SCRIPTS) as up:
        proc = subprocess.Popen([sys.executable, "-m", "ccpo_jax.cli", "gateway", str(art), "--port", str(port),
                                 "--max-batch", "1", "--journal", str(journal), "--base", f"{up.url},{BASE_MODEL}",
                                 "--guide", f"{up.url},{GUIDE_MODEL}"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            url, t0 = f"http://127.0.0.1:{port}/v1", time.monotonic()
            while True:
                try:
                    httpx.get(url.replace("/v1", "/healthz"), timeout=1)
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stderr.read()
                    time.sleep(0.2)
            _ask(openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30), QS[2])
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert "costs are in cents at the router's trained prices" in out and "--price MODEL=IN,OUT" in out
    assert "coverage = the share of questions whose answer set holds a correct answer" in out
    assert (f"gateway: stopped after 1 answered chat completion(s); kept the journal {journal} (2 line(s)"
            in out), out
    assert "POST /v1/chat/completions 200" in err and "GET /healthz 200" in err
    assert len(Path(journal).read_text().splitlines()) == 2
