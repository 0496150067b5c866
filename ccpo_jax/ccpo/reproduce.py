"""``ccpo-jax reproduce``: one paper table, end to end.

:func:`reproduce` reads top to bottom: the preparation it shares with ``sweep``
(``ccpo_jax.ccpo.prepare.prepare``: the run configuration, a new
:class:`ccpo_jax.ccpo.run_config.ReproduceConfig` or the saved one of a killed run; the cache;
replay env params; splits and keys; the run's one ``Execution``) -> the work directory
(``ccpo_jax.runtime.workdir.committed``) -> the non-learned rows (Random, LLM policies, LLM-EXIT,
UALA; ``ccpo_jax.ccpo.baselines``) -> training and evaluation of the learned rows (CPO, CPO batch,
CPO online, CCPO; ``ccpo_jax.ccpo.rows.learned_rows(cfg, data, execution)``) -> outputs (``results.json``, ``table.md``, box plots,
``run.json``; ``ccpo_jax.ccpo.report``). Row names and metrics: docs/reproduce.md "Outputs".

Output is built in a hidden work directory beside ``out_dir``
(``<parent>/.<name>.partial``) and renamed to ``out_dir`` only when complete, so
``out_dir`` never holds a half-written run. A run killed during training leaves the
work directory (with the trainer's checkpoints) behind; ``reproduce(resume=OUT)``
continues it with the configuration saved in its ``run.json``.

Errors are :class:`ccpo_jax.errors.UserError` whose ``field`` is the argument of
:func:`reproduce` at fault; the CLI (``ccpo_jax.cli.reproduce``) names its flags.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo import rows as learned
from ccpo_jax.ccpo.baselines import left_out_rows, non_learned_rows
from ccpo_jax.ccpo.calibration import describe_pooling, group_spec
from ccpo_jax.ccpo.guarantee_results import check_feasible
from ccpo_jax.ccpo.pick import export_default
from ccpo_jax.ccpo.policy_store import POLICIES_DIR
from ccpo_jax.ccpo.prepare import (CKPT_DIR, RUN_FILE, TB_DIR, Prepared, as_rows, bound_row,
                                   check_options, describe_cache, is_setting_profile, prepare)
from ccpo_jax.ccpo.presets import PRESETS_LINK, deviations, deviations_in_words
from ccpo_jax.runtime.progress import status
from ccpo_jax.ccpo.rows import LearnedRows, LearnedRowsFn
from ccpo_jax.ccpo.evaluation import question_cost_max
from ccpo_jax.ccpo.observable import BEST_OBS_ROW, best_observable_row, describe, seconds
from ccpo_jax.ccpo.registry import rows_from
from ccpo_jax.ccpo.results import RunRecord, build_results, write_outputs
from ccpo_jax.ccpo.run_config import ReproduceConfig, check_cost_cap
from ccpo_jax.core.conformal import calibration_size_warning
from envs.replay.bound import BOUND_ROW


@dataclasses.dataclass
class ReproduceResult:
    """What :func:`reproduce` returns: the final directory, the results.json dict and the table text."""

    out_dir: Path
    results: dict[str, Any]
    table: str
    notes: list[str]


# -- the pipeline -------------------------------------------------------------------------

def _announce(say: Callable[[str], Any], run: Prepared, trains: bool, small: str | None) -> None:
    st, cfg, cache, ex = run.setting, run.cfg, run.data.cache, run.execution
    say(f"reproduce {st.name} ({st.run_title(cache.manifest.name, is_setting_profile(st, cache), cfg.alpha)})")
    say(f"  {describe_cache(cache)}")
    say(f"  protocol {cfg.protocol}, {cfg.n_splits} splits of {'/'.join(map(str, cfg.split_sizes))} "
        f"(train/cal/test), alpha {cfg.alpha:g}, seed {cfg.seed}")
    if trains:
        tc = cfg.train_config()
        dev = deviations(tc)
        say(f"  trainer: preset {cfg.preset}, {cfg.seeds} seed(s), {tc.iterations} iterations; "
            + (f"it changes the paper's setting: {deviations_in_words(dev)} (why: {PRESETS_LINK})" if dev else
               "the paper's published setting"))
    if small:
        say(f"  warning: {small}")
    block = ex.member_block
    if trains and (ex.mesh is not None or block is not None):
        n_dev = 1 if ex.mesh is None else ex.mesh.devices.size
        say(f"  training sharded over {n_dev} {jax.default_backend()} device(s)"
            + (f", {block} member(s) per block" if block is not None else "")
            + (" (retrain's default: one split's rows x seeds)" if block and cfg.member_block is None else ""))


def _write_outputs(work: Path, run: Prepared, rows: dict, timing: dict, trains: bool, pooling: dict | None = None,
                   group_rows: dict | None = None, ltt: dict | None = None, best_obs: dict | None = None,
                   kept: dict | None = None, floor: float | None = None) -> tuple[dict, str]:
    """results.json, table.md and the box plots of a finished run, in its work directory
    (``ccpo_jax.ccpo.results``; with ``--calibration mondrian`` also the per-group coverage and its
    picture; ``best_obs``: how the best observable reference was fitted, ``ccpo_jax.ccpo.observable``;
    ``kept``: how each kept-seed twin chose its seed, ``ccpo_jax.ccpo.rows.LearnedRows.kept``)."""
    st, cfg, cache = run.setting, run.cfg, run.data.cache
    pick = export_default(work / POLICIES_DIR, cfg.split_sizes[2]) if trains and (work / POLICIES_DIR).is_dir() else None
    record = RunRecord(
        setting=st.name, alpha=cfg.alpha, protocol=cfg.protocol, n_splits=cfg.n_splits, split_sizes=cfg.split_sizes,
        seeds=cfg.seeds if trains else 1, preset=cfg.preset,
        train_config=dict(dataclasses.asdict(cfg.train_config()), alpha=cfg.alpha) if trains else None,
        cache=report.cache_info(cache), timing=timing, cost_floor_cents=floor, export_default=pick,
        best_observable_s=seconds(best_obs) if best_obs is not None else None,
        left_out=left_out_rows(cache, run.splits.test), calibration=pooling,
        groups={k: v for k, v in group_rows.items() if k != "rows"} if group_rows else None,
        guarantee=cfg.guarantee_of if trains else None)
    rowset = rows_from(rows, kept_seed=kept, ltt=ltt, groups=(group_rows or {}).get("rows"),
                       reference={BEST_OBS_ROW: describe(best_obs)} if best_obs is not None else None)
    results = build_results(record, rowset)
    compare = is_setting_profile(st, cache)
    table = write_outputs(work, results, st, cfg.split_sizes, compare, group_plot=bool(group_rows))
    return results, table


def _learned(trainer: LearnedRowsFn | None, run: Prepared, rows: dict, timing: dict, notes: list[str],
             say: Callable[[str], Any]):
    """Train and evaluate the learned rows (step 4 of :func:`reproduce`): add them to ``rows`` and
    their times to ``timing``; refuse a two-risk request no row met; (per-group rows, two-risk outcome, kept
    seeds). No trainer (``train=False``): a note, and (None, None, None)."""
    if trainer is None:
        notes.append("learned rows (CPO, CPO batch, CPO online, CCPO) not run (train=False)")
        say(f"  note: {notes[-1]}")
        return None, None, None
    cfg = run.cfg
    got: LearnedRows = trainer(cfg, run.data, run.execution)
    check_feasible(getattr(got, "ltt", None), cfg.alpha, cfg.guarantee_of)
    rows.update(as_rows(got.rows, cfg.n_splits, "the trainer"))
    for k in ("compile_s", "train_s", "eval_s"):
        timing[k] += float(got.timing.get(k, 0.0))
    return got.groups, getattr(got, "ltt", None), getattr(got, "kept", None)


def reproduce(
    setting: str | None = None,
    /,
    *,
    echo: Callable[[str], Any] | None = print,
    trainer: LearnedRowsFn | None = None,
    train: bool = True,
    **given: Any,
) -> ReproduceResult:
    """Reproduce one paper table and write its outputs to ``out_dir``.

    ``given``: the options, the fields of :class:`ccpo_jax.ccpo.run_config.ReproduceConfig`
    (``cache``, ``n_splits``, ``split_sizes``, ``out_dir``, ``resume``, ...; None or left out =
    the default; ``setting`` may also come first). With ``resume`` (the out_dir of a killed
    run) the run continues with its saved configuration: the saved options must be left out
    or equal to the saved ones. Python-only arguments:
      echo         where the progress lines go (None: nowhere);
      trainer      the learned rows' trainer (default ``ccpo_jax.ccpo.rows.learned_rows``);
      train        False: the non-learned rows only.
    Raises UserError / CacheError for bad input before anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    if setting is not None:
        given = dict(given, setting=setting)
    check_options(given, ReproduceConfig, "reproduce")
    trainer = (trainer or learned.learned_rows) if train else None
    show = echo is not None and given.get("progress") is not False  # the phase lines (stdout)
    status("preparing the run: the cache, the splits, the devices ...", show)
    # 1. the run configuration (a new one, or the saved one of a killed run), the cache, env, splits, execution
    run = prepare(given, ReproduceConfig, command="reproduce", trains=trainer is not None)
    cfg, st, cache_obj, params, splits = run.cfg, run.setting, run.data.cache, run.data.params, run.splits
    check_cost_cap(cfg, question_cost_max(params), f"the cache {cache_obj.manifest.name!r}")
    notes: list[str] = []
    small = calibration_size_warning(cfg.split_sizes[1], cfg.alpha)
    if small:
        notes.append(small)
    with run.committed(say) as work:
        _announce(say, run, trainer is not None, small)
        groups = group_spec(cfg, cache_obj)
        pooling = None if groups is None else describe_pooling(groups, splits.cal, say, cfg.group_min)
        # 2. the non-learned rows: all splits in one vmapped call
        status(f"evaluating the non-learned rows, the clairvoyant bound and the best observable reference on "
               f"{cfg.n_splits} splits ...", show)
        t0 = time.perf_counter()
        base = non_learned_rows(cache_obj, params, run.k_base, splits.cal, splits.test, cfg.alpha,
                                train_idx=splits.train)
        rows = as_rows(jax.device_get(base), cfg.n_splits, "baselines.non_learned_rows")
        rows[BOUND_ROW] = bound_row(params, splits.test, cfg.alpha)  # not a policy: what none can beat
        rows[BEST_OBS_ROW] = {}  # nor this (no answers): its place in the table, filled below
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": time.perf_counter() - t0}
        # 3. training and evaluation of the learned rows, with the best observable reference's scikit-learn fit
        # (one thread, NumPy only) beside them: the training leaves part of a second core idle
        # (docs/performance.md#figures-behind-code-comments)
        with ThreadPoolExecutor(1, thread_name_prefix="best-observable") as pool:
            fit = pool.submit(best_observable_row, params, splits.test, cfg.alpha)
            pool.submit(report.preload_plotting)
            if trainer is not None:
                status(f"training the learned rows ({cfg.seeds} seed(s), {cfg.train_config().iterations} "
                       "iterations; the first chunk compiles first) ...", show)
            group_rows, ltt, kept = _learned(trainer, run, rows, timing, notes, say)
            rows[BEST_OBS_ROW], best_obs = fit.result()
        timing["eval_s"] += seconds(best_obs)
        # 4. outputs
        status("writing results.json, table.md and the box plots ...", show)
        timing["total_s"] = time.perf_counter() - t_start
        floor = float(np.mean(np.asarray(params.cost, np.float64)[:, 0][np.asarray(splits.test)].sum(axis=1)))
        results, table = _write_outputs(work, run, rows, timing, trainer is not None, pooling, group_rows, ltt,
                                        best_obs, kept, floor)
    out = run.out
    say("")
    say(table.rstrip("\n"))
    say("")
    if small:  # again below the table, where a reader of the coverage column looks
        say(f"warning: {small}")
    dirs = [f"{d}/" for d in (TB_DIR, POLICIES_DIR, CKPT_DIR) if (out / d).is_dir()]
    pngs = [report.COST_PNG, report.COVERAGE_PNG] + ([report.GROUP_PNG] if (out / report.GROUP_PNG).is_file() else [])
    say(f"wrote {out}/: {report.RESULTS_FILE}, {report.TABLE_FILE}, {', '.join(pngs)}, "
        + ", ".join([RUN_FILE] + dirs))
    return ReproduceResult(out_dir=out, results=results, table=table, notes=notes)
