"""RouteLLM's cached correctness on MMLU and GSM8K -> single-round cascade caches (T = 1).

Source (``tests/fixtures/SOURCES.md``): lm-sys/RouteLLM @0b64fdaf,
``routellm/evals/mmlu/responses/*.csv`` and
``routellm/evals/gsm8k/gsm8k_responses.csv`` (Apache-2.0). Each row is one
question with, per model, whether the model answered it correctly
(``True``/``False``); the GSM8K file also holds each model's response text.

The pair is read as a cascade with T = 1 (docs/caches.md, "Real data"): the cheap
model (Mixtral-8x7B-Instruct) is the base, the expensive one (GPT-4-1106) is
the guide whose answer is the "corrected answer". Rules where the data is silent:

- *answers* (MMLU): no answer text, so answer ids come from correctness:
  a correct answer gets the gold id, an incorrect one a single 'wrong' id.
  Two wrong answers therefore count as the same answer; the distinct-answer set
  size is a lower bound (MMLU has 3 wrong options per question).
- *answers* (GSM8K): a correct answer gets the gold id; an incorrect one is
  keyed by the final number of its response (after the last ``####`` if
  present, else the last number in the text; written 'minus 3 point 5' so that
  the SQuAD normalisation keeps numbers apart), so two wrong responses agree
  only when their final numbers are equal; a wrong response with no number gets
  its own id.
- *guide verdict* = the guide's answer id equals the base's (the guide would
  say "Yes"). On MMLU this is "both correct or both wrong".
- *tokens*: input = ceil(chars(prompt) / 4) for both models (the prompt column
  as recorded; any few-shot prefix RouteLLM added is not recorded and not
  counted). Output: MMLU 1 token (one answer letter); GSM8K
  ceil(chars(response) / 4).
- *prices*: ``envs.importers.pricing.PRICES`` (list prices, noted there with their source).
- no gold answer text is recorded (``gold`` = ''), no confidence or uncertainty
  (NaN), no cached EXIT or LLM-policy baselines.
"""
from __future__ import annotations

import re
from pathlib import Path

from envs.cache.schema import CacheError, ResponseCache
from envs.cache.tokens import estimate_tokens
from envs.importers import (
    CASCADE_PROTOCOL,
    GOLD_KEY,
    Side,
    build_cache,
    correctness_key,
    number_key,
    parse_bool,
    read_csv,
)
from envs.importers.pricing import model_info, price_sources

BASE = "mistralai/Mixtral-8x7B-Instruct-v0.1"
GUIDE = "gpt-4-1106-preview"
REPO = "lm-sys/RouteLLM @0b64fdaf"
LICENSE = "Apache-2.0"
GSM8K_FILE = "gsm8k_responses.csv"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _provenance(path: str, tokens: str, answers: str, n_files: int) -> dict:
    return {
        "kind": "real",
        "source": f"{REPO}, {path}",
        "license": LICENSE,
        "protocol": CASCADE_PROTOCOL,
        "base": f"{BASE} (cheap model)",
        "guide": f"{GUIDE} (expensive model; its answer is the guide's corrected answer)",
        "verdict": "guide verdict = guide answer id equals base answer id (agreement)",
        "answers": answers,
        "tokens": tokens,
        "prices": price_sources(BASE, GUIDE),
        "n_files": n_files,
    }


def load_mmlu(src: Path) -> ResponseCache:
    """``src``: the folder of ``mmlu_*.csv`` files (all of them, sorted by name) or one CSV.

    Question id ``<subject>/<row>`` (row = 0-based data row in the subject file); group = the subject.
    """
    if src.is_dir():
        files = sorted(p for p in src.glob("*.csv") if p.is_file())
        if not files:
            raise CacheError(f"{src}: no *.csv files (expected RouteLLM's mmlu_<subject>.csv files)")
    else:
        files = [src]
    ids, rounds, groups = [], [], []
    for path in files:
        subject = path.stem.removeprefix("mmlu_")
        for i, row in enumerate(read_csv(path, ["prompt", BASE, GUIDE])):
            where = f"{path}: row {i + 2}"
            b_ok = parse_bool(row[BASE], f"{where}, column '{BASE}'")
            g_ok = parse_bool(row[GUIDE], f"{where}, column '{GUIDE}'")
            n_in = estimate_tokens(row["prompt"])
            ids.append(f"{subject}/{i}")
            groups.append(subject)
            rounds.append([(Side(correctness_key(b_ok), b_ok, n_in, 1), Side(correctness_key(g_ok), g_ok, n_in, 1))])
    name = "routellm-mmlu" if len(files) > 1 else f"routellm-{files[0].stem.replace('_', '-')}"
    rel = "routellm/evals/mmlu/responses/*.csv" if len(files) > 1 else f"routellm/evals/mmlu/responses/{files[0].name}"
    prov = _provenance(
        rel,
        tokens="input = ceil(chars(prompt)/4) for both models (few-shot prefix, if any, not recorded); output = 1 (answer letter)",
        answers="no answer text: correct -> gold id, incorrect -> one shared 'wrong' id (set size is a lower bound)",
        n_files=len(files),
    )
    return build_cache(
        name=name,
        task="mmlu",
        base=model_info(BASE),
        guide=model_info(GUIDE),
        provenance=prov,
        question_ids=ids,
        gold=[""] * len(ids),
        rounds=rounds,
        T=1,
        groups=groups,
    )


def final_number(text: str) -> str | None:
    """GSM8K final answer of a response: the last number after the last '####' (or in the
    whole text when there is none), commas dropped, trailing '.0…' removed; None if no number."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    nums = _NUMBER.findall(tail)
    if not nums:
        return None
    s = nums[-1].replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s or "0"


def _gsm8k_key(correct: bool, response: str, role: str) -> str:
    if correct:
        return GOLD_KEY
    num = final_number(response)
    return number_key(num) if num is not None else f"no number ({role})"


def load_gsm8k(src: Path) -> ResponseCache:
    """``src``: ``gsm8k_responses.csv`` or the folder holding it. Question id ``gsm8k/<row>``; one group, ``gsm8k``."""
    path = src / GSM8K_FILE if src.is_dir() else src
    if not path.is_file():
        raise CacheError(f"{path}: no such file (expected RouteLLM's {GSM8K_FILE})")
    b_resp, g_resp = f"{BASE}_response", f"{GUIDE}_response"
    ids, rounds = [], []
    for i, row in enumerate(read_csv(path, ["prompt", BASE, GUIDE, b_resp, g_resp])):
        where = f"{path}: row {i + 2}"
        b_ok = parse_bool(row[BASE], f"{where}, column '{BASE}'")
        g_ok = parse_bool(row[GUIDE], f"{where}, column '{GUIDE}'")
        n_in = estimate_tokens(row["prompt"])
        ids.append(f"gsm8k/{i}")
        b = Side(_gsm8k_key(b_ok, row[b_resp], "base"), b_ok, n_in, estimate_tokens(row[b_resp]))
        g = Side(_gsm8k_key(g_ok, row[g_resp], "guide"), g_ok, n_in, estimate_tokens(row[g_resp]))
        rounds.append([(b, g)])
    prov = _provenance(
        "routellm/evals/gsm8k/gsm8k_responses.csv",
        tokens="input = ceil(chars(prompt)/4) for both models (few-shot prefix, if any, not recorded); "
        "output = ceil(chars(response)/4)",
        answers="correct -> gold id; incorrect -> final number of the response (after the last '####', else the "
        "last number), a response without a number gets its own id",
        n_files=1,
    )
    return build_cache(
        name="routellm-gsm8k",
        task="gsm8k",
        base=model_info(BASE),
        guide=model_info(GUIDE),
        provenance=prov,
        question_ids=ids,
        gold=[""] * len(ids),
        rounds=rounds,
        T=1,
        groups=["gsm8k"] * len(ids),
    )
