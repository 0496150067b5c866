"""Typed row identities: what a row of results.json / table.md / frontier.json is, decided once.

A row is named by a :class:`RowId` built by one of the constructor functions below (the paper's rows,
arXiv 2511.11828 §5, Tables 2-9, plus this project's references and ladder rows); its table name
(:attr:`RowId.name`), its family, whether its sets are batch-calibrated, its set-size penalty and its
place in a table (:meth:`RowId.sort_key`) are fields, never parsed back out of the name.
:meth:`RowId.parse` turns a name into its RowId and is meant for the boundaries only (results.json
read back, ``--row``, ``policies/``), where a name is all there is.

The table order (docs/reproduce.md, "Settings"): EXIT rows (the guide's first, as in the paper),
Random, LLM policies (the guide's first), UALA, CPO, CPO batch, CPO online, the CCPO rows by lambda,
then every other row by name; a twin (``ROW [kept seed]``, ``ROW [ensemble]``, ``ROW [Mondrian]``)
right after its row, in :class:`Twin`'s order.
"""
from __future__ import annotations

import dataclasses
import enum
import re

import numpy as np

from ccpo_jax.errors import UserError
from envs.replay.bound import BOUND_ROW

#: The paper's guide model (arXiv 2511.11828 §5): its EXIT and LLM-policy rows come first in their groups.
GUIDE_MODEL = "GPT-4o"


class Twin(enum.Enum):
    """A twin of a calibrated row; the value is its name's suffix, the order the table order after the row."""

    #: of the row's training seeds, the one whose calibrated sets cost least on its own training
    #: questions (``ccpo_jax.ccpo.rows.kept_seeds``), the policy ``ccpo-jax export`` serves
    KEPT_SEED = " [kept seed]"
    #: the row's training seeds as one policy, pi(a|o) the mean of theirs (``ccpo_jax.ccpo.rows.ensemble_rows``)
    ENSEMBLE = " [ensemble]"
    #: the row calibrated per group (Mondrian conformal prediction, ``--calibration mondrian``)
    MONDRIAN = " [Mondrian]"


class Family(enum.StrEnum):
    """What a row is (descriptive: the order is :attr:`RowId.order`)."""

    EXIT = "exit"
    RANDOM = "random"
    LLM_POLICY = "llm_policy"
    UALA = "uala"
    LADDER = "ladder"
    CPO = "cpo"
    CCPO = "ccpo"
    REFERENCE = "reference"
    OTHER = "other"


#: The rows whose place in the table is fixed by their name (the rest: by group, lambda or name).
_FIXED = {"Random": 1, "UALA": 3, "CPO": 4, "CPO batch": 5, "CPO online": 6}
_LAMBDA = re.compile(r"CCPO \(lambda=(.*)\)")


def format_lambda(lam: float) -> str:
    """Stable text of a set-size penalty: ``0``, ``1e-4``, ``2e-4``, ``1.5e-4``, ``0.05``, ``1``, ``1e30``.

    Scientific notation with the shortest mantissa below 0.01 and from 1e6 up (1e30 in plain
    decimal is 31 digits), plain decimal between; the same float always gives the same text,
    and ``float`` reads it back. No ``+`` in the exponent: a policy's directory name keeps only
    letters, digits and dashes, and 1e+30 would become the name of 1e-30.
    """
    lam = float(lam)
    if not np.isfinite(lam):
        raise UserError(f"lambda must be finite, got {lam}")
    if lam == 0.0:
        return "0"
    if abs(lam) < 1e-2 or abs(lam) >= 1e6:
        return np.format_float_scientific(lam, unique=True, trim="-", exp_digits=1).replace("e+", "e")
    return np.format_float_positional(lam, unique=True, trim="-")


def row_key(name: str) -> str:
    """Loose key for matching a row name to the paper's (case, spaces, punctuation ignored)."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _order(label: str) -> tuple[int, str]:
    """The table place of a row that is not a twin (module doc); lambdas as ``%030.15f``, so by value."""
    guide = row_key(GUIDE_MODEL)
    if label.endswith(" EXIT"):
        return (0, "" if row_key(label).startswith(guide) else label)
    if label in _FIXED:
        return (_FIXED[label], "")
    if label.startswith("LLM policy ("):
        return (2, "" if guide in row_key(label) else label)
    m = _LAMBDA.fullmatch(label)
    if m:
        try:
            return (7, f"{float(m.group(1)):030.15f}")
        except ValueError:
            return (7, m.group(1))
    return (8, label)


@dataclasses.dataclass(frozen=True, eq=False)
class RowId:
    """One row of a run's tables. Two RowIds are the same row when their :attr:`name` is the same."""

    label: str
    """The row without its twin suffix: ``CPO batch``, ``CCPO (lambda=2e-4)``, ``GPT-4o EXIT``."""
    family: Family
    order: tuple[int, str]
    """Its place in a table before the twin suffix (module doc); set by the constructor functions."""
    twin: Twin | None = None
    calibrated: bool = False
    """Batch-calibrated sets: CPO batch, the CCPO rows, and their twins."""
    is_policy: bool = True
    """False for the references: the clairvoyant bound, the best observable stopping rule."""
    lam: float = 0.0
    """The set-size penalty (a CCPO row's lambda, 0 for every other row)."""

    @property
    def name(self) -> str:
        """The table's name: the label plus the twin's suffix (the one place a name is built)."""
        return self.label + (self.twin.value if self.twin is not None else "")

    @property
    def base(self) -> RowId:
        """The row this twin twins (itself when it is no twin)."""
        return dataclasses.replace(self, twin=None)

    def twin_of(self, kind: Twin) -> RowId:
        """This row's ``kind`` twin (a twin's twin keeps the first twin's name as its label)."""
        if self.twin is None:
            return dataclasses.replace(self, twin=kind)
        return dataclasses.replace(self, label=self.name, order=self.sort_key(), twin=kind)

    def sort_key(self) -> tuple[int, str]:
        """The table order (module doc): the row's place, a twin right after its row (``chr(0x7d + i)``,
        after every character a name or a ``%030.15f`` lambda holds, i = the twin's index in :class:`Twin`)."""
        if self.twin is None:
            return self.order
        return (self.order[0], self.order[1] + chr(0x7D + list(Twin).index(self.twin)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowId) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> RowId:
        """The RowId of a table name: ONLY at the boundaries (results.json read back, ``--row``, ``policies/``)."""
        for kind in Twin:
            if name.endswith(kind.value):
                return cls.parse(name[: -len(kind.value)]).twin_of(kind)
        if name == BOUND_ROW or name == BEST_OBSERVABLE.label:
            return BOUND if name == BOUND_ROW else BEST_OBSERVABLE
        if name.endswith(" EXIT"):
            return _row(name, Family.EXIT)
        if name.startswith("LLM policy ("):
            return _row(name, Family.LLM_POLICY)
        if name in ("CPO", "CPO batch", "CPO online"):
            return _row(name, Family.CPO, calibrated=name == "CPO batch")
        if name in ("Random", "UALA"):
            return _row(name, Family(name.lower()))
        if name.startswith("CCPO ("):
            m = _LAMBDA.fullmatch(name)
            try:
                lam = float(m.group(1)) if m else 0.0
            except ValueError:
                lam = 0.0
            return _row(name, Family.CCPO, calibrated=True, lam=lam)
        if name.startswith("Always rung ") or name == CASCADE.label:
            return _row(name, Family.LADDER)
        return _row(name, Family.OTHER)


def _row(label: str, family: Family, **kw) -> RowId:
    return RowId(label, family, _order(label), **kw)


def exit_row(model: str) -> RowId:
    """The LLM-EXIT baseline of ``model`` (arXiv 2511.11828 §5, App. 8.2): ``GPT-4o EXIT``."""
    return _row(f"{model} EXIT", Family.EXIT)


def llm_policy_row(model: str) -> RowId:
    """The prompted-LLM policy baseline (arXiv 2511.11828 §5, App. 8.3): ``LLM policy (GPT-4o)``."""
    return _row(f"LLM policy ({model})", Family.LLM_POLICY)


def lambda_row(lam: float) -> RowId:
    """CCPO with set-size penalty ``lam`` (:func:`format_lambda`), docs/reproduce.md: ``CCPO (lambda=2e-4)``."""
    return _row(f"CCPO (lambda={format_lambda(lam)})", Family.CCPO, calibrated=True, lam=float(lam))


def custom_row(label: str, family: Family = Family.OTHER, **fields) -> RowId:
    """A row of a newly registered baseline (``ccpo_jax.ccpo.registry``), placed by the table order's rules
    (a name no rule knows: after the paper's rows, by name); ``fields``: the other :class:`RowId` fields."""
    return _row(label, family, **fields)


def rung_row(k: int, model: str) -> RowId:
    """"Always use base rung k" (1-based) on a base ladder (``ccpo_jax.ccpo.ladder_rows``)."""
    return _row(f"Always rung {k} ({model})", Family.LADDER)


RANDOM = _row("Random", Family.RANDOM)
UALA = _row("UALA", Family.UALA)
CPO = _row("CPO", Family.CPO)
CPO_BATCH = _row("CPO batch", Family.CPO, calibrated=True)
CPO_ONLINE = _row("CPO online", Family.CPO)
#: The threshold cascade of a ladder or a guide-less cascade (``ccpo_jax.ccpo.ladder_rows``).
CASCADE = _row("Threshold cascade", Family.LADDER)
#: The clairvoyant bound (``envs.replay.bound``): not a policy.
BOUND = _row(BOUND_ROW, Family.REFERENCE, is_policy=False)
#: The best observable stopping rule (``ccpo_jax.ccpo.observable``): not a policy.
BEST_OBSERVABLE = _row("Best observable", Family.REFERENCE, is_policy=False)
