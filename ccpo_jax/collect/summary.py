"""What a collection shows: the progress bar's line while it runs, and the summary at the end."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ccpo_jax.collect.meter import Meter
from ccpo_jax.collect.settings import Settings


@dataclasses.dataclass
class Outcome:
    """What :func:`ccpo_jax.collect.collector.collect` did."""

    out: Path
    complete: bool
    done: int
    total: int
    stopped: str | None  # None, "budget", or an error message
    meter: Meter
    elapsed_s: float
    sha256: str | None = None
    removed: bool = False  # stopped before anything was paid or finished: the files were removed


class Progress:
    """A tqdm bar over questions with calls, tokens and dollars (None-safe: ``enabled=False`` shows nothing)."""

    def __init__(self, enabled: bool, total: int, initial: int, meter: Meter):
        self.meter, self.total, self.initial, self.done_now = meter, total, initial, 0
        self._last = ""
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="q", desc="questions", file=sys.stderr,
                             dynamic_ncols=True)

    def advance(self) -> None:
        self.done_now += 1
        if self._bar is not None:
            self._bar.update(1)

    def refresh(self) -> None:
        if self._bar is None:
            return
        post = postfix(self.meter, self.initial + self.done_now, self.total, self.done_now)
        if post != self._last:  # (no redraw while nothing moves: quiet logs)
            self._bar.set_postfix_str(post, refresh=True)
            self._last = post

    def write(self, msg: str) -> None:
        """A message on stderr, above the bar when there is one."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def postfix(m: Meter, done: int, total: int, done_now: int) -> str:
    """calls, tokens, dollars so far and, once a question finished in this run, the projected total
    (this run's dollars per finished question x the questions left)."""
    tok = sum(a + b for a, b in m.tokens.values())
    s = f"calls {m.sent}"
    if m.replayed:
        s += f" (+{m.replayed} reused)"
    s += f" | tokens {tok:,} | ${m.total_usd:.4f}"
    if done_now > 0 and done < total:
        s += f" (~${m.total_usd + m.spent / done_now * (total - done):.4f} at the end)"
    if m.cap is not None:
        s += f" | cap ${m.cap:.2f}"
    return s


def _share(given: int, n: int) -> str:
    return f"{given / n:.0%} ({given}/{n})" if n else "- (0 rounds)"


def signal_lines(m: Meter, s: Settings) -> list[str]:
    """The share of this run's rounds with a base confidence and with a guide uncertainty, and a
    warning per endpoint that returned no log-probs although they were asked for."""
    (c, nc), (u, nu) = m.signals["confidence"], m.signals["uncertainty"]
    if not s.logprobs:
        return ["log-probs: not asked for (--no-logprobs): no base confidence" +
                ("" if s.cascade else ", no guide uncertainty") + " stored"]
    out = [f"log-probs: base confidence given for {_share(c, nc)} of the rounds collected in this run"
           + ("" if s.cascade else f", guide uncertainty for {_share(u, nu)}")]
    for r in s.roles():
        has, n, bad = m.logprobs[r]
        if n and has < n:
            what = "base confidence" if r.startswith("base") else "guide uncertainty"
            ep = s.endpoint(r)
            counts = " and ".join(x for x in (f"no log-probs in {n - has - bad}" if n - has - bad else "",
                                              f"invalid log-probs (NaN, infinite, positive...; the call log's "
                                              f"logprobs_invalid says which) in {bad}" if bad else "") if x)
            out.append(f"warning: the {r} endpoint ({ep.model} at {ep.public_url}) returned {counts} of its {n} "
                       f"replies: no {what} for those rounds"
                       + (" (reproduce leaves out UALA without guide uncertainty)" if r == "guide" else ""))
    return out


def cut_notes(m: Meter, s: Settings) -> list[str]:
    """One note per kind of call with replies stopped at max_tokens (finish_reason 'length'): each
    kind has its own flag; a cut base answer loses its ``Answer:`` line (paper protocol) or its JSON
    answer's end (json protocol), a cut verdict is read from its start."""
    out = []
    n, bad = m.cut["base answer"]
    if n:
        out.append(f"note: {n} base answer(s) stopped at --base-max-tokens {s.base_max_tokens} (finish_reason "
                   f"'length'), {bad} of them unreadable "
                   f"({'no complete JSON answer' if s.proto.structured else 'no Answer: line'})"
                   + ("; raise --base-max-tokens" if bad else ""))
    for kind, flag, v in (("guide verdict", "--guide-max-tokens", s.guide_max_tokens),
                          ("decision", "--decision-max-tokens", s.decision_max_tokens)):
        n, bad = m.cut[kind]
        if n:
            what = "guide verdict(s)" if kind == "guide verdict" else "EXIT / policy decision(s)"
            out.append(f"note: {n} {what} stopped at {flag} {v} (read from their start: {n - bad} readable, "
                       f"{bad} unreadable)" + (f"; raise {flag}" if bad else ""))
    return out


def summary(o: Outcome, s: Settings) -> str:
    m = o.meter
    lines = []
    state = "complete" if o.complete else "INCOMPLETE"
    lines.append(f"collected {o.done}/{o.total} question(s) into {o.out} ({state})")
    retries = sum(m.retries.values())
    rdesc = ", ".join(f"{k} {v}" for k, v in sorted(m.retries.items()))
    lines.append(f"calls: {m.sent} sent, {m.replayed} answered from the call log (the same request already "
                 f"paid), {m.failed} failed; "
                 f"retries: {retries}{' (' + rdesc + ')' if rdesc else ''}, waited {m.waited_s:.1f} s")
    for r in s.roles():
        t_in, t_out = m.tokens[r]
        lines.append(f"tokens {r} ({s.endpoint(r).model}): {t_in:,} in, {t_out:,} out")
    cost = f"cost: ${m.spent:.6f} this run, ${m.total_usd:.6f} in total"
    if m.cap is not None:
        cost += f" (cap ${m.cap:.4f})"
    lines.append(cost)
    if m.latencies:
        lat = sorted(m.latencies)
        p = lambda x: lat[min(len(lat) - 1, int(x * len(lat)))] * 1000  # noqa: E731
        rate = m.sent / o.elapsed_s if o.elapsed_s > 0 else float("nan")
        lines.append(f"latency: p50 {p(0.5):.1f} ms, p95 {p(0.95):.1f} ms; {rate:.1f} calls/s over {o.elapsed_s:.2f} s")
    unread = ", ".join(f"{v} {k}(s)" for k, v in m.unreadable.items() if v)
    if unread:
        lines.append(f"unreadable (recorded as such): {unread}")
    lines += cut_notes(m, s)
    lines += signal_lines(m, s)
    if m.model_mismatch:
        lines.append(f"warning: {m.model_mismatch} repl(ies) named another model than the one asked for "
                     "(served_model in the call log)")
    if m.estimated_usage:
        lines.append(f"warning: {m.estimated_usage} repl(ies) had no usage; their tokens are estimated and flagged")
    if o.sha256:
        lines.append(f"file sha256 {o.sha256} (of the file's bytes; `data check` prints the cache checksum, "
                     "over its arrays and manifest)")
    if o.removed:
        lines.append(f"nothing was paid or finished: {o.out} and its call log were removed")
    else:
        lines.append(f"call log: {o.out.with_name(o.out.name + '.calls')}")
    return "\n".join(lines)
