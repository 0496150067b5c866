"""Real replies of llama.cpp's ``llama-server``, replayed through the collector's parsing.

``tests/fixtures/llama_server/`` holds response bodies recorded from a real ``llama-server``
(the build and version are in its README.md) serving the designed bigram models of
``ccpo_jax/testing/llama_server.py``: the base answers ``Answer: Paris`` with p(" Paris") = 0.45 and
the guide ``Yes`` with p 0.70, so the confidence (0.45) and the uncertainty (0.30) the
collector must read from them are known. Each body goes through the code the collector
runs on a live reply: :func:`parse_completion` / :func:`parse_model_list` and, for the error
and the whole call, :class:`ChatClient` over an ``httpx`` transport that answers with the
recorded body.
"""
from __future__ import annotations

import json

import httpx
import pytest

from ccpo_jax.collect.client import ChatClient
from ccpo_jax.llm import paper as P
from ccpo_jax.llm.wire import Endpoint, EndpointError, RetryPolicy, parse_completion, parse_model_list
from tests.helpers import REPO

FIX = REPO / "tests" / "fixtures" / "llama_server"


def _fx(name: str) -> dict:
    return json.loads((FIX / f"{name}.json").read_text())


def _client(name: str, model: str) -> tuple[ChatClient, list[dict]]:
    """A ChatClient whose every request is answered with the fixture's status and body."""
    fx, sent = _fx(name), []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append({"method": request.method, "path": request.url.path,
                     "body": json.loads(request.content) if request.content else None})
        return httpx.Response(fx["status"], json=fx["reply"])

    c = ChatClient(Endpoint("http://127.0.0.1:8080/v1", model), RetryPolicy(retries=2, backoff_s=0.0),
                   sleep=lambda s: None)
    c._http = httpx.Client(transport=httpx.MockTransport(answer))
    return c, sent


def test_the_model_list_names_the_alias():
    for role in ("base", "guide"):
        fx = _fx(f"{role}_models")
        assert fx["status"] == 200
        assert parse_model_list(fx["reply"]) == [f"bigram-{role}"]
    c, sent = _client("base_models", "bigram-base")
    assert c.served_models() == ["bigram-base"] and sent[0]["path"] == "/v1/models"


@pytest.mark.parametrize("tag", ["logprobs_top1", "logprobs_only"])
def test_log_probs_give_the_designed_confidence_and_uncertainty(tag):
    base = parse_completion(_fx(f"base_chat_{tag}")["reply"])
    assert base.text == "Answer: Paris" and base.finish_reason == "stop" and base.model == "bigram-base"
    assert "".join(t for t, _ in base.logprobs) == base.text
    answer, span = P.parse_base_answer(base.text)
    assert answer == "Paris"
    assert P.answer_confidence(base.logprobs, base.text, span) == pytest.approx(0.45, abs=1e-3)
    guide = parse_completion(_fx(f"guide_chat_{tag}")["reply"])
    assert guide.text == "Yes" and P.parse_verdict(guide.text) == P.Verdict(True, None)
    assert P.verdict_uncertainty(guide.logprobs) == pytest.approx(0.30, abs=1e-3)
    assert base.tokens_in > 0 and base.tokens_out == len(base.logprobs)


def test_without_log_probs_nothing_is_invented():
    for role in ("base", "guide"):
        r = parse_completion(_fx(f"{role}_chat_no_logprobs")["reply"])
        assert r.logprobs is None and r.text in ("Answer: Paris", "Yes")
        assert P.verdict_uncertainty(r.logprobs) is None


def test_a_cut_reply_says_length():
    r = parse_completion(_fx("base_chat_cut_at_max_tokens")["reply"])
    assert r.finish_reason == "length" and r.text == "Answer:" and r.tokens_out == 1
    assert P.parse_base_answer(r.text) is None


def test_an_unlisted_model_is_answered_by_the_loaded_one():
    """llama-server answers a request for a model it does not serve (200) with its own model:
    what GET /v1/models is asked for before the first paid call."""
    fx = _fx("base_chat_unlisted_model")
    assert fx["status"] == 200 and fx["request"]["model"] == "gpt-4o"
    r = parse_completion(fx["reply"])
    assert r.text == "Answer: Paris" and r.model != "gpt-4o"


def test_a_prompt_over_the_context_is_not_retried_and_its_message_is_shown():
    fx = _fx("base_error_context_length")
    assert fx["status"] == 400
    c, sent = _client("base_error_context_length", "bigram-base")
    with pytest.raises(EndpointError) as e:
        c.chat(fx["request"])
    assert len(sent) == 1 and e.value.stats.attempts == 1
    assert "HTTP 400 (not retried)" in str(e.value) and fx["reply"]["error"]["message"][:60] in str(e.value)


def test_a_whole_call_through_the_client():
    c, sent = _client("guide_chat_logprobs_top1", "bigram-guide")
    reply, stats = c.chat(_fx("guide_chat_logprobs_top1")["request"])
    assert stats.attempts == 1 and reply.text == "Yes" and reply.logprobs
    assert sent[0]["path"] == "/v1/chat/completions" and sent[0]["body"]["top_logprobs"] == 1
