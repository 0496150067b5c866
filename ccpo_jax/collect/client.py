"""The synchronous caller of one OpenAI-compatible endpoint (data collect's worker threads): httpx,
retries and backoff by the rules of :mod:`ccpo_jax.llm.wire` (shared with the gateway's async
caller, :mod:`ccpo_jax.gateway.upstream`)."""
from __future__ import annotations

import json
import random
import threading
import time
from typing import Any, Callable

import httpx

from ccpo_jax.llm.wire import (REFUSED_STATUS, AttemptOver, BoundedBody, CallStats, Endpoint, EndpointError, NotRetried,
                               Reply, RetryPolicy, Stopped, TooLarge, judge_attempt, parse_model_list, public_url,
                               redact, retry_wait)


class ChatClient:
    """Calls one endpoint; thread-safe (one pooled ``httpx.Client`` shared by the worker threads)."""

    def __init__(self, endpoint: Endpoint, retry: RetryPolicy, *, max_connections: int = 8,
                 stop: threading.Event | None = None, seed: int = 0,
                 sleep: Callable[[float], Any] | None = None):
        self.endpoint = endpoint
        self.retry = retry
        self._key = endpoint.api_key()
        self._secrets = [self._key] if self._key else []
        self._stop = stop or threading.Event()
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(retry.timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    def served_models(self) -> list[str]:
        """The models the endpoint lists (``GET {base}/models``); EndpointError when it lists none.
        One attempt, not retried (a pre-flight check; its failure names the cause), over the same
        bounded read as a chat call: the attempt deadline and the body cap."""
        u = self.endpoint.completions_url
        url = u[: -len("/chat/completions")] + "/models"
        where = f"GET {public_url(url)}"
        try:
            st, _, raw = self._attempt("GET", url)
        except TooLarge as e:
            raise self._fail(f"{where}: reply body over {self.retry.max_reply_bytes} bytes ({e}; "
                             "--max-reply-bytes)", CallStats()) from None
        except AttemptOver as e:
            raise self._fail(f"{where}: {e}", CallStats()) from None
        except httpx.HTTPError as e:
            raise self._fail(f"{where} failed ({type(e).__name__})", CallStats()) from None
        if st in REFUSED_STATUS:  # the key is refused: no call can succeed
            excerpt = raw[:300].decode("utf-8", "replace").strip()
            e = self._fail(f"HTTP {st} (not retried): {excerpt}", CallStats())
            e.refused = True
            raise e
        if st != 200:
            raise self._fail(f"{where}: HTTP {st}", CallStats())
        try:
            return parse_model_list(json.loads(raw.decode("utf-8")))
        except (ValueError, UnicodeDecodeError) as e:
            raise self._fail(f"{where}: not a model list ({e})", CallStats()) from None

    def _jitter(self, lo: float, hi: float) -> float:
        with self._rng_lock:
            return self._rng.uniform(lo, hi)

    def _wait(self, seconds: float) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
        elif self._stop.wait(seconds):
            raise Stopped()

    def _fail(self, msg: str, stats: CallStats) -> EndpointError:
        return EndpointError(redact(f"{self.endpoint.model} at {self.endpoint.public_url}: {msg}", self._secrets), stats)

    def _attempt(self, method: str, url: str, content: bytes | None = None) -> tuple[int, httpx.Headers, bytes]:
        """One attempt of any request this client makes: (status, headers, body), the body read
        chunk by chunk into a :class:`BoundedBody` (``resp.content`` would read any size, however
        slowly sent). Raises AttemptOver, TooLarge or httpx's errors."""
        body = BoundedBody(self.retry)
        with self._http.stream(method, url, content=content) as resp:
            body.start(resp.headers)
            for chunk in resp.iter_bytes():
                body.feed(chunk)
            return resp.status_code, resp.headers, body.body()

    def chat(self, body: dict) -> tuple[Reply, CallStats]:
        """POST ``body``; the reply, or EndpointError once retrying is pointless or exhausted."""
        stats = CallStats()
        url = self.endpoint.completions_url
        payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
        pol = self.retry
        last = ""
        for attempt in range(pol.retries + 1):
            if self._stop.is_set():
                raise Stopped()
            stats.attempts = attempt + 1
            asked: float | None = None
            t0 = time.perf_counter()
            try:
                st, headers, raw = self._attempt("POST", url, payload)
            except TooLarge as e:
                raise self._fail(f"reply body over {pol.max_reply_bytes} bytes ({e}; --max-reply-bytes; "
                                 "not retried)", stats) from None
            except AttemptOver as e:
                reason = f"attempt {e}"
            except httpx.TimeoutException:
                reason = f"timeout after {pol.timeout_s:g} s"
            except httpx.TransportError as e:
                reason = f"connection error ({type(e).__name__})"
            else:
                latency = time.perf_counter() - t0
                try:
                    reply, reason, asked = judge_attempt(st, headers, raw)
                except NotRetried as e:
                    raise self._fail(str(e), stats) from None
                if reply is not None:
                    stats.latency_s = latency
                    return reply, stats
            last = reason
            if attempt == pol.retries:
                break
            delay = retry_wait(pol, attempt, asked, self._jitter)
            if delay is None:
                raise self._fail(f"{reason}: the server asks to wait {asked:.0f} s, more than "
                                 f"--max-retry-after {pol.max_retry_after_s:g} s", stats)
            if asked is not None:
                reason += f", Retry-After {asked:g} s"
            stats.waits.append((reason, round(delay, 3)))
            self._wait(delay)
        raise self._fail(f"gave up after {stats.attempts} attempts (last: {last})", stats)
