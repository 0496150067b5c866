"""``ccpo-jax data collect``: a resumable run of the CCPO protocol against live endpoints.

Files (``OUT`` is the ``--out`` path):

* ``OUT`` - the cache, in the human JSONL format (docs/caches.md): the manifest
  line, then one line per finished question, appended (and fsync-ed) as each
  question finishes, so the file is a valid cache at every moment. When every
  question is done it is rewritten once, atomically, in the questions file's
  order, so the final file does not depend on which questions finished first,
  on concurrency, or on interruptions (for endpoints that answer a request the
  same way each time, a killed and resumed run ends byte-identical to an
  uninterrupted one).
* ``OUT.calls`` - the call log (JSON Lines): one line per API call made, with
  the request's hash, the reply (text, usage, log-probs), attempts, the waits
  before retries and why, latency and cost; replays and failures too. On
  ``--resume`` every call already paid for is replayed from it instead of being
  sent again (the questions that were in flight when a run was killed or
  stopped resume without paying twice), and identical requests within a run
  (e.g. LLM-EXIT's first round of the base model = the protocol's first base
  call) are sent once. Latency lives here, not in the cache, so that the cache
  is a function of the endpoints' answers only.

Costs: USD per million tokens per model (``--base-price``/``--guide-price``,
a ``--pricing`` file, or ``envs.pricing``'s list prices), tokens from each
reply's ``usage`` (estimated at 4 characters per token, and flagged
``tokens_estimated``, only when an endpoint sends none). ``--max-cost-usd`` is a
cap on the whole collection (earlier runs' calls in the call log count): before
each call its worst case (completion at ``max_tokens``, prompt at
:data:`PROMPT_TOKENS_PER_CHAR` tokens per character until the model has
replied, then 1.25 x the highest ratio seen) is reserved, and a call whose
reservation would cross the cap is not sent: the run stops cleanly (exit
status 3), keeping every finished question, and ``--resume`` with a higher
cap continues it.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ccpo_jax.collect import protocol as P
from ccpo_jax.collect.client import (
    CallStats,
    ChatClient,
    Endpoint,
    EndpointError,
    Reply,
    RetryPolicy,
    Stopped,
)
from ccpo_jax.collect.questions import Question
from ccpo_jax.errors import UserError
from envs.atomic import atomic_write_text

#: Version of the collector's protocol and output (in every cache's provenance).
COLLECTOR_VERSION = "1"
#: Prompt tokens per character assumed by the cost bound before a model has replied.
PROMPT_TOKENS_PER_CHAR = 0.5
#: Tokens added per chat message by the bound (chat template overhead).
TOKENS_PER_MESSAGE = 16
#: Exit status of a run stopped by --max-cost-usd.
EXIT_BUDGET = 3
ROLES = ("base", "guide")


class CollectError(UserError):
    """The run could not go on (endpoint failure, bad resume); finished questions are kept."""


class BudgetStop(Exception):
    """The next call's worst-case cost would cross --max-cost-usd."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides the cache's content. Hashed into the manifest: a ``--resume``
    must use the same settings (execution options such as concurrency may change)."""

    T: int
    base: Endpoint
    guide: Endpoint
    prices: dict[str, tuple[float, float]]  # role -> (USD per M input tokens, per M output tokens)
    price_sources: dict[str, str]
    questions_file: str
    questions_sha256: str
    base_max_tokens: int = 512
    guide_max_tokens: int = 32
    decision_max_tokens: int = 8
    base_temperature: tuple[float, float] = (0.0, 1.0)  # first round, later rounds (paper, MMLU)
    guide_temperature: float = 0.0
    seed: int | None = 0
    logprobs: bool = True
    f1_threshold: float | None = None
    exit_roles: tuple[str, ...] = ()
    policy_roles: tuple[str, ...] = ()
    policy_coverage: float = 0.9
    name: str = "collected"
    task: str = "unknown"
    license: str = "unknown"

    def endpoint(self, role: str) -> Endpoint:
        return self.base if role == "base" else self.guide

    def hashed(self) -> dict[str, Any]:
        """The settings as JSON (endpoints by public URL and model; key variables not included)."""
        d = {
            "T": self.T,
            "endpoints": {r: {"url": self.endpoint(r).public_url, "model": self.endpoint(r).model} for r in ROLES},
            "prices": {r: list(self.prices[r]) for r in ROLES},
            "questions_sha256": self.questions_sha256,
            "max_tokens": {"base": self.base_max_tokens, "guide": self.guide_max_tokens,
                           "decisions": self.decision_max_tokens},
            "base_temperature": list(self.base_temperature),
            "guide_temperature": self.guide_temperature,
            "seed": self.seed,
            "logprobs": self.logprobs,
            "f1_threshold": self.f1_threshold,
            "exit_roles": list(self.exit_roles),
            "policy_roles": list(self.policy_roles),
            "policy_coverage": self.policy_coverage,
            "prompts": P.prompt_hashes(),
            "collector_version": COLLECTOR_VERSION,
            "name": self.name,
            "task": self.task,
            "license": self.license,
        }
        return d

    def config_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.hashed(), sort_keys=True).encode()).hexdigest()

    def model_names(self, roles: tuple[str, ...]) -> list[str]:
        out: list[str] = []
        for r in roles:
            m = self.endpoint(r).model
            if m not in out:
                out.append(m)
        return out


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the run goes (not part of the cache): concurrency, retries, budget, output."""

    concurrency: int = 8
    retry: RetryPolicy = RetryPolicy()
    max_cost_usd: float | None = None
    progress: bool = True
    limit: int | None = None
    resume: bool = False
    dry_run: bool = False


def today() -> str:
    """UTC date (``SOURCE_DATE_EPOCH`` when set, for reproducible files)."""
    sde = os.environ.get("SOURCE_DATE_EPOCH")
    if sde and sde.strip().isdigit():
        return dt.datetime.fromtimestamp(int(sde), dt.timezone.utc).date().isoformat()
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def collector_version() -> str:
    import ccpo_jax

    return f"ccpo-jax {ccpo_jax.__version__}, collector {COLLECTOR_VERSION}"


def make_manifest(s: Settings, started: str) -> dict[str, Any]:
    models = {r: {"name": s.endpoint(r).model, "price_in": s.prices[r][0], "price_out": s.prices[r][1]} for r in ROLES}
    rule = "normalised exact match against any gold alias"
    if s.f1_threshold is not None:
        rule += f", or token F1 >= {s.f1_threshold:g}"
    return {
        "name": s.name,
        "task": s.task,
        "T": s.T,
        "models": models,
        "exit_models": s.model_names(s.exit_roles),
        "llm_policy_models": s.model_names(s.policy_roles),
        "provenance": {
            "kind": "real",
            "source": "ccpo-jax data collect (live chat-completions endpoints)",
            "license": s.license,
            "collector": collector_version(),
            "collected": {"started": started},
            "questions": {"file": s.questions_file, "sha256": s.questions_sha256},
            "endpoints": {r: {"url": s.endpoint(r).public_url, "model": s.endpoint(r).model} for r in ROLES},
            "prices": {r: s.price_sources[r] for r in ROLES},
            "prompts_sha256": P.prompt_hashes(),
            "requests": {
                "base_temperature": list(s.base_temperature),
                "guide_temperature": s.guide_temperature,
                "max_tokens": {"base": s.base_max_tokens, "guide": s.guide_max_tokens,
                               "decisions": s.decision_max_tokens},
                "seed": s.seed,
                "logprobs": s.logprobs,
            },
            "correctness": rule,
            "measures": {"guide_uncertainty": "1 - p(verdict token)",
                         "base_confidence": "exp(mean logprob) over the answer tokens"},
            "config_sha256": s.config_sha256(),
        },
    }


# -- the call log ------------------------------------------------------------------------------


class CallLog:
    """``OUT.calls``: append-only JSON Lines, one record per call; thread-safe appends."""

    def __init__(self, path: Path, read_only: bool = False):
        self.path = path
        self.lock = threading.Lock()
        self.replies: dict[str, dict] = {}
        self.paid_usd = 0.0
        self.ratio: dict[str, float] = {}  # model -> highest prompt tokens per character seen
        self._f = None
        if not read_only:
            self._f = open(path, "a", encoding="utf-8")
            try:  # one writer per collection: a second run on the same --out would interleave
                fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._f.close()
                raise CollectError(f"{path}: another 'ccpo-jax data collect' is writing this collection "
                                   "(its call log is locked); wait for it or stop it first") from None
        if path.stat().st_size if path.exists() else 0:
            self._load(read_only)

    def _load(self, read_only: bool) -> None:
        if not read_only:
            _truncate_partial_line(self.path)
        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if read_only:
                        continue  # (a dry run does not repair a cut last line)
                    raise CollectError(f"{self.path}:{i}: not valid JSON (the call log is damaged)") from None
                if "text" in rec and "key" in rec:
                    self.replies.setdefault(rec["key"], rec)
                    self.paid_usd += float(rec.get("cost_usd", 0.0))
                    self._observe(rec)

    def _observe(self, rec: dict) -> None:
        chars = rec.get("prompt_chars")
        if chars and not rec.get("tokens_estimated"):
            r = rec["tokens_in"] / chars
            m = rec.get("model", "")
            self.ratio[m] = max(self.ratio.get(m, 0.0), r)

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n"
        with self.lock:
            self._f.write(line)
            self._f.flush()  # in the OS from here: survives a kill of this process
            if "text" in rec:
                self.replies.setdefault(rec["key"], rec)
                self._observe(rec)
        # on disk before the reply is used (survives a machine crash); outside the lock, so that the
        # workers' fsyncs overlap (the kernel commits them together) instead of queueing
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _truncate_partial_line(path: Path) -> bool:
    """Drop a last line without its newline (a write cut by a kill); True when one was dropped."""
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
    return True


# -- budget and counters -------------------------------------------------------------------------


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
        self.tokens = {r: [0, 0] for r in ROLES}
        self.latencies: list[float] = []
        self.unreadable = {"guide verdict": 0, "base answer": 0, "EXIT decision": 0, "policy reply": 0}
        self.estimated_usage = 0
        self.truncated = 0  # replies cut at max_tokens (finish_reason "length")

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
            self.truncated += reply.finish_reason == "length"
            self.spent += usd
            self.latencies.append(stats.latency_s)

    def count_tokens(self, role: str, t_in: int, t_out: int) -> None:
        with self.lock:
            self.tokens[role][0] += t_in
            self.tokens[role][1] += t_out

    def bump(self, what: str) -> None:
        with self.lock:
            self.unreadable[what] += 1


@dataclasses.dataclass(frozen=True)
class Answer:
    """One call's outcome as the protocol uses it (replayed or fresh)."""

    text: str
    tokens_in: int
    tokens_out: int
    logprobs: tuple[tuple[str, float], ...] | None
    estimated: bool


def _chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


def estimate_tokens(chars: int, n_messages: int, ratio: float = PROMPT_TOKENS_PER_CHAR) -> int:
    return math.ceil(chars * ratio) + TOKENS_PER_MESSAGE * n_messages


class Caller:
    """Makes the protocol's calls: replay from the call log, budget, send, log, count."""

    def __init__(self, s: Settings, ex: Execution, log: CallLog, meter: Meter, stop: threading.Event,
                 clients: dict[str, ChatClient]):
        self.s, self.ex, self.log, self.meter, self.stop, self.clients = s, ex, log, meter, stop, clients

    def usd(self, role: str, t_in: float, t_out: float) -> float:
        p_in, p_out = self.s.prices[role]
        return (t_in * p_in + t_out * p_out) / 1e6

    def body(self, role: str, messages: list[dict], max_tokens: int, temperature: float) -> dict:
        b: dict[str, Any] = {"model": self.s.endpoint(role).model, "messages": messages,
                             "max_tokens": max_tokens, "temperature": temperature}
        if self.s.seed is not None:
            b["seed"] = self.s.seed
        if self.s.logprobs:
            b["logprobs"] = True
        return b

    def call(self, qid: str, name: str, role: str, messages: list[dict], max_tokens: int,
             temperature: float) -> Answer:
        ep = self.s.endpoint(role)
        body = self.body(role, messages, max_tokens, temperature)
        key = hashlib.sha256(json.dumps({"url": ep.public_url, "body": body}, sort_keys=True,
                                        ensure_ascii=False).encode("utf-8")).hexdigest()
        hit = self.log.replies.get(key)
        if hit is not None:
            with self.meter.lock:
                self.meter.replayed += 1
            self.log.append({"key": key, "q": qid, "call": name, "replayed": True, "at": _now_iso()})
            return _answer(hit)
        if self.stop.is_set():
            raise Stopped()
        chars = _chars(messages)
        ratio = self.log.ratio.get(ep.model)
        ratio = PROMPT_TOKENS_PER_CHAR if ratio is None else 1.25 * ratio
        est = self.usd(role, estimate_tokens(chars, len(messages), ratio), max_tokens)
        self.meter.reserve(est)
        try:
            reply, stats = self.clients[role].chat(body)
        except EndpointError as e:
            self.meter.settle(est, role, None, 0.0, e.stats or CallStats())
            st = e.stats or CallStats()
            self.log.append({"key": key, "q": qid, "call": name, "model": ep.model, "endpoint": ep.public_url,
                             "error": str(e), "attempts": st.attempts, "waits": [list(w) for w in st.waits],
                             "at": _now_iso()})
            with self.meter.lock:
                self.meter.failed += 1
            raise
        except Stopped:
            self.meter.settle(est, role, None, 0.0, CallStats())
            raise
        estimated = reply.tokens_in is None
        t_in = reply.tokens_in if not estimated else math.ceil(chars / 4)
        t_out = reply.tokens_out if not estimated else math.ceil(len(reply.text) / 4)
        usd = self.usd(role, t_in, t_out)
        rec = {
            "key": key, "q": qid, "call": name, "model": ep.model, "endpoint": ep.public_url, "at": _now_iso(),
            "attempts": stats.attempts, "waits": [list(w) for w in stats.waits],
            "latency_s": round(stats.latency_s, 4), "tokens_in": t_in, "tokens_out": t_out,
            "prompt_chars": chars, "cost_usd": usd, "finish_reason": reply.finish_reason,
            "text": reply.text,
            "logprobs": [list(x) for x in reply.logprobs] if reply.logprobs is not None else None,
        }
        if estimated:
            rec["tokens_estimated"] = True
            with self.meter.lock:
                self.meter.estimated_usage += 1
        self.log.append(rec)
        self.meter.settle(est, role, reply, usd, stats)
        self.meter.count_tokens(role, t_in, t_out)
        return _answer(rec)


def _answer(rec: dict) -> Answer:
    lps = rec.get("logprobs")
    return Answer(
        text=rec["text"], tokens_in=int(rec["tokens_in"]), tokens_out=int(rec["tokens_out"]),
        logprobs=tuple((str(t), float(v)) for t, v in lps) if lps else None,
        estimated=bool(rec.get("tokens_estimated", False)),
    )


# -- one question --------------------------------------------------------------------------------


def _tokens(rec: dict, a: Answer) -> None:
    rec["tokens_in"] = a.tokens_in
    rec["tokens_out"] = a.tokens_out
    if a.estimated:
        rec["tokens_estimated"] = True


def collect_question(q: Question, s: Settings, c: Caller) -> dict:
    """The cache line of question ``q`` (human JSONL format, docs/caches.md): T base-guide rounds, then the baselines."""
    correct = lambda ans: P.is_correct(ans, q.golds, s.f1_threshold)  # noqa: E731
    rounds: list[dict] = []
    history: list[tuple[str, str]] = []
    seen: list[dict] = []  # what the LLM-as-policy is shown, per round
    for t in range(s.T):
        temp = s.base_temperature[0] if t == 0 else s.base_temperature[1]
        b = c.call(q.id, f"r{t}.base", "base", P.base_messages(q.question, history), s.base_max_tokens, temp)
        parsed = P.parse_base_answer(b.text)
        ans = parsed[0] if parsed else ""
        base = {"answer": ans, "correct": correct(ans)}
        _tokens(base, b)
        conf = P.answer_confidence(b.logprobs, b.text, parsed[1] if parsed else None)
        if conf is not None:
            base["confidence"] = conf
        if parsed is None:
            base["answer_parsed"] = False
            c.meter.bump("base answer")
        shown = ans if parsed else b.text.strip()
        g = c.call(q.id, f"r{t}.guide", "guide", P.guide_messages(q.question, shown), s.guide_max_tokens,
                   s.guide_temperature)
        v = P.parse_verdict(g.text)
        g_ans = ans if v.correct is True else (v.correction or "")
        guide = {"verdict": v.correct is True, "answer": g_ans, "correct": correct(g_ans)}
        _tokens(guide, g)
        unc = P.verdict_uncertainty(g.logprobs) if v.correct is not None else None
        if unc is not None:
            guide["uncertainty"] = unc
        if v.correct is None:
            guide["verdict_parsed"] = False
            guide["raw"] = g.text
            c.meter.bump("guide verdict")
        elif v.correct is False and v.correction is None:
            guide["correction_given"] = False
        rounds.append({"base": base, "guide": guide})
        history.append((b.text, g.text))
        seen.append({"base": ans, "verdict": v.correct, "guide": g_ans, "uncertainty": unc})

    rec: dict[str, Any] = {"id": q.id, "gold": q.golds[0]}
    if len(q.golds) > 1:
        rec["gold_aliases"] = list(q.golds[1:])
    rec["question"] = q.question
    rec["rounds"] = rounds
    baselines: dict[str, Any] = {}
    exits = {}
    for role in s.exit_roles:
        m = s.endpoint(role).model
        if m not in exits:
            exits[m] = _exit_run(q, s, c, role, correct)
    if exits:
        baselines["exit"] = exits
    pols, calls = {}, {}
    for role in s.policy_roles:
        m = s.endpoint(role).model
        if m in calls:
            continue
        acts, info = _policy_run(q, s, c, role, seen)
        calls[m] = info
        if acts is not None:
            pols[m] = acts
    if pols:
        baselines["llm_policy"] = pols
    if calls:
        baselines["llm_policy_calls"] = calls
    if baselines:
        rec["baselines"] = baselines
    return rec


def _cents(c: Caller, role: str, a: Answer) -> float:
    return c.usd(role, a.tokens_in, a.tokens_out) * 100.0


def _exit_run(q: Question, s: Settings, c: Caller, role: str, correct: Callable[[str], bool]) -> dict:
    """LLM-EXIT of one model (protocol module doc): rounds until it exits or T."""
    answers: list[str] = []
    history: list[tuple[str, str]] = []
    cents = 0.0
    unreadable = 0
    for t in range(s.T):
        temp = s.base_temperature[0] if t == 0 else s.base_temperature[1]
        a = c.call(q.id, f"exit.{role}.r{t}", role, P.base_messages(q.question, history, retry="exit"),
                   s.base_max_tokens, temp)
        cents += _cents(c, role, a)
        parsed = P.parse_base_answer(a.text)
        answers.append(parsed[0] if parsed else "")
        history.append((a.text, ""))
        if t == s.T - 1:
            break
        d = c.call(q.id, f"exit.{role}.d{t}", role, P.exit_messages(q.question, answers), s.decision_max_tokens, 0.0)
        cents += _cents(c, role, d)
        dec = P.parse_exit(d.text)
        if dec is None:
            unreadable += 1  # not an exit request: the run goes on (recorded)
            c.meter.bump("EXIT decision")
        if dec is True:
            break
    out = {"correct": correct(answers[-1]), "rounds": len(answers), "cost_cents": round(cents, 9),
           "answer": answers[-1]}
    if unreadable:
        out["unreadable_decisions"] = unreadable
    return out


def _policy_run(q: Question, s: Settings, c: Caller, role: str, seen: list[dict]) -> tuple[list[int] | None, dict]:
    """LLM-as-policy of one model over the collected chain: actions until it answers."""
    acts: list[int] = []
    cents = 0.0
    info: dict[str, Any] = {}
    for t in range(s.T):
        msgs = P.policy_messages(q.question, seen[: t + 1], s.T, s.policy_coverage)
        a = c.call(q.id, f"policy.{role}.r{t}", role, msgs, s.decision_max_tokens, 0.0)
        cents += _cents(c, role, a)
        act = P.parse_policy_action(a.text, last_round=t == s.T - 1)
        if act is None:
            info["unreadable"] = {"round": t, "reply": a.text}
            c.meter.bump("policy reply")
            acts = []
            break
        acts.append(act)
        if act != 2:
            break
    info["cost_cents"] = round(cents, 9)
    return (acts or None), info


# -- cost bound before the run -----------------------------------------------------------------


def cost_bound(s: Settings, questions: list[Question]) -> dict[str, dict[str, float]]:
    """Per role: calls and the worst-case tokens and USD of collecting ``questions`` (every
    completion at max_tokens, prompts at :data:`PROMPT_TOKENS_PER_CHAR`; no replays counted)."""
    out = {r: {"calls": 0, "tokens_in": 0, "tokens_out": 0, "usd": 0.0} for r in ROLES}

    def add(role, prompt_text_chars, n_msgs, extra_tokens, max_out):
        o = out[role]
        t_in = estimate_tokens(prompt_text_chars, n_msgs) + extra_tokens
        o["calls"] += 1
        o["tokens_in"] += t_in
        o["tokens_out"] += max_out
        p_in, p_out = s.prices[role]
        o["usd"] += (t_in * p_in + max_out * p_out) / 1e6

    B, G, D = s.base_max_tokens, s.guide_max_tokens, s.decision_max_tokens
    for q in questions:
        qc = len(q.question)
        base0 = len(P.BASE_PROMPT) + qc
        for t in range(s.T):
            add("base", base0 + t * len(P.BASE_RETRY), 1 + 2 * t, t * (B + G), B)
            add("guide", len(P.GUIDE_PROMPT) + qc, 1, B, G)
        for role in dict.fromkeys(s.exit_roles):
            for t in range(s.T):
                if not (role == "base" and t == 0):  # the same request as the protocol's first base call
                    add(role, base0 + t * len(P.EXIT_RETRY), 1 + 2 * t, t * B, B)
                if t < s.T - 1:
                    add(role, len(P.EXIT_PROMPT) + qc, 1, (t + 1) * B, D)
        for role in dict.fromkeys(s.policy_roles):
            for t in range(s.T):
                # each round shown: a line of ~200 characters around the base answer (<= B tokens) and the
                # guide's answer (<= G tokens)
                add(role, len(P.POLICY_PROMPT) + len(P.POLICY_NEXT) + qc + 200 * (t + 1), 1, (t + 1) * (B + G), D)
    return out


def format_bound(s: Settings, bound: dict, n: int, cap: float | None, paid: float) -> str:
    lines = [f"cost bound for {n} question(s), T={s.T} (every completion at max_tokens, prompts at "
             f"{PROMPT_TOKENS_PER_CHAR:g} token per character; a real run costs less):"]
    total = 0.0
    for r in ROLES:
        b = bound[r]
        p_in, p_out = s.prices[r]
        src = s.price_sources[r].split(":")[0]
        lines.append(f"  {r:5s} {s.endpoint(r).model} (${p_in:g} in / ${p_out:g} out per M tokens, from {src}): "
                     f"{b['calls']:,} calls, <= {b['tokens_in']:,} in + {b['tokens_out']:,} out tokens, "
                     f"<= ${b['usd']:.4f}")
        total += b["usd"]
    tail = f"  at most ${total:.4f}"
    if paid:
        tail += f" more (already paid ${paid:.4f}, in the call log)"
    tail += f"; budget cap: ${cap:.4f}" if cap is not None else "; no budget cap (--max-cost-usd)"
    lines.append(tail)
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What :func:`collect` did."""

    out: Path
    complete: bool
    done: int
    total: int
    stopped: str | None  # None, "budget", or an error message
    meter: Meter
    elapsed_s: float
    sha256: str | None = None
    removed: bool = False  # stopped before anything was paid or finished: the files were removed


def _read_existing(path: Path, s: Settings, repair: bool = True) -> tuple[dict, dict[str, str]]:
    """(stored manifest, {question id: its line}) of a cache being resumed; ``repair``: drop a
    last line cut by a kill (a dry run only reads)."""
    dropped = _truncate_partial_line(path) if repair else False
    lines = path.read_text(encoding="utf-8").split("\n")
    if not repair and lines and lines[-1]:
        lines = lines[:-1]  # the cut line, as a real run would drop it
    if not lines or not lines[0].strip():
        raise CollectError(f"{path}: empty; remove it and start again")
    try:
        man = json.loads(lines[0])["manifest"]
        stored = man["provenance"]["config_sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CollectError(f"{path}:1: not a cache written by 'ccpo-jax data collect' (no manifest with "
                           "provenance.config_sha256); choose another `out`", field="resume") from None
    if stored != s.config_sha256():
        new = make_manifest(s, "")
        diffs = _diff(man, new)
        raise CollectError(f"{path}: the file was collected with other settings ({', '.join(diffs) or 'config'} "
                           "differ); use the same settings and questions file, or another `out`", field="resume")
    done: dict[str, str] = {}
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            qid = json.loads(line)["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CollectError(f"{path}:{i}: not a question line (damaged file?)") from None
        done[qid] = line
    if dropped:
        print(f"note: dropped the incomplete last line of {path} (a killed write); that question is collected again",
              file=sys.stderr)
    return man, done


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in ("collected", "config_sha256", "collector"):
                continue
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [prefix]


def manifest_line(man: dict) -> str:
    return json.dumps({"manifest": man}, ensure_ascii=False, allow_nan=False)


def collect(s: Settings, questions: list[Question], out: str | os.PathLike, ex: Execution = Execution(),
            echo: Callable[[str], Any] = print, *, sleep: Callable[[float], Any] | None = None) -> Outcome:
    """Run (or resume) the collection of ``questions`` into ``out``; see the module docstring."""
    out = Path(out)
    log_path = out.with_name(out.name + ".calls")
    if out.is_dir():
        raise UserError(f"{out}: is a directory; give a file name ending in .jsonl", field="out")
    if out.suffix != ".jsonl":
        raise UserError(f"{out}: the cache is written in the human format; give a file name ending in .jsonl",
                        field="out")
    if not ex.resume and (out.exists() or log_path.exists()):
        raise UserError(f"{out}: already exists (or its call log {log_path.name}); pass `resume` to continue "
                        "that collection, or choose another `out`", field="out")
    for r in ROLES:
        try:
            s.endpoint(r).api_key()  # a missing key variable is an error before anything is written
        except UserError as e:
            if not ex.dry_run:
                raise
            echo(f"note: {e}; the real run needs it")
    selected = questions[: ex.limit] if ex.limit is not None else questions
    if not ex.dry_run:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{out}: cannot create its folder ({e.strerror or e})", field="out") from None
    log_created = not log_path.exists()
    try:
        log = CallLog(log_path, read_only=True) if ex.dry_run else (CallLog(log_path) if ex.resume else None)
    except OSError as e:
        raise UserError(f"{out}: cannot write its call log ({e.strerror or e})", field="out") from None
    try:
        man, done = _read_existing(out, s, repair=not ex.dry_run) if ex.resume and out.exists() else (None, {})
    except BaseException:
        if log is not None:
            log.close()
            if log_created:
                log_path.unlink(missing_ok=True)
        raise
    paid = log.paid_usd if log is not None else 0.0
    todo = [q for q in selected if q.id not in done]
    echo(format_bound(s, cost_bound(s, todo), len(todo), ex.max_cost_usd, paid))
    if done:
        echo(f"resuming: {len(done)} question(s) already in {out}, {len(todo)} to collect")
    meter = Meter(ex.max_cost_usd, paid)
    if ex.dry_run:
        return Outcome(out, False, len(done), len(selected), "dry run", meter, 0.0)

    if man is None:
        man = make_manifest(s, today())
        try:
            atomic_write_text(out, manifest_line(man) + "\n")
        except OSError as e:
            raise UserError(f"{out}: cannot write ({e.strerror or e})", field="out") from None
        created = True
    else:
        created = False
    if log is None:
        try:
            log = CallLog(log_path)
        except OSError as e:
            out.unlink(missing_ok=True)
            raise UserError(f"{out}: cannot write its call log ({e.strerror or e})", field="out") from None
    stop = threading.Event()
    clients = {r: ChatClient(s.endpoint(r), ex.retry, max_connections=ex.concurrency, stop=stop,
                             seed=i, sleep=sleep) for i, r in enumerate(ROLES)}
    caller = Caller(s, ex, log, meter, stop, clients)
    stopped: str | None = None
    t0 = time.perf_counter()
    n_before = sum(1 for q in selected if q.id in done)
    n_new = 0
    last_post = ""
    bar = _progress(ex.progress, len(selected), n_before)

    def work(q: Question) -> dict:
        if stop.is_set():
            raise Stopped()
        try:
            return collect_question(q, s, caller)
        except (BudgetStop, EndpointError):
            stop.set()  # at once, so that this worker does not start the next question
            raise

    try:
        with open(out, "a", encoding="utf-8") as f, cf.ThreadPoolExecutor(max_workers=ex.concurrency) as pool:
            futs = {pool.submit(work, q): q for q in todo}
            pending = set(futs)
            try:
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    for fut in finished:
                        q = futs[fut]
                        try:
                            rec = fut.result()
                        except BudgetStop:
                            if stopped is None:
                                stopped = "budget"
                            stop.set()
                            continue
                        except Stopped:
                            continue
                        except cf.CancelledError:
                            continue
                        except EndpointError as e:
                            if stopped is None:
                                stopped = str(e)
                            stop.set()
                            continue
                        line = json.dumps(rec, ensure_ascii=False, allow_nan=False)
                        f.write(line + "\n")
                        f.flush()
                        os.fsync(f.fileno())
                        done[q.id] = line
                        n_new += 1
                        if bar is not None:
                            bar.update(1)
                    if stop.is_set():
                        for fut in pending:
                            fut.cancel()
                    if bar is not None:
                        post = _postfix(meter, n_before + n_new, len(selected), n_new)
                        if post != last_post:  # (no redraw while nothing moves: quiet logs)
                            bar.set_postfix_str(post, refresh=True)
                            last_post = post
            except KeyboardInterrupt:
                stop.set()
                for fut in pending:
                    fut.cancel()
                raise
    finally:
        if bar is not None:
            bar.close()
        for cl in clients.values():
            cl.close()
        log.close()
    elapsed = time.perf_counter() - t0
    complete = all(q.id in done for q in selected)
    removed = not complete and created and log_created and not done and not log.replies
    if removed:
        # stopped before anything was paid or finished (a bad key, an unknown model, a tiny cap):
        # the files hold nothing worth resuming, and would only block the corrected rerun
        for p in (out, log_path):
            try:
                p.unlink()
            except OSError:
                pass
    sha = None
    if complete:
        order = [q.id for q in questions if q.id in done]
        man = dict(man)
        man["provenance"] = dict(man["provenance"])
        man["provenance"]["collected"] = {"started": man["provenance"]["collected"]["started"], "finished": today()}
        text = manifest_line(man) + "\n" + "".join(done[i] + "\n" for i in order)
        atomic_write_text(out, text)
        from envs.jsonl import read_jsonl

        read_jsonl(out)  # the file must be a valid cache (a failure here is a collector bug)
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Outcome(out, complete, sum(1 for q in selected if q.id in done), len(selected), stopped, meter, elapsed, sha,
                   removed)


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="q", desc="questions", file=sys.stderr, dynamic_ncols=True)


def _postfix(m: Meter, done: int, total: int, done_now: int) -> str:
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
    for r in ROLES:
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
    if m.truncated:
        lines.append(f"note: {m.truncated} repl(ies) stopped at max_tokens (finish_reason 'length'); "
                     "raise --base-max-tokens if base answers lack their 'Answer:' line")
    if m.estimated_usage:
        lines.append(f"warning: {m.estimated_usage} repl(ies) had no usage; their tokens are estimated and flagged")
    if o.sha256:
        lines.append(f"sha256 {o.sha256}")
    if o.removed:
        lines.append(f"nothing was paid or finished: {o.out} and its call log were removed")
    else:
        lines.append(f"call log: {o.out.with_name(o.out.name + '.calls')}")
    return "\n".join(lines)
