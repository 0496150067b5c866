"""The OpenAI-compatible gateway's service: the CCPO protocol per request, without HTTP (docs/gateway.md).

:class:`Gateway` is the whole behaviour (router, upstream clients, journal, coverage, metrics), so
``live-eval`` runs the same code in-process; :mod:`ccpo_jax.gateway.app` builds the HTTP app around it
(``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /v1/feedback``, ``GET /metrics``,
``GET /healthz``). Requests run concurrently on one event loop; each request's upstream calls are
sequential.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.gateway.engine import ON_EMPTY, Batcher, Caps, Decider, Outcome, ProtocolConfig, run_protocol
from ccpo_jax.gateway.journal import FeedbackError, Journal, journal_manifest
from ccpo_jax.gateway.metrics import Metrics
from ccpo_jax.gateway.online import CoverageState
from ccpo_jax.gateway.schema import MODEL_ID, completion_body, sse_chunks  # noqa: F401 (MODEL_ID: the service's id)
from ccpo_jax.gateway.state import EmbeddedState, FeedbackResult, GatewayState
from ccpo_jax.gateway.upstream import AsyncChatClient, UpstreamError
from ccpo_jax.llm.wire import Endpoint, Reply, RetryPolicy
from ccpo_jax.serving import Router
from ccpo_jax.serving.server import ServerLimits

log = logging.getLogger("ccpo_jax.gateway")

@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """``base``/``guide``: one endpoint, or one per round for a ladder artefact (round order); ``guide``
    None for a guide-less cascade's artefact (:func:`endpoint_rungs` checks them against the artefact)."""

    base: Endpoint | tuple[Endpoint, ...]
    guide: Endpoint | tuple[Endpoint, ...] | None
    retry: RetryPolicy = RetryPolicy(retries=2, backoff_s=0.5, max_backoff_s=5.0, max_retry_after_s=10.0,
                                     timeout_s=60.0, attempt_timeout_s=120.0)
    journal: str | None = None
    online_eta: float | None = None
    window: int = 200
    alarm_p: float = 0.01
    protocol: ProtocolConfig = ProtocolConfig()
    #: The reply when the final set is empty (engine.ON_EMPTY; docs/gateway.md#empty-sets).
    on_empty: str = "guide"
    max_body_bytes: int = 1 << 20
    max_question_chars: int = 100_000
    max_connections: int = 256
    #: The HTTP server's bounds on every client: read timeout, keep-alive, connections, header size
    #: (ccpo_jax.serving.server; docs/gateway.md, "Server limits").
    server: ServerLimits = ServerLimits()
    #: Most decisions in one router call; the decision path is compiled for every power of two up to it
    #: at start-up (7 batch sizes for 64; the time: docs/performance.md#figures-behind-code-comments).
    max_batch: int = 64
    #: A line per request on the ``ccpo_jax.gateway.access`` logger (``gateway --no-access-log``: off).
    access_log: bool = True
    #: Upstream prices (model, USD per million tokens in, out) that replace the router's trained prices
    #: of the rounds that model serves (``gateway --price MODEL=IN,OUT``); costs, caps and the journal use them.
    prices: tuple[tuple[str, float, float], ...] = ()
    #: The shared state (``redis://HOST:PORT/DB``; None: the embedded default) and its settings
    #: (docs/gateway.md, "Replicas"): the local spool folder for journal records the store did not take,
    #: the deadline of one store call, whether an empty store may start a new deployment although the
    #: spool belonged to one, and this replica's name (metrics, replies).
    state: str | None = None
    spool: str = "ccpo-gateway-spool"
    state_timeout_s: float = 0.5
    new_deployment: bool = False
    replica: str | None = None


def _names(model) -> str:
    return ", ".join(m["name"] for m in model) if isinstance(model, list) else model["name"]


def endpoint_rungs(given: Endpoint | tuple[Endpoint, ...] | None, model: dict | list | None, T: int,
                   role: str) -> tuple[Endpoint, ...] | None:
    """Round t's endpoint of ``role`` at index t (T of them), or None for a cascade's guide.

    ``model``: the artefact's ``models[role]``. A ladder takes one endpoint per round, in round order;
    a one-model role takes one endpoint (used every round); a cascade's guide takes none. Any other
    count is a UserError naming ``role`` (the CLI's ``--base``/``--guide``): matching endpoints to
    rungs by model name would fail on servers that answer under another name (llama.cpp)."""
    eps = () if given is None else (given,) if isinstance(given, Endpoint) else tuple(given)
    n = len(eps)
    if model is None:
        if eps:
            raise UserError(f"{role}: the artefact's router is a guide-less cascade (models.guide: null): it makes "
                            f"no guide call, so give no {role} endpoint", field=role)
        return None
    if isinstance(model, list):
        if n != T:
            raise UserError(f"{role}: given {n} time(s); the artefact's router is a ladder of T = {T} {role} models "
                            f"({_names(model)}): give it once per round, in round order", field=role)
        return eps
    if n != 1:
        what = "required" if n == 0 else f"given {n} times"
        raise UserError(f"{role}: {what}; the artefact's router has one {role} model ({_names(model)}): give "
                        "its endpoint once", field=role)
    return eps * T


def _rung_prices(model: dict | list | None, T: int, served: tuple[Endpoint, ...] | None = None,
                 given: dict[str, tuple[float, float]] | None = None) -> tuple[tuple[float, float], ...] | None:
    """Round t's (price in, price out) of a role: the artefact's trained prices, or ``given[model]`` of the
    upstream model serving round t (``--price``)."""
    if model is None:
        return None
    rungs = model if isinstance(model, list) else [model] * T
    trained = [(float(m.get("price_in", 0.0)), float(m.get("price_out", 0.0))) for m in rungs]
    if served is None or not given:
        return tuple(trained)
    return tuple(given.get(e.model, p) for e, p in zip(served, trained))


def served_models(model: dict | list | None, served: tuple[Endpoint, ...] | None,
                  prices: tuple[tuple[float, float], ...] | None) -> dict | list | None:
    """The journal manifest's ``models[role]``: the upstream models that served, at the prices the gateway
    charged (a ladder: one per round; a one-model role: its one endpoint; a cascade's guide: None)."""
    if model is None or served is None or prices is None:
        return None
    one = lambda t: {"name": served[t].model, "price_in": prices[t][0], "price_out": prices[t][1]}  # noqa: E731
    return [one(t) for t in range(len(served))] if isinstance(model, list) else one(0)


class Gateway:
    """The gateway's state: router, upstream clients, metrics, journal, coverage/online kappa."""

    def __init__(self, router: Router, cfg: GatewayConfig, state: GatewayState | None = None):
        # the round protocol the router's cache was collected with, unless one was given (one protocol for
        # data collect, the gateway and live-eval: ccpo_jax.llm.protocols)
        cfg = dataclasses.replace(cfg, protocol=cfg.protocol.resolved(router.manifest["cache"]["provenance"]))
        if cfg.on_empty not in ON_EMPTY:
            raise UserError(f"--on-empty {cfg.on_empty!r}: one of {', '.join(ON_EMPTY)}", field="on_empty")
        self.router, self.cfg = router, cfg
        if cfg.online_eta is not None and router.group_kappas is not None:
            raise UserError("online_eta: a Mondrian router has one threshold per group; the online update "
                            "drives one threshold, so it needs a marginal router", field="online_eta")
        m, T = router.manifest["models"], int(router.T)
        #: Round t's endpoint per role (T each; the guide None in a cascade) and its prices (the artefact's).
        self.rungs = {r: endpoint_rungs(getattr(cfg, r), m[r], T, r) for r in ("base", "guide")}
        given = {name: (p_in, p_out) for name, p_in, p_out in cfg.prices}
        self.prices = {r: _rung_prices(m[r], T, self.rungs[r], given) for r in ("base", "guide")}
        self.roles = ("base", "guide") if self.rungs["guide"] is not None else ("base",)
        #: The distinct endpoints (a one-model role repeats its one endpoint every round).
        self.endpoints = list(dict.fromkeys(e for r in self.roles for e in self.rungs[r]))
        for e in self.endpoints:
            e.api_key()  # a missing key variable is a UserError now, not at the first request
        self.coverage = CoverageState(router.alpha, float(router.kappa), cfg.online_eta, cfg.window, cfg.alarm_p)
        self.metrics = Metrics(router.T, shared=cfg.state is not None)
        self.metrics.kappa.set(float(router.kappa))
        self.metrics.target.set(1.0 - router.alpha)
        self.journal = None
        if state is None and cfg.state is not None:
            state = self._shared_state()
        if state is None:  # the embedded default: memory and the file journal (--journal)
            if cfg.journal is not None:
                self.journal = Journal(cfg.journal, self.journal_manifest())
            state = EmbeddedState(self.journal, self.coverage)
        self.state: GatewayState = state
        self.coverage = state.coverage
        self.decider = Decider(router, self.coverage)
        self.batcher = Batcher(self.decider, cfg.max_batch, refresh=state.refresh if self.coverage.online else None)
        self.clients: dict[Endpoint, AsyncChatClient] = {}

    def _shared_state(self) -> GatewayState:
        from ccpo_jax.gateway.redis_state import RedisState

        cfg, r = self.cfg, self.router
        if cfg.journal is not None:
            raise UserError("--journal: with --state the journal of record is the store's (`ccpo-jax data pull "
                            f"{cfg.state} --out FILE.jsonl` writes it as a cache); give one or the other",
                            field="journal")
        man = self.journal_manifest()
        identity = {"router_manifest_sha256": r.manifest.get("manifest_sha256"), "router_policy":
                    r.manifest["policy"]["row"], "alpha": float(r.alpha), "kappa": float(r.kappa), "T": int(r.T),
                    "upstream_models": {role: self.role_value(role, lambda e: e.model) for role in self.roles},
                    "requests": man["provenance"]["requests"], "online_kappa": cfg.online_eta,
                    "prices": self.prices, "window": cfg.window, "alarm_p": cfg.alarm_p}
        st = RedisState(cfg.state, manifest=man, identity=identity, kappa0=float(r.kappa), alpha=float(r.alpha),
                        eta0=cfg.online_eta, window=cfg.window, alarm_p=cfg.alarm_p, spool=cfg.spool,
                        timeout_s=cfg.state_timeout_s, new_deployment=cfg.new_deployment, replica=cfg.replica)
        st.on_call = lambda op, s: self.metrics.state_latency.labels(op).observe(s)
        return st

    def journal_manifest(self) -> dict:
        """The journal's manifest line (the human cache format's): the artefact's models, the endpoints and
        the protocol's request settings."""
        p = self.cfg.protocol
        reqs = {"base_temperature": list(p.base_temperature), "guide_temperature": p.guide_temperature,
                "max_tokens": {"base": p.base_max_tokens, "guide": p.guide_max_tokens}, "seed": p.seed,
                "logprobs": p.logprobs}
        if p.round_protocol != "paper":
            reqs["round_protocol"] = p.round_protocol
        eps = {r: self.role_value(r, lambda e: {"url": e.public_url, "model": e.model}) for r in self.roles}
        m = self.router.manifest["models"]
        served = {r: served_models(m[r], self.rungs[r], self.prices[r]) for r in ("base", "guide")}
        return journal_manifest(self.router.manifest, eps, reqs, served, groups=self.router.group_kappas is not None)

    def role_value(self, role: str, f, rounds: int | None = None) -> Any:
        """``f`` of the role's endpoint, or for a ladder the list of ``f`` of each round's endpoint (of
        the first ``rounds`` rounds)."""
        eps = self.rungs[role]
        return [f(e) for e in eps[:rounds]] if isinstance(self.router.manifest["models"][role], list) else f(eps[0])

    def warm_up(self) -> None:
        """Compile the decision path for every batch size the batcher can send (powers of two up to
        ``warm_batch``), so that no request waits for a compilation
        (docs/performance.md#figures-behind-code-comments)."""
        rnd = [{"base": {"answer": "a", "tokens_in": 1, "tokens_out": 1},
                "guide": {"verdict": True, "answer": "a", "tokens_in": 1, "tokens_out": 1}}]
        if "guide" not in self.roles:  # a cascade's rounds have no guide object
            rnd = [{"base": rnd[0]["base"]}]
        b = 1
        while b <= self.batcher.max_batch:
            self.decider.decide_many([(rnd, True, None)] * b)
            b *= 2

    async def start(self) -> None:
        await self.state.start()
        self.clients = {e: AsyncChatClient(e, self.cfg.retry, max_connections=self.cfg.max_connections, seed=i)
                        for i, e in enumerate(self.endpoints)}

    async def stop(self) -> None:
        for c in self.clients.values():
            await c.aclose()
        await self.state.close()

    async def _call(self, role: str, t: int, body: dict) -> Reply:
        ep = self.rungs[role][t]  # round t's model (a ladder's rung t)
        body["model"] = ep.model
        try:
            reply, stats = await self.clients[ep].chat(body)
        except UpstreamError as e:
            self.metrics.errors.labels(f"upstream_{e.kind}").inc()
            raise
        self.metrics.latency.labels(ep.model).observe(stats.latency_s)
        if body.get("logprobs") and reply.logprobs is None:
            self.metrics.missing.labels("confidence" if role == "base" else "uncertainty").inc()
        return reply

    def _counted(self, role: str, info: dict) -> None:
        model = self.rungs[role][info["round"]].model
        self.metrics.cost.labels(model).inc(info["cost_cents"])
        self.metrics.tokens.labels(model, "in").inc(info["tokens_in"])
        self.metrics.tokens.labels(model, "out").inc(info["tokens_out"])

    async def complete(self, question: str, group: str | None, caps: Caps,
                       cid: str | None = None) -> tuple[str, Outcome]:
        """Run the protocol for one question; journal it; (completion id, outcome). ``cid``: the id to
        journal it under (live-eval: the question's id; default a fresh ``chatcmpl-`` id)."""
        self.metrics.in_flight.inc()
        try:
            out = await run_protocol(question, group, caps, decider=self.batcher, call=self._call,
                                     cfg=self.cfg.protocol, prices=self.prices, on_round=self._counted,
                                     on_empty=self.cfg.on_empty)
        finally:
            self.metrics.in_flight.dec()
        cid = cid or self.state.new_id()
        self.metrics.rounds.observe(len(out.rounds))
        if out.answer is None:
            self.metrics.empty.labels("abstain" if out.fallback is None else out.fallback["role"]).inc()
        for rnd in out.rounds:
            for role, rec in rnd.items():
                cut = rec.get("answer_truncated", False) + rec.get("raw_truncated", False)
                if cut:
                    self.metrics.truncated.labels(role).inc(cut)
        for d, s in zip(out.decisions, out.decide_s):
            self.metrics.decide.observe(s)
            if d.get("kappa_stale"):
                self.metrics.stale_decisions.inc()
            for a in d["action_set"] or ["empty"]:
                self.metrics.decisions.labels(a).inc()
        out.journal = await self.state.append(self.journal_line(cid, question, group, out))
        return cid, out

    def journal_line(self, cid: str, question: str, group: str | None, out: Outcome) -> dict:
        rec: dict[str, Any] = {"id": cid, "question": question}
        if self.router.group_kappas is not None:  # a Mondrian journal: every line has a group
            rec["group"] = group if group is not None else "(none)"
        rec["rounds"] = out.rounds
        rec["gateway"] = self.ccpo_object(out)
        rec["gateway"]["answer"] = out.answer  # the set's answer (None: the set is empty; see "fallback")
        rec["gateway"]["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return rec

    def ccpo_object(self, out: Outcome) -> dict:
        keep = ("round", "action_set", "probs", "available", "kappa", "kappa_source", "kappa_version", "kappa_stale",
                "group")
        return {
            "answer_set": out.answer_set,
            # the final set is empty: the reply is a fallback outside the guaranteed set, or empty
            "empty_set": out.answer is None,
            "fallback": None if out.fallback is None else {**out.fallback, "guaranteed": False,
                                                           "on_empty": self.cfg.on_empty},
            "abstained": out.answer is None and out.fallback is None,
            "rounds": len(out.rounds),
            "stopped_by": out.stopped_by,
            "decisions": [{k: d[k] for k in keep if k in d} for d in out.decisions],
            # a ladder role's "model": the models of the rounds run, in order
            "tokens": {r: {"model": self.role_value(r, lambda e: e.model, len(out.rounds)), **out.tokens[r]}
                       for r in self.roles},
            "cost_cents": round(sum(t["cost_cents"] for t in out.tokens.values()), 9),
            "tokens_estimated": out.estimated,
            "coverage_target": 1.0 - self.router.alpha,
            **({} if (info := self.state.reply_info()) is None else {"state": dict(info, journal=out.journal)}),
        }

    async def feedback(self, body: Any) -> dict:
        """Record an outcome (``POST /v1/feedback``); FeedbackError (4xx) or StateUnavailable (503)."""
        res: FeedbackResult = await self.state.feedback(body)
        out, cov, v = res.record, res.covered, res.view
        # none_seen: the set missed, but no round run saw a correct answer (counted as covered: journal.outcome)
        counted = "none_seen" if cov and out["feedback"]["covered"] is False else \
            {True: "covered", False: "missed", None: "undetermined"}[cov]
        self.metrics.feedback.labels(counted).inc()
        self.metrics.kappa.set(v.kappa)
        if v.rolling is not None:
            self.metrics.coverage.set(v.rolling)
        self.metrics.alarm.set(float(v.alarm))
        if res.alarm_turned_on:
            log.warning("drift alarm: rolling coverage %.3f over the last %d outcomes is below the target %.3f "
                        "(one-sided binomial p = %.2g)", v.rolling, min(v.seen, self.cfg.window),
                        1 - self.router.alpha, v.p_value)
        reply = {"id": out["id"], "recorded": True, "labelled": "correct" in out["rounds"][0]["base"],
                 "covered": out["feedback"]["covered"], "counted_as": counted, "kappa": v.kappa, "rolling_coverage": v.rolling,
                 "drift_alarm": v.alarm}
        info = self.state.reply_info()
        if info is not None:
            reply["state"] = info
        return reply

    def metrics_text(self) -> bytes:
        """``GET /metrics``: with a shared store, its gauges are set from the deployment's state first."""
        st, m = self.state, self.metrics
        if st.kind != "embedded":
            v = st.view()
            m.kappa.set(v.kappa)
            m.kappa_version.set(v.version)
            if v.rolling is not None:
                m.coverage.set(v.rolling)
            m.alarm.set(float(v.alarm))
            m.state_up.set(float(st.up and not st.lost))
            m.state_lost.set(float(st.lost))
            m.spooled.set(len(st.spool.records))
            return m.render(replica=(self.cfg.replica or st.replica).split("/")[0])
        return m.render()

    def completion_body(self, cid: str, out: Outcome) -> dict:
        """The reply to a chat completion (:class:`ccpo_jax.gateway.schema.ChatCompletion`)."""
        return completion_body(cid, int(time.time()), out.content, out.usage, self.ccpo_object(out))

    def sse_chunks(self, cid: str, out: Outcome) -> list[bytes]:
        """The streamed reply (:class:`ccpo_jax.gateway.schema.ChatCompletionChunk` events, then ``[DONE]``)."""
        return sse_chunks(cid, int(time.time()), out.content, out.usage, self.ccpo_object(out))


def load_gateway(artefact: str | Path, cfg: GatewayConfig) -> Gateway:
    router = Router.load(artefact)
    gw = Gateway(router, cfg)
    gw.warm_up()
    return gw
