"""Which saved policy ``ccpo-jax export`` serves when no row is named, and how a policy is named.

:func:`choose_default_row`: the cheapest calibrated row whose calibration coverage holds and whose
router is not degenerate; ``reproduce`` marks the same row in table.md (:func:`export_default`).
"""
from __future__ import annotations

import json
from pathlib import Path

from ccpo_jax.ccpo.calibration import Calibration
from ccpo_jax.ccpo.policy_store import POLICY_META, policy_slug
from ccpo_jax.ccpo.settings import served_row
from ccpo_jax.errors import UserError

DEFAULT_ROW = "CCPO (lambda=0)"


def _policy_metas(pdir: Path) -> list[tuple[Path, dict]]:
    out = []
    for d in sorted(pdir.iterdir()):
        try:
            out.append((d, json.loads((d / POLICY_META).read_text())))
        except (OSError, ValueError, TypeError, RecursionError):
            continue
    return out


def _usable(meta: dict) -> bool:
    """A calibrated row whose calibration coverage holds and that is not degenerate."""
    cal = meta.get("calibration")
    return (bool(cal) and not cal["degenerate"] and cal["coverage"] >= cal["target"]
            and cal.get("ltt_feasible") is not False)


def _describe(meta: dict, n_test: int | None = None) -> str:
    """The policy by its table name, with its mean test cost (cents per test split, and per question when
    ``n_test`` is known), coverage and threshold."""
    name = served_row(meta["row"], meta.get("seed_rule"))
    cal = meta.get("calibration") or {}
    if not cal:
        return repr(name)
    cost = cal["test_cost_cents_mean"]
    per_q = f", {cost / n_test:.4g} cents a question" if n_test else ""
    return (f"{name!r} (test cost {cost:.4g} cents per test split{per_q}, coverage "
            f"{cal['test_coverage_mean']:.3f}, kappa-hat {cal['kappa']:.3g})")


def export_default(pdir: Path, n_test: int | None = None) -> dict | None:
    """results.json's ``export_default``: the row :func:`choose_default_row` picks, by its table name, and
    why (None when no saved policy is usable)."""
    try:
        d, _ = choose_default_row(pdir)
    except UserError:
        return None
    meta = json.loads((d / POLICY_META).read_text())
    return {"row": served_row(meta["row"], meta.get("seed_rule")), "policy": d.name,
            "why": f"{_describe(meta, n_test)}, the cheapest calibrated row whose calibration coverage holds and "
                   "whose router is not degenerate (`--row ROW` exports another)"}


def choose_default_row(pdir: Path, calibration: str = "marginal", n_test: int | None = None) -> tuple[Path, str]:
    """The cheapest calibrated row (the saved policy's mean test cost over splits: the kept seed's, or the
    ensemble's for ``ROW [ensemble]``; before the kept seed, the mean over seeds x splits) whose calibration
    coverage holds and whose router is not degenerate (``ccpo_jax.ccpo.evaluation.calibration_diagnostics``);
    with ``calibration`` "mondrian", among the rows saved with per-group thresholds (not the ensembles).
    Returns (policy dir, reason). Runs saved before diagnostics existed: ``DEFAULT_ROW``."""
    metas = _policy_metas(pdir)
    if Calibration(calibration) is Calibration.MONDRIAN and any(m.get("mondrian") for _, m in metas):
        metas = [(d, m) for d, m in metas if m.get("mondrian")]
    if metas and all("calibration" not in m for _, m in metas):
        d = pdir / policy_slug(DEFAULT_ROW)
        if d.is_dir():
            return d, f"{DEFAULT_ROW!r} (the run has no calibration diagnostics; re-run reproduce to get them)"
    good = [(m["calibration"]["test_cost_cents_mean"], d, m) for d, m in metas if _usable(m)]
    if not good:
        rows = "; ".join(_why_degenerate(m) for _, m in metas) or "none"
        raise UserError(f"{pdir}: no calibrated row is usable as a router ({rows}); "
                        "choose one with `row` and pass `force` to export it anyway")
    cost, d, m = min(good, key=lambda x: x[0])
    return d, f"{_describe(m, n_test)}: the cheapest calibrated row whose calibration coverage holds"


def _n_test(run_dir: Path) -> int | None:
    """Questions per test split of the run (results.json ``split_sizes``; None for older runs)."""
    try:
        return int(json.loads((run_dir / "results.json").read_text())["split_sizes"][2])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _why_degenerate(meta: dict) -> str:
    cal = meta.get("calibration") or {}
    if not cal:
        return f"{meta.get('row')!r}: no calibration diagnostics"
    bits = []
    if cal["kappa"] < 1e-6:
        bits.append(f"kappa-hat {cal['kappa']:.3g}")
    if cal["full_set_fraction"] >= 0.9:
        bits.append(f"the set holds every available action for {100 * cal['full_set_fraction']:.0f}% of the "
                    f"{cal['n']} calibration questions (always continue, collect everything)")
    if cal["coverage"] < cal["target"]:
        bits.append(f"calibration coverage {cal['coverage']:.3f} < {cal['target']:.3f}")
    return f"{meta['row']!r}: " + ("; ".join(bits) if bits else "usable")
