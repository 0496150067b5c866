"""A command's options as one typed dataclass: one field per option, everything else derived.

A command's run configuration is a frozen dataclass whose fields are declared with
:func:`option`. From the fields come

* the command line: :func:`add_flags` adds one argparse flag per field, and :func:`given`
  turns the parsed flags back into the keyword arguments the user set;
* validation and defaults: :func:`resolve` (called by the dataclass's ``__post_init__``)
  runs each field's ``check`` in field order, so a field's default may depend on an earlier
  field (``alpha`` on ``setting``), and a dataclass built directly is checked too;
* error messages: :func:`flag_names` maps each field to its flag, for
  :meth:`ccpo_jax.errors.UserError.for_cli` (library messages name the field);
* the saved configuration: :func:`saved` (``run.json``), :func:`from_saved` (``--resume``)
  and :func:`resume_mismatch` (an option given with ``--resume`` must equal the saved one);
* the documentation: :func:`markdown` (the option list of the command's docs page, which
  ``tests/test_docs.py`` compares with the page).

Adding an option is adding one field.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ccpo_jax.errors import UserError

#: ``check(name, value, config) -> resolved value``: raises UserError(field=name) for a bad
#: value; ``value`` is None when the user left the option out (the check picks the default).
#: ``config`` holds the fields before this one, already resolved.
Check = Callable[[str, Any, Any], Any]


class _Unset:
    """The value of an :class:`Option` attribute left unset (None is a value)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field of a run configuration is set, checked, saved and documented."""

    flag: str | None  # "--splits", or "RUN_DIR" (a positional argument); None: set from Python only (or derived)
    help: str
    default_doc: str | None = None  # what the default is, in words (None: the field's default)
    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # argparse's converter of the flag's text
    choices: tuple[str, ...] | None = None  # argparse refuses other values
    repeat: bool = False  # the flag may be given several times; the field is a tuple
    switch: Any = UNSET  # a flag without a value that sets the field to this value
    saved: bool = True  # in run.json: resuming takes it from there; given again, it must be equal
    derived: bool = False  # not an input: ``check`` computes it (from the fields before it)
    check: Check | None = None
    dump: Callable[[Any], Any] | None = None  # the JSON form in run.json (default: tuples -> lists)
    load: Callable[[Any], Any] | None = None  # back from JSON (default: lists -> tuples)
    unset_means: Callable[[Any], Any] | None = None  # what a saved None stands for (resume checks)
    if_missing: Any = UNSET  # the value of a saved run.json that predates the field
    required: bool = False  # the command line must give the flag


def option(flag: str | None, *, help: str, default: Any = None, **kw: Any) -> Any:
    """A dataclass field that is an option (see :class:`Option` for ``kw``)."""
    return dataclasses.field(default=default, metadata={"option": Option(flag, help=help, **kw)})


def _options(cls_or_obj: Any) -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls_or_obj) if "option" in f.metadata]


def resolve(cfg: Any) -> None:
    """Check every field of ``cfg`` in order and store its resolved value (``__post_init__``)."""
    for f, opt in _options(cfg):
        v = getattr(cfg, f.name)
        if v is None and f.default is not None and not opt.derived:
            v = f.default
        if opt.repeat and v is not None:
            v = (v,) if isinstance(v, str) else tuple(v)
        if opt.check is not None:
            v = opt.check(f.name, v, cfg)
        object.__setattr__(cfg, f.name, v)


# -- the command line -------------------------------------------------------------------

def _help(f: dataclasses.Field, opt: Option) -> str:
    default = opt.default_doc if opt.default_doc is not None else (
        None if f.default in (None, ()) or opt.switch is not UNSET else str(f.default))
    return opt.help + (f" (default: {default})" if default else "")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              only: Collection[str] | None = None) -> None:
    """One flag per field of ``cls`` that has one (of the fields named in ``only``, when given: a
    --help section, ``parser`` being an argument group); an unset flag parses to None."""
    for f, opt in _options(cls):
        if opt.flag is None or (only is not None and f.name not in only):
            continue
        if not opt.flag.startswith("-"):  # a positional argument: its flag is its metavar
            parser.add_argument(f.name, metavar=opt.flag, type=opt.type, help=_help(f, opt))
            continue
        kw: dict[str, Any] = dict(dest=f.name, default=None, help=_help(f, opt))
        if opt.required:
            kw["required"] = True
        if opt.switch is not UNSET:
            kw.update(action="store_const", const=opt.switch)
        else:
            kw.update(metavar=opt.metavar, type=opt.type, choices=opt.choices)
            if opt.repeat:
                kw["action"] = "append"
        parser.add_argument(opt.flag, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields the user set on the command line (flags left out are not passed)."""
    return {f.name: getattr(args, f.name) for f, opt in _options(cls)
            if opt.flag is not None and getattr(args, f.name, None) is not None}


def flag_names(cls: type) -> dict[str, str]:
    """Field -> flag, for :meth:`ccpo_jax.errors.UserError.for_cli`."""
    return {f.name: opt.flag for f, opt in _options(cls) if opt.flag is not None}


def inputs(cls: type) -> tuple[str, ...]:
    """The fields a caller may set (every field but the derived ones)."""
    return tuple(f.name for f, opt in _options(cls) if not opt.derived)


# -- saved configuration (run.json) and resume ----------------------------------------

def _dump(opt: Option, v: Any) -> Any:
    if opt.dump is not None:
        return opt.dump(v)
    return list(v) if isinstance(v, tuple) else v


def saved(cfg: Any) -> dict[str, Any]:
    """The saved fields of ``cfg`` as JSON values, in field order."""
    return {f.name: _dump(opt, getattr(cfg, f.name)) for f, opt in _options(cfg) if opt.saved}


def from_saved(cls: type, d: Mapping[str, Any], **rest: Any) -> Any:
    """The configuration saved as ``d`` (:func:`saved`), with the unsaved fields from ``rest``."""
    kw = {}
    for f, opt in _options(cls):
        if not opt.saved:
            continue
        if f.name in d:
            v = d[f.name]
            kw[f.name] = opt.load(v) if opt.load is not None else (tuple(v) if isinstance(v, list) else v)
        elif opt.if_missing is not UNSET:
            kw[f.name] = opt.if_missing
        else:
            raise KeyError(f.name)
    return cls(**kw, **rest)


def resume_mismatch(saved_cfg: Any, given_values: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first saved field whose given value (None = not given) differs from ``saved_cfg``'s:
    (name, saved value, given value resolved), or None when all agree."""
    for f, opt in _options(saved_cfg):
        v = given_values.get(f.name)
        if v is None or not opt.saved:
            continue
        if opt.repeat:
            v = (v,) if isinstance(v, str) else tuple(v)
        new = opt.check(f.name, v, saved_cfg) if opt.check is not None else v
        old = getattr(saved_cfg, f.name)
        if old is None and opt.unset_means is not None:
            old = opt.unset_means(saved_cfg)
        if _dump(opt, new) != _dump(opt, old):
            return f.name, old, new
    return None


# -- documentation ----------------------------------------------------------------------

def markdown(cls: type) -> str:
    """The option list of a docs page: one bullet per flag, ``--flag METAVAR`` (field): help (default)."""
    lines = []
    for f, opt in _options(cls):
        if opt.flag is None:
            continue
        value = "" if opt.switch is not UNSET or not opt.flag.startswith("-") else " " + (
            "|".join(opt.choices) if opt.choices else (opt.metavar or f.name.upper()))
        text = _help(f, opt).replace("%%", "%")  # argparse's escape of a percent sign
        lines.append(f"- `{opt.flag}{value}` (`{f.name}`){' (repeatable)' if opt.repeat else ''}: {text}")
    return "\n".join(lines) + "\n"


#: The largest int32: every integer option ends up in an int32 array or argument of the trainer
#: (JAX's default integer type), where a larger value overflows.
INT32_MAX = 2**31 - 1
#: The largest finite float32: every real option reaches the trainer as float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_int(what: str, lo: int, hi: int = INT32_MAX) -> Check:
    """A check: an integer in [``lo``, ``hi``] (``what`` names it in the message); ``hi`` defaults to
    the largest int32, so that a value is refused here, before any training, not by JAX after it."""
    def check(name: str, v: Any, cfg: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise UserError(f"{name}: {what} must be an integer >= {lo}, got {v!r}", field=name)
        if v > hi:
            why = " (the largest int32, the trainer's integer type)" if hi == INT32_MAX else ""
            raise UserError(f"{name}: {what} must be at most {hi}{why}, got {v!r}", field=name)
        return int(v)
    return check


def as_float32(x: float) -> float:
    """``x`` as the trainer sees it: rounded to float32 (inf past :data:`FLOAT32_MAX`, 0 below its
    smallest subnormal), as a Python float, without numpy's overflow warning."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


#: The smallest normal float32: XLA flushes smaller (subnormal) values to 0 in compiled code.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def float32_problem(x: float) -> str | None:
    """Why the finite float ``x`` does not survive the trainer's float32, or None: it overflows to
    infinity, or it is nonzero and below the smallest normal float32, so the trainer sees 0."""
    y = as_float32(x)
    if not np.isfinite(y):
        return (f"{x!r} is not finite in float32 (the largest float32 is {FLOAT32_MAX:.4g}), the precision "
                "the trainer computes in")
    if x != 0.0 and abs(y) < FLOAT32_TINY:
        return (f"{x!r} is 0 to the trainer (below {FLOAT32_TINY:.4g}, the smallest normal float32; the "
                "compiled code flushes smaller values to 0)")
    return None
