"""The gateway's wire schema: OpenAI's chat-completions request and reply as typed models (pydantic v2).

As OpenAI's API and vLLM's OpenAI server do, a request is validated against a model: each field's type
and bounds are declared once, and a refusal names the field (the error's ``param``, from pydantic's
``loc``: ``messages[0].content[1]``). Fields the protocol ignores (``temperature``, ``user``, ...) are
accepted (``extra="allow"``); those it cannot honour are refused by name (:data:`UNSUPPORTED`). Replies
are built as models and dumped in their field order, the order clients have always received.

Why pydantic, not dataclasses: the schema has optional, extra and union fields, and every error must
name its place; a dataclass would keep the hand-written validator this replaces.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ccpo_jax.serving.web import RequestError
from envs.cache.values import group_problem

#: The model id the gateway serves (GET /v1/models); a request must name it.
MODEL_ID = "ccpo-router"

#: OpenAI request fields the protocol cannot honour: refused, not silently ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "audio",
               "modalities", "prediction")


class TextPart(BaseModel):
    """One part of a message's content list; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """A message: its role and its content (a string or a list of text parts; only the last user
    message is read: it is the question)."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Any = None

    def text(self, where: str) -> str:
        c = self.content
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            parts = []
            for i, p in enumerate(c):
                try:
                    parts.append(TextPart.model_validate(p).text)
                except ValidationError:
                    raise RequestError(400, f"{where}[{i}]: only text parts are supported", param=f"{where}[{i}]",
                                       code="unsupported_content") from None
            return "\n".join(parts)
        raise RequestError(400, f"{where}: expected a string or a list of text parts", param=where)


def _positive_finite(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PydanticCustomError("positive_number", "expected a number > 0")
    return float(v)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's fields the gateway reads, plus its own ``group`` (a
    Mondrian router's question group) and caps ``max_rounds`` and ``max_cost_cents``."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    n: Any = 1
    stream: StrictBool = False
    group: Any = None
    max_rounds: Annotated[StrictInt, Field(ge=1)] | None = None
    max_cost_cents: Annotated[Any, Field()] = None

    @field_validator("max_cost_cents")
    @classmethod
    def _cost(cls, v: Any) -> float | None:
        return None if v is None else _positive_finite(v)

    @field_validator("group")
    @classmethod
    def _group(cls, v: Any) -> Any:
        # the cache's own rule (a Mondrian journal keeps it), before any upstream call
        problem = None if v is None else group_problem(v)
        if problem:
            raise PydanticCustomError("group", "{problem}", {"problem": problem})
        return v


#: The message of a refused field, by pydantic error type (the field's name is put before it).
_MESSAGES = {
    "model": "required (a string)",
    "messages": "expected a non-empty array",
    "stream": "expected true or false",
    "max_rounds": "expected an integer >= 1",
    "max_cost_cents": "expected a number > 0",
}


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _refusal(e: ValidationError) -> RequestError:
    """The first refused field as OpenAI's 400 (its ``param`` the field's path)."""
    err = e.errors()[0]
    loc = err["loc"]
    field = loc[0] if loc else None
    if field == "messages" and len(loc) > 1:  # a message that is not an object with a role
        where = _param(loc[:2])
        return RequestError(400, f"{where}: expected an object with a role", param=where)
    if field == "group":
        return RequestError(400, f"group: {err['msg']}", param="group")
    what = _MESSAGES.get(field, err["msg"])
    return RequestError(400, f"{_param(loc)}: {what}", param=_param(loc) or None)


def parse_request(body: Any, max_chars: int) -> tuple[ChatCompletionRequest, str]:
    """(the validated request, its question: the last user message's text), or RequestError (4xx)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model != MODEL_ID:  # OpenAI's 404 comes before any other check
        raise RequestError(404, f"The model `{model}` does not exist; this gateway serves `{MODEL_ID}`",
                           param="model", code="model_not_found")
    if isinstance(model, str):  # (a missing or non-string model is refused first, by the schema)
        for k in UNSUPPORTED:
            if body.get(k) is not None:
                raise RequestError(400, f"{k}: not supported by the CCPO gateway", param=k,
                                   code="unsupported_parameter")
        n = body.get("n", 1)
        if n != 1 or isinstance(n, bool):
            raise RequestError(400, "n: only 1 is supported", param="n", code="unsupported_parameter")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _refusal(e) from None
    question = None
    for i, m in enumerate(req.messages):
        if m.role == "user":
            question = m.text(f"messages[{i}].content")
    if question is None or not question.strip():
        raise RequestError(400, "messages: no user message with text (the question is the last user message)",
                           param="messages")
    if len(question) > max_chars:
        raise RequestError(400, f"messages: the question has {len(question)} characters, more than {max_chars}",
                           param="messages", code="question_too_long")
    return req, question


# -- replies ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str = "stop"


class ChatCompletion(BaseModel):
    """The reply; ``ccpo`` is the gateway's account of the request (docs/gateway.md, "The ccpo object")."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str = MODEL_ID
    choices: list[Choice]
    usage: Usage
    ccpo: dict[str, Any]


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed reply; the last one carries ``usage`` and ``ccpo``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str = MODEL_ID
    choices: list[ChunkChoice]
    usage: Usage | None = None
    ccpo: dict[str, Any] | None = None

    def dump(self) -> dict:
        """The chunk as sent: ``usage`` and ``ccpo`` only on the last one."""
        return self.model_dump(exclude=None if self.usage is not None else {"usage", "ccpo"})


class ModelCard(BaseModel):
    id: str = MODEL_ID
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ccpo-jax"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = [ModelCard()]


class ErrorBody(BaseModel):
    """OpenAI's error object (``type`` is ``invalid_request_error``, ``server_error`` or ``upstream_error``)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


def completion_body(cid: str, created: int, content: str, usage: dict, ccpo: dict) -> dict:
    """A chat completion's reply body (the JSON object clients read)."""
    return ChatCompletion(id=cid, created=created, choices=[Choice(message=AssistantMessage(content=content))],
                          usage=Usage(**usage), ccpo=ccpo).model_dump()


def sse_chunks(cid: str, created: int, content: str, usage: dict, ccpo: dict) -> list[bytes]:
    """A streamed reply: the role, the content, the end (with ``usage`` and ``ccpo``), then ``[DONE]``."""
    deltas = [({"role": "assistant", "content": ""}, None), ({"content": content}, None), ({}, "stop")]
    chunks = []
    for delta, fin in deltas:
        last = fin is not None
        c = ChatCompletionChunk(id=cid, created=created, choices=[ChunkChoice(delta=delta, finish_reason=fin)],
                                usage=Usage(**usage) if last else None, ccpo=ccpo if last else None)
        chunks.append(b"data: " + json.dumps(c.dump()).encode() + b"\n\n")
    return chunks + [b"data: [DONE]\n\n"]
