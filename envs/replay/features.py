"""Observation features of the orchestration POMDP (arXiv 2511.11828, the observation o_t;
docs/environment.md).

The paper says only that o_t "includes the base model's context, the guide
model's judgment and uncertainty, the index of the current round, and
cumulative guide model token usage" (arXiv 2511.11828). The fixed-length vector below
is our choice. Every feature of round t uses only what is known when the
policy acts at round t: round t's base answer and guide judgment exist and
round t's cost is paid. No ``*_correct`` flag and no gold answer is ever read,
so the same code featurises raw rounds at serving time.

Features (``F = T + 15``, plus one per laddered role on a model ladder), in order:

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
``base_rung_price``        a base ladder only: round t's base price / the ladder's top price
``guide_rung_price``       a guide ladder only: the same for the guide's rungs
=========================  ==========================================================

A model ladder (docs/caches.md "Model ladders") gets one feature per laddered role, after the
others, so one policy serves every rung: ``price_in + price_out`` of round t's model divided by the
largest such sum over that role's T rungs (:func:`rung_prices`), in [0, 1] (0 if every rung is
free), 0 on padding rounds. The rung's position is already the round one-hot (round t is rung t).
A one-model cache has neither feature: its ``F = T + 15`` and every value are unchanged.

A guide-less cascade (``models.guide: null``) has no guide call: its guide arrays hold the
"no call" values (answer id -1, verdict False, tokens 0, uncertainty NaN), so the guide
features take their missing values: verdict 0, uncertainty 0.5 with ``has_guide_uncertainty`` 0
(the "not given" convention), agree 0, repeats 0 (id -1 is no answer, never a repeat),
``distinct_answers`` counts base answers only, guide token sums 0.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


#: The roles a model ladder may price per round, in the order of their rung features.
LADDER_ROLES = ("base", "guide")


def rung_feature(role: str) -> str:
    """The name of ``role``'s rung-price feature (and of its raw key)."""
    return f"{role}_rung_price"


def ladder_roles(base: Any, guide: Any) -> tuple[str, ...]:
    """The roles whose models are a ladder: ``base`` / ``guide`` is one model (a ``ModelInfo`` or a
    manifest's model dict), None (a cascade's guide) or a ladder (a list or tuple, one per round)."""
    return tuple(r for r, m in zip(LADDER_ROLES, (base, guide)) if isinstance(m, (list, tuple)))


def rung_prices(rungs: Sequence[Any]) -> np.ndarray:
    """float32 ``[T]``: each rung's ``price_in + price_out`` over the largest such sum of the ladder
    (``rungs``: ModelInfo-like, one per round); all 0 if every rung is free. A blended price per
    token: what the rung costs relative to the ladder's top, whatever the token mix."""
    blended = np.asarray([float(m.price_in) + float(m.price_out) for m in rungs], np.float64)
    top = blended.max(initial=0.0)
    return (blended / top if top > 0 else np.zeros_like(blended)).astype(np.float32)


def ladder_raw(base: Any, guide: Any, roles: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The raw ``[T]`` rung-price arrays of a ladder's roles (``{}`` for one-model caches), for
    :func:`build_features`; ``base`` / ``guide``: a ``ModelInfo`` or a tuple of T (``Manifest.models_of``).
    ``roles``: only these (default: every laddered role)."""
    return {rung_feature(r): rung_prices(m) for r, m in zip(LADDER_ROLES, (base, guide))
            if r in ladder_roles(base, guide) and (roles is None or r in roles)}


def feature_names(T: int, ladder: Sequence[str] = ()) -> tuple[str, ...]:
    """Names of the ``F`` features, in the order of the last axis of :func:`build_features`:
    ``T + 15``, plus one per laddered role of ``ladder`` (:func:`ladder_roles`)."""
    return tuple(f"round_{t + 1}" for t in range(T)) + _TAIL + tuple(rung_feature(r) for r in _roles(ladder))


def n_features(T: int, ladder: Sequence[str] = ()) -> int:
    return T + len(_TAIL) + len(_roles(ladder))


def _roles(ladder: Sequence[str]) -> tuple[str, ...]:
    bad = [r for r in ladder if r not in LADDER_ROLES]
    if bad:
        raise ValueError(f"ladder roles must be among {LADDER_ROLES}, got {bad}")
    return tuple(r for r in LADDER_ROLES if r in ladder)  # one order whatever the caller's


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


def build_features(raw: Mapping[str, Any], T: int, ladder: Sequence[str] = ()) -> jax.Array:
    """Observation features ``[..., T, F]`` from raw per-round fields ``[..., T]`` (see module doc).

    ``raw`` holds :data:`RAW_KEYS` (NumPy or JAX arrays); extra keys are
    ignored, so a dict of cache arrays plus ``round_cost_cents`` works. ``ladder``: the laddered
    roles (:func:`ladder_roles`); ``raw`` then holds each one's ``<role>_rung_price`` (``[T]`` or
    ``[..., T]``, :func:`ladder_raw`). Pure ``jnp``: jit- and vmap-able (``ladder`` static);
    padding rounds get all-zero features.
    """
    roles = _roles(ladder)
    missing = [k for k in RAW_KEYS + tuple(rung_feature(r) for r in roles) if k not in raw]
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
    ] + [jnp.broadcast_to(jnp.asarray(raw[rung_feature(r)], f32), mask.shape) * m for r in roles]
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
