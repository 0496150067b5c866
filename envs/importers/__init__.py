"""Importers of public cached-LLM-response datasets into a :class:`ResponseCache`.

docs/caches.md ("Real data: importers of public cached LLM responses") and
``tests/fixtures/SOURCES.md``. Each
importer reads one public format and returns a checksummed cache whose
manifest says ``provenance.kind = 'real'`` with the upstream repository,
commit, path and license, and which protocol the data follows (none of these
sources has the CCPO multi-round base/guide protocol; see each module).

Formats (``ccpo-jax data import --format NAME SRC --out PATH``):

- ``jsonl``: the human format (``envs.cache.jsonl.read_jsonl``);
- ``routellm-mmlu``, ``routellm-gsm8k``: RouteLLM's cached correctness
  (Mixtral-8x7B base, GPT-4-1106 guide), T = 1 (``envs.importers.routellm``);
- ``uala-hotpotqa``: UALA HotpotQA runs (Llama-2-70B base,
  gpt-3.5-turbo-instruct guide), T = 2 (``envs.importers.uala``); ``uala-ladder``: the same runs as a
  three-rung ladder with confidences (Llama CoT, gpt-3.5 CoT, gpt-3.5 ReAct), no guide;
- ``omnisbench``: OmnisBench results (gpt-5-nano base, claude-opus-5 guide),
  T = 1 (``envs.importers.omnisbench``); ``omnisbench-ladder``: the same runs as a two-rung ladder;
- ``routerarena``: RouterArena's cached_results, a ladder of its models (``envs.importers.routerarena``);
- ``per-model``: anyone's per-model result files, a ladder (``envs.importers.ladder``).

:mod:`envs.importers.pricing` holds the list prices that price their token
estimates (``ccpo_jax.collect`` uses them too).

Rules shared by the importers (documented in ``docs/caches.md``):

- *answer ids*: per question, normalised answer strings get ids in order of
  first appearance (round 1 base, round 1 guide, round 2 base, ...); when a
  source gives correctness but no comparable answer text, a correct answer is
  the text ``gold answer`` and an incorrect one ``wrong answer`` (see
  :func:`correctness_key`); every answer text goes through
  ``envs.cache.normalise.normalise_answer`` (the manifest's normalisation), so a
  cache written as JSONL and read back has the same ids;
- *guide verdict* of a cascade round = the guide's answer id equals the base's
  (the guide "agrees"), i.e. what a judge that outputs its own answer would say;
- *token estimate* where a source records none: ``ceil(chars / 4)``
  (:func:`envs.cache.tokens.estimate_tokens`, the one estimator).
"""
from __future__ import annotations

import csv
import dataclasses
import importlib
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from envs.cache.schema import CacheError, Manifest, ModelInfo, ResponseCache, empty_arrays, group_problem

#: Protocol string of every single-round pair-of-models import (SOURCES.md).
CASCADE_PROTOCOL = "single-round cascade (T = 1), not the CCPO multi-round protocol"
#: Answer texts standing for "the gold answer" / "some wrong answer" where a source gives
#: correctness only. Already in normalised form, so they survive a JSONL round trip.
GOLD_KEY = "gold answer"
WRONG_KEY = "wrong answer"


@dataclasses.dataclass(frozen=True)
class Importer:
    """A public-data format: ``load(src)`` reads ``src`` and returns a checksummed cache."""

    name: str
    description: str
    target: str  # "module:function", imported on first use (keeps ``envs.importers`` import cheap)

    def load(self, src: str | os.PathLike) -> ResponseCache:
        mod_name, fn_name = self.target.split(":")
        fn: Callable[[Path], ResponseCache] = getattr(importlib.import_module(mod_name), fn_name)
        src = Path(src)
        if not src.exists():
            raise CacheError(f"{src}: no such file or directory (format '{self.name}')")
        return fn(src)


IMPORTERS: dict[str, Importer] = {
    imp.name: imp
    for imp in (
        Importer(
            "routellm-mmlu",
            "RouteLLM MMLU correctness CSVs (folder of 57 or one CSV); Mixtral base, GPT-4 guide, T=1",
            "envs.importers.routellm:load_mmlu",
        ),
        Importer(
            "routellm-gsm8k",
            "RouteLLM gsm8k_responses.csv (or its folder); Mixtral base, GPT-4 guide, T=1",
            "envs.importers.routellm:load_gsm8k",
        ),
        Importer(
            "uala-hotpotqa",
            "UALA HotpotQA runs (the uala folder); Llama-2-70B base, gpt-3.5-turbo-instruct guide, T=2 (CoT, then ReAct)",
            "envs.importers.uala:load_hotpotqa",
        ),
        Importer(
            "omnisbench",
            "OmnisBench results JSON (or its folder, every results*.json); gpt-5-nano base, claude-opus-5 guide, T=1",
            "envs.importers.omnisbench:load",
        ),
        Importer(
            "omnisbench-ladder",
            "OmnisBench as a two-rung ladder, no guide: gpt-5-nano, then claude-opus-5 (their own answers), T=2",
            "envs.importers.omnisbench:load_ladder",
        ),
        Importer(
            "uala-ladder",
            "UALA HotpotQA runs as a three-rung ladder with confidences, no guide: Llama-2-70B CoT, "
            "gpt-3.5-turbo-instruct CoT, gpt-3.5-turbo-instruct ReAct, T=3",
            "envs.importers.uala:load_hotpotqa_ladder",
        ),
        Importer(
            "routerarena",
            "RouterArena cached_results (folder of <model>.jsonl or one file): a ladder of the models by price, no guide",
            "envs.importers.routerarena:load",
        ),
        Importer(
            "per-model",
            "a folder of per-model JSONL files (id, answer, correct, tokens_in, tokens_out, confidence?) and an "
            "optional ladder.json with prices and order: a ladder, no guide",
            "envs.importers.ladder:load_per_model",
        ),
    )
}


def import_cache(fmt: str, src: str | os.PathLike) -> ResponseCache:
    """Read ``src`` in format ``fmt`` ('jsonl' or a name in :data:`IMPORTERS`)."""
    if fmt == "jsonl":
        from envs.cache.jsonl import read_jsonl  # written by another module; imported lazily

        path = Path(src)
        if not path.exists():
            raise CacheError(f"{path}: no such file or directory (format 'jsonl')")
        return read_jsonl(path)
    if fmt not in IMPORTERS:
        raise CacheError(f"unknown format {fmt!r}; known formats: {', '.join(['jsonl', *IMPORTERS])}")
    return IMPORTERS[fmt].load(src)


# -- helpers shared by the importers -------------------------------------------


def correctness_key(correct: bool) -> str:
    """Answer key when only correctness is known: all correct answers share the gold key,
    all incorrect ones share one 'wrong' key (so two wrong answers count as agreeing)."""
    return GOLD_KEY if correct else WRONG_KEY


def number_key(num: str) -> str:
    """A number as an answer text that the SQuAD normalisation (which deletes '-' and '.')
    keeps distinct: '-3.5' -> 'minus 3 point 5'."""
    return " ".join(num.replace("-", " minus ").replace(".", " point ").split())


def parse_bool(cell: str, where: str) -> bool:
    """'True'/'False' (any case, also 1/0) -> bool; anything else is a :class:`CacheError`."""
    s = cell.strip().lower()
    if s in ("true", "1"):
        return True
    if s in ("false", "0"):
        return False
    raise CacheError(f"{where}: expected True or False, got {cell!r}")


def read_csv(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    """Rows of a CSV file with a header; every name in ``columns`` must be a column."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            if not header:
                raise CacheError(f"{path}: empty file (no CSV header)")
            missing = [c for c in columns if c not in header]
            if missing:
                raise CacheError(f"{path}: missing column(s) {', '.join(repr(c) for c in missing)} (header: {header})")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CacheError(f"{path}: cannot read CSV ({type(e).__name__}: {e})") from None
    if not rows:
        raise CacheError(f"{path}: no data rows")
    for i, r in enumerate(rows):
        if None in r or any(r[c] is None for c in columns):
            raise CacheError(f"{path}: row {i + 2}: wrong number of fields")
    return rows


class AnswerVocab:
    """Per-question answer ids: same key -> same id, ids in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, key: str) -> int:
        if key not in self.ids:
            self.ids[key] = len(self.ids)
        return self.ids[key]

    def texts(self, width: int) -> list[str]:
        out = [""] * width
        for k, i in self.ids.items():
            out[i] = k
        return out


@dataclasses.dataclass
class Side:
    """One model's response in one round (the importers' intermediate record)."""

    key: str  # answer text (normalised by build_cache), or GOLD_KEY / WRONG_KEY
    correct: bool
    tokens_in: float
    tokens_out: float
    score: float = float("nan")  # base: confidence; guide: uncertainty; both in [0, 1]


def build_cache(
    *,
    name: str,
    task: str,
    base: ModelInfo,
    guide: ModelInfo | None,
    provenance: dict,
    question_ids: Sequence[str],
    gold: Sequence[str],
    rounds: Sequence[Sequence[tuple[Side, Side | None]]],
    T: int,
    groups: Sequence[str] | None = None,
    base_ladder: Sequence[ModelInfo] = (),
) -> ResponseCache:
    """Dense arrays from per-question lists of (base, guide) rounds; verdict = same answer id.

    ``rounds[q]`` holds 1..T rounds of question q; answer keys are normalised with
    ``envs.cache.normalise.normalise_answer`` before ids are given. ``groups``: each question's group
    (MMLU subject, HotpotQA question type, ...; the optional ``group`` array). ``guide`` None: a
    guide-less cascade, whose rounds are ``(base, None)`` and whose guide arrays keep their "no call"
    values; ``base_ladder``: round t's base model (T of them). Returns the checksummed cache.
    """
    from envs.cache.normalise import NORMALISATION, normalise_answer

    Q = len(question_ids)
    a = empty_arrays(Q, T)
    texts = []
    for q, rs in enumerate(rounds):
        vocab = AnswerVocab()
        for t, (b, g) in enumerate(rs):
            a["round_mask"][q, t] = True
            bid = vocab(normalise_answer(b.key))
            a["base_answer"][q, t], a["base_correct"][q, t] = bid, b.correct
            a["base_tokens_in"][q, t], a["base_tokens_out"][q, t] = b.tokens_in, b.tokens_out
            a["base_confidence"][q, t] = b.score
            if g is None:  # a cascade: no guide call
                continue
            gid = vocab(normalise_answer(g.key))
            a["guide_answer"][q, t], a["guide_correct"][q, t] = gid, g.correct
            a["guide_tokens_in"][q, t], a["guide_tokens_out"][q, t] = g.tokens_in, g.tokens_out
            a["guide_uncertainty"][q, t] = g.score
            a["guide_verdict"][q, t] = bid == gid
        texts.append(vocab.texts(2 * T))
    a["question_ids"] = np.array(list(question_ids), dtype=str) if Q else a["question_ids"]
    a["gold"] = np.array(list(gold), dtype=str) if Q else a["gold"]
    a["answer_text"] = np.array(texts, dtype=str).reshape(Q, 2 * T) if Q else a["answer_text"]
    if groups is not None and Q:
        for qid, g in zip(question_ids, groups):  # before NumPy drops a trailing NUL ("a\x00" -> "a")
            problem = group_problem(g)
            if problem:
                raise CacheError(f"{name}: question {qid!r}: group: {problem}")
        a["group"] = np.array(list(groups), dtype=str)
    manifest = Manifest(
        name=name, task=task, T=T, base=base, guide=guide, provenance=provenance, normalisation=NORMALISATION,
        base_ladder=tuple(base_ladder),
    )
    return ResponseCache(manifest, a).with_checksum()
