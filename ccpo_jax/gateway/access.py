"""What the gateway says about itself (docs/gateway.md, "What the gateway prints"): one access-log
line per request, the start-up line about prices, and the line it prints when it stops.

The access log is an ASGI middleware: it sees every request (chat completions, feedback, metrics,
errors) and logs, at INFO on the ``ccpo_jax.gateway.access`` logger, ``METHOD PATH STATUS SECONDS``
and, for a chat completion, what the protocol did (rounds, the set, the answer or an abstention,
the cost in cents at the prices the gateway charges). ``gateway --no-access-log`` turns the lines
off; the counts it keeps (for the stop line) are kept either way.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any

access_log = logging.getLogger("ccpo_jax.gateway.access")

#: Where a chat-completion handler leaves its summary for the access log (the ASGI scope is shared).
SCOPE_KEY = "ccpo_access"


class AccessLog:
    """ASGI middleware: a line per HTTP request (when ``enabled``) and counts by path and status."""

    def __init__(self, app, enabled: bool = True):
        self.app, self.enabled = app, enabled
        self.counts: collections.Counter[tuple[str, int]] = collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.counts[(scope["path"], status[0])] += 1
            if self.enabled:
                extra = scope.get(SCOPE_KEY)
                access_log.info("%s %s %d %.3f s%s", scope["method"], scope["path"], status[0],
                                time.perf_counter() - t0, f" {extra}" if extra else "")

    def answered(self) -> int:
        """Chat completions answered (status 200)."""
        return sum(n for (path, st), n in self.counts.items() if path.endswith("/chat/completions") and st == 200)


def completion_summary(cid: str, out: Any, cost_cents: float) -> str:
    """The access line's tail for an answered chat completion: id, rounds, set, answer, cost."""
    fb = getattr(out, "fallback", None)
    if out.answer is not None:
        chosen = f"answer {out.answer[:40]!r}"
    elif fb is not None:  # --on-empty guide / base: outside the guaranteed set
        chosen = f"empty set, fallback {fb['role']}@{fb['round']} {fb['answer'][:40]!r}"
    else:
        chosen = "abstained (empty set)"
    acts = ",".join(f"{a['role']}@{a['round']}" for a in out.answer_set) or "-"
    return (f"{cid} rounds {len(out.rounds)} stopped_by {out.stopped_by} set [{acts}] {chosen} "
            f"cost {cost_cents:.4g} cents")


def price_line(prices: dict, served: dict, overridden: set[str]) -> str:
    """The start-up line saying at which prices costs are counted: the router's trained prices
    (USD per million tokens, in/out) unless ``--price MODEL=IN,OUT`` set an upstream's own."""
    parts = []
    for role, rungs in prices.items():
        if rungs is None:
            continue
        seen = []
        for t, (p_in, p_out) in enumerate(rungs):
            name = served[role][t]
            item = f"{name} ${p_in:g}/${p_out:g}" + (" (--price)" if name in overridden else " (trained)")
            if item not in seen:
                seen.append(item)
        parts.append(f"{role} {', '.join(seen)}")
    how = ("the router's trained prices" if not overridden else "the router's trained prices, except where "
           "--price set an upstream's own")
    return (f"gateway: costs are in cents at {how}, USD per million tokens in/out: {'; '.join(parts)}"
            + ("" if overridden else "; --price MODEL=IN,OUT sets an upstream's own"))


def stop_line(answered: int, journal: str | None, journal_lines: int | None, kappa: float | None) -> str:
    """What the gateway prints when it stops (SIGTERM or Ctrl-C): what it served, what it kept on disk
    and what lived in memory only."""
    kept = ("nothing on disk (no --journal)" if journal is None else
            f"the journal {journal} ({journal_lines} line(s), each fsync-ed before its reply)")
    mem = "the metrics and the rolling coverage" + ("" if kappa is None else f" and the online kappa ({kappa:.6g})")
    return f"gateway: stopped after {answered} answered chat completion(s); kept {kept}; lost {mem} (in memory only)"
