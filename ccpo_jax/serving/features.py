"""Featurisation glue: raw rounds (as in the human JSONL format) -> the policy's observation.

The observation is built by :func:`envs.replay.features.build_features`, the very
function that featurises the response cache for training, so a serving layer
never re-implements the features (docs/environment.md, docs/export.md). This module only turns a list
of per-round dicts into the ``[B, T]`` raw arrays that function reads:

* answers are normalised with :func:`envs.cache.normalise.normalise_answer` and
  numbered per request in order of first appearance (round 0 base, round 0
  guide, round 1 base, ...), as the JSONL reader numbers them; the features
  use only equality of ids, so any consistent numbering gives the same vector;
* a missing or null ``confidence`` / ``uncertainty`` is NaN ("not given");
* the round's cost in cents is ``envs.cache.schema.round_cost_cents_of`` (``ResponseCache.round_cost_cents``) of the
  manifest's prices (the same code, called on these arrays);
* ``can_continue`` says whether another round may still run after the last
  given one (default: fewer than T rounds so far). It sets the
  ``is_last_round`` feature and the availability of "next", exactly as the
  cache's ``round_mask`` does for a question whose chain ends there.

Fields that only training reads (``correct``, ``gold``) are ignored if present.

A guide-less cascade's router (``models.guide: null``): rounds have no ``guide``
object (one is an error naming ``rounds[t].guide``); the guide values are the
cache's "no call" values (envs.cache.values.NO_GUIDE, uncertainty NaN) and
"guide" is never available.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.serving.artifact import RouterInputError
from envs.cache.schema import round_cost_cents_of
from envs.replay.features import available_actions, build_features, ladder_raw
from envs.cache.values import CASCADE_NO_GUIDE, NO_GUIDE_ROUND, json_type_name
from envs.cache.normalise import normalise_answer

#: Largest token count accepted for one call (the JSONL reader's bound).
MAX_TOKENS = 1e7

_FLOAT_KEYS = ("guide_uncertainty", "base_confidence", "guide_tokens_in", "guide_tokens_out",
               "base_tokens_in", "base_tokens_out")


_type = json_type_name  # the same JSON type names as the cache reader's messages


def _number(obj: Mapping, key: str, ctx: str, lo: float, hi: float, optional: bool) -> float:
    if key not in obj or obj[key] is None:
        if optional:
            return math.nan
        raise RouterInputError(f"{ctx}.{key}: missing (a number in [{lo:g}, {hi:g}])")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RouterInputError(f"{ctx}.{key}: expected a number, got {_type(v)}")
    try:
        v = float(v)
    except OverflowError:  # a huge JSON integer
        v = math.inf
    if not math.isfinite(v) or not lo <= v <= hi:
        raise RouterInputError(f"{ctx}.{key}: expected a number in [{lo:g}, {hi:g}], got {v!r}")
    return v


def _object(obj: Mapping, key: str, ctx: str) -> Mapping:
    v = obj.get(key) if isinstance(obj, Mapping) else None
    if not isinstance(v, Mapping):
        raise RouterInputError(f"{ctx}.{key}: expected an object, got {_type(v) if key in obj else 'nothing'}")
    return v


def parse_request(rounds: Any, can_continue: Any, T: int, ctx: str,
                  has_guide: bool = True) -> tuple[dict[str, list], list[dict], bool]:
    """Validate one request's rounds: ``(per-round raw values, answer texts per round, can_continue)``.

    ``ctx`` prefixes every error message (e.g. ``rounds.jsonl:3`` or ``batch[2]``). ``has_guide``
    False: a cascade's rounds, with no ``guide`` object.
    """
    if not isinstance(rounds, list):
        raise RouterInputError(f"{ctx}.rounds: expected an array of rounds, got {_type(rounds)}")
    n = len(rounds)
    if not 1 <= n <= T:
        raise RouterInputError(f"{ctx}.rounds: the router takes 1 to T = {T} rounds so far, got {n}")
    if can_continue is None:
        can_continue = n < T
    elif not isinstance(can_continue, bool):
        raise RouterInputError(f"{ctx}.can_continue: expected true or false, got {_type(can_continue)}")
    elif can_continue and n >= T:
        raise RouterInputError(f"{ctx}.can_continue: true, but {n} rounds already reach T = {T}")
    vals: dict[str, list] = {k: [] for k in _FLOAT_KEYS + ("guide_verdict", "base_answer", "guide_answer")}
    texts: list[dict] = []
    ids: dict[str, int] = {}
    for t, rnd in enumerate(rounds):
        rctx = f"{ctx}.rounds[{t}]"
        if not isinstance(rnd, Mapping):
            raise RouterInputError(f"{rctx}: expected an object, got {_type(rnd)}")
        shown = {}
        if not has_guide:
            if "guide" in rnd:
                raise RouterInputError(f"{rctx}.guide: {CASCADE_NO_GUIDE} (the router's cache)")
            for k, v in NO_GUIDE_ROUND.items():
                if k != "guide_correct":  # a label: the featuriser never reads it
                    vals[k].append(v)
        for role in ("base", "guide") if has_guide else ("base",):
            r = _object(rnd, role, rctx)
            c = f"{rctx}.{role}"
            ans = r.get("answer")
            if not isinstance(ans, str):
                raise RouterInputError(f"{c}.answer: expected a string, got {_type(ans) if 'answer' in r else 'nothing'}")
            norm = normalise_answer(ans)
            vals[f"{role}_answer"].append(ids.setdefault(norm, len(ids)))
            shown[role] = ans
            vals[f"{role}_tokens_in"].append(_number(r, "tokens_in", c, 0.0, MAX_TOKENS, optional=False))
            vals[f"{role}_tokens_out"].append(_number(r, "tokens_out", c, 0.0, MAX_TOKENS, optional=False))
            if role == "base":
                vals["base_confidence"].append(_number(r, "confidence", c, 0.0, 1.0, optional=True))
            else:
                v = r.get("verdict")
                if not isinstance(v, bool):
                    raise RouterInputError(f"{c}.verdict: expected true or false, got {_type(v) if 'verdict' in r else 'nothing'}")
                vals["guide_verdict"].append(v)
                vals["guide_uncertainty"].append(_number(r, "uncertainty", c, 0.0, 1.0, optional=True))
        texts.append(shown)
    return vals, texts, bool(can_continue)


def raw_arrays(parsed: Sequence[tuple[dict[str, list], list, bool]], T: int,
               base: Any, guide: Any, ladder: Sequence[str] = ()) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``[B, T]`` raw arrays (:data:`envs.replay.features.RAW_KEYS`) and the 0-based last round ``[B]``.

    A request that may continue gets one placeholder round after its last one
    (zeros, id -1), so ``round_mask`` says "round t+1 exists", as in the cache;
    no feature of round t reads round t+1's values. ``base``, ``guide``: a ``ModelInfo``, or a
    ladder of T (round t's model). ``ladder``: the roles whose rung prices the router's features
    hold (``Router.ladder``; none for a version-1 artefact), from the same
    :func:`envs.replay.features.ladder_raw` as the replay env's.
    """
    B = len(parsed)
    a = {
        "round_mask": np.zeros((B, T), bool),
        "guide_verdict": np.zeros((B, T), bool),
        "base_answer": np.full((B, T), -1, np.int32),
        "guide_answer": np.full((B, T), -1, np.int32),
    }
    for k in _FLOAT_KEYS:
        a[k] = np.zeros((B, T), np.float32)
    a["guide_uncertainty"][:] = np.nan
    a["base_confidence"][:] = np.nan
    last = np.zeros((B,), np.int32)
    for i, (vals, _, cont) in enumerate(parsed):
        n = len(vals["guide_verdict"])
        last[i] = n - 1
        a["round_mask"][i, : n + int(cont)] = True
        for k, v in vals.items():
            a[k][i, :n] = v
    # The cache's own cost formula, on these arrays and the manifest's (per-round) prices.
    a["round_cost_cents"] = round_cost_cents_of(a, base, guide)
    for k, v in ladder_raw(base, guide, ladder).items():
        a[k] = np.broadcast_to(v, (B, T)).copy()  # [B, T]: padded along the batch as the rest
    return a, last


def _obs_at(raw: dict, last: jax.Array, T: int, has_guide: bool, ladder: tuple[str, ...]):
    obs = build_features(raw, T, ladder)  # [B, T, F]
    avail = available_actions(raw["round_mask"], has_guide)  # [B, T, 3]
    rows = jnp.arange(last.shape[0])
    return obs[rows, last], avail[rows, last]


_obs_at_jit = jax.jit(_obs_at, static_argnums=(2, 3, 4))


def bucket(n: int) -> int:
    """Padded batch size: the next power of two (one compile per bucket, not per size)."""
    return 1 << max(0, int(n - 1).bit_length())


def observe(raw: dict[str, np.ndarray], last: np.ndarray, T: int,
            has_guide: bool = True, ladder: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(obs ``[B, F]`` float32, available ``[B, 3]`` bool) at each request's last round (``has_guide``
    False: a cascade, "guide" never available; ``ladder``: the roles with rung-price features)."""
    B = last.shape[0]
    P = bucket(B)
    pad = {k: np.concatenate([v, np.zeros((P - B, T), v.dtype)]) for k, v in raw.items()}
    obs, avail = _obs_at_jit(pad, np.concatenate([last, np.zeros(P - B, np.int32)]), T, bool(has_guide),
                             tuple(ladder))
    return np.asarray(obs)[:B], np.asarray(avail)[:B]
