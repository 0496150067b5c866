"""``ccpo-jax sweep``: the cost-coverage frontier as one compiled program.

Every learned row (CPO, CPO batch, CPO online, and one CCPO row per lambda of the grid) x
alpha x seed (x training split under ``--protocol retrain``) is a member of ONE vmapped
trainer (alpha and lambda are traced data: ``ccpo_jax.ccpo.config.Variant``), every member is
calibrated and evaluated at its own alpha over the same splits (one jitted evaluation), and
the non-learned rows (Random, the LLM policies, LLM-EXIT, UALA, whose threshold depends on
alpha) and the clairvoyant bound are evaluated at every alpha. The splits, baseline draws and
member keys are those of ``ccpo-jax reproduce`` with the same seed, and the members are computed
in blocks of one reproduce run's size (:func:`reproduce_block`), so the point at alpha a is the
``reproduce --alpha a`` run bit for bit (docs/reproduce.md, "Sweeps"). Reads top to bottom like
:mod:`ccpo_jax.ccpo.reproduce`: configuration -> cache -> splits -> baselines and bound per
alpha -> the learned grid -> frontier.json / frontier.md / frontier.png (:mod:`ccpo_jax.ccpo.frontier`).

Output is built in ``<parent>/.<name>.partial`` and renamed when complete; a killed sweep
resumes from its checkpoints with ``--resume OUT``, like a reproduce run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax

from ccpo_jax.ccpo import frontier as fr
from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.baselines import non_learned_rows
from ccpo_jax.ccpo.calibration import add_frontier_guarantees
from ccpo_jax.ccpo.observable import BEST_OBS_ROW, best_observable_row, describe, fit_scores
from ccpo_jax.ccpo.reproduce import (CKPT_DIR, RUN_FILE, TB_DIR, as_rows, bound_row, check_resumed_cache, run_guarantee,
                                     describe_cache, is_setting_profile, load_run_cache, open_run, resolve_mesh)
from ccpo_jax.ccpo.rows import row_variants, run_batch, train_sweep
from ccpo_jax.ccpo.run_config import SweepConfig
from ccpo_jax.ccpo.settings import get_setting
from ccpo_jax.ccpo.splits import check_split_sizes, splits_for_protocol
from ccpo_jax.core.conformal import calibration_size_warning
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options, workdir
from ccpo_jax.runtime.scalars import ScalarWriter
from envs.cache.atomic import atomic_write_text
from envs.replay.bound import BOUND_ROW
from envs.replay.env import make_env_params


@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` returns: the final directory, the frontier.json dict and frontier.md."""

    out_dir: Path
    frontier: dict[str, Any]
    table: str


def reproduce_block(cfg: SweepConfig, tc) -> int:
    """The sweep's default member block: the batch a ``reproduce`` run of this sweep's setting computes
    each member in (its learned rows x seeds, :func:`ccpo_jax.ccpo.rows.run_batch`), under either
    protocol. XLA picks its kernels, and so the last bit of rounding that the CPO step amplifies, by
    the vmapped batch size (``ccpo_jax.runtime.sharding.blocked_vmap``); computed in blocks of this
    size every member runs the program of a reproduce run, on one device or, with ``--devices``, on
    each device (``sharding.PerDevice``)."""
    return run_batch(len(row_variants(tuple(get_setting(cfg.setting).lambdas), tc)), cfg.seeds)


def sweep(*, echo: Callable[[str], Any] | None = print, train: bool = True, **given: Any) -> SweepResult:
    """Sweep alpha (and lambda) for every row of one setting's table; write the frontier to ``out_dir``.

    ``given``: the fields of :class:`ccpo_jax.ccpo.run_config.SweepConfig` (reproduce's data,
    split, preset and execution options plus ``alphas`` and ``lambdas``); with ``resume`` (the
    out_dir of a killed sweep) it continues with the saved configuration. ``train`` False: the
    non-learned rows, the bound and the best observable reference only. Raises UserError /
    CacheError for bad input before anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    unknown = sorted(set(given) - set(options.inputs(SweepConfig)))
    if unknown:
        raise TypeError(f"sweep() got unknown option(s) {', '.join(unknown)}; "
                        f"the options: {', '.join(options.inputs(SweepConfig))}")
    out, cfg = open_run(given, SweepConfig, out_prefix="sweep-", results_file=fr.FRONTIER_JSON,
                        command="sweep")
    resuming = cfg.resume is not None
    st = get_setting(cfg.setting)
    work = workdir.work_dir(out)
    if jax.process_count() > 1:
        raise UserError("sweep runs on one host; see docs/performance.md for multi-host training")
    mesh = resolve_mesh(cfg.devices)
    cache = load_run_cache(st, cfg.cache)
    check_split_sizes(cache.n_questions, *cfg.split_sizes, cfg.n_splits, where=f"the cache {cache.manifest.name!r}")
    if resuming:
        check_resumed_cache(work, cache)
    tc = cfg.train_config()
    created = False
    try:
        if not resuming:
            work.mkdir(parents=True)
            created = True
            atomic_write_text(work / RUN_FILE, json.dumps(dict(options.saved(cfg), command="sweep",
                                                               cache_checksum=cache.manifest.checksum), indent=2) + "\n")
        own = is_setting_profile(st, cache)
        say(f"sweep {st.name}: {'the SYNTHETIC' if cache.manifest.provenance.get('kind') == 'synthetic' else 'the'} "
            f"cache {cache.manifest.name!r}{' (the setting profile)' if own else ''}")
        say(f"  {describe_cache(cache)}")
        say(f"  alphas {', '.join(f'{a:g}' for a in cfg.alphas)}; CCPO lambdas {', '.join(f'{x:g}' for x in cfg.lambdas)}; "
            f"protocol {cfg.protocol}, {cfg.n_splits} splits of {'/'.join(map(str, cfg.split_sizes))}, seed {cfg.seed}")
        for a in cfg.alphas:
            small = calibration_size_warning(cfg.split_sizes[1], a)
            if small:
                say(f"  warning: {small}")
        k_split, k_base, k_train = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)  # as reproduce
        splits = splits_for_protocol(cfg.protocol, k_split, cache.n_questions, *cfg.split_sizes, cfg.n_splits)
        params = make_env_params(cache)
        t0 = time.perf_counter()
        grid: dict[float, dict[str, dict]] = {}
        scores, fit = fit_scores(params)  # the best observable reference's model: once, for every alpha
        ref_s = fit["fit_s"]
        for a in cfg.alphas:  # the non-learned rows (UALA's threshold depends on alpha) and the bound
            rows = as_rows(jax.device_get(non_learned_rows(cache, params, k_base, splits.cal, splits.test, a)),
                           cfg.n_splits, "baselines.non_learned_rows")
            rows[BOUND_ROW] = bound_row(params, splits.test, a)
            rows[BEST_OBS_ROW], got = best_observable_row(params, splits.test, a, scores, fit)
            ref_s += got["search_s"]
            grid[a] = rows
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": time.perf_counter() - t0, "best_observable_s": ref_s}
        learned: tuple[str, ...] = ()
        if train:
            block = cfg.member_block
            if block is None:  # one reproduce run's batch per block: its numbers, bit for bit, on any devices
                block = reproduce_block(cfg, tc)
            say(f"  trainer: preset {cfg.preset}, {tc.iterations} iterations; {len(cfg.alphas)} alpha(s) x "
                f"{cfg.seeds} seed(s) x the learned rows, one program" + (f", {block} member(s) per block" if block else ""))
            writer = ScalarWriter(work / TB_DIR, ".train")
            try:
                got, t_learn = train_sweep(tc, params, splits, k_train, alphas=cfg.alphas, lambdas=cfg.lambdas,
                                           seeds=cfg.seeds, protocol=cfg.protocol, ckpt_dir=work / CKPT_DIR,
                                           tensorboard=writer, progress=cfg.progress, mesh=mesh,
                                           member_block=block, guarantee=run_guarantee(cfg))
            finally:
                writer.close()
            for a in cfg.alphas:
                grid[a].update(as_rows(got[a], cfg.n_splits, "the trainer"))
            learned = tuple(got[cfg.alphas[0]])
            for k in timing:
                timing[k] += float(t_learn.get(k, 0.0))
        timing["total_s"] = time.perf_counter() - t_start
        frontier = fr.build_frontier(grid, setting=st.name, cache=report.cache_info(cache), protocol=cfg.protocol,
                                     n_splits=cfg.n_splits, seeds=cfg.seeds if train else 1, lambdas=cfg.lambdas,
                                     preset=cfg.preset, train_config=dataclasses.asdict(tc) if train else None,
                                     timing=timing, learned=learned)
        frontier["rows"][BEST_OBS_ROW].update(describe(fit))  # its form: fitted on this cache
        add_frontier_guarantees(frontier, grid, run_guarantee(cfg))
        md = fr.write_frontier(work, frontier)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
    except KeyboardInterrupt:
        if (work / CKPT_DIR).exists() and not cfg.discard_failed:
            say(f"interrupted; continue with: ccpo-jax sweep --resume {out}")
        elif work.exists() and (created or cfg.discard_failed):
            shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException as e:
        workdir.after_failure(e, work, created=created, discard=cfg.discard_failed, ckpt_dir=CKPT_DIR,
                              resume_hint=f"after fixing the cause, continue with `ccpo-jax sweep --resume {out}`")
        raise
    say("")
    say(md.rstrip("\n"))
    say("")
    say(f"wrote {out}/: {fr.FRONTIER_JSON}, {fr.FRONTIER_MD}, {fr.FRONTIER_PNG}, {RUN_FILE}"
        + "".join(f", {d}/" for d in (TB_DIR, CKPT_DIR) if (out / d).is_dir()))
    return SweepResult(out_dir=out, frontier=frontier, table=md)
