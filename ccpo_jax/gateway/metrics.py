"""The gateway's Prometheus metrics (``GET /metrics``), one registry per app (docs/gateway.md lists them).

With a shared store (``--state``) every series carries a ``replica`` label (``HOST:PORT`` of the
replica): each replica is a scrape target reporting itself, and ``sum without (replica)`` gives the
deployment. Under ``--workers N`` the N processes of one replica are summed by prometheus_client's
multiprocess mode (gauges: the most recent value, in-flight and spooled summed over live workers).
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

disable_created_metrics()  # no *_created series: their timestamps only clutter a scrape

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class OptionalGauge:
    """A gauge with no sample until its first ``set``: a rolling coverage of 0.0 before any feedback
    would read as a failure, so the series appears with the first outcome."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry):
        self.name, self.doc, self.value = name, doc, None
        registry.register(self)

    def set(self, value: float | None) -> None:
        self.value = None if value is None else float(value)

    def describe(self):
        return [GaugeMetricFamily(self.name, self.doc)]

    def collect(self):
        if self.value is not None:
            yield GaugeMetricFamily(self.name, self.doc, value=self.value)


class Metrics:
    def __init__(self, T: int, shared: bool = False):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ccpo_gateway_requests", "Chat-completion requests by outcome", ["outcome"], registry=r)
        self.rounds = Histogram("ccpo_gateway_rounds_per_request", "Protocol rounds per answered request",
                                buckets=tuple(range(1, T + 1)), registry=r)
        self.decisions = Counter("ccpo_gateway_decisions", "Router decisions: actions in the set (empty: none)",
                                 ["action"], registry=r)
        self.cost = Counter("ccpo_gateway_cost_cents", "Upstream cost in cents by model", ["model"], registry=r)
        self.tokens = Counter("ccpo_gateway_tokens", "Upstream tokens by model and direction", ["model", "kind"],
                              registry=r)
        self.latency = Histogram("ccpo_gateway_upstream_latency_seconds", "Upstream call latency (successful calls)",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.decide = Histogram("ccpo_gateway_decision_seconds", "Router decision time per round",
                                buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1), registry=r)
        self.errors = Counter("ccpo_gateway_errors", "Errors by kind", ["kind"], registry=r)
        self.missing = Counter("ccpo_gateway_missing_signal", "Rounds whose confidence/uncertainty could not be "
                               "measured (no log-probs): the features' missing value is used", ["signal"], registry=r)
        self.kappa = Gauge("ccpo_gateway_kappa", "The threshold in use (online: the live one)",
                           multiprocess_mode="mostrecent", registry=r)
        self.feedback = Counter("ccpo_gateway_feedback", "Feedback by outcome for coverage (covered, none_seen, "
                                "missed, undetermined)", ["outcome"], registry=r)
        self.coverage = OptionalGauge("ccpo_gateway_rolling_coverage", "Coverage over the last window of feedback "
                                      "(a question is covered when its answer set holds a correct answer or no "
                                      "round run saw one; no sample before the first feedback)", registry=r)
        self.target = Gauge("ccpo_gateway_coverage_target", "1 - alpha of the router",
                            multiprocess_mode="mostrecent", registry=r)
        self.alarm = Gauge("ccpo_gateway_drift_alarm", "1 while rolling coverage is below target (binomial test)",
                           multiprocess_mode="mostrecent", registry=r)
        self.empty = Counter("ccpo_gateway_empty_sets", "Requests whose final set was empty, by the reply given "
                             "(--on-empty): a fallback answer of the guide or base, outside the guaranteed set, "
                             "or an abstention", ["reply"], registry=r)
        self.truncated = Counter("ccpo_gateway_truncated_texts", "Upstream answers (and unreadable guide replies) "
                                 "cut to MAX_ANSWER_CHARS before they were journaled and returned", ["role"],
                                 registry=r)
        self.in_flight = Gauge("ccpo_gateway_requests_in_flight", "Requests running the protocol",
                               multiprocess_mode="livesum", registry=r)
        if shared:  # --state: the shared store's health (docs/gateway.md, "Replicas")
            self.kappa_version = Gauge("ccpo_gateway_kappa_version", "Outcomes the deployment's kappa has taken "
                                       "(Eq. 9 steps over every replica's feedback)",
                                       multiprocess_mode="mostrecent", registry=r)
            self.state_up = Gauge("ccpo_gateway_state_up", "1 while the shared store answered the last call",
                                  multiprocess_mode="mostrecent", registry=r)
            self.state_lost = Gauge("ccpo_gateway_state_lost", "1 once the store no longer holds this deployment "
                                    "(Redis restarted empty or flushed)",
                                    multiprocess_mode="mostrecent", registry=r)
            self.stale_decisions = Counter("ccpo_gateway_stale_decisions", "Decisions taken with the last good "
                                           "kappa because the store did not answer", registry=r)
            self.spooled = Gauge("ccpo_gateway_journal_spooled", "Journal records kept in the local spool until "
                                 "the store takes them",
                                 multiprocess_mode="livesum", registry=r)
            self.state_latency = Histogram("ccpo_gateway_state_seconds", "Shared-store calls by operation",
                                           ["op"], buckets=LATENCY_BUCKETS, registry=r)

    def render(self, replica: str | None = None) -> bytes:
        """The exposition text; ``replica``: the label every series gets (a shared store's replica)."""
        reg = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # --workers: every worker's values
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            reg.register(self.coverage)  # (this worker's view of the deployment's coverage)
        return generate_latest(reg if replica is None else _Labelled(reg, replica))


class _Labelled:
    """A registry's families with one more label on every sample."""

    def __init__(self, reg, replica: str):
        self.reg, self.replica = reg, replica

    def collect(self):
        for fam in self.reg.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                out.add_sample(smp.name, dict(smp.labels, replica=self.replica), smp.value, smp.timestamp,
                               smp.exemplar)
            yield out
