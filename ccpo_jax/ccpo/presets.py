"""Named trainer configurations and ``field=value`` overrides (``reproduce --preset/--set``).

``paper`` is the CCPO paper's published setting (arXiv 2511.11828, section 5.1 and
Algorithm 1): batch 10, 1,500 iterations, delta 0.01, softmask eps 0.01, critic
learning rate 1e-3, and the importance-weighted constraint estimate J-bar of
Eq. 8. ``default`` is the configuration that learns on the oracle caches
(``envs.generators.oracle``); docs/results.md lists each deviation from ``paper`` with the
measurement that justifies it. Every other field of :class:`TrainConfig` is the
same in both.
"""
from __future__ import annotations

import dataclasses
import typing

from ccpo_jax.ccpo.config import TrainConfig
from ccpo_jax.errors import UserError
from ccpo_jax.runtime.options import INT32_MAX, float32_problem

PAPER = TrainConfig(estimator="jbar", batch_size=10, iterations=1500, chunk=100, constraint_z=0.0, pointwise_z=0.0,
                    cg_iters=10, backtrack_steps=15, ccpo_target="stochastic")
DEFAULT = TrainConfig()

#: Fields that change how a run is executed (progress/checkpoint granularity), not what it learns.
EXECUTION_FIELDS = ("chunk",)

PRESETS: dict[str, TrainConfig] = {"default": DEFAULT, "paper": PAPER}


def get_preset(name: str) -> TrainConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}") from None


def deviations(cfg: TrainConfig, reference: TrainConfig = PAPER) -> dict[str, tuple]:
    """Fields where ``cfg`` differs from ``reference``: name -> (reference value, cfg value)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in EXECUTION_FIELDS:
            continue
        a, b = getattr(reference, f.name), getattr(cfg, f.name)
        if a != b:
            out[f.name] = (a, b)
    return out


#: What each field's default changes from the paper's setting, in words (``{a}``: the paper's value, ``{b}``
#: this run's); the measurement behind each is in docs/results.md, "Presets: paper and default".
DEVIATION_WORDS = {
    "estimator": "exact expected cost and coverage over the cached answers instead of the paper's sampled "
                 "estimate (J-bar, Eq. 8)",
    "ccpo_target": "CCPO trains its calibrated answer set itself rather than the stochastic policy",
    "pointwise_z": "the pointwise CPO row keeps a {b}-standard-error coverage margin",
    "iterations": "{b} training iterations instead of {a}",
    "cg_iters": "a shorter trust-region step ({b} conjugate-gradient iterations instead of {a})",
    "backtrack_steps": "{b} line-search steps instead of {a}",
}
PRESETS_LINK = "docs/results.md#presets-paper-and-default"


def deviations_in_words(dev: dict[str, tuple]) -> str:
    """``dev`` (:func:`deviations`) as one sentence: what the run changes from the paper's setting."""
    g = lambda x: format(x, "g") if isinstance(x, (int, float)) and not isinstance(x, bool) else x  # noqa: E731
    keys = [k for k in DEVIATION_WORDS if k in dev] + sorted(k for k in dev if k not in DEVIATION_WORDS)
    return "; ".join(DEVIATION_WORDS[k].format(a=g(dev[k][0]), b=g(dev[k][1])) if k in DEVIATION_WORDS
                     else f"{k} {dev[k][0]} -> {dev[k][1]}" for k in keys)


def deviations_from_dict(d: dict, reference: TrainConfig = PAPER) -> dict[str, tuple]:
    """:func:`deviations` for a ``train_config`` as stored in results.json (lists for tuples; alpha,
    which comes from the setting, and unknown keys are ignored)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in EXECUTION_FIELDS or f.name == "alpha" or f.name not in d:
            continue
        a, b = getattr(reference, f.name), d[f.name]
        if (list(a) if isinstance(a, tuple) else a) != b:
            out[f.name] = (a, b)
    return out


def _parse(name: str, typ, text: str):
    text = text.strip()
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if typ is int:
        return _int32(int(text))
    if typ is float:
        v = float(text)
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("must be finite")
        why = float32_problem(v)  # the trainer computes in float32
        if why:
            raise ValueError(why)
        return v
    if typ is str:
        return text
    if typing.get_origin(typ) is tuple:
        return tuple(_int32(int(x)) for x in text.replace("x", ",").split(",") if x.strip())
    raise ValueError(f"unsupported field type {typ}")


def _int32(v: int) -> int:
    if abs(v) > INT32_MAX:  # JAX's integers are int32: a larger value overflows inside the trainer
        raise ValueError(f"{v} is past the int32 range (at most {INT32_MAX} in size), the trainer's integer type")
    return v


def field_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def apply_overrides(cfg: TrainConfig, items) -> TrainConfig:
    """``cfg`` with ``["field=value", ...]`` applied (types from the dataclass; validated).

    Raises UserError naming the item for an unknown field, a malformed value or a value
    that :meth:`TrainConfig.validate` refuses.
    """
    types = field_types()
    changes = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"{item!r}: expected FIELD=VALUE (fields: {', '.join(types)})")
        name, text = item.split("=", 1)
        name = name.strip().replace("-", "_")
        if name not in types:
            raise UserError(f"{item!r}: unknown trainer field {name!r} (fields: {', '.join(types)})")
        try:
            changes[name] = _parse(name, types[name], text)
        except ValueError as e:
            raise UserError(f"{item!r}: bad value for {name} ({e})") from None
    try:
        return dataclasses.replace(cfg, **changes).validate()
    except UserError as e:
        raise UserError(f"{', '.join(items)}: {e}") from None


def presets_table() -> str:
    """Every TrainConfig field with its value in each preset (``reproduce --list-presets``)."""
    names = list(PRESETS)
    rows = [("field", "type", *names)]
    for name, typ in field_types().items():
        t = getattr(typ, "__name__", str(typ))
        rows.append((name, t, *(str(getattr(PRESETS[p], name)) for p in names)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("Set any field with --set FIELD=VALUE (tuples as 64,64,64). alpha comes from the setting or --alpha.")
    return "\n".join(lines)
