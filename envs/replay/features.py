"""Observation features of the orchestration POMDP (arXiv 2511.11828, the observation o_t;
docs/environment.md).

The paper says only that o_t "includes the base model's context, the guide
model's judgment and uncertainty, the index of the current round, and
cumulative guide model token usage" (arXiv 2511.11828). The fixed-length vector below
is our choice. Every feature of round t uses only what is known when the
policy acts at round t: round t's base answer and guide judgment exist and
round t's cost is paid. No ``*_correct`` flag and no gold answer is ever read,
so the same code featurises raw rounds at serving time.

Features (``F = T + 15``), in order:

=========================  ==========================================================
name                       value at round t (0 on padding rounds)
=========================  ==========================================================
``round_1 .. round_T``     one-hot of the round index
``is_last_round``          1 if round t is the question's last existing round
``guide_verdict``          1 if the guide judged the base answer correct ("Yes")
``guide_uncertainty``      guide uncertainty in [0, 1]; NaN (not given) -> 0.5
``has_guide_uncertainty``  1 if the uncertainty was given
``base_confidence``        base confidence in [0, 1]; NaN -> 0.5
``has_base_confidence``    1 if the confidence was given
``base_guide_agree``       1 if base and guide answers have the same id
``base_repeats_prev``      1 if the base answer equals its round t-1 answer (0 at t=1)
``guide_repeats_prev``     1 if the guide answer equals its round t-1 answer (0 at t=1)
``distinct_answers``       distinct answer ids among rounds 1..t (base and guide) / 2T
``cum_guide_tokens_in``    log1p(sum of guide prompt tokens, rounds 1..t / 1000)
``cum_guide_tokens_out``   log1p(sum of guide completion tokens / 100)
``cum_base_tokens_in``     log1p(sum of base prompt tokens / 1000)
``cum_base_tokens_out``    log1p(sum of base completion tokens / 100)
``cum_cost_cents``         log1p(10 * API cost of rounds 1..t in cents)
=========================  ==========================================================

A guide-less cascade (``models.guide: null``) has no guide call: its guide arrays hold the
"no call" values (answer id -1, verdict False, tokens 0, uncertainty NaN), so the guide
features take their missing values: verdict 0, uncertainty 0.5 with ``has_guide_uncertainty`` 0
(the "not given" convention), agree 0, repeats 0 (id -1 is no answer, never a repeat),
``distinct_answers`` counts base answers only, guide token sums 0.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

#: Keys of ``raw`` read by :func:`build_features` (all ``[..., T]``).
RAW_KEYS = (
    "round_mask",
    "guide_verdict",
    "guide_uncertainty",
    "base_confidence",
    "base_answer",
    "guide_answer",
    "guide_tokens_in",
    "guide_tokens_out",
    "base_tokens_in",
    "base_tokens_out",
    "round_cost_cents",
)

#: Scales of the cumulative features (documented in the manifest of an exported router).
SCALES = {
    "cum_guide_tokens_in": 1000.0,
    "cum_guide_tokens_out": 100.0,
    "cum_base_tokens_in": 1000.0,
    "cum_base_tokens_out": 100.0,
    "cum_cost_cents": 0.1,
}

_TAIL = (
    "is_last_round",
    "guide_verdict",
    "guide_uncertainty",
    "has_guide_uncertainty",
    "base_confidence",
    "has_base_confidence",
    "base_guide_agree",
    "base_repeats_prev",
    "guide_repeats_prev",
    "distinct_answers",
    "cum_guide_tokens_in",
    "cum_guide_tokens_out",
    "cum_base_tokens_in",
    "cum_base_tokens_out",
    "cum_cost_cents",
)


def feature_names(T: int) -> tuple[str, ...]:
    """Names of the ``F = T + 15`` features, in the order of the last axis of :func:`build_features`."""
    return tuple(f"round_{t + 1}" for t in range(T)) + _TAIL


def n_features(T: int) -> int:
    return T + len(_TAIL)


def _next_exists(mask: jax.Array) -> jax.Array:
    """[..., T] bool: round t+1 exists."""
    return jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)


def _prev_equal(ids: jax.Array, mask: jax.Array) -> jax.Array:
    """[..., T] bool: id at t equals id at t-1 (both rounds exist); False at t = 0."""
    same = (ids[..., 1:] == ids[..., :-1]) & mask[..., 1:] & mask[..., :-1]
    return jnp.concatenate([jnp.zeros(ids.shape[:-1] + (1,), bool), same], axis=-1)  # T = 1 safe


def distinct_so_far(base_answer: jax.Array, guide_answer: jax.Array, mask: jax.Array) -> jax.Array:
    """[..., T] int32: distinct answer ids among base and guide answers of rounds 1..t (a cascade's
    guide slots hold id -1, no answer, and do not count)."""
    T = mask.shape[-1]
    ids = jnp.stack([base_answer, guide_answer], axis=-1).reshape(mask.shape[:-1] + (2 * T,))
    valid = jnp.repeat(mask, 2, axis=-1) & (ids >= 0)
    same = (ids[..., :, None] == ids[..., None, :]) & valid[..., None, :]
    earlier = jnp.tril(jnp.ones((2 * T, 2 * T), bool), k=-1)  # [k, j]: j < k
    new = valid & ~jnp.any(same & earlier, axis=-1)
    count = jnp.cumsum(new.astype(jnp.int32), axis=-1)
    return count[..., 1::2]  # after round t's guide slot


def build_features(raw: Mapping[str, Any], T: int) -> jax.Array:
    """Observation features ``[..., T, F]`` from raw per-round fields ``[..., T]`` (see module doc).

    ``raw`` holds :data:`RAW_KEYS` (NumPy or JAX arrays); extra keys are
    ignored, so a dict of cache arrays plus ``round_cost_cents`` works.
    Pure ``jnp``: jit- and vmap-able; padding rounds get all-zero features.
    """
    missing = [k for k in RAW_KEYS if k not in raw]
    if missing:
        raise KeyError(f"build_features: raw lacks {', '.join(missing)}")
    f32 = jnp.float32
    mask = jnp.asarray(raw["round_mask"], bool)
    if mask.shape[-1] != T:
        raise ValueError(f"build_features: round_mask has last axis {mask.shape[-1]}, expected T = {T}")

    def get(k: str) -> jax.Array:
        return jnp.asarray(raw[k], f32) * mask  # NaN-free for tokens/costs; padding -> 0

    m = mask.astype(f32)
    base_id = jnp.asarray(raw["base_answer"], jnp.int32)
    guide_id = jnp.asarray(raw["guide_answer"], jnp.int32)
    unc = jnp.asarray(raw["guide_uncertainty"], f32)
    conf = jnp.asarray(raw["base_confidence"], f32)
    has_unc = ~jnp.isnan(unc)
    has_conf = ~jnp.isnan(conf)

    onehot = jnp.broadcast_to(jnp.eye(T, dtype=f32), mask.shape + (T,))
    tail = [
        (mask & ~_next_exists(mask)).astype(f32),
        jnp.asarray(raw["guide_verdict"], bool).astype(f32),
        jnp.where(has_unc, unc, 0.5),
        has_unc.astype(f32),
        jnp.where(has_conf, conf, 0.5),
        has_conf.astype(f32),
        (base_id == guide_id).astype(f32),
        _prev_equal(base_id, mask).astype(f32),
        _prev_equal(guide_id, mask & (guide_id >= 0)).astype(f32),  # a cascade's -1 (no answer) never repeats
        distinct_so_far(base_id, guide_id, mask).astype(f32) / (2 * T),
        jnp.log1p(jnp.cumsum(get("guide_tokens_in"), -1) / SCALES["cum_guide_tokens_in"]),
        jnp.log1p(jnp.cumsum(get("guide_tokens_out"), -1) / SCALES["cum_guide_tokens_out"]),
        jnp.log1p(jnp.cumsum(get("base_tokens_in"), -1) / SCALES["cum_base_tokens_in"]),
        jnp.log1p(jnp.cumsum(get("base_tokens_out"), -1) / SCALES["cum_base_tokens_out"]),
        jnp.log1p(jnp.cumsum(get("round_cost_cents"), -1) / SCALES["cum_cost_cents"]),
    ]
    feats = jnp.concatenate([onehot, jnp.stack(tail, axis=-1)], axis=-1)
    return feats * m[..., None]


def available_actions(round_mask: Any, has_guide: bool = True) -> jax.Array:
    """bool ``[..., T, 3]``: (base, guide, next) allowed at round t.

    base and guide on every existing round; "next" only where round t+1 exists
    (so it is masked at a question's last round; our choice). Padding rounds:
    nothing is available (an episode never reaches them). A guide-less cascade
    (``has_guide`` False): "guide" never.
    """
    mask = jnp.asarray(round_mask, bool)
    return jnp.stack([mask, mask & has_guide, mask & _next_exists(mask)], axis=-1)
