"""The gateway's state behind one small interface: the embedded default (one process) or a shared store.

What a gateway keeps between requests, and what replicas must share to be one
gateway (docs/gateway.md, "Replicas"):

* the **journal of record**: one line per answered request, outcomes attached
  once (:meth:`GatewayState.append`, :meth:`GatewayState.feedback`);
* the **pending feedback** and the **exactly-once** rule: an outcome for an id
  is recorded once; a second is a 409 (:class:`~ccpo_jax.gateway.journal.FeedbackError`);
* **online kappa** (CCPO Eq. 9 over the sequence of recorded outcomes), with a
  **version** (the number of outcomes it has taken), and the rolling coverage
  and drift alarm over the last ``window`` outcomes (:class:`CoverageView`);
* **request ids** unique across replicas (:meth:`GatewayState.new_id`).

:class:`EmbeddedState` is today's gateway: memory plus the file journal
(:class:`~ccpo_jax.gateway.journal.Journal`), one process. The Redis backend
(:mod:`ccpo_jax.gateway.redis_state`) keeps the same things in Redis, with its
atomicity in Lua scripts. When a store does not answer, :class:`StateUnavailable`
says so (feedback answers 503 with Retry-After); completions never wait on it.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import uuid
from typing import Any

from ccpo_jax.gateway.journal import FeedbackError, Journal
from ccpo_jax.gateway.online import CoverageState


class StateUnavailable(Exception):
    """The shared store did not answer in time (or lost the deployment): feedback answers 503.

    ``code``: ``state_unavailable`` (down or slow: retry after ``retry_after_s``) or ``state_lost``
    (the store no longer holds this deployment, e.g. Redis restarted empty)."""

    def __init__(self, message: str, code: str = "state_unavailable", retry_after_s: float = 1.0):
        super().__init__(message)
        self.code, self.retry_after_s = code, retry_after_s


@dataclasses.dataclass(frozen=True)
class FeedbackResult:
    """An outcome recorded: the journal line written, whether it counted for coverage (None: it did
    not determine one, or an earlier ``correct`` already counted), whether the drift alarm turned on
    with it, and the deployment's coverage state after it."""

    record: dict
    covered: bool | None
    alarm_turned_on: bool
    view: "CoverageView"


@dataclasses.dataclass(frozen=True)
class CoverageView:
    """The threshold and coverage state decisions and replies read.

    ``version``: how many outcomes kappa has taken (Eq. 9 steps; the pooled outcomes of every
    replica under a shared store). ``stale``: the store did not answer the last refresh, so this
    is the last good state."""

    kappa: float
    version: int
    rolling: float | None
    alarm: bool
    p_value: float
    seen: int
    stale: bool = False


class GatewayState(abc.ABC):
    """One interface for the gateway's state; ``coverage`` is what decisions read (``online``, ``kappa``)."""

    #: ``embedded`` or the store's scheme (``redis``).
    kind: str = "embedded"
    coverage: CoverageState

    async def start(self) -> None:
        """Open connections and background tasks (on the serving event loop)."""

    async def close(self) -> None:
        """Flush what can be flushed and release the store."""

    def new_id(self) -> str:
        """A fresh completion id (``chatcmpl-`` and 128 random bits: unique across replicas)."""
        return "chatcmpl-" + uuid.uuid4().hex

    async def refresh(self) -> None:
        """Before a batch of decisions: take the latest kappa (a shared store; never raises, never waits
        longer than the store's timeout: a store that does not answer leaves the last good kappa)."""

    @abc.abstractmethod
    async def append(self, rec: dict) -> str | None:
        """Journal a finished request before its reply is sent. Returns where it went (None: no journal)."""

    @abc.abstractmethod
    async def feedback(self, body: Any) -> FeedbackResult:
        """Record ``{"id", "correct" | "gold"}`` once; FeedbackError (4xx) or StateUnavailable (503)."""

    @abc.abstractmethod
    def view(self) -> CoverageView:
        """The coverage state now (the last good one when a store is down)."""

    def reply_info(self) -> dict | None:
        """What a reply's ``ccpo.state`` says (None: the embedded gateway adds nothing to its replies)."""
        return None


def coverage_view(cov: CoverageState, stale: bool = False) -> CoverageView:
    return CoverageView(float(cov.kappa), cov.steps if cov.online else cov.seen, cov.rolling, cov.alarm,
                        cov.p_value, cov.seen, stale)


class EmbeddedState(GatewayState):
    """Today's gateway: pending feedback and coverage in this process's memory, the journal a local file
    (``--journal``; without it, no feedback). One process only: ``--workers`` > 1 needs a shared store."""

    kind = "embedded"

    def __init__(self, journal: Journal | None, coverage: CoverageState):
        self.journal, self.coverage = journal, coverage

    async def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    async def append(self, rec: dict) -> str | None:
        if self.journal is None:
            return None
        await asyncio.to_thread(self.journal.append, rec)
        return "journal"

    async def feedback(self, body: Any) -> FeedbackResult:
        return await asyncio.to_thread(self._feedback, body)

    def _feedback(self, body: Any) -> FeedbackResult:
        if self.journal is None:
            raise FeedbackError("feedback needs a journal: start the gateway with --journal FILE", 409)
        out, cov = self.journal.feedback(body)
        turned_on = self.coverage.record(cov) if cov is not None else False
        return FeedbackResult(out, cov, turned_on, self.view())

    def view(self) -> CoverageView:
        return coverage_view(self.coverage)
