"""A small JSON-over-HTTP endpoint for a :class:`Router` (standard library ``http.server``).

Endpoints:

* ``GET /healthz`` -> 200 ``Router.describe()``.
* ``POST /v1/route`` with ``Content-Type: application/json`` and a body
  ``{"rounds": [...], "can_continue"?: bool, "id"?: any}`` -> 200 one decision
  (``id`` echoed), or ``{"batch": [request, ...]}`` (at most ``max_batch``) ->
  200 ``{"decisions": [...]}``.

Errors are JSON ``{"error": {"status": int, "message": str}}``: 400 invalid JSON
or not an object, 404 unknown path, 405 wrong method, 411 no Content-Length,
413 body over ``max_bytes`` (not read) or batch over ``max_batch``, 415 not
JSON, 422 a request that does not match the feature spec (the message names
the field), 500 anything else (logged, message generic). HTTP/1.1 keep-alive;
each connection times out after ``timeout_s`` of silence.
"""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ccpo_jax.serving.artifact import RouterInputError
from ccpo_jax.serving.router import Router

MAX_BYTES = 1 << 20
MAX_BATCH = 1024
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close  # the body was not read: the connection cannot be reused


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class RouterHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ccpo-jax-router/1"
    timeout = 30  # seconds of silence before a connection is dropped
    # Headers and body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (~40 ms a request on a keep-alive connection).
    disable_nagle_algorithm = True

    # -- helpers ---------------------------------------------------------------
    def _send(self, status: int, body: dict, close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        self._send(status, {"error": {"status": status, "message": message}}, close=close)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.verbose:
            super().log_message(format, *args)

    # -- GET ---------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/healthz":
            self._send(200, self.server.router.describe())
        elif self.path == "/v1/route":
            self._error(405, "use POST for /v1/route")
        else:
            self._error(404, f"no such endpoint: {self.path} (GET /healthz, POST /v1/route)")

    # -- POST ------------------------------------------------------------------
    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "chunked bodies are not accepted; send Content-Length", close=True)
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HTTPError(411, "Content-Length required", close=True)
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise _HTTPError(400, f"bad Content-Length: {length!r}", close=True) from None
        if n > self.server.max_bytes:
            raise _HTTPError(413, f"request body of {n} bytes exceeds the limit of {self.server.max_bytes} bytes",
                             close=True)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        body = self.rfile.read(n)
        if ctype != "application/json":
            raise _HTTPError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        try:
            return json.loads(body, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HTTPError(400, f"invalid JSON: {e}") from None
        except RecursionError:
            raise _HTTPError(400, "invalid JSON: nested too deeply") from None

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        if self.path != "/v1/route":
            # The body is not read: close so that it is not taken for the next request.
            status = 405 if self.path == "/healthz" else 404
            self._error(status, f"no POST endpoint {self.path} (POST /v1/route)", close=True)
            return
        try:
            req = self._read_json()
            if not isinstance(req, dict):
                raise _HTTPError(400, "the body must be a JSON object with 'rounds' or 'batch'")
            router: Router = self.server.router
            if "batch" in req:
                batch = req["batch"]
                if not isinstance(batch, list) or not batch:
                    raise _HTTPError(422, "batch: expected a non-empty array of requests")
                if len(batch) > self.server.max_batch:
                    raise _HTTPError(413, f"batch: {len(batch)} requests exceed the limit of {self.server.max_batch}")
                decisions = router.decide_many(batch, where="batch")
                for d, r in zip(decisions, batch):
                    if "id" in r:
                        d["id"] = r["id"]
                self._send(200, {"decisions": decisions})
            else:
                d = router.decide_many([req], where="request")[0]
                if "id" in req:
                    d["id"] = req["id"]
                self._send(200, d)
        except _HTTPError as e:
            self._error(e.status, str(e), close=e.close)
        except RouterInputError as e:
            self._error(422, str(e))
        except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dropping the connection
            print(f"ccpo-jax serve: internal error: {e!r}", file=sys.stderr)
            self._error(500, "internal error")


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0, *,
                 max_bytes: int = MAX_BYTES, max_batch: int = MAX_BATCH, verbose: bool = False):
        self.router = router
        self.max_bytes = int(max_bytes)
        self.max_batch = int(max_batch)
        self.verbose = verbose
        if ":" in host:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__((host, port), RouterHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def start_in_thread(router: Router, host: str = "127.0.0.1", port: int = 0, **kw) -> tuple[RouterServer, threading.Thread]:
    """Start a server in a daemon thread (tests, benchmarks); stop with ``server.shutdown(); server.server_close()``."""
    server = RouterServer(router, host, port, **kw)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread
