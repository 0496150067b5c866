"""One protocol call: replay it from the call log, or reserve its worst case, send it, log it, count it."""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import threading
from typing import Any, Callable

from ccpo_jax.collect.calllog import CallLog
from ccpo_jax.collect.client import ChatClient
from ccpo_jax.collect.meter import Meter
from ccpo_jax.collect.settings import Settings
from ccpo_jax.llm.calls import PROMPT_TOKENS_PER_CHAR, TOP_LOGPROBS, request_body, reserve_tokens
from ccpo_jax.llm.wire import CallStats, EndpointError, Stopped
from envs.cache.tokens import estimate_tokens, tokens_for_chars

@dataclasses.dataclass(frozen=True)
class Answer:
    """One call's outcome as the protocol uses it (replayed or fresh)."""

    text: str
    tokens_in: int
    tokens_out: int
    logprobs: tuple[tuple[str, float], ...] | None
    estimated: bool
    finish_reason: str | None = None
    logprobs_invalid: str | None = None  # sent but unusable: what is wrong (client.read_logprobs)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def _chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


class Caller:
    """Makes the protocol's calls: replay from the call log, budget, send, log, count."""

    def __init__(self, s: Settings, log: CallLog, meter: Meter, stop: threading.Event,
                 clients: dict[str, ChatClient], warn: Callable[[str], Any] = lambda msg: None):
        self.s, self.log, self.meter, self.stop, self.clients, self.warn = s, log, meter, stop, clients, warn

    def usd(self, role: str, t_in: float, t_out: float) -> float:
        p_in, p_out = self.s.prices[role]
        return (t_in * p_in + t_out * p_out) / 1e6

    def body(self, role: str, messages: list[dict], max_tokens: int, temperature: float,
             response_format: dict | None = None) -> dict:
        return request_body(self.s.endpoint(role).model, messages, max_tokens, temperature, self.s.seed,
                            self.s.logprobs, response_format)

    def call(self, qid: str, name: str, role: str, messages: list[dict], max_tokens: int,
             temperature: float, response_format: dict | None = None) -> Answer:
        ep = self.s.endpoint(role)
        body = self.body(role, messages, max_tokens, temperature, response_format)
        key = request_key(ep.public_url, body, qid, name)
        hit = self.log.replies.get(key)
        if hit is not None:
            self.meter.count("replayed")
            self.log.append({"key": key, "q": qid, "call": name, "replayed": True, "at": now_iso()})
            return self._seen(role, _answer(hit), qid, name)
        if self.stop.is_set():
            raise Stopped()
        chars = _chars(messages)
        ratio = self.log.ratio.get(ep.model)
        ratio = PROMPT_TOKENS_PER_CHAR if ratio is None else 1.25 * ratio
        est = self.usd(role, reserve_tokens(chars, len(messages), ratio), max_tokens)
        self.meter.reserve(est)
        try:
            reply, stats = self.clients[role].chat(body)
        except EndpointError as e:
            st = e.stats or CallStats()
            self.meter.settle(est, role, None, 0.0, st)
            self.log.append({"key": key, "q": qid, "call": name, "model": ep.model, "endpoint": ep.public_url,
                             "error": str(e), "attempts": st.attempts, "waits": [list(w) for w in st.waits],
                             "at": now_iso()})
            self.meter.count("failed")
            raise
        except Stopped:
            self.meter.settle(est, role, None, 0.0, CallStats())
            raise
        estimated = reply.tokens_in is None
        t_in = reply.tokens_in if not estimated else tokens_for_chars(chars)
        t_out = reply.tokens_out if not estimated else estimate_tokens(reply.text)
        usd = self.usd(role, t_in, t_out)
        rec = {
            "key": key, "q": qid, "call": name, "model": ep.model, "endpoint": ep.public_url, "at": now_iso(),
            "attempts": stats.attempts, "waits": [list(w) for w in stats.waits],
            "latency_s": round(stats.latency_s, 4), "tokens_in": t_in, "tokens_out": t_out,
            "prompt_chars": chars, "cost_usd": usd, "finish_reason": reply.finish_reason,
            "text": reply.text, "served_model": reply.model,
            "logprobs": [list(x) for x in reply.logprobs] if reply.logprobs is not None else None,
        }
        if reply.logprobs_invalid is not None:
            rec["logprobs_invalid"] = reply.logprobs_invalid
        if reply.model is not None and reply.model != ep.model and not reply.model.startswith(ep.model + "-"):
            # (a dated snapshot such as gpt-4o-2024-08-06 for gpt-4o is the model asked for)
            self.meter.count("model_mismatch")
            self.warn(f"warning: the {role} endpoint ({ep.public_url}) answered as model {reply.model!r}, not "
                      f"{ep.model!r} as asked (each reply's model is in the call log as served_model)")
        if estimated:
            rec["tokens_estimated"] = True
            self.meter.count("estimated_usage")
        self.log.append(rec)
        self.meter.settle(est, role, reply, usd, stats)
        self.meter.count_tokens(role, t_in, t_out)
        return self._seen(role, _answer(rec), qid, name)

    def _seen(self, role: str, a: Answer, qid: str, name: str) -> Answer:
        """Count whether the reply has log-probs; warn once per role when the endpoint returned
        none at its first reply although they were asked for, and at its first reply whose
        log-probs are invalid (NaN, positive...), naming the question and the call."""
        if not self.s.logprobs:
            return a
        first, first_invalid = self.meter.logprobs_seen(role, a.logprobs is not None, a.logprobs_invalid is not None)
        ep = self.s.endpoint(role)
        what = "base confidence" if role.startswith("base") else "guide uncertainty"
        if first_invalid:
            self.warn(f"warning: the {role} endpoint ({ep.model} at {ep.public_url}) returned invalid log-probs "
                      f"for question {qid} (call {name}): {a.logprobs_invalid}; {what} will be missing wherever "
                      "they are invalid; the summary counts them (docs/collect.md)")
        elif first:
            self.warn(f"warning: the {role} endpoint ({ep.model} at {ep.public_url}) returned no log-probs in its "
                      f"first reply, although the request asked for them (logprobs, top_logprobs "
                      f"{TOP_LOGPROBS}): {what} will be missing wherever it sends none; the summary gives the "
                      "share of rounds with each signal (docs/collect.md)")
        return a


def is_sampled(body: dict) -> bool:
    """A request whose reply is a fresh sample each time: temperature > 0 and no seed sent."""
    return float(body.get("temperature", 1.0)) > 0.0 and body.get("seed") is None


def request_key(url: str, body: dict, qid: str, name: str) -> str:
    """The call log's key of a request: its URL and body, so that an identical request is sent once
    (its reply is the same: temperature 0, or a seed sent); for a sampled request (:func:`is_sampled`)
    also the question and the call's name, so that each call site gets its own sample, and a
    ``--resume`` still replays what that call site was paid for."""
    what: dict[str, Any] = {"url": url, "body": body}
    if is_sampled(body):
        what["at"] = [qid, name]
    return hashlib.sha256(json.dumps(what, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _answer(rec: dict) -> Answer:
    lps = rec.get("logprobs")
    fin = rec.get("finish_reason")
    return Answer(
        text=rec["text"], tokens_in=int(rec["tokens_in"]), tokens_out=int(rec["tokens_out"]),
        logprobs=tuple((str(t), float(v)) for t, v in lps) if lps else None,
        estimated=bool(rec.get("tokens_estimated", False)),
        finish_reason=fin if isinstance(fin, str) else None,
        logprobs_invalid=rec["logprobs_invalid"] if isinstance(rec.get("logprobs_invalid"), str) else None,
    )
