"""One upstream chat-completions endpoint, called with ``aiohttp`` under data collect's rules.

The async caller of :mod:`ccpo_jax.llm.wire`'s rules, shared, not copied: the same
:class:`~ccpo_jax.llm.wire.RetryPolicy`, the same bounded read of a reply
(:class:`~ccpo_jax.llm.wire.BoundedBody`: attempt deadline and body cap), the same judgement
of an attempt (:func:`~ccpo_jax.llm.wire.judge_attempt`: retries on malformed bodies and HTTP
408/409/429/5xx, other 4xx fail at once, the reply parser) and the same wait
(:func:`~ccpo_jax.llm.wire.retry_wait`: backoff with jitter, ``Retry-After`` honoured up to
``max_retry_after_s``). Only the waiting is asynchronous, so a cancelled request (a client that hung
up) cancels its upstream call at once.

Why aiohttp and not ``httpx.AsyncClient`` (which the gateway used first, and ``data collect`` keeps for
its threads): measured against ``ccpo_jax/testing/chat_server.py`` at 16 concurrent calls on the 2-core machine,
``httpx.AsyncClient`` spent several times aiohttp's CPU per call (its connection pool polls every
pooled socket on each request, and HTTP/1.1 is parsed in pure Python by h11; aiohttp has a C
parser); two calls a round made httpx most of the gateway's CPU per request and the gateway, not
the upstreams, the bottleneck at concurrency 16 (docs/performance.md#the-gateway).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from ccpo_jax.llm.wire import (AttemptOver, BoundedBody, CallStats, Endpoint, EndpointError, NotRetried, Reply,
                               RetryPolicy, TooLarge, judge_attempt, redact, retry_wait)


class UpstreamError(EndpointError):
    """An upstream call failed for good; ``kind``: timeout, connection, status, malformed, too_large, retry_after."""

    def __init__(self, msg: str, kind: str, stats: CallStats | None = None):
        super().__init__(msg, stats)
        self.kind = kind


class AsyncChatClient:
    """Calls one endpoint from the gateway's event loop; one pooled connection set per endpoint."""

    def __init__(self, endpoint: Endpoint, retry: RetryPolicy, *, max_connections: int = 64, seed: int = 0):
        self.endpoint = endpoint
        self.retry = retry
        self._key = endpoint.api_key()
        self._secrets = [self._key] if self._key else []
        self._rng = random.Random(seed)
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        # timeout_s bounds connecting and each wait for bytes (like httpx.Timeout(timeout_s) in
        # collect); the attempt as a whole is held to attempt_timeout_s by BoundedBody and wait_for.
        t = retry.timeout_s
        self._http = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=None, connect=t, sock_connect=t, sock_read=t),
            connector=aiohttp.TCPConnector(limit=max_connections), trust_env=False)

    async def aclose(self) -> None:
        await self._http.close()

    def _fail(self, msg: str, kind: str, stats: CallStats) -> UpstreamError:
        ep = self.endpoint
        return UpstreamError(redact(f"{ep.model} at {ep.public_url}: {msg}", self._secrets), kind, stats)

    async def _post(self, url: str, payload: bytes) -> tuple[int, Any, bytes]:
        """One attempt, the body read into collect's :class:`BoundedBody` (deadline and cap)."""
        body = BoundedBody(self.retry)
        async with self._http.post(url, data=payload, allow_redirects=False) as resp:
            body.start(resp.headers)
            async for chunk in resp.content.iter_any():
                body.feed(chunk)
            return resp.status, resp.headers, body.body()

    async def chat(self, body: dict) -> tuple[Reply, CallStats]:
        """POST ``body``; the reply, or :class:`UpstreamError` once retrying is pointless or exhausted.
        The outcome of each attempt is judged by collect's :func:`judge_attempt` and the wait before
        the next by its :func:`retry_wait`; only the waiting is asynchronous."""
        stats = CallStats()
        pol = self.retry
        payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
        last, kind = "", "status"
        for attempt in range(pol.retries + 1):
            stats.attempts = attempt + 1
            asked = None
            t0 = time.perf_counter()
            try:
                # the whole attempt under the deadline, also while headers are awaited
                st, headers, raw = await asyncio.wait_for(self._post(self.endpoint.completions_url, payload),
                                                          pol.attempt_timeout_s + pol.timeout_s)
            except TooLarge as e:
                raise self._fail(f"reply body over {pol.max_reply_bytes} bytes ({e}; not retried)", "too_large",
                                 stats) from None
            except aiohttp.ServerTimeoutError:  # (before TimeoutError: it is one) connect or read wait
                last, kind = f"timeout after {pol.timeout_s:g} s", "timeout"
            except (AttemptOver, asyncio.TimeoutError):
                last, kind = f"attempt not complete within {pol.attempt_timeout_s:g} s", "timeout"
            except aiohttp.ClientError as e:
                last, kind = f"connection error ({type(e).__name__})", "connection"
            else:
                try:
                    reply, last, asked = judge_attempt(st, headers, raw)
                except NotRetried as e:
                    raise self._fail(str(e), e.kind, stats) from None
                if reply is not None:
                    stats.latency_s = time.perf_counter() - t0
                    return reply, stats
                kind = "malformed" if last.startswith("malformed") else "status"
            if attempt == pol.retries:
                break
            delay = retry_wait(pol, attempt, asked, self._rng.uniform)
            if delay is None:
                raise self._fail(f"{last}: the server asks to wait {asked:.0f} s, more than "
                                 f"{pol.max_retry_after_s:g} s", "retry_after", stats)
            stats.waits.append((last, round(delay, 3)))
            await asyncio.sleep(delay)
        raise self._fail(f"gave up after {stats.attempts} attempts (last: {last})", kind, stats)
