"""Calibration's room on the host: the ``--calibration`` / ``--guarantee`` vocabulary shared by
``reproduce``, ``sweep``, ``export`` and serving, the Mondrian groups and their pooling, the rank
tables and the exported thresholds' manifest blocks.

The maths is in :mod:`ccpo_jax.core.guarantee` (which order statistic gives which guarantee; Learn
then Test's critical counts) and :mod:`ccpo_jax.core.conformal` (scores and thresholds, marginal,
Mondrian and two-risk); the jitted per-split evaluation is :mod:`ccpo_jax.ccpo.evaluation`. Here: one
rank table per trained variant (each has its own alpha in a sweep), the group minimum a PAC Mondrian
calibration needs. What results.json and table.md say of a calibrated row (its guarantee, how often a
split fell short of it, Learn then Test's entries) is :mod:`ccpo_jax.ccpo.guarantee_results`.
docs/calibration.md describes all of it.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from ccpo_jax.core.guarantee import GUARANTEES  # noqa: F401 - the --guarantee vocabulary, read here by run_config, export
from ccpo_jax.ccpo.rowid import Twin
from ccpo_jax.core.guarantee import Guarantee, Marginal, rank_table
from ccpo_jax.errors import UserError
from envs.cache.schema import ResponseCache, cache_groups

#: Suffix of a calibrated row's group-conditional (Mondrian) twin (``rowid.Twin.MONDRIAN``).
MONDRIAN = Twin.MONDRIAN.value


# -- the vocabulary of reproduce, sweep, export and serving ----------------------------------

class Calibration(enum.StrEnum):
    """``--calibration`` of ``reproduce`` and ``export``: one marginal threshold per row, or per
    question group as well (Mondrian). A StrEnum: equal to its value, written as it in run.json."""

    MARGINAL = "marginal"
    MONDRIAN = "mondrian"

    @classmethod
    def of(cls, cfg: object) -> "Calibration":
        """The calibration of a run configuration (one without the option, e.g. a sweep's: marginal)."""
        return cls(getattr(cfg, "calibration", None) or cls.MARGINAL)


#: The choices of ``--calibration``, in the order the help lists them.
CALIBRATIONS = tuple(c.value for c in Calibration)
#: ``--guarantee``: GUARANTEES (:mod:`ccpo_jax.core.guarantee`); the default ``--delta`` of ``pac``:
DELTA = 0.1


class CalibratedRun(Protocol):
    """What the calibration reads of a run configuration (``ReproduceConfig``, ``rows.RowsRun``)."""

    @property
    def calibration(self) -> str: ...
    @property
    def group_min(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def guarantee_of(self) -> Guarantee: ...


# -- Mondrian: the groups, their pooling, the exported thresholds ------------------------------

class GroupSpec(NamedTuple):
    """The cache's question groups for the group-conditional (Mondrian) calibration:
    ``codes`` [Q] int32 into ``names`` (sorted), and the smallest group with its own threshold."""

    codes: np.ndarray
    names: tuple[str, ...]
    group_min: int

    @classmethod
    def of(cls, groups: np.ndarray, group_min: int) -> "GroupSpec":
        names, codes = np.unique(np.asarray(groups).astype(str), return_inverse=True)
        return cls(codes.astype(np.int32), tuple(str(n) for n in names), int(group_min))


def group_spec(cfg: CalibratedRun, cache: ResponseCache) -> GroupSpec | None:
    """The cache's groups for ``--calibration mondrian`` (None for marginal); a cache without a
    ``group`` per question is refused."""
    if Calibration.of(cfg) is not Calibration.MONDRIAN:
        return None
    g = cache_groups(cache.arrays)
    if g is None:
        raise UserError(f"calibration: mondrian needs a question group ('group') for every question, and the cache "
                        f"{cache.manifest.name!r} has none; add a 'group' field beside each question's 'id' "
                        "(docs/caches.md) or use --calibration marginal", field="calibration")
    return GroupSpec.of(g, effective_group_min(cfg.group_min, cfg.alpha, cfg.guarantee_of))


def describe_pooling(spec: GroupSpec, cal_idx: Any, say: Callable[[str], Any] | None = None,
                     asked: int | None = None) -> dict[str, Any]:
    """How the Mondrian calibration groups the calibration questions, mean (and range) over splits:
    groups with their own threshold, groups and questions pooled into the rest (said in one line).
    ``asked``: the ``--group-min`` given, when a PAC guarantee raised it to ``spec.group_min``."""
    counts = np.stack([np.bincount(spec.codes[np.asarray(c)], minlength=len(spec.names)) for c in np.asarray(cal_idx)])
    own = counts >= spec.group_min
    pooled_q = np.where(own, 0, counts).sum(axis=1)
    out = {"kind": "mondrian", "group_min": spec.group_min, "n_groups": len(spec.names),
            "own_groups": {"mean": float(own.sum(1).mean()), "min": int(own.sum(1).min()), "max": int(own.sum(1).max())},
            "pooled_groups": {"mean": float((~own).sum(1).mean()), "min": int((~own).sum(1).min()),
                              "max": int((~own).sum(1).max())},
            "pooled_questions": {"mean": float(pooled_q.mean()), "min": int(pooled_q.min()), "max": int(pooled_q.max())},
            "n_cal": int(counts.sum(1)[0])}
    raised = asked is not None and asked != spec.group_min
    if raised:
        out["group_min_asked"] = int(asked)
    if say is not None:
        why = f" (raised from {asked} for the PAC threshold)" if raised else ""
        say(f"  calibration mondrian: {out['n_groups']} groups, --group-min {spec.group_min}{why}: "
            f"{out['own_groups']['mean']:.1f} groups with their own threshold, "
            f"{out['pooled_groups']['mean']:.2f} groups ({out['pooled_questions']['mean']:.1f} of "
            f"{out['n_cal']} calibration questions) pooled into one 'rest' group (means over splits)")
    return out


def mondrian_manifest(meta: dict, policy_dir: Path) -> dict:
    """The manifest's ``mondrian`` block from a policy saved by ``reproduce --calibration mondrian``."""
    m = meta.get("mondrian")
    if not m:
        raise UserError(f"calibration: {policy_dir}/policy.json has no per-group thresholds; the run was calibrated "
                        "marginally. Re-run it with `ccpo-jax reproduce --calibration mondrian` (the cache needs a "
                        "'group' per question), or export with --calibration marginal", field="calibration")
    return {"group_min": int(m["group_min"]), "kappas": {str(g): float(k) for g, k in m["kappas"].items()},
            "rest_kappa": float(m["rest_kappa"]), "rest_groups": [str(g) for g in m["rest_groups"]],
            "n_cal": {str(g): int(n) for g, n in m.get("n_cal", {}).items()},
            "rule": "a request's group with its own threshold (kappas) uses it; any other group, or none, "
                    "uses rest_kappa (the pooled small groups; the marginal kappa when none was pooled)",
            "note": "thresholds of the saved seed on split 0, like kappa"}


def guarantee_manifest(meta: dict, policy_dir: Path, want: str | None) -> dict:
    """The manifest's ``guarantee`` (kind, alpha, delta, statement) from the saved policy (a policy saved
    before ``--guarantee`` was marginal); ``want`` not None must be the saved kind."""
    g = meta.get("guarantee") or Marginal().describe(float(meta["alpha"]))
    if want is not None and want != g["kind"]:
        raise UserError(f"guarantee: {policy_dir}/policy.json was calibrated with a {g['kind']} guarantee, not {want}; "
                        f"re-run `ccpo-jax reproduce --guarantee {want}` to get {want} thresholds", field="guarantee")
    return {k: g.get(k) for k in ("kind", "alpha", "delta", "statement", "guide_cap", "cost_cap")
            if k in g or k not in ("guide_cap", "cost_cap")}


# -- rank tables ------------------------------------------------------------------

def variant_ranks(guarantee: Guarantee, alphas: Sequence[float], n_cal: int) -> np.ndarray:
    """``[V, n_cal + 1]`` int32: each variant's rank for every calibration count 0..n_cal."""
    return np.stack([rank_table(int(n_cal), float(a), guarantee) for a in alphas]).astype(np.int32)


def effective_group_min(group_min: int, alpha: float, guarantee: Guarantee) -> int:
    """The smallest group with a threshold of its own: ``--group-min``, as the guarantee sets it
    (:meth:`Guarantee.group_min`: raised under ``pac`` to the fewest calibration questions that have a PAC
    threshold, so that no group gets the trivial "every action" threshold; smaller groups are pooled)."""
    return guarantee.group_min(group_min, alpha)
