"""One upstream chat-completions endpoint, called with ``httpx.AsyncClient`` under data collect's rules.

The async twin of :class:`ccpo_jax.collect.client.ChatClient`: the same
:class:`~ccpo_jax.collect.client.RetryPolicy` (retries on timeouts, connection
errors, HTTP 408/409/429/5xx and bodies that are not a chat completion;
exponential backoff with jitter; ``Retry-After`` honoured up to
``max_retry_after_s``; other 4xx fail at once), the same attempt deadline and
reply-body cap, and the same reply parser (:func:`~ccpo_jax.collect.client.parse_completion`).
Only the waiting is asynchronous, so a cancelled request (a client that hung up)
cancels its upstream call at once.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from ccpo_jax.collect.client import (RETRY_STATUS, CallStats, Endpoint, EndpointError, ImplausibleReply, Reply,
                                     RetryPolicy, parse_completion, redact, retry_after_s)


class UpstreamError(EndpointError):
    """An upstream call failed for good; ``kind``: timeout, connection, status, malformed, too_large, retry_after."""

    def __init__(self, msg: str, kind: str, stats: CallStats | None = None):
        super().__init__(msg, stats)
        self.kind = kind


class _AttemptOver(Exception):
    pass


class _TooLarge(Exception):
    pass


def backoff_delay(pol: RetryPolicy, attempt: int, asked: float | None, rng: random.Random) -> float:
    """The wait before retry ``attempt`` + 1 (collect.client's rule: ``backoff_s * 2**k`` capped,
    drawn in [d/2, d]; a server's Retry-After plus up to 10% jitter)."""
    if asked is not None:
        return asked + rng.uniform(0.0, 0.1 * max(asked, pol.backoff_s))
    d = min(pol.max_backoff_s, pol.backoff_s * 2.0 ** attempt)
    return rng.uniform(d / 2.0, d)


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
        self._http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(retry.timeout_s), follow_redirects=False,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def aclose(self) -> None:
        await self._http.aclose()

    def _fail(self, msg: str, kind: str, stats: CallStats) -> UpstreamError:
        ep = self.endpoint
        return UpstreamError(redact(f"{ep.model} at {ep.public_url}: {msg}", self._secrets), kind, stats)

    async def _post(self, url: str, payload: bytes) -> tuple[int, httpx.Headers, bytes]:
        pol = self.retry
        deadline = time.monotonic() + pol.attempt_timeout_s
        async with self._http.stream("POST", url, content=payload) as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > pol.max_reply_bytes:
                raise _TooLarge(f"Content-Length {declared}")
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > pol.max_reply_bytes:
                    raise _TooLarge(f"more than {pol.max_reply_bytes} bytes read")
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise _AttemptOver()
            return resp.status_code, resp.headers, b"".join(chunks)

    async def chat(self, body: dict) -> tuple[Reply, CallStats]:
        """POST ``body``; the reply, or :class:`UpstreamError` once retrying is pointless or exhausted."""
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
            except _TooLarge as e:
                raise self._fail(f"reply body over {pol.max_reply_bytes} bytes ({e}; not retried)", "too_large",
                                 stats) from None
            except (_AttemptOver, asyncio.TimeoutError):
                last, kind = f"attempt not complete within {pol.attempt_timeout_s:g} s", "timeout"
            except httpx.TimeoutException:
                last, kind = f"timeout after {pol.timeout_s:g} s", "timeout"
            except httpx.TransportError as e:
                last, kind = f"connection error ({type(e).__name__})", "connection"
            else:
                if st == 200:
                    try:
                        reply = parse_completion(json.loads(raw.decode("utf-8")))
                    except ImplausibleReply as e:
                        raise self._fail(f"{e} (not retried)", "malformed", stats) from None
                    except (ValueError, UnicodeDecodeError) as e:
                        last, kind = (f"malformed body ({e})" if not isinstance(e, json.JSONDecodeError)
                                      else "malformed JSON body"), "malformed"
                    else:
                        stats.latency_s = time.perf_counter() - t0
                        return reply, stats
                elif st in RETRY_STATUS or 500 <= st <= 599:
                    last, kind = f"HTTP {st}", "status"
                    asked = retry_after_s(headers)
                else:
                    excerpt = raw[:300].decode("utf-8", "replace").strip()
                    raise self._fail(f"HTTP {st} (not retried): {excerpt}", "status", stats)
            if attempt == pol.retries:
                break
            if asked is not None and asked > pol.max_retry_after_s:
                raise self._fail(f"{last}: the server asks to wait {asked:.0f} s, more than "
                                 f"{pol.max_retry_after_s:g} s", "retry_after", stats)
            delay = backoff_delay(pol, attempt, asked, self._rng)
            stats.waits.append((last, round(delay, 3)))
            await asyncio.sleep(delay)
        raise self._fail(f"gave up after {stats.attempts} attempts (last: {last})", kind, stats)
