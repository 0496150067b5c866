"""A small JSON-over-HTTP endpoint for a :class:`Router` (standard library ``http.server``).

Endpoints:

* ``GET /healthz`` -> 200 ``Router.describe()``.
* ``POST /v1/route`` with ``Content-Type: application/json`` and a body
  ``{"rounds": [...], "can_continue"?: bool, "id"?: any}`` -> 200 one decision
  (``id`` echoed), or ``{"batch": [request, ...]}`` (at most ``max_batch``) ->
  200 ``{"decisions": [...]}``.

Errors are JSON ``{"error": {"status": int, "message": str}}``, always after a
status line: 400 invalid JSON or not an object, a request line that is not
``METHOD PATH HTTP/1.x`` (HTTP/0.9 is not served), two ``Content-Length`` headers or one
that is not decimal digits; 404 unknown path, 405 a method the path does not take
(HEAD, PUT, DELETE, ...; with ``Allow``; a HEAD reply has no body), 408 a request not
complete within ``request_timeout_s`` of its first byte (slow or trickling
client; one log line, connection closed), 411 no Content-Length, 413 body over
``max_bytes`` (not read; no ``100 Continue`` is sent before a refusal) or
batch over ``max_batch``, 415 not JSON, 422 a request that does not match the
feature spec (the message names the field; also both ``batch`` and ``rounds``,
or an ``id`` that strict JSON cannot carry, such as 1e400), 503 more than
``max_connections`` open connections, 500 anything else (logged, message
generic). Output is strict JSON (no NaN/Infinity). HTTP/1.1 keep-alive; an
idle connection is closed after ``idle_timeout_s``. Client disconnects and
timeouts are one log line each. Limits and flags: docs/integrity.md.

Why the standard library and not a server package: the endpoint is small, runs
beside a JAX process, and each abuse case (backlog, deadline, connection cap,
Expect handling) is a few lines here with a test; a dependency would add more
surface than it removes.
"""
from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

from ccpo_jax.serving.artifact import RouterInputError
from ccpo_jax.serving.router import Router

MAX_BYTES = 1 << 20
MAX_BATCH = 1024
#: listen(2) backlog: connections the kernel queues before accept (the stdlib default is 5; 128
#: still overflowed once in 200 connects made in a burst on a busy 2-core machine, 1024 never did).
BACKLOG = 1024
#: Most connections served at once (one thread each); more are answered 503 and closed.
MAX_CONNECTIONS = 64
#: Seconds from a request's first byte to its last (headers and body): slower -> 408.
REQUEST_TIMEOUT_S = 10.0
#: Seconds a keep-alive connection may stay silent between requests.
IDLE_TIMEOUT_S = 30.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class _RequestTimeout(TimeoutError):
    """The request was not complete within the server's request_timeout_s."""


class _DeadlineReader(io.RawIOBase):
    """Socket reads under a per-request deadline, not only a per-read timeout.

    A per-read timeout lets a client that trickles one byte just inside it hold
    a thread forever. Here the first byte of a request starts a clock
    (``handler.deadline``); every later read may wait only until it runs out.
    Between requests a read may wait ``idle_timeout_s``.
    """

    def __init__(self, sock, handler: "RouterHandler"):
        self._sock = sock
        self._h = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        h = self._h
        if h.deadline is None:
            wait = h.server.idle_timeout_s
        else:
            wait = h.deadline - time.monotonic()
            if wait <= 0:
                raise _RequestTimeout()
        self._sock.settimeout(wait)
        try:
            n = self._sock.recv_into(b)
        except TimeoutError:
            if h.deadline is not None:
                raise _RequestTimeout() from None
            raise
        if n and h.deadline is None:
            h.deadline = time.monotonic() + h.server.request_timeout_s
        return n


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close  # the body was not read: the connection cannot be reused


_DIGITS = re.compile(r"[0-9]+")
_METHOD = re.compile(r"[A-Z]{1,20}")  # the methods of RFC 9110 and the like; anything else is not a request
#: The method each path answers (the ``Allow`` header of a 405).
_ALLOW = {"/healthz": "GET", "/v1/route": "POST"}


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _check_id(req: dict, where: str) -> None:
    """An echoed ``id`` must survive strict JSON output (1e400 parses as inf: refuse it)."""
    if "id" in req:
        try:
            json.dumps(req["id"], allow_nan=False)
        except (ValueError, RecursionError):
            raise RouterInputError(f"{where}.id: a non-finite number (NaN, Infinity or beyond float range, "
                                   "e.g. 1e400) cannot be echoed in JSON; send a finite number or a string") from None


class RouterHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ccpo-jax-router/1"
    timeout = 30  # seconds of silence before a connection is dropped
    # Headers and body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (~40 ms a request on a keep-alive connection).
    disable_nagle_algorithm = True

    deadline: float | None = None  # monotonic end of the current request (set by its first byte)

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def _client(self) -> str:
        host, port = self.client_address[:2]
        return f"{host}:{port}"

    def handle_one_request(self) -> None:
        """The stdlib loop body, with the request deadline, JSON errors and one-line logs."""
        self.deadline = None
        # (parse_request sets these; a 408 or disconnect before it needs them for the log)
        self.requestline, self.command, self.request_version = "", None, "HTTP/1.1"
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline:  # the client closed the connection
                self.close_connection = True
                return
            if self.deadline is None:  # a pipelined request already in the buffer: its clock starts now
                self.deadline = time.monotonic() + self.server.request_timeout_s
            if len(self.raw_requestline) > 65536:
                self.send_error(414, "request line too long")
                return
            if not self.parse_request():
                return
            if self.request_version == "HTTP/0.9" or not _METHOD.fullmatch(self.command):
                # (a 0.9 reply has no status line; a garbage line is not a request)
                self.request_version = "HTTP/1.1"
                self.send_error(400, f"bad request line {self.requestline[:200]!r}; expected 'METHOD PATH HTTP/1.1'")
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self._wrong_method()
                return
            method()
            self.wfile.flush()
        except _RequestTimeout:
            self.server.log(f"{self._client()}: request not complete within {self.server.request_timeout_s:g} s; "
                            "408, connection closed")
            self.close_connection = True
            try:
                self._error(408, f"request not complete within {self.server.request_timeout_s:g} s", close=True)
            except OSError:
                pass
        except TimeoutError:  # idle keep-alive connection, or a client that does not read its answer
            self.close_connection = True
        except (ConnectionError, OSError) as e:
            self.server.log(f"{self._client()}: client disconnected ({type(e).__name__})")
            self.close_connection = True

    def handle_expect_100(self) -> bool:
        # Do not send "100 Continue" while parsing headers: _read_json sends it only once
        # the request passed every check that needs no body (so a 413 comes without it).
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol errors of the stdlib parser (bad request line, headers) as JSON, connection closed."""
        if self.request_version == "HTTP/0.9":  # the parser gave up before the version: still a status line
            self.request_version = "HTTP/1.1"
        try:
            phrase = self.responses[code][0]
        except KeyError:
            phrase = "error"
        self._error(code, message or phrase, close=True)

    def _wrong_method(self) -> None:
        """Any method but GET and POST: 405 with ``Allow`` on a known path, 404 elsewhere. The body
        (if any) is not read, so the connection is closed; a HEAD reply has no body."""
        allow = _ALLOW.get(self.path)
        if allow is None:
            self._error(404, f"no such endpoint: {self.path} (GET /healthz, POST /v1/route)", close=True)
            return
        self._error(405, f"method {self.command} not allowed on {self.path}; use {allow}", close=True,
                    headers={"Allow": allow})

    # -- helpers ---------------------------------------------------------------
    def _send(self, status: int, body: dict, close: bool = False, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.connection.settimeout(self.server.idle_timeout_s)  # a write may wait for a slow reader
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":  # HEAD: the headers GET would get, no body (RFC 9110 9.3.2)
            self.wfile.write(data)

    def _error(self, status: int, message: str, close: bool = False, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, {"error": {"status": status, "message": message}}, close=close, headers=headers)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.verbose:
            super().log_message(format, *args)

    # -- GET ---------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/healthz":
            self._send(200, self.server.router.describe())
        elif self.path == "/v1/route":
            self._error(405, "use POST for /v1/route", headers={"Allow": "POST"})
        else:
            self._error(404, f"no such endpoint: {self.path} (GET /healthz, POST /v1/route)")

    # -- POST ------------------------------------------------------------------
    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "chunked bodies are not accepted; send Content-Length", close=True)
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise _HTTPError(411, "Content-Length required", close=True)
        if len(lengths) > 1:  # which one frames the body is ambiguous (request smuggling): refuse
            raise _HTTPError(400, f"{len(lengths)} Content-Length headers; send exactly one", close=True)
        length = lengths[0].strip()
        if not _DIGITS.fullmatch(length) or len(length) > 18:  # RFC 9110 8.6: 1*DIGIT (int() takes "1_0", "+2")
            raise _HTTPError(400, f"bad Content-Length: {lengths[0][:40]!r} (expected decimal digits)", close=True)
        n = int(length)
        if n > self.server.max_bytes:
            raise _HTTPError(413, f"request body of {n} bytes exceeds the limit of {self.server.max_bytes} bytes",
                             close=True)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise _HTTPError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}", close=True)
        if (self.headers.get("Expect") or "").lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
        body = self.rfile.read(n)
        if len(body) < n:  # the client closed its side before sending the whole body
            raise ConnectionResetError("body shorter than Content-Length")
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
            self._error(status, f"no POST endpoint {self.path} (POST /v1/route)", close=True,
                        headers={"Allow": "GET"} if status == 405 else None)
            return
        try:
            req = self._read_json()
            if not isinstance(req, dict):
                raise _HTTPError(400, "the body must be a JSON object with 'rounds' or 'batch'")
            router: Router = self.server.router
            if "batch" in req and "rounds" in req:
                raise _HTTPError(422, "give either 'rounds' (one request) or 'batch' (several), not both")
            if "batch" in req:
                batch = req["batch"]
                if not isinstance(batch, list) or not batch:
                    raise _HTTPError(422, "batch: expected a non-empty array of requests")
                if len(batch) > self.server.max_batch:
                    raise _HTTPError(413, f"batch: {len(batch)} requests exceed the limit of {self.server.max_batch}")
                for i, r in enumerate(batch):
                    if isinstance(r, dict):
                        _check_id(r, f"batch[{i}]")
                decisions = router.decide_many(batch, where="batch")
                for d, r in zip(decisions, batch):
                    if "id" in r:
                        d["id"] = r["id"]
                self._send(200, {"decisions": decisions})
            else:
                _check_id(req, "request")
                d = router.decide_many([req], where="request")[0]
                if "id" in req:
                    d["id"] = req["id"]
                self._send(200, d)
        except _HTTPError as e:
            self._error(e.status, str(e), close=e.close)
        except RouterInputError as e:
            self._error(422, str(e))
        except (TimeoutError, ConnectionError):
            raise  # handle_one_request: 408 or a one-line disconnect
        except Exception as e:  # noqa: BLE001 - a server answers 500 rather than dropping the connection
            self.server.log(f"{self._client()}: internal error: {e!r}")
            self._error(500, "internal error")


class RouterServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once; see the module doc for the limits.

    ``warm_up`` compiles the router's batch buckets (``Router.buckets`` up to
    ``max_batch``) before listening, so memory does not grow with the batch
    sizes clients send and no client waits for a compile.
    """

    daemon_threads = True

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0, *,
                 max_bytes: int = MAX_BYTES, max_batch: int = MAX_BATCH, verbose: bool = False,
                 backlog: int = BACKLOG, max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 warm_up: bool = True):
        self.router = router
        self.max_bytes = int(max_bytes)
        self.max_batch = int(max_batch)
        self.verbose = verbose
        self.request_queue_size = int(backlog)  # read by server_activate's listen()
        self.max_connections = int(max_connections)
        self.request_timeout_s = float(request_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._log_lock = threading.Lock()
        self._refused, self._refused_logged = 0, float("-inf")
        if warm_up:
            router.warm_up(self.max_batch)
        if ":" in host:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__((host, port), RouterHandler)

    def log(self, message: str) -> None:
        """One line on stderr (disconnects, timeouts, refusals, internal errors)."""
        with self._log_lock:
            print(f"ccpo-jax serve: {message}", file=sys.stderr, flush=True)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request, client_address) -> None:
        """503 on a connection over the cap, written from the accept loop without a thread."""
        body = json.dumps({"error": {"status": 503, "message": f"more than {self.max_connections} open connections; "
                                     "retry later"}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.settimeout(1.0)
            request.sendall(head + body)
        except OSError:
            pass
        self.shutdown_request(request)
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:  # a flood of refusals is one line a second, not one each
            self.log(f"refused {self._refused} connection(s) (503): {self.max_connections} open, the limit")
            self._refused, self._refused_logged = 0, now

    def handle_error(self, request, client_address) -> None:
        """An exception that escaped a handler: one line, not the stdlib's traceback."""
        e = sys.exc_info()[1]
        what = "client disconnected" if isinstance(e, (ConnectionError, TimeoutError)) else "error"
        self.log(f"{client_address[0]}:{client_address[1]}: {what} ({type(e).__name__}: {e})")

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
