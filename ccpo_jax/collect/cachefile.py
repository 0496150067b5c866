"""``OUT``, the cache being collected: its manifest, the lines appended as questions finish, the final file.

The file is the human JSONL format (docs/caches.md): the manifest line, then
one line per finished question, appended and fsync-ed as each question
finishes (in the order they finish). When every question is done it is
rewritten once, atomically, in the questions file's order, so the final file
does not depend on which questions finished first, on concurrency, or on
interruptions. A ``--resume`` reads it back (:func:`read_existing`) and refuses
a file collected with other settings, naming the fields that differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ccpo_jax.collect.settings import CollectError, Settings
from ccpo_jax.llm.provenance import collector_version, today
from envs.cache.atomic import atomic_write_text, truncate_partial_line


def make_manifest(s: Settings, started: str) -> dict[str, Any]:
    def model(r: str) -> dict[str, Any]:
        return {"name": s.endpoint(r).model, "price_in": s.prices[r][0], "price_out": s.prices[r][1]}

    # a ladder: round t's base model (docs/caches.md#model-ladders)
    models = {"base": [model(s.base_role(t)) for t in range(s.T)] if s.ladder else model("base"),
              "guide": None if s.cascade else model("guide")}  # None: a guide-less cascade
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
            "endpoints": s.endpoints(),
            "prices": {r: s.price_sources[r] for r in s.roles()},
            "prompts_sha256": s.proto.prompt_hashes(),
            # the round protocol (ccpo_jax.llm.protocols); the gateway serves the artefact with it
            **({} if s.protocol == "paper" else {"round_protocol": s.protocol}),
            "requests": {
                "base_temperature": list(s.base_temperature),
                **s.guide_requests(),
                "max_tokens": s.max_tokens(),
                "seed": s.seed,
                "logprobs": s.logprobs,
                "top_logprobs": s.top_logprobs,
            },
            "correctness": rule,
            "measures": {**({} if s.cascade else {"guide_uncertainty": "1 - p(verdict token)"}),
                         "base_confidence": "exp(mean logprob) over the answer tokens"},
            "config_sha256": s.config_sha256(),
        },
    }


def manifest_line(man: dict) -> str:
    return json.dumps({"manifest": man}, ensure_ascii=False, allow_nan=False)


def read_existing(path: Path, s: Settings, repair: bool = True) -> tuple[dict, dict[str, str]]:
    """(stored manifest, {question id: its line}) of a cache being resumed; ``repair``: drop a
    last line cut by a kill (a dry run only reads)."""
    dropped = truncate_partial_line(path) if repair else False
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
        diffs = _diff(man, make_manifest(s, ""))
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


class CacheFile:
    """The cache being collected: ``done`` = {question id: its line}, appended as questions finish."""

    def __init__(self, path: Path, man: dict, done: dict[str, str]):
        self.path, self.man, self.done = path, man, done
        self._f = None

    @classmethod
    def create(cls, path: Path, s: Settings) -> "CacheFile":
        """A new file holding the manifest line only (atomically)."""
        man = make_manifest(s, today())
        atomic_write_text(path, manifest_line(man) + "\n")
        return cls(path, man, {})

    def __enter__(self) -> "CacheFile":
        self._f = open(self.path, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def append(self, qid: str, rec: dict) -> None:
        """Question ``qid``'s line, on disk (fsync-ed) when this returns; a line the cache reader
        would refuse (envs.cache.values: e.g. 10^12 tokens) is refused before it is written."""
        from envs.cache.jsonl import check_question

        check_question(self.man, rec, str(self.path))
        line = json.dumps(rec, ensure_ascii=False, allow_nan=False)
        self._f.write(line + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done[qid] = line

    def finish(self, order: list[str]) -> str:
        """Rewrite the file atomically with the questions in ``order`` and the finish date; its sha256."""
        man = dict(self.man)
        man["provenance"] = dict(man["provenance"])
        man["provenance"]["collected"] = {"started": man["provenance"]["collected"]["started"], "finished": today()}
        text = manifest_line(man) + "\n" + "".join(self.done[i] + "\n" for i in order if i in self.done)
        atomic_write_text(self.path, text)
        from envs.cache.jsonl import read_jsonl

        read_jsonl(self.path)  # the file must be a valid cache (a failure here is a collector bug)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
