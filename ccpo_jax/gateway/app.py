"""The gateway's HTTP app (Starlette) around :class:`~ccpo_jax.gateway.service.Gateway`: OpenAI's request
and error shapes, body cap and deadline (:func:`ccpo_jax.serving.web.read_json`), client disconnects."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ccpo_jax.gateway.access import SCOPE_KEY, AccessLog, completion_summary
from ccpo_jax.gateway.engine import CapTooSmall, Caps
from ccpo_jax.gateway.journal import FeedbackError
from ccpo_jax.gateway.schema import ModelList, parse_request
from ccpo_jax.gateway.service import Gateway
from ccpo_jax.gateway.state import StateUnavailable
from ccpo_jax.gateway.upstream import UpstreamError
from ccpo_jax.serving.web import ClientGone, RequestError, read_json
from envs.cache.values import lone_surrogate

log = logging.getLogger("ccpo_jax.gateway")


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_json(request: Request, cap: int, timeout_s: float):
    """The body as JSON (:func:`ccpo_jax.serving.web.read_json`: 413 over ``cap``, 408 after ``timeout_s``),
    its text checked by the cache's rule, or RequestError."""
    body = await read_json(request, cap, timeout_s)
    # "\ud800" parses to a str that UTF-8 cannot write: refused by the cache's rule (envs.cache.values)
    # before any upstream call (it failed the journal's write: a 500 after the calls were paid)
    bad = lone_surrogate(body)
    if bad:
        raise RequestError(400, f"{bad[0] or 'the body'}: {bad[1]}", param=bad[0] or None, code="invalid_text")
    return body


def log_unexpected(what: str, e: BaseException) -> None:
    """One log line for an unexpected error (a bug, a full disk): its type, its message on one line
    and where it was raised, no traceback (docs/gateway.md)."""
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    msg = " ".join(str(e).split())
    log.error("%s failed: %s: %s%s", what, type(e).__name__, msg[:300] + ("..." if len(msg) > 300 else ""), at)


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _run_watched(request: Request, coro):
    """``coro``'s result; if the client hangs up first, ``coro`` (and its upstream calls) is cancelled."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    return task.result()


def build_app(gw: Gateway) -> AccessLog:
    """The ASGI app: the routes behind the access log (``gw.cfg.access_log``; its counts are
    ``app.counts`` either way)."""
    m = gw.metrics

    async def _complete(request: Request, question, group, caps):
        """The protocol's (completion id, outcome), None on a disconnect, or the error reply."""
        try:
            return await _run_watched(request, gw.complete(question, group, caps))
        except CapTooSmall as e:
            m.requests.labels("bad_request").inc()
            return _error(RequestError(400, str(e), param="max_cost_cents", code="cost_cap_too_small"))
        except UpstreamError as e:
            m.requests.labels("upstream_error").inc()
            status = 504 if e.kind == "timeout" else 502
            return _error(RequestError(status, f"upstream failed; no answer was chosen: {e}",
                                       code=f"upstream_{e.kind}", kind="upstream_error"))
        except Exception as e:  # noqa: BLE001 - a bug or a full disk: OpenAI's shape, one log line, no answer
            log_unexpected("request", e)
            m.requests.labels("internal_error").inc()
            m.errors.labels("internal").inc()
            return _error(RequestError(500, f"internal error ({type(e).__name__}); no answer was chosen",
                                       code="internal_error", kind="server_error"))

    async def completions(request: Request) -> Response:
        try:
            body = await _read_json(request, gw.cfg.max_body_bytes, gw.cfg.server.read_timeout_s)
            req, question = parse_request(body, gw.cfg.max_question_chars)
            group, caps, stream = req.group, Caps(req.max_rounds, req.max_cost_cents), req.stream
        except RequestError as e:
            m.requests.labels("bad_request").inc()
            m.errors.labels(f"http_{e.status}").inc()
            return _error(e)
        except ClientGone:  # hung up before its body was complete: as a disconnect during the protocol
            res = None
        else:
            res = await _complete(request, question, group, caps)
            if isinstance(res, Response):
                return res
        if res is None:
            m.requests.labels("client_disconnected").inc()
            m.errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        cid, out = res
        m.requests.labels("ok").inc()
        request.scope[SCOPE_KEY] = completion_summary(cid, out, sum(t["cost_cents"] for t in out.tokens.values()))
        if stream:
            chunks = gw.sse_chunks(cid, out)

            async def gen():
                for c in chunks:
                    yield c
            return StreamingResponse(gen(), media_type="text/event-stream")
        return JSONResponse(gw.completion_body(cid, out))

    async def models(request: Request) -> Response:
        return JSONResponse(ModelList().model_dump())

    async def feedback(request: Request) -> Response:
        try:
            body = await _read_json(request, 1 << 16, gw.cfg.server.read_timeout_s)
            return JSONResponse(await gw.feedback(body))
        except RequestError as e:
            return _error(e)
        except ClientGone:  # hung up before its body was complete: nothing was recorded, nobody to answer
            return Response(status_code=499)
        except StateUnavailable as e:  # nothing was recorded: the client may send it again
            m.errors.labels("feedback_503").inc()
            r = _error(RequestError(503, str(e), code=e.code, kind="server_error"))
            r.headers["Retry-After"] = str(max(1, round(e.retry_after_s)))
            return r
        except FeedbackError as e:
            m.errors.labels(f"feedback_{e.status}").inc()
            return _error(RequestError(e.status, str(e), param=e.field))
        except Exception as e:  # noqa: BLE001 - as a chat completion's: OpenAI's shape, one log line
            log_unexpected("feedback", e)
            m.errors.labels("internal").inc()
            return _error(RequestError(500, f"internal error ({type(e).__name__}); the feedback was not recorded",
                                       code="internal_error", kind="server_error"))

    async def metrics(request: Request) -> Response:
        await gw.state.refresh()  # a shared store's latest kappa and coverage (bounded by its timeout)
        return Response(gw.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def healthz(request: Request) -> Response:
        return JSONResponse(gw.router.describe())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(RequestError(status, f"{request.method} {request.url.path}: "
                                   f"{'not found' if status == 404 else 'method not allowed'}", code=str(status)))

    return AccessLog(Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/feedback", feedback, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={404: not_found, 405: not_found}), enabled=gw.cfg.access_log)
