"""The questions file of ``ccpo-jax data collect``: JSON Lines or CSV with ``id``, ``question``, ``gold``.

* JSONL (``.jsonl``, ``.json``, ``.ndjson``): one object per line; ``id`` a
  string or integer, ``question`` a non-empty string, ``gold`` a non-empty
  string or an array of them (aliases: an answer matching any is correct; the
  first is the cache's ``gold``); optional ``group`` (a non-empty string of at
  most 200 characters: the question's group for Mondrian calibration, written
  to the cache). Other fields are ignored.
* CSV (``.csv``; ``.tsv`` tab-separated): a header row naming at least ``id``,
  ``question`` and ``gold`` (and optionally ``group``); one gold answer per row.

Bad input is a UserError naming the file, line and field.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
from pathlib import Path

from ccpo_jax.errors import UserError
from envs.cache.schema import group_problem
from envs.cache.normalise import normalise_answer


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    question: str
    golds: tuple[str, ...]
    group: str | None = None


def load_questions(path: str | Path) -> tuple[list[Question], str]:
    """(questions in file order, sha256 of the file's bytes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file", field="questions") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory (expected a .jsonl or .csv file)", field="questions") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})", field="questions") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text") from None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path, text)
    elif suffix in (".csv", ".tsv"):
        rows = _csv_rows(path, text, "\t" if suffix == ".tsv" else ",")
    else:
        raise UserError(f"{path}: expected a .jsonl or .csv file (id, question, gold)", field="questions")
    out: list[Question] = []
    seen: dict[str, int] = {}
    for line, obj in rows:
        where = f"{path}:{line}"
        qid = obj.get("id")
        if isinstance(qid, int) and not isinstance(qid, bool):
            qid = str(qid)
        if not isinstance(qid, str) or not qid.strip():
            raise UserError(f"{where}: id: expected a non-empty string or integer")
        qid = qid.strip()
        if qid in seen:
            raise UserError(f"{where}: id: duplicate id {qid!r} (first on line {seen[qid]})")
        seen[qid] = line
        q = obj.get("question")
        if not isinstance(q, str) or not q.strip():
            raise UserError(f"{where}: question: expected a non-empty string")
        gold = obj.get("gold")
        golds = gold if isinstance(gold, list) else [gold]
        if not golds or not all(isinstance(g, str) and normalise_answer(g) for g in golds):
            raise UserError(f"{where}: gold: expected a non-empty answer (a string, or an array of strings in JSONL) "
                            "that is not empty after normalisation")
        group = obj.get("group")
        if group is not None:
            # the name as written (a control character is refused even at the ends), then stripped
            problem = group_problem(group) or group_problem(group.strip())
            if problem:
                raise UserError(f"{where}: group: {problem} (question {qid!r})")
            group = group.strip()
        out.append(Question(qid, q.strip(), tuple(g.strip() for g in golds), group))
    if not out:
        raise UserError(f"{path}: no questions in the file", field="questions")
    lacking = [(line, q) for (line, _), q in zip(rows, out) if q.group is None]
    if lacking and len(lacking) != len(out):
        raise UserError(f"{path}:{lacking[0][0]}: group: question {lacking[0][1].id!r} has no group but others do "
                        "(give every question a group or none)")
    return out, hashlib.sha256(raw).hexdigest()


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    rows = []
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise UserError(f"{path}:{i}: not valid JSON") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{i}: expected a JSON object with id, question, gold")
        rows.append((i, obj))
    return rows


def _csv_rows(path: Path, text: str, delim: str) -> list[tuple[int, dict]]:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delim)
    missing = [c for c in ("id", "question", "gold") if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{path}:1: the header must name id, question and gold (missing: {', '.join(missing)})")
    rows = []
    try:
        for rec in reader:
            rows.append((reader.line_num, rec))
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    return rows
