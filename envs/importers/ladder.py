"""Multi-model result tables -> a guide-less ladder cache (docs/caches.md "Model ladders").

A ladder cache from runs of k models on the same questions: round t is rung t's run, the rungs
ordered by price (``price_in + price_out``, then name) unless an order is given, and no guide
(``models.guide: null``): a pure cascade, in which a router's only choices are to stop at a rung
or to go on to the next. Round t's cost is rung t's tokens at rung t's prices.

* :func:`build_ladder`: per question, one :class:`~envs.importers.Side` per rung -> the cache;
* :func:`pair_to_ladder`: a one-round (base, guide) import (``routellm-*``, ``omnisbench``) as the
  two-rung ladder (base model, then guide model): the guide's answer is that model's own run;
* :func:`load_per_model` (format ``per-model``): a folder with one JSONL file per model, lines
  ``{"id", "answer", "correct", "tokens_in", "tokens_out", "confidence"?, "gold"?, "group"?}``, and an
  optional ``ladder.json`` ``{"models": [{"name", "price_in", "price_out", "file"?}], "order"?: "given" |
  "price", "name"?, "task"?, "license"?, "source"?}`` giving the prices and the order (without it: the file
  stems are the model names, priced by :data:`envs.importers.pricing.PRICES`, ordered by price). Lines and
  prices go through the cache's value rules (``envs.cache.values``), errors naming ``FILE:LINE: field``.

Questions are those present in every model's file (in the first rung's file order); how many were
left out is in the provenance (``questions_dropped``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Sequence


from envs.cache.schema import CacheError, ModelInfo, ResponseCache
from envs.cache.fast import read_json_object
from envs.cache.values import (group_problem, json_type_name, lone_surrogate, price_problem, show, tokens_problem,
                               unit_problem)
from envs.importers import Side, build_cache

#: The protocol string of a ladder import.
LADDER_PROTOCOL = "a ladder of independent runs (round t = rung t's own answer), no guide; not the CCPO protocol"


def order_rungs(models: Sequence[ModelInfo]) -> list[int]:
    """Indices of ``models`` from the cheapest (``price_in + price_out``, then name) to the dearest."""
    return sorted(range(len(models)), key=lambda i: (models[i].price_in + models[i].price_out, models[i].name))


def build_ladder(*, name: str, task: str, rungs: Sequence[ModelInfo], provenance: dict, question_ids: Sequence[str],
                 gold: Sequence[str], answers: Sequence[Sequence[Side]], groups: Sequence[str] | None = None
                 ) -> ResponseCache:
    """The cascade cache: ``answers[q][t]`` is rung t's answer to question q (every question has every rung;
    a Side's ``score`` is the base confidence). :func:`envs.importers.build_cache` without a guide."""
    T = len(rungs)
    if T < 1:
        raise CacheError(f"{name}: a ladder needs at least one model")
    return build_cache(name=name, task=task, base=rungs[0], guide=None, provenance=provenance,
                       question_ids=question_ids, gold=gold, rounds=[[(b, None) for b in sides] for sides in answers],
                       T=T, groups=groups, base_ladder=tuple(rungs) if T > 1 else ())


def pair_to_ladder(cache: ResponseCache, source: str) -> ResponseCache:
    """A one-round (base, guide) cache as the two-rung ladder: round 1 the base model's answer, round 2 the
    guide model's own answer, each at its model's prices; no guide. Its confidences are dropped where the
    pair had the guide's uncertainty (a judge's measure, not the model's confidence in its answer)."""
    if cache.T != 1 or not cache.manifest.has_guide:
        raise CacheError(f"{source}: a two-rung ladder is made from a one-round import with a guide (T = 1)")
    a, man = cache.arrays, cache.manifest
    texts = a["answer_text"]
    answers = []
    for q in range(cache.n_questions):
        sides = []
        for role, conf in (("base", float(a["base_confidence"][q, 0])), ("guide", math.nan)):
            aid = int(a[f"{role}_answer"][q, 0])
            sides.append(Side(str(texts[q, aid]) if aid >= 0 else "", bool(a[f"{role}_correct"][q, 0]),
                              float(a[f"{role}_tokens_in"][q, 0]), float(a[f"{role}_tokens_out"][q, 0]), conf))
        answers.append(sides)
    prov = {**man.provenance, "protocol": LADDER_PROTOCOL,
            "ladder": f"rung 1 = {man.base.name} (the import's base), rung 2 = {man.guide.name} (the import's guide, "
                      "its own answer)"}
    groups = [str(g) for g in a["group"]] if "group" in a else None
    return build_ladder(name=f"{man.name}-ladder", task=man.task, rungs=[man.base, man.guide], provenance=prov,
                        question_ids=[str(x) for x in a["question_ids"]], gold=[str(x) for x in a["gold"]],
                        answers=answers, groups=groups)


# -- the generic per-model JSONL format ---------------------------------------------------------

_REQUIRED = {"id": str, "answer": str, "correct": bool, "tokens_in": (int, float), "tokens_out": (int, float)}


def _row(path: Path, line_no: int, obj: Any) -> dict:
    """One line, checked with the cache's value rules (``envs.cache.values``: the JSONL reader's texts), so a
    bad value is refused here naming ``FILE:LINE: field``, not later naming the output."""
    where = f"{path}:{line_no}"
    if not isinstance(obj, dict):
        raise CacheError(f"{where}: expected a JSON object")
    for k, typ in _REQUIRED.items():
        if k not in obj:
            raise CacheError(f"{where}: {k}: missing")
        v = obj[k]
        if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
            want = {str: "a string", bool: "true or false"}.get(typ, "a number")
            raise CacheError(f"{where}: {k}: expected {want}, got {show(v)}")
    bad = lone_surrogate(obj)
    problems = [(bad[0], bad[1])] if bad else []
    problems += [("id", 'expected a non-empty string, got ""' if not obj["id"] else None),
                 ("tokens_in", tokens_problem(obj["tokens_in"])), ("tokens_out", tokens_problem(obj["tokens_out"])),
                 ("confidence", unit_problem(obj.get("confidence")))]
    for k in ("gold", "group"):
        if k in obj and not isinstance(obj[k], str):
            problems.append((k, f"expected a string, got {json_type_name(obj[k])} {show(obj[k])}"))
    if "group" in obj:
        problems.append(("group", group_problem(obj["group"])))
    field, problem = next(((f, p) for f, p in problems if p), (None, None))
    if problem:
        raise CacheError(f"{where}: {field}: {problem}")
    return obj


def jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of ``path``, read one line at a time and at most
    :data:`envs.cache.jsonl.MAX_LINE_BYTES` a line (the cache reader's bound); a CacheError naming the line
    for text that is not UTF-8 or JSON, and for JSON past the parser's limits (nesting, digits)."""
    from envs.cache.jsonl import MAX_LINE_BYTES

    try:
        with open(path, "rb") as f:
            for i, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise CacheError(f"{path}:{i}: line longer than {MAX_LINE_BYTES >> 20} MiB (one record per line)")
                try:
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise CacheError(f"{path}:{i}: not UTF-8 text (byte {e.start} of the line)") from None
                if line.strip():
                    yield i, _json_line(path, i, line)
    except OSError as e:
        raise CacheError(f"{path}: cannot read ({e.strerror or e})") from None


def _json_line(path: Path, i: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise CacheError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise CacheError(f"{path}:{i}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise CacheError(f"{path}:{i}: not valid JSON ({e})") from None


def _read_rows(path: Path) -> dict[str, dict]:
    """id -> the line's object, with its line number under :data:`_LINE` (a key no JSON object holds)."""
    rows: dict[str, dict] = {}
    for i, obj in jsonl_objects(path):
        r = _row(path, i, obj)
        if r["id"] in rows:
            raise CacheError(f"{path}:{i}: id: {r['id']!r} is given twice")
        rows[r["id"]] = {**r, _LINE: i}
    if not rows:
        raise CacheError(f"{path}: no lines")
    return rows


#: The key under which :func:`_read_rows` keeps a row's line number (JSON keys are strings: no clash).
_LINE = 0


def _conflict(qid: str, lines: Sequence[tuple[str, dict]]) -> str | None:
    """The cache's contradiction rules (docs/caches.md, ``envs.cache.values``) on one question's rungs,
    named in the sources' terms: ``lines`` is ``(FILE, row)`` per rung, in rung order. Within a question
    one normalised answer has one ``correct`` flag, and an answer equal to the gold is correct."""
    from envs.cache.normalise import normalise_answer

    gold = next((r["gold"] for _, r in lines if r.get("gold")), "")
    gold_norm = normalise_answer(gold) if gold else None
    seen: dict[str, tuple[bool, str]] = {}
    for f, r in lines:
        where, norm, ok = f"{f}:{r[_LINE]}", normalise_answer(r["answer"]), r["correct"]
        if norm == gold_norm and not ok:
            return (f"{where}: correct: false, but the answer {r['answer']!r} equals the gold answer {gold!r} "
                    f"after normalisation (question {qid!r})")
        if norm in seen and seen[norm][0] != ok:
            return (f"{where}: correct: {json.dumps(ok)} contradicts {seen[norm][1]} (correct: "
                    f"{json.dumps(seen[norm][0])}) for the same normalised answer {norm!r} (question {qid!r}); "
                    "a cache holds one flag per answer of a question: correct one of the lines")
        seen.setdefault(norm, (ok, where))
    return None


def _source_problem(cache: ResponseCache, files: Sequence[Path], rows: Sequence[dict[str, dict]],
                    spec_path: Path) -> str | None:
    """The shared value rules (``envs.cache.values``, as every reader and writer applies them) on the
    built cache, the first problem placed at its source ``FILE:LINE`` (round t is rung t's file)."""
    from envs.cache.schema import values_problem

    p = values_problem(cache.manifest, cache.arrays)
    if p is None:
        return None
    if p.question is None:
        return f"{spec_path}: {p.field}: {p.message}"
    qid = str(cache.arrays["question_ids"][p.question])
    t = int(p.field[len("rounds["):p.field.index("]")]) if p.field.startswith("rounds[") else 0
    field = p.field.split(".", 2)[2] if p.field.count(".") >= 2 else p.field
    return f"{files[t]}:{rows[t][qid][_LINE]}: {field}: {p.message} (question {qid!r})"


#: ladder.json's ``order``: the rungs as listed, or by price (:func:`order_rungs`).
ORDERS = ("given", "price")
#: ladder.json's optional text fields (the cache's name and task, the provenance's license and source).
SPEC_TEXT = ("name", "task", "license", "source")


def _check_spec(spec_path: Path, spec: dict) -> None:
    """Refuse a value of ladder.json's ``order`` or text fields that would otherwise be taken silently
    (``"order": "prise"`` was read as the given order; a number as the name)."""
    order = spec.get("order", "given")
    if order not in ORDERS:
        raise CacheError(f"{spec_path}: order: expected {' or '.join(map(json.dumps, ORDERS))}, got {show(order)}")
    for k in SPEC_TEXT:
        if k in spec and not isinstance(spec[k], str):
            shown = "" if isinstance(spec[k], (dict, list)) else f" {show(spec[k])}"
            raise CacheError(f"{spec_path}: {k}: expected a string, got {json_type_name(spec[k])}{shown}")


def _ladder_spec(src: Path) -> tuple[list[tuple[ModelInfo, Path]], dict]:
    """(model, file) per rung in ladder order, and the ladder.json fields (or none)."""
    from envs.importers.pricing import PRICES

    spec_path = src / "ladder.json"
    if spec_path.is_file():
        spec = read_json_object(spec_path, "ladder.json")  # every way JSON can fail (nesting, size, ...) is one line
        _check_spec(spec_path, spec)
        ms = spec.get("models")
        if not isinstance(ms, list) or not ms:
            raise CacheError(f"{spec_path}: models: expected a non-empty list of {{name, price_in, price_out}}")
        out = []
        for i, m in enumerate(ms):
            ctx = f"{spec_path}: models[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                raise CacheError(f"{ctx}: name: expected a string")
            for k in ("price_in", "price_out"):  # the cache's own price rule (envs.cache.values), as every reader applies it
                problem = price_problem(m[k]) if k in m else "missing"
                if problem:
                    raise CacheError(f"{ctx}.{k}: {problem}")
            if not isinstance(m.get("file", ""), str):
                raise CacheError(f"{ctx}.file: expected a string (the model's file in {src}), got {show(m['file'])}")
            f = src / m.get("file", f"{m['name']}.jsonl")
            if not f.is_file():
                raise CacheError(f"{ctx}: file {f.name!r} not found in {src}")
            out.append((ModelInfo(m["name"], float(m["price_in"]), float(m["price_out"])), f))
        if spec.get("order") == "price":
            out = [out[i] for i in order_rungs([m for m, _ in out])]
        return out, spec
    files = sorted(p for p in src.glob("*.jsonl") if p.is_file())
    if not files:
        raise CacheError(f"{src}: no *.jsonl files (one per model) and no ladder.json")
    out = []
    for f in files:
        if f.stem not in PRICES:
            raise CacheError(f"{f}: no list price for the model {f.stem!r}: give the prices in {src / 'ladder.json'} "
                             "(docs/caches.md, the per-model format)")
        p = PRICES[f.stem]
        out.append((ModelInfo(f.stem, p.price_in, p.price_out), f))
    return [out[i] for i in order_rungs([m for m, _ in out])], {}


def load_per_model(src: Path) -> ResponseCache:
    """Format ``per-model``: see the module docstring."""
    if not src.is_dir():
        raise CacheError(f"{src}: expected a folder of per-model JSONL files")
    rungs, spec = _ladder_spec(src)
    tables = [_read_rows(f) for _, f in rungs]
    first = tables[0]
    ids = [i for i in first if all(i in t for t in tables[1:])]
    if not ids:
        raise CacheError(f"{src}: no question id is in every model's file")
    answers, gold, groups = [], [], []
    files = [f for _, f in rungs]
    for qid in ids:
        problem = _conflict(qid, [(str(f), r[qid]) for f, r in zip(files, tables)])
        if problem:
            raise CacheError(problem)
        answers.append([Side(r[qid]["answer"], r[qid]["correct"], float(r[qid]["tokens_in"]), float(r[qid]["tokens_out"]),
                             math.nan if r[qid].get("confidence") is None else float(r[qid]["confidence"]))
                        for r in tables])
        gold.append(next((r[qid]["gold"] for r in tables if "gold" in r[qid]), ""))
        groups.append(next((r[qid]["group"] for r in tables if "group" in r[qid]), None))
    n_all = len(set().union(*tables))
    prov = {"kind": "real", "source": str(spec.get("source", f"per-model JSONL files in {src.name}")),
            "license": str(spec.get("license", "unknown")), "protocol": LADDER_PROTOCOL,
            "ladder": ", ".join(f"rung {t + 1} = {m.name} ({f.name})" for t, (m, f) in enumerate(rungs)),
            "prices": "ladder.json" if spec else "envs/importers/pricing.py list prices",
            "questions_dropped": n_all - len(ids)}
    has_groups = all(g is not None for g in groups)
    cache = build_ladder(name=str(spec.get("name", src.name)), task=str(spec.get("task", "unknown")),
                         rungs=[m for m, _ in rungs], provenance=prov, question_ids=ids, gold=gold, answers=answers,
                         groups=groups if has_groups else None)
    problem = _source_problem(cache, files, tables, src / "ladder.json")
    if problem:  # the last word: nothing is written that a reader would refuse, named where it was written
        raise CacheError(problem)
    return cache
