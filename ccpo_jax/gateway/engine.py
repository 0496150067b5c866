"""One request through the CCPO protocol, live: base, guide, parse, decide, until the router's set stops.

The prompts, parsers, measures and request bodies are data collect's
(:mod:`ccpo_jax.llm.paper`, :func:`ccpo_jax.llm.calls.request_body`,
with the defaults of :class:`ccpo_jax.llm.calls.CallDefaults` and the round protocol for max tokens,
temperatures, seed and log-probs). After each round the exported router decides
on the rounds so far (:meth:`ccpo_jax.serving.Router.decide`), exactly as
``serve`` and ``route`` would; with ``--online-kappa`` the set is taken at the
live threshold, ``{a available : pi(a|o) >= kappa}`` (the conformal set of Eq. 2). Decisions
are screened (``Router.decide_many(screen=True)``): the exported module's sets, with the float64
forward pass deciding every row that is not within 1e-4 of its threshold.

Answer rule: the reply is the answer collected last, i.e. of the latest round
whose set held an answer, the guide's when that set holds both. When no round's set held an
answer (the final set is empty), ``on_empty`` decides (:data:`ON_EMPTY`, docs/gateway.md#empty-sets):
``abstain`` replies with empty content; ``guide`` / ``base`` reply with that role's answer of the last
round run (the other role's when that one is empty), marked as a fallback outside the guaranteed set.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any, Callable, Protocol, runtime_checkable

from ccpo_jax.gateway.online import CoverageState
from ccpo_jax.llm import paper as P
from ccpo_jax.llm import protocols
from ccpo_jax.llm.calls import PROMPT_TOKENS_PER_CHAR, CallDefaults, request_body, reserve_tokens
from ccpo_jax.llm.wire import Reply
from ccpo_jax.serving import Router
from envs.cache.tokens import CHARS_PER_TOKEN, estimate_tokens, tokens_for_chars

ROLES = ("base", "guide")
#: What the reply holds when the final set is empty: nothing, or the last round's guide / base answer.
ON_EMPTY = ("guide", "base", "abstain")


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(CallDefaults) if f.name == name)


@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
    """Per-call settings; the defaults are data collect's (one definition: :class:`ccpo_jax.llm.calls.CallDefaults`
    and the round protocol's, :mod:`ccpo_jax.llm.protocols`). ``round_protocol`` None: the artefact's (the protocol
    its cache was collected with, :func:`protocols.of_provenance`); max tokens None: that protocol's."""

    base_max_tokens: int | None = None
    guide_max_tokens: int | None = None
    base_temperature: tuple[float, float] = _default("base_temperature")
    guide_temperature: float = _default("guide_temperature")
    seed: int | None = _default("seed")
    logprobs: bool = _default("logprobs")
    round_protocol: str | None = None

    def resolved(self, provenance: dict) -> "ProtocolConfig":
        """Every None filled: the protocol from ``provenance`` (a cache's or an artefact's cache's) unless
        one was given, and its max tokens unless given."""
        pr = protocols.get(self.round_protocol) if self.round_protocol else protocols.of_provenance(provenance)
        return dataclasses.replace(
            self, round_protocol=pr.name,
            base_max_tokens=self.base_max_tokens if self.base_max_tokens is not None else pr.base_max_tokens,
            guide_max_tokens=self.guide_max_tokens if self.guide_max_tokens is not None else pr.guide_max_tokens)

    @property
    def proto(self) -> protocols.Protocol:
        return protocols.get(self.round_protocol or "paper")

    @property
    def complete(self) -> bool:
        return None not in (self.base_max_tokens, self.guide_max_tokens, self.round_protocol)


@dataclasses.dataclass(frozen=True)
class Caps:
    """Per-request caps (request fields ``max_rounds``, ``max_cost_cents``)."""

    max_rounds: int | None = None
    max_cost_cents: float | None = None


class CapTooSmall(ValueError):
    """``max_cost_cents`` is below the first round's worst case: nothing is sent."""


@dataclasses.dataclass
class Outcome:
    """A finished request: what the reply and the journal say."""

    rounds: list[dict]
    decisions: list[dict]
    answer_set: list[dict]
    answer: str | None  # None: the final set is empty
    stopped_by: str
    tokens: dict[str, dict]
    usage: dict[str, int]
    estimated: bool
    decide_s: list[float]
    journal: str | None = None  # where the request was journaled (GatewayState.append)
    #: The answer given although the set is empty (``on_empty`` guide / base): {"role", "round", "answer"};
    #: None when the set held an answer or the reply abstains.
    fallback: dict | None = None

    @property
    def content(self) -> str:
        """The reply's text: the set's answer, else the fallback's, else empty (an abstention)."""
        if self.answer is not None:
            return self.answer
        return self.fallback["answer"] if self.fallback is not None else ""


def fallback_answer(rounds: list[dict], on_empty: str) -> dict | None:
    """The answer an empty set falls back to (:data:`ON_EMPTY`): the chosen role's answer of the last
    round, the other role's when it is empty (unparsed); None for ``abstain`` or when both are empty."""
    if on_empty == "abstain" or not rounds:
        return None
    last = rounds[-1]
    order = ("guide", "base") if on_empty == "guide" else ("base", "guide")
    for role in order:
        if role in last and last[role].get("answer"):
            return {"role": role, "round": len(rounds), "answer": last[role]["answer"]}
    return None


class Decider:
    """The router's decision, at the artefact's kappa or at the online one."""

    def __init__(self, router: Router, coverage: CoverageState, screen: bool = True):
        self.router = router
        self.coverage = coverage
        #: Screened decisions (Router.decide_many): the module's sets, at a fraction of its cost.
        self.screen = screen

    def decide_many(self, reqs: list[tuple[list[dict], bool, str | None]]) -> list[dict]:
        """One decision per (rounds so far, can_continue, group), in one batch of the router."""
        k = float(self.coverage.kappa) if self.coverage.online else None  # the live threshold
        ds = self.router.decide_many([{"rounds": r, "can_continue": c, "group": g} for r, c, g in reqs],
                                     where="request" if len(reqs) == 1 else "batch", screen=self.screen, kappa=k)
        version = getattr(self.coverage, "version", None) if k is not None else None  # a shared store's
        for d in ds:
            d.setdefault("kappa_source", "marginal" if k is None else "online (--online-kappa)")
            if version is not None:
                d["kappa_version"] = version
                if self.coverage.stale:  # the store did not answer: the last good kappa
                    d["kappa_stale"] = True
        return ds

    def decide(self, rounds: list[dict], can_continue: bool, group: str | None) -> dict:
        return self.decide_many([(rounds, can_continue, group)])[0]


@runtime_checkable
class Decides(Protocol):
    """What :func:`run_protocol` decides with: the router (its T, guide and cache) and an awaitable decision
    on the rounds so far. :class:`Batcher` is one (concurrent requests in one router call), :class:`Immediate`
    another (a :class:`Decider`'s decision at once)."""

    router: Router

    async def decide(self, rounds: list[dict], can_continue: bool, group: str | None) -> dict: ...


class Immediate:
    """A :class:`Decider` as :class:`Decides`: each decision at once, in its own router call."""

    def __init__(self, decider: Decider):
        self.decider, self.router = decider, decider.router

    async def decide(self, rounds: list[dict], can_continue: bool, group: str | None) -> dict:
        return self.decider.decide(rounds, can_continue, group)


class Batcher:
    """Decisions of concurrent requests in one router call: the decisions asked for while the event loop
    was busy are decided together when it next runs the batcher. The call runs on the event loop
    itself: a screened decision costs less than handing it to a thread, which then waits for the GIL
    behind the loop (measured: docs/performance.md#figures-behind-code-comments).
    A batch that fails is decided one by one, so one request's error stays its own."""

    def __init__(self, decider: Decider, max_batch: int = 256, refresh=None):
        self.decider, self.max_batch = decider, max_batch
        #: awaited before each batch (a shared store's latest kappa; it never raises, never hangs)
        self.refresh = refresh
        self._pending: list = []
        self._running = False
        self.batches = 0

    @property
    def router(self) -> Router:
        return self.decider.router

    async def decide(self, rounds: list[dict], can_continue: bool, group: str | None) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(((rounds, can_continue, group), fut))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
                batch = [(req, f) for req, f in batch if not f.done()]  # (a cancelled request's)
                if not batch:
                    continue
                if self.refresh is not None:
                    await self.refresh()
                self.batches += 1
                try:
                    out = self.decider.decide_many([req for req, _ in batch])
                except Exception:  # noqa: BLE001 - decide each alone: the error goes to its request
                    out = []
                    for req, _ in batch:
                        try:
                            out.append(self.decider.decide(*req))
                        except Exception as e:  # noqa: BLE001
                            out.append(e)
                for (_, f), d in zip(batch, out):
                    if not f.done():
                        f.set_exception(d) if isinstance(d, Exception) else f.set_result(d)
        finally:
            self._running = False


def cents(price: tuple[float, float], t_in: float, t_out: float) -> float:
    """Cents for a call at (USD per M input tokens, per M output tokens)."""
    return (t_in * price[0] + t_out * price[1]) / 1e6 * 100.0


#: Per-round prices of each role: round t's (USD per M input, per M output) at index t; None: a
#: guide-less cascade's guide (no call).
Prices = dict[str, tuple[tuple[float, float], ...] | None]


def per_round(prices: dict, T: int) -> Prices:
    """``prices`` with every role as T per-round pairs: a role given one pair (one model) is that pair
    every round; a ladder's T pairs are kept; None (a cascade's guide) stays None."""
    out: Prices = {}
    for role in ROLES:
        p = prices.get(role)
        if p is None or (len(p) == 2 and all(isinstance(x, (int, float)) for x in p)):
            out[role] = None if p is None else ((float(p[0]), float(p[1])),) * T
        elif len(p) == T:
            out[role] = tuple((float(a), float(b)) for a, b in p)
        else:
            raise ValueError(f"prices[{role!r}]: one (in, out) pair or T = {T} of them, got {len(p)}")
    return out


def round_reserve(question: str, history: list[tuple[str, str]], cfg: ProtocolConfig, prices: Prices,
                  t: int = 0) -> float:
    """Worst-case cents of round ``t`` (0-based), at that round's prices (data collect's reservation:
    prompt tokens estimated at PROMPT_TOKENS_PER_CHAR per character plus a per-message overhead,
    completions at max_tokens; the guide may be shown a whole base completion). ``history``: what
    the base is shown (none in a cascade); a cascade's round is the base call alone."""
    cfg = cfg if cfg.complete else cfg.resolved({})  # (a config not resolved against an artefact: the paper's)
    bm = cfg.proto.base_messages(question, history)
    b_in = reserve_tokens(sum(len(m["content"]) for m in bm), len(bm))
    base = cents(prices["base"][t], b_in, cfg.base_max_tokens)
    if prices.get("guide") is None:
        return base
    g_chars = cfg.proto.guide_prompt_chars() + len(question)
    g_in = reserve_tokens(g_chars, 1) + math.ceil(cfg.base_max_tokens * CHARS_PER_TOKEN * PROMPT_TOKENS_PER_CHAR)
    return base + cents(prices["guide"][t], g_in, cfg.guide_max_tokens)


def _side(reply: Reply, messages: list[dict]) -> tuple[int, int, bool]:
    """Tokens of a call: the reply's usage, or the one estimate (envs.cache.tokens, as data collect)."""
    if reply.tokens_in is None:
        return tokens_for_chars(sum(len(m["content"]) for m in messages)), estimate_tokens(reply.text), True
    return reply.tokens_in, reply.tokens_out, False


#: Longest upstream text the gateway journals and returns, in characters: each answer, and an unreadable
#: guide reply (``raw``); longer ones are cut here and marked ``answer_truncated`` / ``raw_truncated``
#: (an upstream that ignores max_tokens sent an 8 MB answer: a 74 MB journal line, past the cache
#: reader's 16 MiB per line). The bound keeps every line readable: at most 5 texts a round (base and
#: guide answers, raw, two in the answer set) and the reply's answer, 6 bytes a character at worst
#: (JSON's \u escape), so T = 64 rounds (envs.cache.values.MAX_T) take at most 321 * 6 * 4096 bytes
#: = 7.9 MB, and a 100,000-character question 0.6 MB more.
MAX_ANSWER_CHARS = 4096


def bounded(text: str) -> tuple[str, bool]:
    """``text`` cut to :data:`MAX_ANSWER_CHARS` characters, and whether it was cut."""
    return (text, False) if len(text) <= MAX_ANSWER_CHARS else (text[:MAX_ANSWER_CHARS], True)


def _round_record(br: P.BaseRead, g: Reply | None, gr: P.GuideRead | None, rnd: dict) -> dict:
    """The round's cache record (human format) from the readings; ``rnd`` holds each role's tokens.
    Texts are :func:`bounded` (the guide's "Yes" answer is the base's, cut alike)."""
    answer, cut = bounded(br.answer)
    rnd["base"] = {"answer": answer, **rnd["base"], **({"answer_truncated": True} if cut else {})}
    if br.confidence is not None:
        rnd["base"]["confidence"] = br.confidence
    if not br.parsed:
        rnd["base"]["answer_parsed"] = False
    if gr is None:  # a cascade: no guide object
        return rnd
    answer, cut = bounded(gr.answer)
    rnd["guide"] = {"verdict": gr.verdict is True, "answer": answer, **rnd["guide"],
                    **({"answer_truncated": True} if cut else {})}
    if gr.uncertainty is not None:
        rnd["guide"]["uncertainty"] = gr.uncertainty
    if gr.verdict is None:
        rnd["guide"]["verdict_parsed"] = False
        rnd["guide"]["raw"], cut = bounded(g.text)
        if cut:
            rnd["guide"]["raw_truncated"] = True
    return rnd


async def run_protocol(question: str, group: str | None, caps: Caps, *, decider: Decides, call: Callable,
                       cfg: ProtocolConfig, prices: dict,
                       on_round: Callable[[str, dict], Any] = lambda role, rec: None,
                       on_empty: str = "abstain") -> Outcome:
    """The protocol for one question. ``call(role, t, body)`` is awaited for each upstream call of round
    ``t`` (0-based) and returns a :class:`~ccpo_jax.llm.wire.Reply`; ``on_round(role, info)`` sees
    each call's round, tokens and cost. ``prices``: per role one pair or T per-round pairs (a ladder;
    :func:`per_round`). A guide-less cascade's router (``has_guide`` False) makes no guide call, and
    its base is asked afresh every round (there is no guide reply to show it). ``on_empty``: the reply
    when the final set is empty (:func:`fallback_answer`). ``decider``: any :class:`Decides` (the
    gateway's :class:`Batcher`; :class:`Immediate` for one request alone)."""
    router = decider.router
    T, has_guide = router.T, router.has_guide
    if not cfg.complete:
        cfg = cfg.resolved(router.manifest["cache"]["provenance"])
    pr = cfg.proto
    prices = per_round(prices, T)
    roles = ROLES if has_guide else ("base",)
    limit = T if caps.max_rounds is None else min(T, caps.max_rounds)
    if caps.max_cost_cents is not None:
        first = round_reserve(question, [], cfg, prices, 0)
        if first > caps.max_cost_cents:
            raise CapTooSmall(f"max_cost_cents {caps.max_cost_cents:g} is below the first round's worst case "
                              f"({first:.6g} cents); nothing was sent")
    rounds: list[dict] = []
    decisions: list[dict] = []
    collected: list[dict] = []
    history: list[tuple[str, str]] = []  # what the base is shown (stays empty in a cascade)
    tokens = {r: {"tokens_in": 0, "tokens_out": 0, "cost_cents": 0.0} for r in roles}
    estimated = False
    decide_s: list[float] = []
    spent = 0.0
    stopped_by = "router"
    for t in range(limit):
        temp = P.base_temperature(cfg.base_temperature, t, cascade=not has_guide)
        bm = pr.base_messages(question, history)
        b = await call("base", t, request_body("", bm, cfg.base_max_tokens, temp, cfg.seed, cfg.logprobs,
                                               pr.base_format(question)))
        br = pr.read_base(question, b.text, b.logprobs)
        calls = [("base", b, bm)]
        g = gr = None
        if has_guide:
            gm = pr.guide_messages(question, br.shown)
            g = await call("guide", t, request_body("", gm, cfg.guide_max_tokens, cfg.guide_temperature, cfg.seed,
                                                    cfg.logprobs, pr.guide_format(question)))
            gr = pr.read_guide(question, g.text, g.logprobs, br.answer)
            calls.append(("guide", g, gm))
        rnd: dict[str, dict] = {}
        for role, reply, msgs in calls:
            t_in, t_out, est = _side(reply, msgs)
            estimated |= est
            c = cents(prices[role][t], t_in, t_out)
            spent += c
            tk = tokens[role]
            tk["tokens_in"] += t_in
            tk["tokens_out"] += t_out
            tk["cost_cents"] += c
            rnd[role] = {"tokens_in": t_in, "tokens_out": t_out, **({"tokens_estimated": True} if est else {})}
            on_round(role, {"round": t, "cost_cents": c, "tokens_in": t_in, "tokens_out": t_out})
        rounds.append(_round_record(br, g, gr, rnd))
        if has_guide:
            history.append((b.text, g.text))
        can_continue = t + 1 < limit
        if can_continue and caps.max_cost_cents is not None and \
                spent + round_reserve(question, history, cfg, prices, t + 1) > caps.max_cost_cents:
            can_continue, stopped_by = False, "max_cost_cents"
        elif not can_continue:
            stopped_by = "max_rounds" if limit < T else "T"
        t0 = time.perf_counter()
        d = await decider.decide(rounds, can_continue, group)
        decide_s.append(time.perf_counter() - t0)
        decisions.append(d)
        for role in roles:
            if role in d["action_set"]:
                collected.append({"round": t + 1, "role": role, "answer": rnd[role]["answer"]})
        if not d["continue"]:
            if can_continue:
                stopped_by = "router"
            break
    for tk in tokens.values():
        tk["cost_cents"] = round(tk["cost_cents"], 9)
    usage = {"prompt_tokens": sum(tk["tokens_in"] for tk in tokens.values()),
             "completion_tokens": sum(tk["tokens_out"] for tk in tokens.values())}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    answer = collected[-1]["answer"] if collected else None
    fb = fallback_answer(rounds, on_empty) if answer is None else None
    return Outcome(rounds, decisions, collected, answer, stopped_by, tokens, usage, estimated, decide_s, fallback=fb)
