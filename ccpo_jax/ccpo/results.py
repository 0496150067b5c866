"""The one builder of a run's results.json and table.md (docs/reproduce.md, "Outputs").

:func:`build_results` makes results.json's dict from the run's header (:class:`RunRecord`) and its rows
(:class:`ccpo_jax.ccpo.registry.RowSet`): the header and every row's metrics (``report.build_results``),
then, in this order, each fragment: the cost floor, the row ``export`` serves by default, the best
observable reference's form, the kept-seed and ensemble twins' rules, the rows left out, the
group-conditional calibration (``report.add_groups``), the guarantee and each calibrated row's
``below_target`` / Learn then Test outcome (``guarantee_results``). :func:`build_table` writes table.md's
text from that dict (:data:`TABLE_SECTIONS` after the main table); :func:`write_outputs` writes
results.json, table.md (once) and the pictures.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.guarantee_results import add_group_guarantees, add_guarantees, format_guarantees
from ccpo_jax.ccpo.registry import RowSet
from ccpo_jax.ccpo.settings import ENSEMBLE_RULE, KEPT_RULE, Setting
from ccpo_jax.ccpo.rowid import BEST_OBSERVABLE, Twin
from ccpo_jax.core.guarantee import Guarantee
from envs.cache.atomic import atomic_write_text


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """results.json's header: what the run was (everything but its rows)."""

    setting: str
    alpha: float
    protocol: str
    n_splits: int
    split_sizes: tuple[int, int, int]
    seeds: int
    """The training seeds (1 without training)."""
    preset: str
    train_config: dict[str, Any] | None
    """The trainer's configuration (None without training)."""
    cache: dict[str, Any]
    """``report.cache_info``."""
    timing: dict[str, float]
    cost_floor_cents: float | None = None
    """The least any policy pays: round 1 of every test question."""
    export_default: dict[str, Any] | None = None
    """``pick.export_default``: the row ``export`` serves by default (training runs that saved policies)."""
    best_observable_s: float | None = None
    """The best observable reference's seconds (part of eval_s)."""
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    """{row: why} of the non-learned rows the cache cannot support (``baselines.left_out_rows``)."""
    calibration: dict[str, Any] | None = None
    """How the groups were pooled (``--calibration mondrian``; ``calibration.describe_pooling``)."""
    groups: dict[str, Any] | None = None
    """The per-group outcome's shared part (``names`` [G], ``n_cal`` / ``n_test`` [S, G], ``group_min``; each
    row's part is its ``groups`` extra), given when the trainer returned one."""
    guarantee: Guarantee | None = None
    """The guarantee the calibrated rows were fitted under (training runs)."""


def _group_rows(run: RunRecord, rows: RowSet) -> dict[str, Any] | None:
    """The per-group outcome as ``report.add_groups`` reads it (None without one)."""
    if not run.groups:
        return None
    return {**run.groups, "rows": rows.extra("groups")}


def build_results(run: RunRecord, rows: RowSet, environment: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """results.json's dict (module doc): the keys in the order docs/reproduce.md lists them."""
    metrics = rows.metrics()
    results = report.build_results(
        setting=run.setting, alpha=run.alpha, protocol=run.protocol, n_splits=run.n_splits, cache=run.cache,
        rows=metrics, timing=run.timing, environment=environment, seeds=run.seeds, preset=run.preset,
        train_config=run.train_config, n_test=run.split_sizes[2], split_sizes=run.split_sizes)
    pol = results["policies"]
    if run.cost_floor_cents is not None:
        results["cost_floor_cents"] = run.cost_floor_cents
    if run.export_default is not None and run.export_default["row"] in pol:
        results["export_default"] = run.export_default
    for name, desc in rows.extra("reference").items():
        if name in pol:
            pol[name].update(desc)
            if name == BEST_OBSERVABLE.name and run.best_observable_s is not None:
                results["timing"]["best_observable_s"] = run.best_observable_s
    for name, how in rows.extra("kept_seed").items():
        pol[name]["kept_seed"] = dict(how, rule=KEPT_RULE)
    for rid in rows:
        if rid.twin is Twin.ENSEMBLE:
            pol[rid.name]["ensemble"] = {"members": run.seeds, "rule": ENSEMBLE_RULE}
    results["left_out"] = dict(run.left_out)
    group_rows = _group_rows(run, rows)
    if run.calibration is not None:
        results["calibration"] = run.calibration
        if group_rows:
            report.add_groups(results, group_rows, run.alpha)
    if run.guarantee is not None:
        add_guarantees(results, metrics, run.alpha, run.guarantee, rows.extra("ltt"), run.split_sizes[2])
        add_group_guarantees(results, group_rows, run.alpha, run.guarantee)
    return results


def _groups_section(results: Mapping[str, Any]) -> str:
    return report.format_groups(results) if results.get("calibration", {}).get("kind") == "mondrian" else ""


def _guarantee_section(results: Mapping[str, Any]) -> str:
    return format_guarantees(results) if results.get("guarantee") else ""


def _left_out_section(results: Mapping[str, Any]) -> str:
    left = results.get("left_out") or {}
    return "\nRows left out:\n" + "".join(f"- {r}: {why}\n" for r, why in left.items()) if left else ""


#: table.md's sections after the main table, in order (each "" where it does not apply).
TABLE_SECTIONS: tuple[Callable[[Mapping[str, Any]], str], ...] = (_groups_section, _guarantee_section,
                                                                  _left_out_section)


def build_table(results: Mapping[str, Any], setting: Setting | None, split_sizes: tuple[int, int, int] | None,
                compare_paper: bool) -> tuple[str, str]:
    """table.md's text and the text printed after a run (the same sections; each section printed after the
    one before with a single line break between)."""
    text = shown = report.format_table(results, setting, split_sizes, compare_paper=compare_paper)
    for section in TABLE_SECTIONS:
        extra = section(results)
        if extra:
            text += extra
            shown = shown.rstrip("\n") + "\n" + extra
    return text, shown


def write_outputs(work: Path, results: Mapping[str, Any], setting: Setting, split_sizes: tuple[int, int, int],
                  compare_paper: bool, group_plot: bool) -> str:
    """Write results.json, table.md (once) and the box plots (and the group coverage picture when
    ``group_plot``) into ``work``; the printed table."""
    report.write_results(work, results)
    text, shown = build_table(results, setting, split_sizes, compare_paper)
    atomic_write_text(work / report.TABLE_FILE, text)
    if group_plot and results.get("calibration", {}).get("kind") == "mondrian":
        report.write_group_plot(work, results)
    report.write_boxplots(work, results, setting, own_cache=compare_paper)
    return shown
