"""List prices (USD per million tokens) used by the importers of public data.

docs/caches.md: a cache stores each model's price per million input and
output tokens; ``ResponseCache.round_cost_cents`` turns tokens into cents.
Most public datasets (RouteLLM, UALA) record no cost, so the importers price
their token estimates with this table. Each entry names where the price was
read and when; prices change, so treat the cents of a real-data cache as an
estimate at these prices, not as what the original runs cost.

OmnisBench ships its own dated pricing YAML; its importer reads that file and
does not use this table.
"""
from __future__ import annotations

import dataclasses

from envs.cache.schema import CacheError, ModelInfo


@dataclasses.dataclass(frozen=True)
class Price:
    """A list price in USD per million tokens, with where and when it was read."""

    price_in: float
    price_out: float
    source: str


#: Model name (as the dataset spells it) -> list price. Each ``source`` says where the
#: number comes from; none is re-checked at import time.
PRICES: dict[str, Price] = {
    "gpt-4-1106-preview": Price(
        10.00, 30.00, "OpenAI list price of GPT-4 Turbo (gpt-4-1106-preview) as stated in the project brief; not re-read online"
    ),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": Price(
        0.30, 0.30, "OpenRouter model page mistralai/mixtral-8x7b-instruct (hosted list price; stored copy, page undated), read 2026-11-29"
    ),
    "gpt-4o": Price(2.50, 10.00, "OpenAI list price of gpt-4o (arXiv 2511.11828 states no prices; our choice); not re-read online"),
    "gpt-3.5-turbo-instruct": Price(
        1.50, 2.00, "OpenAI list price of gpt-3.5-turbo-instruct as stated in the project brief; not re-read online"
    ),
    # RouterArena's models: these list prices reproduce every record's recorded inference_cost
    # (tokens x price; the routerarena importer checks it and stores the largest deviation).
    "gemini-2.0-flash-001": Price(
        0.10, 0.40, "Google list price of gemini-2.0-flash-001; reproduces RouterArena's cached inference_cost (checked at import)"
    ),
    "claude-3-haiku-20240307": Price(
        0.25, 1.25, "Anthropic list price of claude-3-haiku-20240307; reproduces RouterArena's cached inference_cost (checked at import)"
    ),
    "gpt-4o-mini": Price(0.15, 0.60, "OpenAI list price of gpt-4o-mini; not re-read online"),
    "meta-llama/Llama-2-70b-hf": Price(
        0.64, 0.80, "DeepInfra model page meta-llama/Llama-2-70b-chat-hf (hosted list price of the chat variant; stored copy, page undated), read 2026-11-29"
    ),
}


def model_info(name: str) -> ModelInfo:
    """The :class:`ModelInfo` of ``name`` at its list price in :data:`PRICES`."""
    if name not in PRICES:
        raise CacheError(f"no list price for model {name!r} in envs/importers/pricing.py (known: {', '.join(sorted(PRICES))})")
    p = PRICES[name]
    return ModelInfo(name, p.price_in, p.price_out)


def price_sources(*names: str) -> dict[str, str]:
    """``{model: 'in $X / out $Y per M tokens: <source>'}`` for a manifest's provenance."""
    out = {}
    for n in names:
        p = PRICES[n]
        out[n] = f"in ${p.price_in} / out ${p.price_out} per M tokens: {p.source}"
    return out


def yaml_error_text(e: Exception) -> str:
    """A PyYAML error as one line, ``line L, column C: not valid YAML (PROBLEM)`` (its own text spans
    three or more lines: the context, the problem and a quoted excerpt of the file)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}not valid YAML ({problem})"
