"""RouterArena's ``cached_results`` -> a guide-less ladder cache (format ``routerarena``).

Source: RouteWorks/RouterArena @4714a9a, ``cached_results/<model>.jsonl`` (Apache-2.0): one file per
model, one line per benchmark item: ``global_index`` (``<dataset>_<n>``), ``generated_answer``,
``token_usage`` ({input_tokens, output_tokens}), ``success``, and ``evaluation_result`` with the
benchmark's ``score`` in [0, 1], ``ground_truth`` and ``inference_cost`` (USD).

Read as a ladder (:mod:`envs.importers.ladder`): every model is a rung, ordered by list price
(:data:`envs.importers.pricing.PRICES`), round t = rung t's own answer; no guide.

- *correct* = ``score >= 0.5``: most metrics are 0 or 1; the few graded ones (F1, METEOR, BLEU-like;
  one METEOR score is slightly negative) count as correct at half marks or more (the provenance says
  how many answers had a score strictly between 0 and 1);
- *answers*: the answers are long free text that cannot be compared across models, so a correct
  answer is the gold answer and an incorrect one 'wrong answer' (``envs.importers.correctness_key``);
- *tokens*: the recorded ``token_usage``; a failed call (``success`` false) is an incorrect answer
  with its recorded tokens;
- *prices*: the list prices; the importer checks tokens x prices against every record's
  ``inference_cost`` and stores the largest deviation in the provenance (``cost_check``);
- *group*: the dataset (``global_index`` without its number), for Mondrian calibration.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

from envs.cache.schema import CacheError, ModelInfo, ResponseCache
from envs.cache.values import group_problem, show, tokens_problem
from envs.importers import Side, correctness_key
from envs.importers.ladder import LADDER_PROTOCOL, build_ladder, jsonl_objects, order_rungs

REPO = "RouteWorks/RouterArena @4714a9a"
LICENSE = "Apache-2.0"
CORRECT_AT = 0.5


#: Longest Python-literal text parsed as an object (the files write some dicts as Python literals;
#: a ``token_usage`` is ~80 characters, an ``evaluation_result`` holds one answer). Python's parser
#: needs memory per nesting level, so ``"-" * 100000 + "1"`` was a MemoryError: longer text is
#: refused unparsed, and the parser's own limits are caught as bad input.
MAX_LITERAL_CHARS = 1 << 20


def _dict(v: Any, where: str) -> dict:
    if isinstance(v, dict):
        return v
    if isinstance(v, str):
        if len(v) > MAX_LITERAL_CHARS:
            raise CacheError(f"{where}: expected an object, got a text of {len(v)} characters (at most "
                             f"{MAX_LITERAL_CHARS} are parsed)")
        try:
            d = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            d = None  # not a literal, or nested past the parser's limits
        if isinstance(d, dict):
            return d
    raise CacheError(f"{where}: expected an object, got {str(v)[:60]!r}")


def _number(v: Any, where: str, signed: bool = False) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):  # (an integer of 400 digits overflows a float)
        raise CacheError(f"{where}: expected a number, got {show(v)}") from None
    if not math.isfinite(x) or (x < 0 and not signed):
        raise CacheError(f"{where}: expected a finite number{'' if signed else ' >= 0'}, got {show(v)}")
    return x


def _tokens(v: Any, where: str) -> float:
    """A token count: a number (the files write some as text) within the cache's bound (envs.cache.values)."""
    x = _number(v, where)
    problem = tokens_problem(x)
    if problem:
        raise CacheError(f"{where}: {problem}")
    return x


def _group(global_index: str) -> str:
    """The question's group: its dataset, ``global_index`` without its number (``AIME_112`` -> ``AIME``)."""
    return global_index.rsplit("_", 1)[0]


def _read_model(path: Path) -> tuple[str, dict[str, dict]]:
    rows: dict[str, dict] = {}
    model = None
    for i, d in jsonl_objects(path):
        where = f"{path}:{i}"
        if not isinstance(d, dict):
            raise CacheError(f"{where}: expected a JSON object")
        for k in ("global_index", "llm_selected", "token_usage", "evaluation_result"):
            if k not in d:
                raise CacheError(f"{where}: {k}: missing (not a RouterArena cached_results file)")
        m = str(d["llm_selected"])
        if model is not None and m != model:
            raise CacheError(f"{where}: llm_selected: {m!r}, but the file's earlier lines are {model!r}")
        model = m
        usage, ev = _dict(d["token_usage"], f"{where}: token_usage"), _dict(d["evaluation_result"], f"{where}: evaluation_result")
        qid = str(d["global_index"])
        problem = group_problem(_group(qid))  # before NumPy and the cache writers see it, named here
        if problem:
            raise CacheError(f"{where}: global_index: its dataset part is the question's group: {problem}")
        if qid in rows:
            raise CacheError(f"{where}: global_index: {qid!r} is given twice")
        rows[qid] = {"score": _number(ev.get("score"), f"{where}: evaluation_result.score", signed=True),
                     "gold": str(ev.get("ground_truth", "")),
                     "cost": _number(ev.get("inference_cost", 0.0), f"{where}: evaluation_result.inference_cost"),
                     "tokens_in": _tokens(usage.get("input_tokens"), f"{where}: token_usage.input_tokens"),
                     "tokens_out": _tokens(usage.get("output_tokens"), f"{where}: token_usage.output_tokens"),
                     "success": str(d.get("success", "True")).lower() == "true"}
    if model is None:
        raise CacheError(f"{path}: no lines")
    return model, rows


def load(src: Path) -> ResponseCache:
    """The ladder of every ``*.jsonl`` file in ``src`` (a cached_results folder), or of one file."""
    from envs.importers.pricing import PRICES

    files = sorted(p for p in src.glob("*.jsonl") if p.is_file()) if src.is_dir() else [src]
    if not files:
        raise CacheError(f"{src}: no *.jsonl files (expected RouterArena's cached_results)")
    runs = []
    for f in files:
        model, rows = _read_model(f)
        if model not in PRICES:
            raise CacheError(f"{f}: no list price for the model {model!r} in envs/importers/pricing.py")
        p = PRICES[model]
        runs.append((ModelInfo(model, p.price_in, p.price_out), rows, f))
    runs = [runs[i] for i in order_rungs([m for m, _, _ in runs])]
    ids = [q for q in runs[0][1] if all(q in r for _, r, _ in runs[1:])]
    if not ids:
        raise CacheError(f"{src}: no item is in every model's file")
    answers, gold, max_dev, graded, failed = [], [], 0.0, 0, 0
    for q in ids:
        sides = []
        for m, rows, _ in runs:
            r = rows[q]
            ok = r["success"] and r["score"] >= CORRECT_AT
            graded += 0.0 < r["score"] < 1.0 or r["score"] < 0.0
            failed += not r["success"]
            max_dev = max(max_dev, abs((r["tokens_in"] * m.price_in + r["tokens_out"] * m.price_out) / 1e6 - r["cost"]))
            sides.append(Side(correctness_key(ok), ok, r["tokens_in"], r["tokens_out"]))
        answers.append(sides)
        gold.append(runs[0][1][q]["gold"])
    prov = {
        "kind": "real", "source": f"{REPO}, cached_results/: " + ", ".join(f.name for _, _, f in runs),
        "license": LICENSE, "protocol": LADDER_PROTOCOL,
        "ladder": ", ".join(f"rung {t + 1} = {m.name}" for t, (m, _, _) in enumerate(runs)),
        "correct": f"evaluation_result.score >= {CORRECT_AT} and success; {graded} model answers had a graded "
                   f"score (not 0 or 1), {failed} calls failed",
        "prices": "envs/importers/pricing.py list prices",
        "cost_check": f"tokens x prices vs each record's inference_cost: largest deviation {max_dev:.3g} USD",
        "questions_dropped": len(set().union(*(r for _, r, _ in runs))) - len(ids),
    }
    groups = [_group(q) for q in ids]
    return build_ladder(name="routerarena", task="routerarena (78 benchmark datasets)", rungs=[m for m, _, _ in runs],
                        provenance=prov, question_ids=ids, gold=gold, answers=answers, groups=groups)
