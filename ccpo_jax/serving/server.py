"""The HTTP server of the gateway and of ``ccpo-jax serve``: uvicorn, with every client bounded
(docs/gateway.md, "Server limits"; docs/integrity.md).

uvicorn's own settings bound what they can: ``timeout_keep_alive`` (an idle keep-alive connection
is closed after it) and ``limit_concurrency`` (a request beyond it gets 503). Three bounds uvicorn
does not have are added here, in a subclass of its httptools protocol (the C parser the gateway
uses): uvicorn arms no timer before a connection's first request and resets its keep-alive timer on
every byte (a client that connects and sends nothing, or one byte at a time, is never closed), it
bounds a request's head only with the h11 parser (``h11_max_incomplete_event_size``; httptools
buffers a header of any size: a huge one was read whole, slowly, doubling the gateway's resident memory;
docs/gateway.md, "Server limits"), and it accepts connections
until the process runs out of file descriptors (300 idle sockets under ``ulimit -n 256`` stopped
every new client). So:

* **read timeout**: the request line and headers must arrive within ``read_timeout_s`` of the
  connection opening or of the previous response ending (an absolute deadline: bytes trickled in
  do not extend it); else 408 and the connection is closed. The body is held to the same time by
  the app (:func:`ccpo_jax.serving.web.read_json`: 408).
* **header size**: more than ``max_header_bytes`` of request line and headers: 431, closed.
* **connections**: at most ``max_clients`` at once. A connection past it closes the oldest one
  that has no request in progress (an idle or half-sent one), so new clients keep being served
  while idle sockets pile up; when every connection has a request in progress, the new one is
  answered 503 at once. The default leaves room in the process's file-descriptor limit for one
  upstream connection per client.

A request the HTTP parser refuses (a bad request line, HTTP/0.9, an unknown method, two
``Content-Length`` headers or one that is not digits) gets uvicorn's 400, but in OpenAI's error shape
as every other error (uvicorn's own is plain text).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
from typing import Callable

#: File descriptors a started gateway holds besides its clients' and upstream connections, with room to
#: spare (measured: 14 at idle, JAX, the event loop and the listening socket included).
FD_RESERVE = 64


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Bounds on every client (module doc). ``max_clients`` None: from the file-descriptor limit."""

    read_timeout_s: float = 10.0
    keep_alive_s: float = 5
    max_clients: int | None = None
    max_header_bytes: int = 64 << 10

    def clients(self) -> int:
        """``max_clients``, or half of what the soft file-descriptor limit leaves after FD_RESERVE (a
        client's connection and its upstream call each take one), at most 1024."""
        if self.max_clients is not None:
            return self.max_clients
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(4, min(1024, (soft - FD_RESERVE) // 2))


def _refusal(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


#: The 400 of a request the HTTP parser refuses (uvicorn does not say which rule it broke).
NOT_HTTP = ("the request is not valid HTTP: a bad request line, an unknown method or version, a bad header, or a "
            "Content-Length that is not one number of decimal digits")


class RefusalLog:
    """One log line per refusal (``ccpo-jax serve``'s stderr); 503s, a flood of connections, at most one
    line a second with their count."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.n, self.at = log, 0, float("-inf")

    def __call__(self, status: int, message: str, client) -> None:
        if status != 503:
            host, port = (client or ("?", 0))[:2]
            self.log(f"{host}:{port}: {message}; {status}, connection closed")
            return
        self.n += 1
        now = asyncio.get_running_loop().time()
        if now - self.at >= 1.0:
            self.log(f"{self.n} connection(s) closed with 503 since the last such line: {message}")
            self.n, self.at = 0, now


def _make_room(new, connections, max_clients: int) -> None:
    """A connection past ``max_clients``: the oldest one with no request in progress is closed (503 on it);
    when every one has a request in progress, the new one is answered 503."""
    idle = [c for c in connections if c is not new and hasattr(c, "busy") and not c.busy()
            and not c.transport.is_closing()]
    if idle:
        min(idle, key=lambda c: c.idle_since).refuse(
            503, "Service Unavailable", "too_many_connections", f"closed to serve a new client: the server "
            f"keeps at most {max_clients} connections and this one had no request in progress")
    else:
        new.refuse(503, "Service Unavailable", "too_many_connections", f"the server serves at most {max_clients} "
                   "connections and every one has a request in progress; retry")


def bounded_protocol(limits: ServerLimits, log: Callable[[str], None] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the read timeout, the header bound and the connection bound.
    ``log``: called with one line per refusal (``ccpo-jax serve``'s stderr; the gateway logs none)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    max_clients = limits.clients()
    said = None if log is None else RefusalLog(log)

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.head_bytes, self.heads, self.idle_since = 0, 0, 0.0  # heads: completed on this connection
            self.in_head = True  # between a request's first byte (or the connection) and its headers' end
            self._deadline: asyncio.TimerHandle | None = None

        def busy(self) -> bool:
            """A request of this connection is in progress (its headers arrived, its response is not done)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self.idle_since = self.loop.time()
            self._deadline = self.loop.call_later(limits.read_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def refuse(self, status: int, reason: str, code: str, message: str) -> None:
            """Answer ``status`` and close (only close while a response is being sent on this connection).
            The connection stops counting at once (uvicorn drops it when the close completes, a loop turn
            later: its ``limit_concurrency`` would still count it against the client it made room for)."""
            self._disarm()
            if not self.transport.is_closing():
                if said is not None:  # (logged first: a client that has read the answer finds the line written)
                    said(status, message, self.client)
                if not self.busy():
                    self.transport.write(_refusal(status, reason, code, message))
                self.transport.close()
            self.connections.discard(self)

        def send_400_response(self, msg: str) -> None:  # the parser refused it: OpenAI's shape, not plain text
            self.refuse(400, "Bad Request", "invalid_http", NOT_HTTP)

        def _too_slow(self) -> None:
            self._deadline = None
            if self.busy():
                return
            if self.in_head:
                self.refuse(408, "Request Timeout", "request_timeout", f"the request line and headers did not "
                            f"arrive within {limits.read_timeout_s:g} s")
            else:  # the rest of a body the app has answered already (a 413, a 408): nothing more to say
                self.transport.close()
                self.connections.discard(self)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > max_clients:
                _make_room(self, self.connections, max_clients)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            heads, in_head = self.heads, self.in_head
            super().data_received(data)
            if in_head and self.in_head and self.heads == heads and not self.transport.is_closing():
                # bytes of a head, still unfinished after them: the parser keeps them all (the bytes in which
                # a head ends are measured at its end; the start of a pipelined head after a body's end is
                # not counted: less than one read)
                self.head_bytes += len(data)
                if self.head_bytes > limits.max_header_bytes:
                    self.refuse(431, "Request Header Fields Too Large", "headers_too_large",
                                f"the request line and headers are longer than {limits.max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._disarm()
            self.in_head, self.head_bytes, self.heads = False, 0, self.heads + 1
            if self.transport.is_closing():  # (refused: the parser goes on through the bytes it was given)
                return
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_header_bytes:  # a head that arrived in one read: its exact size
                self.refuse(431, "Request Header Fields Too Large", "headers_too_large",
                            f"the request line and headers are longer than {limits.max_header_bytes} bytes")
                return
            if self.parser.get_http_version() not in ("1.0", "1.1"):  # HTTP/0.9: a reply would have no status line
                self.send_400_response("")
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.transport.is_closing():
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.transport.is_closing():
                super().on_message_complete()
            self.in_head = True

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._arm()  # the next request's head is due within read_timeout_s of this response

    return BoundedHttpToolsProtocol


def uvicorn_config(app, limits: ServerLimits, log: Callable[[str], None] | None = None, **kwargs):
    """The ``uvicorn.Config`` of the gateway and of serve: the bounded protocol, uvicorn's keep-alive
    timeout and its concurrency limit (a request past ``max_clients`` + 1 at once: 503)."""
    import uvicorn

    kwargs.setdefault("log_level", "warning")
    return uvicorn.Config(app, http=bounded_protocol(limits, log), timeout_keep_alive=limits.keep_alive_s,
                          limit_concurrency=limits.clients() + 1, **kwargs)
