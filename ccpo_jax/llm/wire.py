"""One OpenAI-compatible chat-completions endpoint on the wire: the rules of a call with retries,
without I/O, shared by data collect's sync caller (:class:`ccpo_jax.collect.client.ChatClient`) and
the gateway's async one (:mod:`ccpo_jax.gateway.upstream`).

Works with vLLM (``vllm serve``), the llama.cpp server, OpenAI and any other
server that speaks ``POST {base_url}/chat/completions``. What a call does:

* sends the request body as JSON, with ``Authorization: Bearer <key>`` when the
  endpoint names an environment variable holding the key (keys are read from
  the environment only, and are redacted from every message this module makes);
* retries, a bounded number of times, on timeouts and connection errors, on
  HTTP 408, 409, 429 and 5xx, and on a 200 whose body is not a chat completion
  (malformed JSON, no ``choices``): exponential backoff with jitter
  (``backoff_s * 2**k``, capped at ``max_backoff_s``, each wait drawn uniformly
  in [d/2, d]); a ``Retry-After`` (seconds or an HTTP date) or
  ``retry-after-ms`` header on a 429/503 is honoured (the wait is at least what
  the server asks, plus up to 10% jitter), and a server asking for more than
  ``max_retry_after_s`` ends the call instead of sleeping for hours;
* other 4xx (bad key, unknown model, prompt too long) fail at once: retrying
  cannot help and may cost money;
* every request (the chat call and the ``GET /models`` listing) is one bounded
  read, :meth:`ccpo_jax.collect.client.ChatClient._attempt`: a wall-clock deadline over the whole
  attempt and a cap on the body (:class:`BoundedBody`). The rules are small
  pieces (:class:`RetryPolicy`, :class:`BoundedBody`, :func:`should_retry`,
  :func:`retry_wait`) that need no I/O, so an async caller shares them.

The result is a :class:`Reply` (text, tokens from ``usage``, token log-probs
when the endpoint returns them) and a :class:`CallStats` (attempts, the waits
and why, latency of the successful attempt).
"""
from __future__ import annotations

import dataclasses
import email.utils
import json
import math
import os
import re
import time
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import httpx

from ccpo_jax.errors import UserError
from envs.cache.values import MAX_TOKENS

#: HTTP statuses that are retried (besides every 5xx).
RETRY_STATUS = frozenset({408, 409, 429})
#: HTTP statuses saying the key is refused: no request to that endpoint can succeed.
REFUSED_STATUS = frozenset({401, 403})


def should_retry(status: int) -> bool:
    """Whether a reply with HTTP ``status`` is worth another attempt (408, 409, 429, 5xx); other
    4xx (bad key, unknown model, prompt too long) cannot get better and may cost money."""
    return status in RETRY_STATUS or 500 <= status <= 599


class EndpointError(UserError):
    """A call failed for good (non-retryable status, or retries exhausted); ``stats``: what it tried."""

    def __init__(self, msg: str, stats: "CallStats | None" = None):
        super().__init__(msg)
        self.stats = stats


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where a model is served. ``url`` is the API base (``http://host:8000/v1``) or the
    full ``.../chat/completions`` URL; ``key_env`` names the environment variable
    holding the API key (None: send no key, e.g. a local server)."""

    url: str
    model: str
    key_env: str | None = None

    @property
    def completions_url(self) -> str:
        u = self.url.rstrip("/")
        return u if u.endswith("/chat/completions") else u + "/chat/completions"

    @property
    def public_url(self) -> str:
        """The completions URL without user info, query or fragment (what provenance records)."""
        return public_url(self.completions_url)

    def api_key(self) -> str | None:
        if not self.key_env:
            return None
        key = os.environ.get(self.key_env)
        if not key:
            raise UserError(f"the environment variable {self.key_env} (the API key of {self.model} at "
                            f"{self.public_url}) is not set or empty")
        return key


def public_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def parse_endpoint(spec: str, flag: str, key_env: str | None = None) -> Endpoint:
    """``URL,MODEL`` (the flag value) -> :class:`Endpoint`; a bad value is a UserError naming ``flag``."""
    if "," not in spec:
        raise UserError(f"{flag} {spec!r}: expected URL,MODEL (e.g. http://127.0.0.1:8000/v1,meta-llama/Llama-3.2-3B-Instruct)")
    url, model = (s.strip() for s in spec.rsplit(",", 1))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{flag}: {url!r} is not an http(s) URL")
    if parts.username or parts.password or parts.query:
        raise UserError(f"{flag}: put credentials in an environment variable (see --base-key-env/--guide-key-env), "
                        "not in the URL (no user:password@ or ?query)")
    if not model:
        raise UserError(f"{flag} {spec!r}: the model name after the comma is empty")
    return Endpoint(url=url, model=model, key_env=key_env)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How hard one call tries. ``retries`` = attempts after the first."""

    retries: int = 6
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_retry_after_s: float = 600.0
    timeout_s: float = 120.0
    #: The whole attempt (headers and body): a server trickling bytes cannot hold a call longer
    #: (checked after every chunk read, so at worst one more ``timeout_s`` of silence).
    attempt_timeout_s: float = 600.0
    #: Largest reply body read (decoded); a larger one fails the call, not retried.
    max_reply_bytes: int = 8 << 20


def retry_wait(pol: RetryPolicy, attempt: int, asked: float | None,
               uniform: Callable[[float, float], float]) -> float | None:
    """Seconds to wait before retrying after failed attempt ``attempt`` (0-based): what the server
    asks (``asked``, from :func:`retry_after_s`) plus up to 10% jitter, or else exponential backoff
    with jitter drawn by ``uniform(lo, hi)``; None when the server asks for more than
    ``pol.max_retry_after_s`` (then the call fails instead of sleeping)."""
    if asked is not None:
        if asked > pol.max_retry_after_s:
            return None
        return asked + uniform(0.0, 0.1 * max(asked, pol.backoff_s))
    backoff = min(pol.max_backoff_s, pol.backoff_s * 2.0 ** attempt)
    return uniform(backoff / 2.0, backoff)


@dataclasses.dataclass(frozen=True)
class Reply:
    """A chat completion: ``tokens_in/out`` from ``usage`` (None when the endpoint sent none);
    ``logprobs`` = [(token, logprob)] of the completion, None when not returned."""

    text: str
    tokens_in: int | None
    tokens_out: int | None
    logprobs: tuple[tuple[str, float], ...] | None
    finish_reason: str | None
    model: str | None = None  # the model the reply says it came from
    #: Log-probs were sent but cannot be used (``logprobs`` is then None): what is wrong with them.
    logprobs_invalid: str | None = None


@dataclasses.dataclass
class CallStats:
    """What one call took: ``waits`` = [(reason, seconds slept)] before each retry."""

    attempts: int = 0
    waits: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    latency_s: float = 0.0


class Stopped(Exception):
    """The run was asked to stop while this call waited to retry."""


def redact(text: str, secrets: list[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def retry_after_s(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds the server asks to wait (``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            v = float(ms) / 1000.0
            if math.isfinite(v) and v >= 0:
                return v
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    try:
        v = float(ra)
        return v if math.isfinite(v) and v >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(ra)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _finite_logprob(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v <= 0.0 else None


def read_logprobs(lp: Any) -> tuple[tuple[tuple[str, float], ...] | None, str | None]:
    """``choices[0].logprobs`` -> (the (token, logprob) pairs, None) when usable; (None, None) when
    absent (missing, null, a null or empty ``content``); (None, what is wrong) when sent but
    unusable: one bad entry (a log-prob that is NaN, infinite, positive or not a number, a token
    that is not a string) voids them all, since the rest cannot be trusted either."""
    if lp is None:
        return None, None
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(lp, dict) and content is None:
        return None, None
    if not isinstance(content, list):
        return None, "choices[0].logprobs is not an object with a content list"
    out = []
    for i, item in enumerate(content):
        where = f"choices[0].logprobs.content[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            return None, f"{where} has no string token"
        v = _finite_logprob(item.get("logprob"))
        if v is None:
            return None, f"{where}.logprob = {repr(item.get('logprob'))[:40]} (a log-prob is a finite number <= 0)"
        out.append((_text(item["token"]), v))
    return (tuple(out) if out else None), None


_SURROGATE = re.compile("[\ud800-\udfff]")  # (a valid pair is one code point after json.loads)


class ImplausibleReply(ValueError):
    """A well-formed reply that cannot be true (10^12 tokens of usage): retrying cannot help."""


class AttemptOver(Exception):
    """The attempt passed RetryPolicy.attempt_timeout_s (retried like a timeout)."""


class TooLarge(Exception):
    """The reply body passed RetryPolicy.max_reply_bytes (not retried)."""


class BoundedBody:
    """One attempt's reply body, held to ``policy.attempt_timeout_s`` (a wall-clock deadline over
    headers and body, started at construction, i.e. before the request is sent) and
    ``policy.max_reply_bytes``. It does no I/O: a sync or an async reader calls :meth:`start` with
    the headers, then :meth:`feed` with each chunk as it arrives, so that neither a server dripping
    a byte at a time nor one sending gigabytes can hold the caller or its memory; ``str(error)``
    names the limit that was passed."""

    def __init__(self, policy: "RetryPolicy", clock: Callable[[], float] = time.monotonic):
        self.limit = policy.max_reply_bytes
        self.seconds = policy.attempt_timeout_s
        self._clock = clock
        self.deadline = clock() + policy.attempt_timeout_s
        self.size = 0
        self._chunks: list[bytes] = []

    def _check_deadline(self) -> None:
        if self._clock() > self.deadline:
            raise AttemptOver(f"not complete within {self.seconds:g} s (--attempt-timeout)")

    def start(self, headers: Any) -> None:
        """The headers have arrived: refuse a declared length over the cap before reading any body."""
        self._check_deadline()
        declared = headers.get("content-length", "") or ""
        if declared.isdigit() and int(declared) > self.limit:
            raise TooLarge(f"Content-Length {declared}")

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(f"more than {self.limit} bytes read")
        self._chunks.append(chunk)
        self._check_deadline()

    def body(self) -> bytes:
        return b"".join(self._chunks)


def _text(s: str) -> str:
    """A reply's string as Unicode text: a lone surrogate (JSON's "\\ud800", which UTF-8 cannot
    write to the call log or the cache) becomes U+FFFD, as a decoder does with a bad byte."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", s)


def parse_completion(body: Any) -> Reply:
    """A parsed response body -> :class:`Reply`; ValueError when it is not a chat completion."""
    if not isinstance(body, dict):
        raise ValueError("the body is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            raise ValueError(f"no choices; the server says: {err['message'][:200]}")
        raise ValueError("no choices in the body")
    ch = choices[0]
    msg = ch.get("message")
    if not isinstance(msg, dict):
        raise ValueError("choices[0].message missing")
    text = msg.get("content")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise ValueError("choices[0].message.content is not a string")
    usage = body.get("usage")
    t_in = t_out = None
    if isinstance(usage, dict):
        pi, co = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(pi, int) and not isinstance(pi, bool) and pi >= 0:
            t_in = pi
        if isinstance(co, int) and not isinstance(co, bool) and co >= 0:
            t_out = co
        if t_in is None or t_out is None:
            t_in = t_out = None  # half a usage record is no usage record
        for key, v in (("prompt_tokens", t_in), ("completion_tokens", t_out)):
            if v is not None and v > MAX_TOKENS:  # a cache cannot hold it (envs.cache.values): refuse the reply
                raise ImplausibleReply(f"usage.{key} = {v}, more than the {MAX_TOKENS:.0e} tokens a call "
                                       "can have in a cache")
    lps, invalid = read_logprobs(ch.get("logprobs"))
    finish = ch.get("finish_reason")
    model = body.get("model")
    return Reply(text=_text(text), tokens_in=t_in, tokens_out=t_out, logprobs=lps,
                 finish_reason=finish if isinstance(finish, str) else None,
                 model=model if isinstance(model, str) else None, logprobs_invalid=invalid)


def parse_model_list(body: Any) -> list[str]:
    """A ``GET /models`` body (``{"data": [{"id": ...}, ...]}``, OpenAI's shape) -> the model ids;
    ValueError when it is not one."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list of models in the body")
    return [d["id"] for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]


class NotRetried(Exception):
    """An attempt's outcome that another attempt cannot change; ``kind``: 'malformed' (an implausible
    completion) or 'status' (a 4xx other than 408/409/429)."""

    def __init__(self, msg: str, kind: str):
        super().__init__(msg)
        self.kind = kind


def judge_attempt(status: int, headers: Any, raw: bytes) -> tuple[Reply | None, str, float | None]:
    """One chat attempt's HTTP outcome, the rule every caller (the sync :class:`~ccpo_jax.collect.client.ChatClient`, the
    gateway's async client) applies: ``(reply, "", None)`` for a chat completion; ``(None, reason,
    asked)`` for an attempt worth retrying (a malformed body, a retryable status; ``asked`` is the
    server's Retry-After in seconds, or None); :class:`NotRetried` otherwise."""
    if status == 200:
        try:
            return parse_completion(json.loads(raw.decode("utf-8"))), "", None
        except ImplausibleReply as e:
            raise NotRetried(f"{e} (not retried)", "malformed") from None
        except (ValueError, UnicodeDecodeError) as e:
            return None, (f"malformed body ({e})" if not isinstance(e, json.JSONDecodeError) else "malformed JSON body"), None
    if should_retry(status):
        return None, f"HTTP {status}", retry_after_s(headers)
    excerpt = raw[:300].decode("utf-8", "replace").strip()
    raise NotRetried(f"HTTP {status} (not retried): {excerpt}", "status")
