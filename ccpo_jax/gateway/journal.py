"""The gateway's journal: every finished request as a line of the human cache format (docs/gateway.md).

* Line 1 is a manifest (T, models and prices from the router's manifest;
  ``provenance.journal`` marks the file as a journal). Each finished request
  appends one line, ``{"id", "question", "group"?, "rounds", "gateway": {...}}``,
  written and fsync-ed before the reply is sent; ``correct`` and ``gold`` are
  absent: an *unlabelled* line, which the cache reader skips in a journal.
* ``POST /v1/feedback`` appends the request's line again with its outcome:
  with ``gold`` (and optional ``gold_aliases``), every answer is labelled (``correct`` by data collect's rule,
  normalised exact match) and the line becomes a question of the cache; with
  ``correct`` (was the returned answer right?) the answers are labelled only
  when they all normalise to the returned one, else the line stays unlabelled
  and carries ``feedback.correct``. The reader takes the last line of an id.
* Crash safety: lines are appended whole and fsync-ed; a last line cut by a
  kill is dropped when the gateway opens the journal again (so a killed gateway
  loses at most the requests in flight), and the reader refuses nothing else.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.llm import paper as P
from ccpo_jax.llm import protocols
from ccpo_jax.llm.provenance import collector_version, today
from envs.cache.atomic import atomic_write_text, truncate_partial_line
from envs.cache.journal import as_labelled, unlabelled
from envs.cache.jsonl import MAX_LINE_BYTES, check_question
from envs.cache.normalise import normalise_answer
from envs.cache.schema import CacheError
from envs.cache.values import show

#: Requests kept in memory for feedback (the oldest are forgotten first), by count ...
MAX_PENDING = 100_000
#: ... and by memory: the kept lines' sizes (``sys.getsizeof`` of each journal line, kept as its JSON
#: text and parsed when its feedback comes). At most 256 MiB: 100,000 requests of typical lines
#: (about 2 kB) fit; a stream of large answers is held to this bound instead of about 1 MB each.
MAX_PENDING_BYTES = 256 << 20


class JournalLineRefused(RuntimeError):
    """A line the cache reader would refuse (its length, a value): not written (an internal error, HTTP 500)."""


class FeedbackError(UserError):
    """Feedback that cannot be recorded; ``status``: the HTTP status to answer with."""

    def __init__(self, msg: str, status: int, field: str | None = None):
        super().__init__(msg, field=field)
        self.status = status


def _model_entry(model: dict | list | None) -> dict | list | None:
    """The artefact's ``models[role]`` as the cache writes it: one model, a ladder's list, or None."""
    if model is None:  # a guide-less cascade's guide
        return None
    pick = lambda x: {k: x[k] for k in ("name", "price_in", "price_out") if k in x}  # noqa: E731
    return [pick(x) for x in model] if isinstance(model, list) else pick(model)


def journal_manifest(router_manifest: dict, endpoints: dict[str, dict | list], requests: dict,
                     served: dict | None = None, groups: bool = False) -> dict:
    """The journal's manifest line. ``models``: ``served`` (the upstream models that answered, at the
    prices the gateway charged) when given, else the router's; ``provenance.journal.router_models``: the
    models and prices the router was trained with; ``provenance.journal.groups``: whether every line
    has a ``group`` (a Mondrian router's journal)."""
    m = router_manifest
    trained = {r: _model_entry(m["models"][r]) for r in ("base", "guide")}
    return {
        "name": "gateway-journal",
        "task": m["cache"].get("task", "unknown") if isinstance(m["cache"].get("task"), str) else "unknown",
        "T": int(m["T"]),
        # a ladder's rungs and a cascade's null guide as in the artefact (docs/caches.md)
        "models": trained if served is None else served,
        "provenance": {
            "kind": "real",
            "source": "ccpo-jax gateway (live requests; outcomes from POST /v1/feedback)",
            "license": "unknown",
            "collector": collector_version(),
            "journal": {"started": today(), "router_manifest_sha256": m.get("manifest_sha256"),
                        "router_policy": m["policy"]["row"], "alpha": m["alpha"], "router_models": trained,
                        "groups": bool(groups)},
            "endpoints": endpoints,
            # the round protocol's prompts (ccpo_jax.llm.protocols), and its name unless the paper's
            "prompts_sha256": protocols.get(requests.get("round_protocol", "paper")).prompt_hashes(),
            **({"round_protocol": requests["round_protocol"]} if "round_protocol" in requests else {}),
            "requests": requests,
            "correctness": "normalised exact match against the gold given by feedback",
            "measures": {"guide_uncertainty": "1 - p(verdict token)",
                         "base_confidence": "exp(mean logprob) over the answer tokens"},
        },
    }


def label(rec: dict, gold: str | None, correct: bool | None, aliases: list[str] = ()) -> dict:
    """``rec`` with the outcome of its feedback (module doc's rules)."""
    out = json.loads(json.dumps(rec))
    out["feedback"] = {"gold": gold} if gold is not None else {"correct": correct}
    answers = [r[role]["answer"] for r in out["rounds"] for role in ("base", "guide") if role in r]
    if gold is not None:
        out["gold"] = gold
        if aliases:
            out["gold_aliases"] = list(aliases)
        judge = lambda a: P.is_correct(a, [gold, *aliases])  # noqa: E731
    else:
        chosen = out["gateway"].get("answer")
        if chosen is None or any(normalise_answer(a) != normalise_answer(chosen) for a in answers):
            return out  # not every answer is determined: stays unlabelled
        judge = lambda a: bool(correct)  # noqa: E731
    for r in out["rounds"]:
        for role in ("base", "guide"):
            if role in r:  # (a cascade's rounds have no guide)
                r[role]["correct"] = judge(r[role]["answer"])
    return out


def covered(rec: dict, gold: str | None, correct: bool | None, aliases: list[str] = ()) -> bool | None:
    """Whether the request's answer set covered a correct answer (None: the feedback does not say).
    ``gold``: any answer of the set correct; ``correct``: the returned answer's outcome decides when
    it is true or the set holds no other answer."""
    gw = rec["gateway"]
    answers = [a["answer"] for a in gw["answer_set"]]
    if gold is not None:
        return any(P.is_correct(a, [gold, *aliases]) for a in answers)
    if correct or len({normalise_answer(a) for a in answers}) <= 1:
        return bool(correct) and bool(answers)
    return None


def none_seen(rec: dict, gold: str, aliases: list[str] = ()) -> bool:
    """Whether no answer of the rounds the request ran (base or guide) is ``gold``: the question may be
    unsolvable (no correct answer in any of the T rounds), which the paper's coverage counts as covered
    (Eq. 8; the replay's ``covered``), or its correct answer may lie in a round the router did not run.
    Live, the two cannot be told apart."""
    return not any(P.is_correct(r[role]["answer"], [gold, *aliases])
                   for r in rec["rounds"] for role in ("base", "guide") if role in r)


def outcome(rec: dict, gold: str | None, correct: bool | None, aliases: list[str] = ()) -> bool | None:
    """The coverage outcome feedback adds to the rolling coverage, the drift alarm and online kappa
    (None: undetermined). With ``gold`` it is the replay's definition as far as the rounds run show it:
    covered when the set holds a correct answer or no round run saw one (:func:`none_seen`), missed only
    when a round run answered correctly and the set does not hold it (a certain miss: a miss under any
    continuation). Counting a none-seen question as missed would make every unsolvable question a miss,
    so that a weak pair of models (80% unsolvable questions, docs/real-llms.md) sets the alarm off on the
    distribution it was calibrated on and drives online kappa to 0; since certain misses are a subset of
    the misses, the alarm's test stays valid (it can only be late, never early). With ``correct`` alone
    it is :func:`covered` (no gold: a wrong answer cannot be told from an unsolvable question)."""
    cov = covered(rec, gold, correct, aliases)
    if gold is not None and not cov and none_seen(rec, gold, aliases):
        return True
    return cov


def _identity(manifest: dict, groups: bool | None) -> dict[str, Any]:
    """What a journal's lines depend on, by the name a message gives it: a gateway appends to a journal
    only when its own are equal (:func:`journal_mismatch`)."""
    j = manifest.get("provenance", {}).get("journal", {}) if isinstance(manifest, dict) else {}
    return {"T": manifest.get("T"), "models": manifest.get("models"),
            "the router (provenance.journal.router_manifest_sha256)": j.get("router_manifest_sha256"),
            "group use (a Mondrian router's journal has a group on every line)": groups}


def _leaves(v: Any, path: str) -> dict[str, Any]:
    if isinstance(v, dict):
        return {k: x for key, sub in v.items() for k, x in _leaves(sub, f"{path}.{key}").items()}
    if isinstance(v, list):
        return {k: x for i, sub in enumerate(v) for k, x in _leaves(sub, f"{path}[{i}]").items()}
    return {path: v}


def journal_mismatch(old: dict, new: dict, old_groups: bool | None) -> list[str]:
    """How the journal's manifest ``old`` (``old_groups``: its lines' group use, None when unknown)
    differs from the one this gateway would write (``new``), one ``NAME: X in the journal, Y here``
    each (``models`` value by value: ``models.guide.price_out``). Lines of another router would mix
    two T (a line with more rounds than the manifest's T), two prices, lines with and without a group
    (``data check`` refuses each) or two routers' outcomes under one router's name."""
    a, b = _identity(old, old_groups), _identity(new, new.get("provenance", {}).get("journal", {}).get("groups"))
    legacy = "router_models" not in old.get("provenance", {}).get("journal", {})
    trained = _leaves(new.get("provenance", {}).get("journal", {}).get("router_models"), "models")
    out = []
    for k in a:
        if a[k] is None or b[k] is None or a[k] == b[k]:
            continue
        x, y = _leaves(a[k], k), _leaves(b[k], k)
        if k == "models" and legacy:  # a journal from before the manifest named the upstream models that
            # served: its models are the router's (trained) names, at the prices charged (then: trained)
            y = {p: trained.get(p, v) if p.endswith(".name") else v for p, v in y.items()}
        out += [f"{p}: {show(x.get(p, '(none)'))} in the journal, {show(y.get(p, '(none)'))} here"
                for p in dict.fromkeys([*x, *y]) if x.get(p, "(none)") != y.get(p, "(none)")]
    return out


class Journal:
    """Appends request and feedback lines (thread-safe); keeps recent requests for feedback."""

    def __init__(self, path: str | os.PathLike, manifest: dict, max_pending: int | None = None,
                 max_pending_bytes: int | None = None):
        self.path = Path(path)
        self.manifest = manifest  # (a reopened journal's own, once read: its lines are checked against it)
        self.max_pending = MAX_PENDING if max_pending is None else max_pending
        self.max_pending_bytes = MAX_PENDING_BYTES if max_pending_bytes is None else max_pending_bytes
        self.pending_bytes = 0  # sys.getsizeof of the lines in ``pending``
        # one lock for the file and the tables; re-entrant, because feedback checks an id's outcome,
        # writes its line and marks it recorded under one hold (checked and written apart, 8 identical
        # feedbacks at once recorded four outcomes for one id)
        self._lock = threading.RLock()
        #: id -> its latest journal line (JSON text), oldest first; ``labelled``: ids whose outcome is
        #: recorded (a 409 rather than a 404; the latest ``max_pending``, oldest forgotten first).
        self.pending: dict[str, str] = {}
        self.labelled: dict[str, None] = {}
        if self.path.suffix != ".jsonl":
            raise UserError(f"{self.path}: the journal is a human-format cache; give a file name ending in .jsonl",
                            field="journal")
        if self.path.exists() and self.path.stat().st_size > 0:
            self._reopen(manifest)
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.path, json.dumps({"manifest": manifest}, ensure_ascii=False) + "\n")
            except OSError as e:
                raise UserError(f"{self.path}: cannot write ({e.strerror or e})", field="journal") from None
        self._f = open(self.path, "ab")

    def _reopen(self, manifest: dict) -> None:
        """An existing journal: drop a torn last line, refuse one that another router wrote
        (:func:`journal_mismatch`), reload the requests still awaiting feedback."""
        if truncate_partial_line(self.path):
            print(f"note: dropped the incomplete last line of {self.path} (a killed write)", file=sys.stderr)
        old, groups = None, None
        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"{self.path}:{i}: not valid JSON; not a journal this gateway can append to",
                                    field="journal") from None
                if i == 1:
                    man = obj.get("manifest") if isinstance(obj, dict) else None
                    prov = man.get("provenance") if isinstance(man, dict) else None
                    if not isinstance(prov, dict) or not isinstance(prov.get("journal"), dict):
                        raise UserError(f"{self.path}:1: not a gateway journal (no manifest with provenance.journal)",
                                        field="journal")
                    old = self.manifest = man
                    groups = prov["journal"].get("groups")  # (None: a journal from before it was kept)
                    continue
                if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"] \
                        or not isinstance(obj.get("rounds"), list):
                    # (another JSONL file given as --journal: an AttributeError traceback before)
                    raise UserError(f"{self.path}:{i}: not a gateway journal line (an object with an id and rounds); "
                                    "not a journal this gateway can append to", field="journal")
                if i == 2 and groups is None:
                    groups = "group" in obj
                qid = obj.get("id")
                if not unlabelled(obj):
                    self._recorded(qid)
                else:
                    self._keep(qid, line.rstrip("\n"))
        differs = journal_mismatch(old, manifest, groups)
        if differs:
            raise UserError(f"{self.path}:1: written by another router ({'; '.join(differs)}); a journal holds "
                            "one router's requests: give a new `journal` file", field="journal")

    def close(self) -> None:
        self._f.close()

    def _write(self, rec: dict) -> str:
        """Append ``rec`` as one line, fsync-ed; returns the line. A line the cache reader would refuse for
        its length (over envs.cache.jsonl.MAX_LINE_BYTES; MAX_ANSWER_CHARS keeps every line far below) or
        text UTF-8 cannot encode is an error before anything is written."""
        line = json.dumps(rec, ensure_ascii=False, allow_nan=False)
        data = (line + "\n").encode("utf-8")
        if len(data) > MAX_LINE_BYTES:
            raise JournalLineRefused(f"{self.path}: a line of {len(data)} bytes, over the cache reader's "
                                     f"{MAX_LINE_BYTES >> 20} MiB; not written")
        with self._lock:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())
        return line

    def _check(self, rec: dict) -> None:
        """A feedback line passes the cache reader's rules before it is written (``check_question``, the
        code path of ``data check``): an outcome can never make the journal unreadable. The check is too dear
        for every request line (docs/performance.md#figures-behind-code-comments), so request lines rely
        on their fields' checks (the client's before any upstream call)."""
        check_feedback_line(self.manifest, rec, str(self.path))

    def _keep(self, qid: str, line: str) -> None:
        """Keep ``line`` as ``qid``'s awaiting feedback; forget the oldest beyond the count and bytes bounds."""
        with self._lock:
            old = self.pending.pop(qid, None)
            self.pending_bytes += sys.getsizeof(line) - (0 if old is None else sys.getsizeof(old))
            self.pending[qid] = line
            while self.pending and (len(self.pending) > self.max_pending or self.pending_bytes > self.max_pending_bytes):
                self.pending_bytes -= sys.getsizeof(self.pending.pop(next(iter(self.pending))))

    def _recorded(self, qid: str) -> None:
        """``qid``'s outcome is recorded: no longer awaiting, remembered for a 409."""
        with self._lock:
            old = self.pending.pop(qid, None)
            if old is not None:
                self.pending_bytes -= sys.getsizeof(old)
            self.labelled[qid] = None
            while len(self.labelled) > self.max_pending:
                self.labelled.pop(next(iter(self.labelled)))

    def append(self, rec: dict) -> None:
        """A finished request's line, on disk when this returns."""
        self._keep(rec["id"], self._write(rec))

    def feedback(self, body: Any) -> tuple[dict, bool | None]:
        """Record ``{"id", "correct" | "gold"}``: (the line written, whether the set covered)."""
        qid, gold, correct, aliases = parse_feedback(body)
        with self._lock:  # one outcome per id, whatever the concurrency: check, write and mark together
            if qid in self.labelled:
                raise FeedbackError(f"id {qid!r}: its outcome is already recorded", 409, "id")
            line = self.pending.get(qid)
            if line is None:
                raise FeedbackError(f"id {qid!r}: no request with this id awaits feedback in {self.path.name} (the "
                                    f"gateway keeps the latest {self.max_pending} requests, at most "
                                    f"{self.max_pending_bytes >> 20} MiB)", 404, "id")
            out, cov = apply_feedback(json.loads(line), qid, gold, correct, aliases)
            self._check(out)
            written = self._write(out)
            if is_labelled(out):
                self._recorded(qid)
            else:
                self._keep(qid, written)
        return out, cov


def check_feedback_line(manifest: dict, rec: dict, where: str) -> None:
    """JournalLineRefused unless the feedback line ``rec`` passes the cache reader's rules under ``manifest``
    (``check_question``, data check's code path): both backends run it before writing an outcome."""
    try:
        check_question(manifest, as_labelled(rec) if unlabelled(rec) else rec, where)
    except CacheError as e:
        raise JournalLineRefused(f"{e} (the feedback line was not written)") from None


def parse_feedback(body: Any) -> tuple[str, str | None, bool | None, list[str]]:
    """``(id, gold, correct, gold_aliases)`` of a feedback body (exactly one of gold and correct is not
    None), or FeedbackError 400 naming the field."""
    if not isinstance(body, dict):
        raise FeedbackError("the body must be a JSON object {\"id\", \"correct\" | \"gold\"}", 400)
    qid = body.get("id")
    if not isinstance(qid, str) or not qid:
        raise FeedbackError("id: expected the id of a chat completion this gateway answered", 400, "id")
    has_c, has_g = "correct" in body, "gold" in body
    if has_c == has_g:
        raise FeedbackError("give exactly one of `correct` (true/false) and `gold` (a string)", 400)
    gold, correct = body.get("gold"), body.get("correct")
    if has_g and (not isinstance(gold, str) or not normalise_answer(gold)):
        raise FeedbackError("gold: expected a non-empty answer string", 400, "gold")
    if has_c and not isinstance(correct, bool):
        raise FeedbackError("correct: expected true or false", 400, "correct")
    aliases = body.get("gold_aliases", [])
    if not (has_g or "gold_aliases" not in body) or not isinstance(aliases, list) or \
            not all(isinstance(a, str) and normalise_answer(a) for a in aliases):
        raise FeedbackError("gold_aliases: expected a list of non-empty answer strings, with `gold`", 400,
                            "gold_aliases")
    return qid, (gold if has_g else None), (correct if has_c else None), aliases


def is_labelled(rec: dict) -> bool:
    """Whether a journal line carries its outcome (no further feedback is taken for its id)."""
    return "gold" in rec or "correct" in rec["rounds"][0]["base"]


def apply_feedback(rec: dict, qid: str, gold: str | None, correct: bool | None,
                   aliases: list[str]) -> tuple[dict, bool | None]:
    """The line to write for feedback on ``rec`` (the id's latest line, not labelled; its ``feedback.covered``
    says whether the set held a correct answer) and the coverage outcome it adds (:func:`outcome`; None:
    undetermined, or an earlier ``correct`` already counted); FeedbackError 409
    when ``correct`` was already given."""
    if "feedback" in rec and correct is not None:
        raise FeedbackError(f"id {qid!r}: `correct` was already given; send `gold` to label it", 409, "id")
    cov = covered(rec, gold, correct, aliases)
    counted = rec.get("feedback", {}).get("covered") is not None  # an earlier `correct` already counted
    out = label(rec, gold, correct, aliases)
    out["feedback"]["covered"] = cov if not counted else rec["feedback"]["covered"]
    return out, (None if counted else outcome(rec, gold, correct, aliases))
