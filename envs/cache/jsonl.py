"""The human format of a response cache: JSON Lines, one question per line
(docs/caches.md; the field names are a public contract).

::

    {"manifest": {"name": ..., "task": ..., "T": 4,
                  "models": {"base": {"name", "price_in", "price_out"}, "guide": {...}},
                  "provenance": {"kind": "real"|"synthetic", ...}}}        <- optional
    {"id": "q-17", "gold": "...",                                          <- gold optional
     "rounds": [{"base":  {"answer", "correct", "tokens_in", "tokens_out", "confidence"?},
                 "guide": {"verdict", "answer", "correct", "tokens_in", "tokens_out",
                           "uncertainty"?}}, ...],
     "baselines": {"exit": {"<model>": {"correct", "rounds", "cost_cents"}},  <- optional
                   "llm_policy": {"<model>": [2, 1]}}}

:func:`read_jsonl` validates every field and raises :class:`envs.cache.schema.CacheError`
with ``FILE:LINE: FIELD: problem`` (round indices are 0-based, as in JSON).
:func:`write_jsonl` writes the same format atomically. The rules are listed in
``docs/caches.md``; the ones the design leaves open:

* Without a manifest line: name = file stem, task = "unknown", T = most rounds
  of any question, models "base" and "guide" at price 0, provenance
  ``{"kind": "real", "source": <path>, "license": "unknown"}``.
* With one: ``models``, ``T`` and ``provenance`` are required; ``name``
  defaults to the file stem, ``task`` to "unknown". ``checksum`` and
  ``arrays_checksum`` there are informational: both are recomputed on every
  read, and ``checksum`` covers the manifest fields too (prices, models, T,
  provenance, normalisation, name: :func:`envs.cache.schema.manifest_checksum`), so
  an edited manifest line gives another checksum (and ``--resume`` refuses it).
* Answers are normalised (:func:`envs.cache.normalise.normalise_answer`) and numbered
  per question in order of first appearance (round 0 base, round 0 guide,
  round 1 base, ...); base and guide share the numbering. Only the normalised
  text is kept (``answer_text``), so an export writes normalised answers.
* Contradictions: within one question, answers with the same normalised text
  must carry the same ``correct`` flag, and an answer whose normalised text
  equals the normalised ``gold`` must have ``correct: true``. (``correct:
  true`` on a different text is allowed: tasks judge by aliases, F1 or a judge.)
* ``baselines.llm_policy.<model>`` is the LLM-as-policy's action per round
  (0 base, 1 guide, 2 next) until it answers: every action but the last is 2,
  the last is 0 or 1, and there are at most as many as the question's rounds.
* ``baselines.exit.<model>.rounds`` is an integer in [1, T].
* A guide-less cascade (``models.guide: null``): rounds have no ``guide`` object (one is an
  error, ``rounds[t].guide``); the guide arrays hold :data:`envs.cache.values.NO_GUIDE_ROUND`.
* Extra fields anywhere are allowed and ignored.
* A gateway journal (a manifest with ``provenance.journal``, docs/gateway.md):
  a line with no ``gold`` and no ``correct`` on any answer is a request that
  awaits feedback; it is checked like a question and then skipped, and a later
  labelled line with its id (the feedback) takes its place. A last line without
  its newline that is not valid JSON (a write cut by a kill) is skipped.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from envs.cache.atomic import atomic_write_text
from envs.cache.schema import (
    CacheError,
    group_problem,
    Manifest,
    ResponseCache,
    SCHEMA_VERSION,
    check_arrays,
    empty_arrays,
    values_problem,
)
from envs.cache.journal import as_labelled as _as_labelled, is_journal, unlabelled as _unlabelled
from envs.cache.normalise import NORMALISATION, normalise_answer
from envs.cache.values import (
    CASCADE_NO_GUIDE, MAX_T, NO_GUIDE_ROUND, actions_problem, cents_problem, exit_rounds_problem,
    json_type_name, lone_surrogate, model_names_problem, number_problem, show, tokens_problem, unit_problem,
)

# The value rules and their bounds are envs.cache.values (shared with the fast format and the writers).
_show = show

class _Line:
    """Field accessors for one JSONL line that raise CacheError naming FILE:LINE: FIELD."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, msg: str) -> CacheError:
        return CacheError(f"{self.where}: {field}: {msg}" if field else f"{self.where}: {msg}")

    def get(self, obj: dict, key: str, ctx: str, required: bool = True) -> Any:
        field = f"{ctx}.{key}" if ctx else key
        if key not in obj or (obj[key] is None and not required):
            if required:
                raise self.fail(field, "missing required field")
            return None
        return obj[key]

    def obj(self, obj: dict, key: str, ctx: str, required: bool = True) -> dict | None:
        v = self.get(obj, key, ctx, required)
        if v is not None and not isinstance(v, dict):
            raise self.fail(_join(ctx, key), f"expected an object, got {json_type_name(v)}")
        return v

    def boolean(self, obj: dict, key: str, ctx: str) -> bool:
        v = self.get(obj, key, ctx)
        if not isinstance(v, bool):
            raise self.fail(_join(ctx, key), f"expected true or false, got {_show(v)}")
        return v

    def string(self, obj: dict, key: str, ctx: str, required: bool = True) -> str | None:
        v = self.get(obj, key, ctx, required)
        if v is not None and not isinstance(v, str):
            raise self.fail(_join(ctx, key), f"expected a string, got {json_type_name(v)} {_show(v)}")
        return v

    def number(self, obj: dict, key: str, ctx: str, lo: float, hi: float, what: str,
               required: bool = True) -> float | None:
        v = self.get(obj, key, ctx, required)
        if v is None:
            return None
        self.check(_join(ctx, key), number_problem(v, lo, hi, what))
        return float(v)

    def check(self, field: str, problem: str | None) -> None:
        if problem:
            raise self.fail(field, problem)

    def tokens(self, obj: dict, key: str, ctx: str) -> float:
        v = self.get(obj, key, ctx)
        self.check(_join(ctx, key), tokens_problem(v))
        return float(v)

    def unit(self, obj: dict, key: str, ctx: str) -> float:
        v = self.get(obj, key, ctx, required=False)
        self.check(_join(ctx, key), unit_problem(v))
        return math.nan if v is None else float(v)


def _join(ctx: str, key: str) -> str:
    return f"{ctx}.{key}" if ctx else key


def _reject_constant(name: str) -> float:
    # json.loads accepts NaN / Infinity / -Infinity (not JSON). Keep them as
    # floats so the field check reports them with the field's name; fields the
    # reader ignores may hold them harmlessly.
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


#: Longest line read (one question; a real one is a few kB). Longer lines are refused before
#: they are parsed, so a runaway line cannot take the machine's memory.
MAX_LINE_BYTES = 16 << 20

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _open(path: Path):
    try:
        return open(path, "rb")
    except IsADirectoryError:
        raise CacheError(f"{path}: is a directory (expected a .jsonl file)") from None
    except FileNotFoundError:
        raise CacheError(f"{path}: no such file or directory") from None
    except OSError as e:
        raise CacheError(f"{path}: cannot read ({e.strerror or e})") from None


def _parse_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, parsed JSON object) for the non-blank lines of ``path``, one at a time:
    the file is streamed, so memory holds one line and what the caller keeps of the others."""
    hint = "" if path.suffix.lower() in (".jsonl", ".json", ".ndjson") else (
        " (data commands read the human JSONL format or a fast-format directory; "
        "other formats go through 'ccpo-jax data import --format NAME')"
    )
    offset = 0
    journal = False
    with _open(path) as f:
        for i in itertools.count(1):
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise CacheError(f"{path}:{i}: cannot read ({e.strerror or e})") from None
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise CacheError(f"{path}:{i}: line longer than {MAX_LINE_BYTES >> 20} MiB (one question per "
                                 "line is a few kB; is this a JSON Lines cache?)")
            start, offset = offset, offset + len(raw)
            if i == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").removesuffix("\n")
            except UnicodeDecodeError as e:
                raise CacheError(f"{path}:{i}: not UTF-8 text (byte {start + e.start})") from None
            if not line.strip():
                continue
            try:
                val = json.loads(line, parse_constant=_reject_constant)
            except json.JSONDecodeError as e:
                if journal and not raw.endswith(b"\n"):
                    return  # a gateway journal's last line, cut by a kill (the gateway drops it on restart)
                raise CacheError(
                    # e.msg may end in " at" ("Unterminated string starting at"): no "at at column"
                    f"{path}:{i}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}; truncated line?){hint}"
                ) from None
            except RecursionError:
                raise CacheError(f"{path}:{i}: JSON nested too deeply") from None
            except ValueError as e:  # e.g. an integer with more than 4300 digits
                raise CacheError(f"{path}:{i}: not valid JSON ({e})") from None
            if not isinstance(val, dict):
                raise CacheError(f"{path}:{i}: expected a JSON object, got {json_type_name(val)}{hint}")
            if i == 1:
                journal = is_journal(val.get("manifest"))
            if _SURROGATE_ESCAPE.search(raw):  # "\ud800" parses to a str that UTF-8 cannot write
                bad = lone_surrogate(val)
                if bad:
                    raise CacheError(f"{path}:{i}: {bad[0]}: {bad[1]}")
            yield i, val


def _manifest(path: Path, line_no: int | None, mdict: dict | None, max_rounds: int,
              exit_seen: list[str], policy_seen: list[str]) -> Manifest:
    """The manifest from the first line (or the defaults), with baseline model lists."""
    where = f"{path}:{line_no}" if line_no else str(path)
    if mdict is None:
        if max_rounds > MAX_T:
            raise CacheError(f"{path}: a question has {max_rounds} rounds; at most {MAX_T} are supported")
        d: dict[str, Any] = {
            "name": path.stem,
            "task": "unknown",
            "T": max_rounds,
            "models": {"base": {"name": "base"}, "guide": {"name": "guide"}},
            "provenance": {"kind": "real", "source": str(path), "license": "unknown"},
        }
    else:
        d = dict(mdict)
        d.setdefault("name", path.stem)
        d.setdefault("task", "unknown")
        for key in ("models", "T", "provenance"):
            if key not in d:
                raise CacheError(f"{where}: manifest.{key}: missing required field")
        norm = d.get("normalisation", NORMALISATION)
        if norm != NORMALISATION:
            raise CacheError(
                f"{where}: manifest.normalisation: only {NORMALISATION!r} is supported, got {_show(norm)}"
            )
        if "schema_version" in d and d["schema_version"] != SCHEMA_VERSION:
            raise CacheError(
                f"{where}: manifest.schema_version: this build reads version {SCHEMA_VERSION}, got {_show(d['schema_version'])}"
            )
    # Model order of the baseline columns: as listed in the manifest, then as first seen.
    lists = {}
    for key, seen in (("exit_models", exit_seen), ("llm_policy_models", policy_seen)):
        listed = d.get(key, [])
        problem = model_names_problem(listed)
        if problem:
            raise CacheError(f"{where}: manifest.{key}: {problem}")
        lists[key] = listed + [m for m in seen if m not in listed]
    d["exit_models"], d["llm_policy_models"] = lists["exit_models"], lists["llm_policy_models"]
    d["checksum"] = d["arrays_checksum"] = ""
    try:
        man = Manifest.from_dict(d, where="manifest")
    except CacheError as e:
        raise CacheError(f"{where}: {e}") from None
    return man


class NoQuestions(CacheError):
    """A human-format file with a valid manifest line and no question yet (e.g. a collection
    stopped before its first question finished): ``data check`` accepts it, a run cannot use it."""


def read_jsonl(path: str | os.PathLike) -> ResponseCache:
    """Read and validate a human-format cache (module docstring); returns it with its checksum."""
    path = Path(path)
    return _read(path, _parse_lines(path))


def awaiting_feedback(path: str | os.PathLike) -> int:
    """How many of a journal's requests await feedback (0 for a cache that is no journal)."""
    lines = _parse_lines(Path(path))
    first = next(lines, None)
    if first is None or not is_journal(first[1].get("manifest")):
        return 0
    waiting: set = set()
    for _, obj in lines:
        (waiting.add if _unlabelled(obj) else waiting.discard)(obj.get("id"))
    return len(waiting)


def check_question(manifest: dict, record: dict, where: str) -> None:
    """Refuse (CacheError) a question line that :func:`read_jsonl` would refuse under ``manifest``,
    before it is written (``data collect`` appends lines as questions finish). Messages read
    ``WHERE:2: FIELD: problem`` (line 2: the line after the manifest)."""
    bad = lone_surrogate(record)
    if bad:
        raise CacheError(f"{where}:2: {bad[0]}: {bad[1]}")
    _read(Path(where), iter([(1, {"manifest": manifest}), (2, record)]))


def _read(path: Path, lines: Iterator[tuple[int, dict]]) -> ResponseCache:
    first = next(lines, None)
    if first is None:
        raise CacheError(f"{path}: empty file (no manifest and no questions)")
    mline, mdict = None, None
    if "manifest" in first[1]:
        mline, mobj = first
        mdict = mobj["manifest"]
        if not isinstance(mdict, dict):
            raise CacheError(f"{path}:{mline}: manifest: expected an object, got {json_type_name(mdict)}")
        _manifest(path, mline, mdict, 0, [], [])  # report manifest errors before question errors
    else:
        lines = itertools.chain([first], lines)
    T_limit = mdict.get("T") if mdict is not None else None
    if not (isinstance(T_limit, int) and not isinstance(T_limit, bool)):
        T_limit = None  # a bad or missing T is reported by the manifest check below
    has_guide = mdict is None or mdict["models"]["guide"] is not None  # (the manifest was checked above)

    questions = []
    first_line: dict[str, int] = {}
    exit_seen: list[str] = []
    policy_seen: list[str] = []
    journal = is_journal(mdict)
    awaiting: dict[str, int] = {}  # a journal's unlabelled lines: id -> line
    for line_no, obj in lines:
        L = _Line(f"{path}:{line_no}")
        if "manifest" in obj:
            raise L.fail("manifest", "the manifest must be on the first line")
        if journal and _unlabelled(obj):
            # a gateway request awaiting feedback: checked as a question, then skipped (no outcome to learn from)
            q = _read_question(L, _as_labelled(obj), T_limit, has_guide)
            if q["id"] in first_line:
                raise L.fail("id", f"duplicate question id {q['id']!r} (labelled on line {first_line[q['id']]})")
            awaiting[q["id"]] = line_no
            continue
        q = _read_question(L, obj, T_limit, has_guide)
        awaiting.pop(q["id"], None)  # a journal's feedback line supersedes the request's unlabelled line
        if q["id"] in first_line:
            raise L.fail("id", f"duplicate question id {q['id']!r} (first on line {first_line[q['id']]})")
        first_line[q["id"]] = line_no
        for m in q["exit"]:
            if m not in exit_seen:
                exit_seen.append(m)
        for m in q["llm_policy"]:
            if m not in policy_seen:
                policy_seen.append(m)
        q["line"] = line_no
        questions.append(q)

    if not questions:
        if awaiting:
            raise NoQuestions(f"{path}: no questions yet: {len(awaiting)} journal line(s) await feedback")
        raise NoQuestions(f"{path}: no questions (the file holds only a manifest)")
    max_rounds = max(len(q["rounds"]) for q in questions)
    man = _manifest(path, mline, mdict, max_rounds, exit_seen, policy_seen)
    T = man.T
    for q in questions:
        if len(q["rounds"]) > T:  # only reachable when T was unusable above
            raise CacheError(f"{path}:{q['line']}: rounds: {len(q['rounds'])} rounds, more than T = {T}")
        for m, ex in q["exit"].items():
            if ex["rounds"] > T:
                raise CacheError(
                    f"{path}:{q['line']}: baselines.exit.{m}.rounds: expected an integer in [1, {T}], got {ex['rounds']}"
                )
    with_group = [q for q in questions if q["group"] is not None]
    if with_group and len(with_group) != len(questions):
        lacking = next(q for q in questions if q["group"] is None)
        raise CacheError(f"{path}:{lacking['line']}: group: question {lacking['id']!r} has no group, but "
                         f"{len(with_group)} other question(s) do (give every question a group or none)")
    arrays = _to_arrays(questions, man)
    problem = values_problem(man, arrays)  # the rules every format shares (envs.cache.values), as the last word
    if problem:
        line = mline if problem.question is None else questions[problem.question]["line"]
        raise CacheError(f"{path}:{line}: {problem.field}: {problem.message}")
    return ResponseCache(man, arrays).with_checksum()


#: The per-round values a question keeps while the file is read, in this order.
_ROUND_KEYS = ("guide_verdict", "base_answer", "base_correct", "base_tokens_in", "base_tokens_out", "base_confidence",
               "guide_answer", "guide_correct", "guide_tokens_in", "guide_tokens_out", "guide_uncertainty")


def _read_question(L: _Line, obj: dict, T_limit: int | None, has_guide: bool = True) -> dict:
    qid = L.get(obj, "id", "")
    if isinstance(qid, int) and not isinstance(qid, bool):
        qid = str(qid)
    if not isinstance(qid, str) or not qid:
        raise L.fail("id", f"expected a non-empty string, got {json_type_name(qid)} {_show(qid)}")
    gold = L.string(obj, "gold", "", required=False)
    group = None
    if "group" in obj:
        group = obj["group"]
        problem = group_problem(group)
        if problem:
            raise L.fail("group", f"{problem} (question {qid!r})")
    rounds = L.get(obj, "rounds", "")
    if not isinstance(rounds, list):
        raise L.fail("rounds", f"expected an array of rounds, got {json_type_name(rounds)}")
    if not rounds:
        raise L.fail("rounds", "a question needs at least one round, got 0")
    if T_limit is not None and 1 <= T_limit < len(rounds):
        raise L.fail("rounds", f"{len(rounds)} rounds, more than the manifest's T = {T_limit}")

    ids: dict[str, int] = {}
    texts: list[str] = []
    id_correct: dict[int, tuple[bool, str]] = {}
    gold_norm = normalise_answer(gold) if gold else None
    out_rounds = []
    for t, rnd in enumerate(rounds):
        ctx = f"rounds[{t}]"
        if not isinstance(rnd, dict):
            raise L.fail(ctx, f"expected an object, got {json_type_name(rnd)}")
        rec = dict(NO_GUIDE_ROUND)  # a cascade's guide values; a guide's are read below
        if not has_guide and "guide" in rnd:
            raise L.fail(f"{ctx}.guide", CASCADE_NO_GUIDE)
        for role in ("base", "guide") if has_guide else ("base",):
            rctx = f"{ctx}.{role}"
            r = L.obj(rnd, role, ctx)
            if role == "guide":
                rec["guide_verdict"] = L.boolean(r, "verdict", rctx)
            text = L.string(r, "answer", rctx)
            correct = L.boolean(r, "correct", rctx)
            norm = normalise_answer(text)
            if norm not in ids:
                ids[norm] = len(texts)
                texts.append(norm)
            aid = ids[norm]
            if gold_norm is not None and norm == gold_norm and not correct:
                raise L.fail(
                    f"{rctx}.correct",
                    f"false, but the answer {text!r} equals the gold answer {gold!r} after normalisation",
                )
            if aid in id_correct and id_correct[aid][0] != correct:
                prev_correct, prev_field = id_correct[aid]
                raise L.fail(
                    f"{rctx}.correct",
                    f"{json.dumps(correct)} contradicts {prev_field}.correct = {json.dumps(prev_correct)} for the same "
                    f"normalised answer {norm!r}",
                )
            id_correct.setdefault(aid, (correct, rctx))
            rec[f"{role}_answer"] = aid
            rec[f"{role}_correct"] = correct
            rec[f"{role}_tokens_in"] = L.tokens(r, "tokens_in", rctx)
            rec[f"{role}_tokens_out"] = L.tokens(r, "tokens_out", rctx)
            if role == "base":
                rec["base_confidence"] = L.unit(r, "confidence", rctx)
            else:
                rec["guide_uncertainty"] = L.unit(r, "uncertainty", rctx)
        out_rounds.append(tuple(rec[k] for k in _ROUND_KEYS))  # a tuple: a third of a dict's memory

    exits: dict[str, dict] = {}
    policies: dict[str, list[int]] = {}
    base = L.obj(obj, "baselines", "", required=False)
    if base is not None:
        ex = L.obj(base, "exit", "baselines", required=False) or {}
        for m, rec in ex.items():
            ctx = f"baselines.exit.{m}"
            if not isinstance(rec, dict):
                raise L.fail(ctx, f"expected an object, got {json_type_name(rec)}")
            n = L.get(rec, "rounds", ctx)
            L.check(f"{ctx}.rounds", exit_rounds_problem(n, T_limit if T_limit is not None and T_limit >= 1 else MAX_T))
            correct = L.boolean(rec, "correct", ctx)
            cost = L.get(rec, "cost_cents", ctx)
            L.check(f"{ctx}.cost_cents", cents_problem(cost))
            exits[m] = {"correct": correct, "rounds": n, "cost_cents": float(cost)}
        pol = L.obj(base, "llm_policy", "baselines", required=False) or {}
        for m, acts in pol.items():
            ctx = f"baselines.llm_policy.{m}"
            problem = actions_problem(acts, len(rounds))
            if problem:
                raise L.fail(ctx + problem[0], problem[1])
            policies[m] = list(acts)
    return {"id": qid, "gold": gold or "", "group": group, "rounds": out_rounds, "texts": texts,
            "exit": exits, "llm_policy": policies}


def _to_arrays(questions: list[dict], man: Manifest) -> dict[str, np.ndarray]:
    Q, T = len(questions), man.T
    M, M2 = len(man.exit_models), len(man.llm_policy_models)
    a = empty_arrays(Q, T, M, M2)
    e_idx = {m: j for j, m in enumerate(man.exit_models)}
    p_idx = {m: j for j, m in enumerate(man.llm_policy_models)}
    answer_text = [[""] * (2 * T) for _ in range(Q)]
    for i, q in enumerate(questions):
        for t, rec in enumerate(q["rounds"]):
            a["round_mask"][i, t] = True
            for k, v in zip(_ROUND_KEYS, rec):
                a[k][i, t] = v
        answer_text[i][: len(q["texts"])] = q["texts"]
        for m, ex in q["exit"].items():
            j = e_idx[m]
            a["exit_mask"][i, j] = True
            a["exit_correct"][i, j] = ex["correct"]
            a["exit_rounds"][i, j] = ex["rounds"]
            a["exit_cost_cents"][i, j] = ex["cost_cents"]
        for m, acts in q["llm_policy"].items():
            a["llm_policy_actions"][i, p_idx[m], : len(acts)] = acts
    a["question_ids"] = np.array([q["id"] for q in questions], dtype=str)
    a["gold"] = np.array([q["gold"] for q in questions], dtype=str)
    if Q and questions[0].get("group") is not None:
        a["group"] = np.array([q["group"] for q in questions], dtype=str)
    a["answer_text"] = np.array(answer_text, dtype=str).reshape(Q, 2 * T)
    return a


# -- writing -----------------------------------------------------------------

def _num(v: Any) -> int | float:
    """A float32 value as JSON: integral values as ints (tokens), else the shortest
    decimal that reads back as the same float32 (0.4, not 0.4000000059604645)."""
    v32 = np.float32(v)
    f = float(v32)
    return int(f) if f.is_integer() and abs(f) < 2**53 else float(str(v32))


def cache_to_records(cache: ResponseCache) -> list[dict]:
    """The question lines of the human format (without the manifest line)."""
    a, man = cache.arrays, cache.manifest
    out = []
    for i in range(cache.n_questions):
        texts = a["answer_text"][i]
        rounds = []
        for t in range(man.T):
            if not a["round_mask"][i, t]:
                break
            base = {
                "answer": str(texts[a["base_answer"][i, t]]),
                "correct": bool(a["base_correct"][i, t]),
                "tokens_in": _num(a["base_tokens_in"][i, t]),
                "tokens_out": _num(a["base_tokens_out"][i, t]),
            }
            if not np.isnan(a["base_confidence"][i, t]):
                base["confidence"] = _num(a["base_confidence"][i, t])
            if not man.has_guide:  # a cascade: no guide object
                rounds.append({"base": base})
                continue
            guide = {
                "verdict": bool(a["guide_verdict"][i, t]),
                "answer": str(texts[a["guide_answer"][i, t]]),
                "correct": bool(a["guide_correct"][i, t]),
                "tokens_in": _num(a["guide_tokens_in"][i, t]),
                "tokens_out": _num(a["guide_tokens_out"][i, t]),
            }
            if not np.isnan(a["guide_uncertainty"][i, t]):
                guide["uncertainty"] = _num(a["guide_uncertainty"][i, t])
            rounds.append({"base": base, "guide": guide})
        rec: dict[str, Any] = {"id": str(a["question_ids"][i])}
        if a["gold"][i]:
            rec["gold"] = str(a["gold"][i])
        if "group" in a:
            rec["group"] = str(a["group"][i])
        rec["rounds"] = rounds
        baselines: dict[str, Any] = {}
        exits = {
            m: {
                "correct": bool(a["exit_correct"][i, j]),
                "rounds": int(a["exit_rounds"][i, j]),
                "cost_cents": _num(a["exit_cost_cents"][i, j]),
            }
            for j, m in enumerate(man.exit_models)
            if a["exit_mask"][i, j]
        }
        if exits:
            baselines["exit"] = exits
        pols = {}
        for j, m in enumerate(man.llm_policy_models):
            acts = a["llm_policy_actions"][i, j]
            acts = [int(x) for x in acts[acts >= 0]]
            if acts:
                pols[m] = acts
        if pols:
            baselines["llm_policy"] = pols
        if baselines:
            rec["baselines"] = baselines
        out.append(rec)
    return out


def write_jsonl(cache: ResponseCache, path: str | os.PathLike) -> Path:
    """Write ``cache`` in the human format: manifest line, then one line per question.

    Atomic: written to a temporary file beside ``path`` and renamed into place,
    so a failed or killed write leaves nothing behind (an existing file stays).
    """
    path = Path(path)
    if path.is_dir():
        raise CacheError(f"{path}: is a directory; give a file name ending in .jsonl")
    # The rules every reader applies (envs.cache.values): never write a file the reader would refuse.
    check_arrays(cache.manifest, cache.arrays, f"{path} (not written)")
    cache = cache.with_checksum()
    lines = [json.dumps({"manifest": cache.manifest.to_dict()}, allow_nan=False)]
    lines += [json.dumps(r, ensure_ascii=False, allow_nan=False) for r in cache_to_records(cache)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, "\n".join(lines) + "\n")
    except OSError as e:
        raise CacheError(f"{path}: cannot write ({e.strerror or e})") from None
