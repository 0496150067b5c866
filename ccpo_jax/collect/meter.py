"""Dollars spent and reserved against ``--max-cost-usd``, and the run's counters, shared by the workers."""
from __future__ import annotations

import collections
import threading

from ccpo_jax.llm.wire import CallStats, Reply


#: Kinds of call whose cut replies are counted apart: each has its own max_tokens flag.
CUT_KINDS = ("base answer", "guide verdict", "decision")


class BudgetStop(Exception):
    """The next call's worst-case cost would cross --max-cost-usd."""


class Meter:
    """Spent dollars, reservations and counters, shared by the worker threads."""

    def __init__(self, cap: float | None, paid_before: float):
        self.cap = cap
        self.lock = threading.Lock()
        self.paid_before = paid_before
        self.spent = 0.0  # this run
        self.reserved = 0.0
        self.sent = 0
        self.replayed = 0
        self.failed = 0
        self.retries: dict[str, int] = {}
        self.waited_s = 0.0
        self.tokens: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # role -> [in, out]
        self.latencies: list[float] = []
        self.unreadable = {"guide verdict": 0, "base answer": 0, "EXIT decision": 0, "policy reply": 0}
        self.estimated_usage = 0
        self.model_mismatch = 0  # replies naming another model than the one asked for
        # replies used that stopped at max_tokens (finish_reason "length"), per kind of call:
        # [how many, how many of them could not be read]
        self.cut = {k: [0, 0] for k in CUT_KINDS}
        # role -> [replies with log-probs, replies, replies whose log-probs were sent but invalid]
        self.logprobs: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        # per round collected in this run: [rounds with the signal, rounds]
        self.signals = {"confidence": [0, 0], "uncertainty": [0, 0]}

    @property
    def total_usd(self) -> float:
        return self.paid_before + self.spent

    def reserve(self, usd: float) -> None:
        with self.lock:
            if self.cap is not None and self.paid_before + self.spent + self.reserved + usd > self.cap + 1e-12:
                raise BudgetStop()
            self.reserved += usd

    def settle(self, reserved: float, role: str, reply: Reply | None, usd: float, stats: CallStats) -> None:
        with self.lock:
            self.reserved -= reserved
            for reason, s in stats.waits:
                kind = reason.split(",")[0]
                kind = "timeout" if kind.startswith("timeout") else kind
                self.retries[kind] = self.retries.get(kind, 0) + 1
                self.waited_s += s
            if reply is None:
                return
            self.sent += 1
            self.spent += usd
            self.latencies.append(stats.latency_s)

    def count(self, what: str) -> None:
        """One more of ``what``: ``replayed``, ``failed`` or ``estimated_usage``."""
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)

    def count_tokens(self, role: str, t_in: int, t_out: int) -> None:
        with self.lock:
            self.tokens[role][0] += t_in
            self.tokens[role][1] += t_out

    def cut_reply(self, kind: str, finish_reason: str | None, unreadable: bool) -> None:
        """Count a reply of ``kind`` (:data:`CUT_KINDS`) that stopped at its max_tokens."""
        if finish_reason != "length":
            return
        with self.lock:
            self.cut[kind][0] += 1
            self.cut[kind][1] += bool(unreadable)

    def logprobs_seen(self, role: str, has: bool, invalid: bool = False) -> tuple[bool, bool]:
        """Count one reply of ``role``: (it is the role's first reply and has no log-probs, it is the
        role's first reply with invalid ones)."""
        with self.lock:
            c = self.logprobs[role]
            c[0] += has
            c[1] += 1
            c[2] += invalid
            return c[1] == 1 and not has, invalid and c[2] == 1

    def signal(self, what: str, given: bool) -> None:
        """One more round collected, with or without ``what`` (confidence / uncertainty)."""
        with self.lock:
            self.signals[what][0] += given
            self.signals[what][1] += 1

    def bump(self, what: str) -> None:
        with self.lock:
            self.unreadable[what] += 1
