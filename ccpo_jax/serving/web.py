"""What every HTTP endpoint of ccpo-jax shares: OpenAI's error shape and a bounded JSON body reader.

``ccpo-jax serve`` (:mod:`ccpo_jax.serving.app`) and the gateway (:mod:`ccpo_jax.gateway.app`) answer
every error as OpenAI's API does, ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status, so one client error handler reads both; :func:`read_json` reads a request body up to a byte cap
within a deadline (uvicorn bounds a request's head, not its body: :mod:`ccpo_jax.serving.server`).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse


class RequestError(Exception):
    """A client error: the HTTP status and OpenAI's error object (``kind`` is its ``type``). ``close``:
    the body was not read, so the connection is closed after the answer (``Connection: close``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", close: bool = False,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.close, self.headers = close, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return error(self.status, str(self), type_=self.kind, param=self.param, code=self.code, close=self.close,
                     headers=self.headers)


def error(status: int, message: str, *, type_: str | None = None, param: str | None = None,
          code: str | None = None, close: bool = False, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """OpenAI's error reply: ``type_`` defaults to ``invalid_request_error`` below 500, else ``server_error``."""
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    h = dict(headers or {})
    if close:  # uvicorn closes the connection after a reply that says so
        h["Connection"] = "close"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=h)


class ClientGone(Exception):
    """The client closed its connection before the whole body arrived (nothing to answer)."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, cap: int, timeout_s: float, *, constants: bool = True) -> Any:
    """The body as JSON, read up to ``cap`` bytes (413 beyond; a declared length over it is refused
    before a byte is read, so no ``100 Continue`` goes out) within ``timeout_s`` seconds (408 after),
    or RequestError; ClientGone when the client hangs up first. ``constants`` False: ``NaN`` and
    ``Infinity`` are invalid JSON (strict JSON; ``ccpo-jax serve``)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise RequestError(413, f"the body has {declared} bytes, more than {cap}", code="body_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise RequestError(413, f"the body is longer than {cap} bytes", code="body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    try:
        return json.loads(raw.decode("utf-8"), **({} if constants else {"parse_constant": _no_constant}))
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise RequestError(400, "the body is not valid JSON (nested too deeply)", code="invalid_json") from None
