"""``ccpo-jax gateway | live-eval`` options: one typed dataclass per command (:mod:`ccpo_jax.runtime.options`).

Every default is read from :class:`~ccpo_jax.gateway.service.GatewayConfig` (its retry policy and
server limits included), so a default is written once; :meth:`EndpointOptions.config` turns the
options into that configuration. Checks run in field order and name the field; the CLI says the flag
(:data:`GATEWAY_FLAGS`, :data:`LIVE_EVAL_FLAGS`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.gateway.engine import ON_EMPTY, ProtocolConfig
from ccpo_jax.gateway.service import GatewayConfig
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import option


def _config_default(name: str) -> Any:
    """GatewayConfig's default of field ``name`` (the one place it is written)."""
    return next(f.default for f in dataclasses.fields(GatewayConfig) if f.name == name)


RETRY, SERVER = _config_default("retry"), _config_default("server")


def _number(lo: float, what: str = "a number >="):
    def check(name: str, v: Any, cfg: Any) -> Any:
        if v is not None and not (math.isfinite(v) and v >= lo):
            raise UserError(f"{name}: expected {what} {lo:g}, got {v!r}", field=name)
        return v
    return check


def _within(lo: int, hi: int):
    def check(name: str, v: Any, cfg: Any) -> Any:
        if not lo <= v <= hi:
            raise UserError(f"{name}: expected an integer in [{lo}, {hi}], got {v}", field=name)
        return v
    return check


def _step(name: str, v: Any, cfg: Any) -> float | None:
    if v is not None and not (math.isfinite(v) and v > 0):
        raise UserError(f"{name}: expected a step > 0, got {v!r}", field=name)
    return v


def _port(name: str, v: Any, cfg: Any) -> int:
    if not 0 <= v <= 65535:
        raise UserError(f"{name}: expected 0..65535, got {v}", field=name)
    return v


def _seconds(name: str, v: Any, cfg: Any) -> float:
    if not (math.isfinite(v) and v > 0):
        raise UserError(f"{name}: expected a number of seconds > 0, got {v!r}", field=name)
    return v


def _state_timeout(name: str, v: Any, cfg: Any) -> float:
    if not (math.isfinite(v) and 0.001 <= v <= 60):
        raise UserError(f"{name}: expected seconds in [0.001, 60], got {v!r}", field=name)
    return v


@dataclasses.dataclass(frozen=True)
class EndpointOptions:
    """What both commands take: the artefact, the upstream endpoints, retries, batching and prices."""

    artifact: str = option("ARTIFACT", help="an exported router (the --out of 'ccpo-jax export')")
    base: tuple[str, ...] = option("--base", help="the base model's OpenAI-compatible endpoint; for a ladder "
                                   "artefact once per round, in round order: round t's base call goes to the t-th",
                                   metavar="URL,MODEL", repeat=True, required=True)
    guide: tuple[str, ...] | None = option("--guide", help="the guide model's endpoint (once per round for a guide "
                                           "ladder); none for a guide-less cascade artefact", metavar="URL,MODEL",
                                           repeat=True)
    base_key_env: str | None = option("--base-key-env", help="environment variable holding the base endpoints' API "
                                      "key (every rung's)", metavar="VAR", default_doc="send none")
    guide_key_env: str | None = option("--guide-key-env", help="likewise for the guide", metavar="VAR")
    retries: int = option("--retries", help="retries per upstream call", type=int, default=RETRY.retries,
                          check=_number(0))
    timeout: float = option("--timeout", help="seconds of upstream silence before an attempt fails", type=float,
                            metavar="S", default=RETRY.timeout_s, default_doc=f"{RETRY.timeout_s:g}",
                            check=_number(1e-3))
    attempt_timeout: float = option("--attempt-timeout", help="seconds one upstream attempt may take in all",
                                    type=float, metavar="S", default=RETRY.attempt_timeout_s,
                                    default_doc=f"{RETRY.attempt_timeout_s:g}", check=_number(1e-3))
    max_retry_after: float = option("--max-retry-after", help="longest Retry-After honoured; a longer one fails the "
                                    "request", type=float, metavar="S", default=RETRY.max_retry_after_s,
                                    default_doc=f"{RETRY.max_retry_after_s:g}", check=_number(0))
    max_batch: int = option("--max-batch", help="most decisions of concurrent requests in one router call; compiled "
                            "for every power of two up to it at start-up", type=int,
                            default=_config_default("max_batch"), check=_within(1, 4096))
    price: tuple[str, ...] = option("--price", help="an upstream model's own prices, USD per million tokens in and "
                                    "out; costs, cost caps and the journal use them for the rounds MODEL serves",
                                    metavar="MODEL=IN,OUT", repeat=True, default=(),
                                    default_doc="the router's trained prices (the artefact's models)")
    on_empty: str = option("--on-empty", help="the reply when the router's final set is empty: guide / base = that "
                           "role's answer of the last round (marked in the reply's ccpo.fallback as outside the "
                           "guaranteed set), abstain = empty content (docs/gateway.md#empty-sets)", choices=ON_EMPTY,
                           default=_config_default("on_empty"))
    round_protocol: str | None = option("--round-protocol", help="the round protocol (docs/real-llms.md)",
                                        choices=("json", "paper"), default_doc="the one the artefact's cache was "
                                        "collected with (paper for caches that do not record one)")
    online_kappa: float | None = option("--online-kappa", help="update kappa online from feedback (Eq. 9, eta_k = "
                                        "ETA k^-0.6)", type=float, metavar="ETA", default_doc="the artefact's kappa",
                                        check=_step)

    def __post_init__(self) -> None:
        options.resolve(self)

    def fields(self, journal: str | None) -> dict:
        """GatewayConfig's fields these options set (the endpoints parsed and checked here)."""
        from ccpo_jax.llm.wire import parse_endpoint

        retry = dataclasses.replace(RETRY, retries=self.retries, max_retry_after_s=self.max_retry_after,
                                    timeout_s=self.timeout, attempt_timeout_s=self.attempt_timeout)
        base = tuple(parse_endpoint(b, "--base", self.base_key_env) for b in self.base)
        if self.guide is None and self.guide_key_env is not None:
            raise UserError("--guide-key-env: given without --guide (a guide-less cascade calls no guide)")
        guide = None if self.guide is None else tuple(parse_endpoint(g, "--guide", self.guide_key_env)
                                                      for g in self.guide)
        return dict(base=base, guide=guide, retry=retry, journal=journal, online_eta=self.online_kappa,
                    on_empty=self.on_empty, protocol=ProtocolConfig(round_protocol=self.round_protocol),
                    max_batch=self.max_batch, prices=_prices(self.price, base, guide))

    def config(self) -> GatewayConfig:
        return GatewayConfig(**self.fields(getattr(self, "journal", None)))


def _prices(specs: tuple[str, ...], base, guide) -> tuple[tuple[str, float, float], ...]:
    """``--price MODEL=IN,OUT`` values -> (model, in, out); MODEL must be one of the upstream models."""
    models = {e.model for e in (*base, *(guide or ()))}
    out = {}
    for spec in specs:
        name, eq, pair = spec.rpartition("=")
        try:
            p_in, p_out = (float(x) for x in pair.split(","))
        except ValueError:
            p_in = p_out = float("nan")
        if not eq or not name or not (math.isfinite(p_in) and math.isfinite(p_out) and min(p_in, p_out) >= 0):
            raise UserError(f"--price {spec!r}: expected MODEL=IN,OUT, two prices >= 0 in USD per million tokens "
                            "(e.g. gpt-4o=2.5,10)")
        if name not in models:
            raise UserError(f"--price {spec!r}: {name!r} is not an upstream model (--base/--guide name "
                            f"{', '.join(sorted(models))})")
        out[name] = (p_in, p_out)
    return tuple((k, *v) for k, v in out.items())


@dataclasses.dataclass(frozen=True)
class GatewayOptions(EndpointOptions):
    """``ccpo-jax gateway``: the endpoints, then the HTTP server, the journal and the shared state."""

    host: str = option("--host", help="bind address", default="127.0.0.1", default_doc="127.0.0.1, loopback only")
    port: int = option("--port", help="TCP port", type=int, default=8080, check=_port)
    journal: str | None = option("--journal", help="append every request to this cache file; needed for POST "
                                 "/v1/feedback", metavar="FILE.jsonl")
    max_body_bytes: int = option("--max-body-bytes", help="largest request body", type=int,
                                 default=_config_default("max_body_bytes"), default_doc="1 MiB",
                                 check=_number(1024, "at least"))
    read_timeout: float = option("--read-timeout", help="seconds a client has to send a request's line and headers "
                                 "(from connecting or from the previous response), and again its body; then 408 and "
                                 "the connection is closed", type=float, metavar="S", default=SERVER.read_timeout_s,
                                 default_doc=f"{SERVER.read_timeout_s:g}", check=_seconds)
    keep_alive: int = option("--keep-alive", help="seconds an idle keep-alive connection is kept (uvicorn's "
                             "timeout_keep_alive)", type=int, metavar="S", default=SERVER.keep_alive_s,
                             check=_number(1, "an integer >="))
    max_clients: int | None = option("--max-clients", help="most client connections at once; past it the oldest "
                                     "connection with no request in progress is closed, or the new one gets 503",
                                     type=int, metavar="N", default_doc="half the file-descriptor limit left after "
                                     "64, at most 1024", check=_number(1, "an integer >="))
    max_header_bytes: int = option("--max-header-bytes", help="longest request line and headers; longer: 431",
                                   type=int, metavar="N", default=SERVER.max_header_bytes, default_doc="64 KiB",
                                   check=_number(1024, "an integer >="))
    window: int = option("--window", help="feedback outcomes in the rolling coverage", type=int,
                         default=_config_default("window"), check=_number(1, "an integer >="))
    no_access_log: bool = option("--no-access-log", help="no line per request on stderr (default: one line per "
                                 "request at INFO)", switch=True, default=False)
    state: str | None = option("--state", help="keep the deployment's state (journal, feedback, online kappa, "
                               "coverage) in this Redis database: every gateway started with the same --state and "
                               "artefact is one gateway (docs/gateway.md, Replicas)", metavar="redis://HOST:PORT/DB",
                               default_doc="this process's memory and --journal")
    workers: int = option("--workers", help="N processes behind one port (N > 1 needs --state)", type=int,
                          metavar="N", default=1, check=_within(1, 64))
    spool: str = option("--spool", help="with --state: where journal records wait while the store does not answer",
                        metavar="DIR", default=_config_default("spool"), default_doc="./ccpo-gateway-spool")
    state_timeout: float = option("--state-timeout", help="with --state: the longest one store call may take before "
                                  "the request goes on without it", type=float, metavar="S",
                                  default=_config_default("state_timeout_s"))
    new_deployment: bool = option("--new-deployment", help="with --state: start a new deployment in an empty store "
                                  "although --spool belonged to one (after Redis lost its data)", switch=True,
                                  default=False)

    def config(self) -> GatewayConfig:
        from ccpo_jax.serving.server import ServerLimits

        kw = self.fields(self.journal)
        kw.update(window=self.window, max_body_bytes=self.max_body_bytes, access_log=not self.no_access_log,
                  server=ServerLimits(read_timeout_s=self.read_timeout, keep_alive_s=self.keep_alive,
                                      max_clients=self.max_clients, max_header_bytes=self.max_header_bytes))
        return GatewayConfig(**kw, **self._state_fields())

    def _state_fields(self) -> dict:
        """The --state flags as GatewayConfig fields."""
        if self.state is None:
            if self.workers > 1:
                raise UserError(f"--workers {self.workers}: needs --state redis://HOST:PORT/DB: without a shared "
                                "store each worker would keep its own pending feedback, kappa and journal (feedback "
                                "sent to another worker would be a 404, and several writers on one journal file "
                                "would interleave)")
            if self.new_deployment:
                raise UserError("--new-deployment: only with --state")
            return {}
        from ccpo_jax.gateway.redis_state import parse_state_url

        parse_state_url(self.state)
        _state_timeout("state_timeout", self.state_timeout, self)
        return {"state": self.state, "spool": self.spool, "state_timeout_s": self.state_timeout,
                "new_deployment": self.new_deployment,
                "replica": f"{self.host}:{self.port}" if self.port else None}


@dataclasses.dataclass(frozen=True)
class LiveEvalOptions(EndpointOptions):
    """``ccpo-jax live-eval``: the endpoints, then the questions, the journal and the report."""

    questions: str = option("--questions", help="{id, question, gold} per line (as data collect)", metavar="Q.jsonl",
                            required=True)
    journal: str = option("--journal", help="the journal (a cache) to write", metavar="FILE.jsonl", required=True)
    results: str | None = option("--results", help="the training run's results.json", metavar="results.json",
                                 default_doc="RUN_DIR/results.json of the artefact's run if found")
    cache: str | None = option("--cache", help="the cache the router was trained on (its checksum must match the "
                               "artefact's): the router's own replay over it is the prediction the live figures are "
                               "compared with", metavar="PATH", default_doc="the one the training run's run.json names, "
                               "if found; else that prediction is skipped")
    budget_cents: float | None = option("--budget-cents", help="stop before a question whose worst case would cross "
                                        "this total", type=float)
    concurrency: int = option("--concurrency", help="questions in flight", type=int, default=4,
                              check=_number(1, "an integer >="))
    report: str | None = option("--report", help="also write the report (every figure of the table, the intervals, "
                                "the prediction) as JSON", metavar="FILE.json")


#: Field -> flag, for UserError.for_cli: the options' own and the library's names (GatewayConfig, live_eval).
LIBRARY_FLAGS = {"base": "--base", "guide": "--guide", "on_empty": "--on-empty", "journal": "--journal",
                 "online_eta": "--online-kappa", "questions": "--questions", "budget_cents": "--budget-cents",
                 "results": "--results", "cache": "--cache", "row": "--row", "spool": "--spool"}
GATEWAY_FLAGS = {**LIBRARY_FLAGS, **options.flag_names(GatewayOptions)}
LIVE_EVAL_FLAGS = {**LIBRARY_FLAGS, **options.flag_names(LiveEvalOptions)}
