"""A guide-less cascade made from any cache (docs/caches.md "Guide-less cascades").

:func:`as_cascade` drops the guide: its arrays take their "no call" values
(:data:`envs.cache.values.NO_GUIDE`, uncertainty NaN), the answers are renumbered
in order of first appearance among the base answers alone (the numbering the
JSONL reader gives the cascade, so a round trip keeps the checksum), the cached
LLM-policy columns go (they chose among base, guide and next), and the base may
become a ladder of T models. The cached EXIT columns stay: they are runs of
other systems, priced in the cache.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from envs.cache.schema import Manifest, ModelInfo, ResponseCache
from envs.cache.values import NO_GUIDE


def as_cascade(cache: ResponseCache, base_ladder: Sequence[ModelInfo] = ()) -> ResponseCache:
    """``cache`` without its guide (``models.guide: null``), with ``base_ladder`` (T models or none)."""
    a = {k: np.array(v, copy=True) for k, v in cache.arrays.items()}
    Q, T = a["round_mask"].shape
    for k, v in NO_GUIDE.items():
        a[k] = np.full((Q, T), v, a[k].dtype)
    a["guide_uncertainty"] = np.full((Q, T), np.nan, np.float32)
    texts = [[""] * (2 * T) for _ in range(Q)]
    for q in range(Q):
        ids: dict[int, int] = {}
        for t in range(T):
            old = int(a["base_answer"][q, t])
            if old < 0:
                continue
            new = ids.setdefault(old, len(ids))
            texts[q][new] = str(cache.arrays["answer_text"][q, old])
            a["base_answer"][q, t] = new
    a["answer_text"] = np.array(texts, dtype=str).reshape(Q, 2 * T)
    a["llm_policy_actions"] = np.zeros((Q, 0, T), np.int32)
    man: Manifest = dataclasses.replace(cache.manifest, guide=None, guide_ladder=(), llm_policy_models=(),
                                        base_ladder=tuple(base_ladder),
                                        base=base_ladder[0] if base_ladder else cache.manifest.base)
    return ResponseCache(man, a).with_checksum()
