"""The gateway's typed wire schema (issue 52, item 5): pydantic models in place of the hand-written validator.

Oracle: the validator the schema replaced (``gateway/app.py``'s ``parse_request`` before issue 52), copied
below verbatim: on bodies with at most one fault each, the schema gives the same status, ``param`` and
``code`` and, for good bodies, the same (question, group, caps, stream). The replies are the dict literals
they replaced, byte for byte (key order included).
"""
from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from ccpo_jax.gateway.engine import Caps
from ccpo_jax.gateway.schema import (MODEL_ID, ChatCompletion, ChatCompletionChunk, parse_request, completion_body,
                                     sse_chunks)
from ccpo_jax.serving.web import RequestError
from envs.cache.values import group_problem

# -- the oracle: the validator before issue 52 (verbatim but for the unused router argument) ---------------
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "audio",
               "modalities", "prediction")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise RequestError(400, f"{where}[{i}]: only text parts are supported", param=f"{where}[{i}]",
                                   code="unsupported_content")
            parts.append(p["text"])
        return "\n".join(parts)
    raise RequestError(400, f"{where}: expected a string or a list of text parts", param=where)


def old_parse_request(body: Any, max_chars: int) -> tuple[str, str | None, Caps, bool]:
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "model: required (a string)", param="model")
    if model != MODEL_ID:
        raise RequestError(404, f"The model `{model}` does not exist; this gateway serves `{MODEL_ID}`",
                           param="model", code="model_not_found")
    for k in UNSUPPORTED:
        if body.get(k) is not None:
            raise RequestError(400, f"{k}: not supported by the CCPO gateway", param=k, code="unsupported_parameter")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise RequestError(400, "n: only 1 is supported", param="n", code="unsupported_parameter")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages: expected a non-empty array", param="messages")
    question = None
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}]: expected an object with a role", param=f"messages[{i}]")
        if m["role"] == "user":
            question = _text_content(m.get("content"), f"messages[{i}].content")
    if question is None or not question.strip():
        raise RequestError(400, "messages: no user message with text (the question is the last user message)",
                           param="messages")
    if len(question) > max_chars:
        raise RequestError(400, f"messages: the question has {len(question)} characters, more than {max_chars}",
                           param="messages", code="question_too_long")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream: expected true or false", param="stream")
    group = body.get("group")
    if group is not None:
        problem = group_problem(group)
        if problem:
            raise RequestError(400, f"group: {problem}", param="group")
    mr = body.get("max_rounds")
    if mr is not None and (isinstance(mr, bool) or not isinstance(mr, int) or mr < 1):
        raise RequestError(400, "max_rounds: expected an integer >= 1", param="max_rounds")
    mc = body.get("max_cost_cents")
    if mc is not None and (isinstance(mc, bool) or not isinstance(mc, (int, float)) or not math.isfinite(mc)
                           or mc <= 0):
        raise RequestError(400, "max_cost_cents: expected a number > 0", param="max_cost_cents")
    return question, group, Caps(mr, None if mc is None else float(mc)), stream


# -- bodies: good ones, and each with one fault --------------------------------------------------------------
GOOD = {"model": MODEL_ID, "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "Who wrote Emma?"}]}
FAULTS = [
    ("model", None), ("model", 7), ("model", "gpt-4o"), ("model", ""), ("tools", [{}]), ("response_format", {}),
    ("n", 2), ("n", True), ("n", "1"), ("messages", []), ("messages", "hi"), ("messages", None),
    ("messages", [{"content": "x"}]), ("messages", [3]), ("messages", [{"role": 5, "content": "x"}]),
    ("messages", [{"role": "system", "content": "x"}]), ("messages", [{"role": "user", "content": "   "}]),
    ("messages", [{"role": "user", "content": None}]), ("messages", [{"role": "user", "content": 4}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 3}]}]),
    ("messages", [{"role": "user", "content": "x" * 101}]),
    ("stream", "yes"), ("stream", 1), ("stream", None), ("group", 3), ("group", ""), ("group", "a\nb"),
    ("max_rounds", 0), ("max_rounds", True), ("max_rounds", 1.5), ("max_rounds", "2"),
    ("max_cost_cents", -1), ("max_cost_cents", 0), ("max_cost_cents", True), ("max_cost_cents", float("nan")),
    ("max_cost_cents", float("inf")), ("max_cost_cents", "1"),
]
GOOD_VARIANTS = [
    {}, {"stream": True}, {"stream": False}, {"group": "history"}, {"max_rounds": 2}, {"max_cost_cents": 3},
    {"max_cost_cents": 0.5, "max_rounds": 1}, {"n": 1}, {"n": 1.0}, {"temperature": 0.2, "user": "u"},
    {"tools": None}, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b", "x": 1}]}]},
    {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": None},
                  {"role": "user", "content": "last"}]},
]


def _outcome(f, body):
    try:
        return ("ok", f(body, 100))
    except RequestError as e:
        return (e.status, e.param, e.code)


@pytest.mark.parametrize("field,value", FAULTS)
def test_one_fault_is_refused_as_before(field, value):
    body = dict(GOOD, **{field: value}) if value is not None or field != "model" else \
        {k: v for k, v in GOOD.items() if k != "model"}
    old = _outcome(old_parse_request, body)
    assert old[0] != "ok", body
    assert _outcome(_new, body) == old


@pytest.mark.parametrize("extra", GOOD_VARIANTS)
def test_good_bodies_read_as_before(extra):
    body = dict(GOOD, **extra)
    assert _outcome(_new, body) == _outcome(old_parse_request, body)
    assert _outcome(_new, body)[0] == "ok"


def _new(body, max_chars):
    req, question = parse_request(body, max_chars)
    return question, req.group, Caps(req.max_rounds, req.max_cost_cents), req.stream


def test_random_single_faults_agree_with_the_old_validator():
    rng = random.Random(0)
    for _ in range(300):
        body = json.loads(json.dumps(dict(GOOD, **rng.choice(GOOD_VARIANTS))))
        field, value = rng.choice(FAULTS)
        if rng.random() < 0.5:
            body[field] = value
        assert _outcome(_new, body) == _outcome(old_parse_request, body), body
    for bad in ([], "x", 3, None):
        assert _outcome(_new, bad) == _outcome(old_parse_request, bad) == (400, None, None)


# -- replies: the dict literals they replaced ----------------------------------------------------------------
class _Out:
    content = "Jane Austen"
    usage = {"prompt_tokens": 812, "completion_tokens": 64, "total_tokens": 876}


CCPO = {"answer_set": [{"round": 1, "role": "guide", "answer": "Jane Austen"}], "empty_set": False, "fallback": None,
        "abstained": False, "rounds": 1, "stopped_by": "router", "decisions": [{"round": 1, "probs": {"base": 0.25}}],
        "cost_cents": 0.012, "coverage_target": 0.9}


def test_completion_body_is_the_old_literal_byte_for_byte():
    old = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": MODEL_ID,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": _Out.content},
                        "logprobs": None, "finish_reason": "stop"}],
           "usage": _Out.usage, "ccpo": CCPO}
    new = completion_body("chatcmpl-1", 7, _Out.content, _Out.usage, CCPO)
    assert json.dumps(new) == json.dumps(old)
    assert isinstance(ChatCompletion.model_validate(new), ChatCompletion)


def test_stream_chunks_are_the_old_literals_byte_for_byte():
    base = {"id": "c", "object": "chat.completion.chunk", "created": 7, "model": MODEL_ID}
    deltas = [({"role": "assistant", "content": ""}, None), ({"content": _Out.content}, None), ({}, "stop")]
    old = []
    for delta, fin in deltas:
        c = dict(base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}])
        if fin is not None:
            c["usage"], c["ccpo"] = _Out.usage, CCPO
        old.append(b"data: " + json.dumps(c).encode() + b"\n\n")
    old.append(b"data: [DONE]\n\n")
    assert sse_chunks("c", 7, _Out.content, _Out.usage, CCPO) == old
    assert ChatCompletionChunk.model_validate(json.loads(old[2][6:])).usage.total_tokens == 876
