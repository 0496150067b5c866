"""``data collect --ladder FILE``: the base ladder (and optionally the guide) in a JSON file.

The file is the repeated flags written down (docs/collect.md#a-ladder-of-base-models)::

    {"rungs": [{"url": "http://127.0.0.1:8001/v1", "model": "llama-3.2-1b", "price_in": 0, "price_out": 0},
               {"url": "http://127.0.0.1:8002/v1", "model": "llama-3.1-8b", "price_in": 0, "price_out": 0}],
     "guide": {"url": "https://api.openai.com/v1", "model": "gpt-4o", "price_in": 2.5, "price_out": 10}}

Each rung becomes ``--base URL,MODEL --base-price IN,OUT``, a guide entry ``--guide URL,MODEL
--guide-price IN,OUT`` and ``"guide": null`` ``--guide none`` (:meth:`LadderFile.flags`), so a
collection from the file is the one from those flags, byte for byte. Every entry gives its
prices (a price left out would make a hosted model free). A bad file is one error naming the
file and the field (``ladder.json: rungs[2]: missing field 'price_out'``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from envs.cache.values import price_problem

FIELDS = ("url", "model", "price_in", "price_out")


def price_text(x: float) -> str:
    """``x`` as the flags write it (``0.1``, ``10``), exactly: a ``--base-price`` of this text is ``x``."""
    t = f"{x:g}"
    return t if float(t) == x else repr(float(x))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model of the file: a rung or the guide."""

    url: str
    model: str
    price_in: float
    price_out: float

    def spec(self) -> str:
        return f"{self.url},{self.model}"

    def price(self) -> str:
        return f"{price_text(self.price_in)},{price_text(self.price_out)}"


@dataclasses.dataclass(frozen=True)
class LadderFile:
    rungs: tuple[Entry, ...]
    guide_given: bool  # the file has a "guide" key (an entry, or null: a guide-less cascade)
    guide: Entry | None

    def flags(self) -> dict[str, Any]:
        """The flags' values this file stands for (argparse's names)."""
        out: dict[str, Any] = {"base": [r.spec() for r in self.rungs], "base_price": [r.price() for r in self.rungs]}
        if self.guide_given:
            out["guide"] = self.guide.spec() if self.guide else "none"
            out["guide_price"] = self.guide.price() if self.guide else None
        return out


def _entry(obj: Any, where: str) -> Entry:
    from ccpo_jax.llm.wire import parse_endpoint

    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object {{url, model, price_in, price_out}}, got {type(obj).__name__}")
    for k in obj:
        if k not in FIELDS:
            raise UserError(f"{where}: unknown field {k!r} (the fields are {', '.join(FIELDS)})")
    for k in FIELDS:
        if k not in obj:
            raise UserError(f"{where}: missing field {k!r}")
    for k in ("url", "model"):
        if not isinstance(obj[k], str) or not obj[k].strip():
            raise UserError(f"{where}.{k}: expected a non-empty string, got {json.dumps(obj[k])}")
    if "," in obj["model"]:  # (URL,MODEL splits at the last comma: such a name has no flag spelling)
        raise UserError(f"{where}.model: {obj['model']!r}: a model name with a comma is not supported")
    for k in ("price_in", "price_out"):
        problem = price_problem(obj[k])  # the cache's own rule (envs.cache.values): the manifest must be readable
        if problem:
            raise UserError(f"{where}.{k}: {problem}")
    ep = parse_endpoint(f"{obj['url']},{obj['model']}", where)  # the URL rules of --base / --guide
    return Entry(ep.url, ep.model, float(obj["price_in"]), float(obj["price_out"]))


def read_ladder_file(path: str) -> LadderFile:
    """The file at ``path``, checked; a bad one is a :class:`UserError` (field ``ladder``) naming the
    file and the field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: cannot read ({getattr(e, 'strerror', None) or e})", field="ladder") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{p}:{e.lineno}: not valid JSON ({e.msg})", field="ladder") from None
    try:
        if not isinstance(data, dict):
            raise UserError(f"expected an object {{\"rungs\": [...], \"guide\": ...}}, got {type(data).__name__}")
        for k in data:
            if k not in ("rungs", "guide"):
                raise UserError(f"unknown field {k!r} (the fields are rungs, guide)")
        rungs = data.get("rungs")
        if not isinstance(rungs, list) or not rungs:
            raise UserError("rungs: expected a list of the base models, cheapest first, one per round" +
                            ("" if "rungs" in data else " (missing)"))
        entries = tuple(_entry(r, f"rungs[{i}]") for i, r in enumerate(rungs))
        guide = _entry(data["guide"], "guide") if data.get("guide") is not None else None
    except UserError as e:
        raise UserError(f"{p}: {e}", field="ladder") from None
    return LadderFile(entries, "guide" in data, guide)
