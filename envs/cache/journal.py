"""A gateway journal's lines (docs/gateway.md, docs/caches.md): which lines await feedback.

A journal is a human-format cache whose manifest has ``provenance.journal``;
:mod:`envs.cache.jsonl` skips its unlabelled lines (requests awaiting feedback) and a
last line cut by a kill.
"""
from __future__ import annotations

from typing import Any


def is_journal(manifest: Any) -> bool:
    """A gateway journal's manifest (``provenance.journal``): its unlabelled lines are skipped."""
    prov = manifest.get("provenance") if isinstance(manifest, dict) else None
    return isinstance(prov, dict) and isinstance(prov.get("journal"), dict)


def unlabelled(obj: dict) -> bool:
    """A journal line without outcome: no ``gold`` and no ``correct`` on any answer."""
    rounds = obj.get("rounds")
    if "gold" in obj or not isinstance(rounds, list):
        return False
    return not any(isinstance(r, dict) and isinstance(r.get(role), dict) and "correct" in r[role]
                   for r in rounds for role in ("base", "guide"))


def as_labelled(obj: dict) -> dict:
    """``obj`` with ``correct: false`` on every answer, so that the question checks apply to it."""
    out = dict(obj, rounds=[dict(r) for r in obj["rounds"]])
    for r in out["rounds"]:
        for role in ("base", "guide"):
            if isinstance(r.get(role), dict):
                r[role] = dict(r[role], correct=False)
    return out
