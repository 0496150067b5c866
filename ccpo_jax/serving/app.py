"""``ccpo-jax serve``: an exported :class:`Router` over HTTP, on the gateway's server (docs/export.md).

Endpoints:

* ``GET /healthz`` -> 200 ``Router.describe()``.
* ``POST /v1/route`` with ``Content-Type: application/json`` and a body
  ``{"rounds": [...], "can_continue"?: bool, "group"?: str, "id"?: any}`` -> 200 one decision
  (``id`` echoed), or ``{"batch": [request, ...]}`` (at most ``max_batch``) -> 200
  ``{"decisions": [...]}``.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (:mod:`ccpo_jax.serving.web`):
400 invalid JSON (NaN and Infinity included) or not an object, and a request the HTTP parser refuses
(a bad request line, HTTP/0.9, an unknown method, two ``Content-Length`` headers or one that is not
digits); 404 unknown path; 405 a method the path does not take (with ``Allow``; a HEAD reply has no
body); 408 a request line and headers not complete within the read timeout of the connection's start
or previous answer, or a body not complete within it; 411 no ``Content-Length`` (or a chunked body);
413 a body over ``max_bytes`` (not read; no ``100 Continue`` is sent before the refusal) or a batch
over ``max_batch``; 415 not JSON; 422 a request that does not match the feature spec (the message
names the field; also both ``batch`` and ``rounds``, or an ``id`` that strict JSON cannot carry, such
as 1e400); 431 a head over the header bound; 503 a new connection while every allowed one has a
request in progress (an idle one is closed to make room instead); 500 anything else (logged, message
generic). Output is strict JSON (no NaN/Infinity). The server and its bounds on every client are the
gateway's (:mod:`ccpo_jax.serving.server`, docs/integrity.md).
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ccpo_jax.serving.artifact import RouterInputError
from ccpo_jax.serving.router import Router
from ccpo_jax.serving.server import ServerLimits, uvicorn_config
from ccpo_jax.serving.web import ClientGone, RequestError, error, read_json

MAX_BYTES = 1 << 20
MAX_BATCH = 1024
#: listen(2) backlog: connections the kernel queues before accept (the stdlib default is 5; 128
#: still overflowed once in 200 connects made in a burst on a busy 2-core machine, 1024 never did).
BACKLOG = 1024
#: serve's bounds on every client: 64 connections (each a file descriptor, no thread), a request's head
#: within 10 s of the connection or the previous answer (its body within 10 s more), 30 s keep-alive.
LIMITS = ServerLimits(read_timeout_s=10.0, keep_alive_s=30, max_clients=64)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
#: The method each path answers (the ``Allow`` header of a 405).
ALLOW = {"/healthz": "GET", "/v1/route": "POST"}


def log_line(message: str) -> None:
    """One line on stderr (refusals, timeouts, disconnects, internal errors)."""
    print(f"ccpo-jax serve: {message}", file=sys.stderr, flush=True)


def _check_id(req: dict, where: str) -> None:
    """An echoed ``id`` must survive strict JSON output (1e400 parses as inf: refuse it)."""
    if "id" in req:
        try:
            json.dumps(req["id"], allow_nan=False)
        except (ValueError, RecursionError):
            raise RouterInputError(f"{where}.id: a non-finite number (NaN, Infinity or beyond float range, "
                                   "e.g. 1e400) cannot be echoed in JSON; send a finite number or a string") from None


def _framing(request: Request) -> None:
    """The checks that need no body: a declared length (411 without), JSON (415); the body is not read
    after a refusal, so the connection is closed."""
    if request.headers.get("transfer-encoding"):
        raise RequestError(411, "chunked bodies are not accepted; send Content-Length", code="length_required",
                           close=True)
    if "content-length" not in request.headers:
        raise RequestError(411, "Content-Length required", code="length_required", close=True)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           code="unsupported_media_type", close=True)


def decide_body(router: Router, req: Any, max_batch: int) -> dict:
    """The reply to a ``/v1/route`` body: one decision, or ``{"decisions": [...]}``; RequestError or
    RouterInputError (422) otherwise."""
    if not isinstance(req, dict):
        raise RequestError(400, "the body must be a JSON object with 'rounds' or 'batch'")
    if "batch" in req and "rounds" in req:
        raise RequestError(422, "give either 'rounds' (one request) or 'batch' (several), not both", param="batch")
    if "batch" not in req:
        _check_id(req, "request")
        d = router.decide_many([req], where="request")[0]
        if "id" in req:
            d["id"] = req["id"]
        return d
    batch = req["batch"]
    if not isinstance(batch, list) or not batch:
        raise RequestError(422, "batch: expected a non-empty array of requests", param="batch")
    if len(batch) > max_batch:
        raise RequestError(413, f"batch: {len(batch)} requests exceed the limit of {max_batch}", param="batch",
                           code="batch_too_large")
    for i, r in enumerate(batch):
        if isinstance(r, dict):
            _check_id(r, f"batch[{i}]")
    decisions = router.decide_many(batch, where="batch")
    for d, r in zip(decisions, batch):
        if "id" in r:
            d["id"] = r["id"]
    return {"decisions": decisions}


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body, allow_nan=False).encode(), status_code=status, media_type="application/json")


def build_app(router: Router, max_bytes: int = MAX_BYTES, max_batch: int = MAX_BATCH,
              read_timeout_s: float = LIMITS.read_timeout_s, log: Callable[[str], None] = log_line) -> Starlette:
    """The ASGI app of ``ccpo-jax serve`` (module doc). A decision runs in a worker thread, so a large
    batch does not hold the event loop (JAX releases the GIL while it computes)."""

    def client(request: Request) -> str:
        return f"{request.client.host}:{request.client.port}" if request.client else "?"

    async def route(request: Request) -> Response:
        try:
            _framing(request)
            req = await read_json(request, max_bytes, read_timeout_s, constants=False)
            return _json(await run_in_threadpool(decide_body, router, req, max_batch))
        except RequestError as e:
            if e.status == 408 or e.code == "body_too_large":  # the body is not read (whole): close after
                e.close = True
            if e.status == 408:
                log(f"{client(request)}: {e}; 408, connection closed")
            return e.response()
        except RouterInputError as e:
            return error(422, str(e))
        except ClientGone:
            log(f"{client(request)}: client disconnected before its body was complete")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dropping the connection
            log(f"{client(request)}: internal error: {e!r}")
            return error(500, "internal error", code="internal_error")

    async def healthz(request: Request) -> Response:
        if request.method == "HEAD":  # (Starlette answers HEAD on a GET route; serve takes GET only)
            return await wrong_method(request, None)
        return _json(router.describe())

    async def wrong_method(request: Request, exc) -> Response:
        """404 on an unknown path; 405 with ``Allow`` on a known one (the body is not read: closed)."""
        path = request.url.path
        allow = ALLOW.get(path)
        if allow is None:
            return error(404, f"no such endpoint: {path} (GET /healthz, POST /v1/route)", code="not_found",
                         close=request.method != "GET")
        return error(405, f"method {request.method} not allowed on {path}; use {allow}", code="method_not_allowed",
                     close=True, headers={"Allow": allow})

    return Starlette(routes=[Route("/v1/route", route, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])],
                     exception_handlers={404: wrong_method, 405: wrong_method})


def listen(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening socket (connections queue in the kernel until the server accepts them); OSError if the
    address is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def server(router: Router, *, max_bytes: int = MAX_BYTES, max_batch: int = MAX_BATCH, limits: ServerLimits = LIMITS,
           backlog: int = BACKLOG, verbose: bool = False, log: Callable[[str], None] = log_line, warm_up: bool = True):
    """A ``uvicorn.Server`` for the router on the gateway's bounded protocol. ``warm_up`` compiles the
    router's batch buckets up to ``max_batch`` first, so memory does not grow with the batch sizes clients
    send and no client waits for a compile."""
    import uvicorn

    if warm_up:
        router.warm_up(max_batch)
    app = build_app(router, max_bytes, max_batch, limits.read_timeout_s, log)
    # uvicorn's own logging setup (handlers bound to the sys.stderr of the moment) only when its access log is
    # wanted: otherwise its few warnings go through Python's default handler, and a server started under
    # pytest's capture does not keep a captured stream that is closed afterwards
    more = {"log_level": "info"} if verbose else {"log_config": None}
    return uvicorn.Server(uvicorn_config(app, limits, log=log, backlog=backlog, lifespan="off", access_log=verbose,
                                         timeout_graceful_shutdown=2, **more))


class ServerThread:
    """``ccpo-jax serve``'s server in a daemon thread (tests, benchmarks): ``url``, ``server_address``;
    ``shutdown()`` stops it, ``server_close()`` closes the socket."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0, **kw):
        self.sock = listen(host, port, kw.get("backlog", BACKLOG))
        self.server_address = self.sock.getsockname()[:2]
        self.server = server(router, **kw)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("ccpo-jax serve did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def server_close(self) -> None:
        self.sock.close()


def start_in_thread(router: Router, host: str = "127.0.0.1", port: int = 0, **kw) -> tuple[ServerThread, threading.Thread]:
    """Start a server in a daemon thread; stop with ``server.shutdown(); server.server_close()``."""
    srv = ServerThread(router, host, port, **kw).start()
    return srv, srv.thread
