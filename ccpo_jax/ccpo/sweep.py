"""``ccpo-jax sweep``: the cost-coverage frontier as one compiled program.

Every learned row (CPO, CPO batch, CPO online, and one CCPO row per lambda of the grid) x
alpha x seed (x training split under ``--protocol retrain``) is a member of ONE vmapped
trainer (alpha and lambda are traced data: ``ccpo_jax.ccpo.config.Variant``), every member is
calibrated and evaluated at its own alpha over the same splits (one jitted evaluation), and
the non-learned rows (Random, the LLM policies, LLM-EXIT, UALA, whose threshold depends on
alpha) and the clairvoyant bound are evaluated at every alpha. The splits, baseline draws and
member keys are those of ``ccpo-jax reproduce`` with the same seed, and the members are computed
in blocks of one reproduce run's size (``ccpo_jax.ccpo.prepare.default_member_block``), so the point at alpha a is the
``reproduce --alpha a`` run bit for bit (docs/reproduce.md, "Sweeps"). Reads top to bottom like
:mod:`ccpo_jax.ccpo.reproduce`: the shared preparation (``ccpo_jax.ccpo.prepare``: configuration,
cache, splits, execution) -> baselines and bound per alpha -> the learned grid -> frontier.json / frontier.md / frontier.png (:mod:`ccpo_jax.ccpo.frontier`).

Output is built in ``<parent>/.<name>.partial`` and renamed when complete; a killed sweep
resumes from its checkpoints with ``--resume OUT``, like a reproduce run.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import jax

from ccpo_jax.runtime.progress import status
from ccpo_jax.ccpo import frontier as fr
from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.baselines import non_learned_rows
from ccpo_jax.ccpo.guarantee_results import add_frontier_guarantees
from ccpo_jax.ccpo.observable import BEST_OBS_ROW, best_observable_row, describe, fit_scores
from ccpo_jax.ccpo.prepare import (CKPT_DIR, RUN_FILE, TB_DIR, Prepared, as_rows, bound_row, check_options,
                                   describe_cache, is_setting_profile, prepare)
from ccpo_jax.ccpo.rows import train_sweep
from ccpo_jax.ccpo.run_config import SweepConfig
from ccpo_jax.core.conformal import calibration_size_warning
from envs.replay.bound import BOUND_ROW


@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` returns: the final directory, the frontier.json dict and frontier.md."""

    out_dir: Path
    frontier: dict[str, Any]
    table: str


def _announce(say: Callable[[str], Any], run: Prepared) -> None:
    st, cfg, cache = run.setting, run.cfg, run.data.cache
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


def _grid(run: Prepared) -> tuple[dict[float, dict[str, dict]], dict, float]:
    """The non-learned rows (UALA's threshold depends on alpha), the bound and the best observable
    reference at every alpha; (grid, how the reference was fitted, its seconds)."""
    cfg, d = run.cfg, run.data
    grid: dict[float, dict[str, dict]] = {}
    scores, fit = fit_scores(d.params)  # the best observable reference's model: once, for every alpha
    ref_s = fit["fit_s"]
    for a in cfg.alphas:
        rows = as_rows(jax.device_get(non_learned_rows(d.cache, d.params, run.k_base, d.splits.cal, d.splits.test, a,
                                                        train_idx=d.splits.train)),
                       cfg.n_splits, "baselines.non_learned_rows")
        rows[BOUND_ROW] = bound_row(d.params, d.splits.test, a)
        rows[BEST_OBS_ROW], got = best_observable_row(d.params, d.splits.test, a, scores, fit)
        ref_s += got["search_s"]
        grid[a] = rows
    return grid, fit, ref_s


def sweep(*, echo: Callable[[str], Any] | None = print, train: bool = True, **given: Any) -> SweepResult:
    """Sweep alpha (and lambda) for every row of one setting's table; write the frontier to ``out_dir``.

    ``given``: the fields of :class:`ccpo_jax.ccpo.run_config.SweepConfig` (reproduce's data,
    split, preset and execution options plus ``alphas`` and ``lambdas``); with ``resume`` (the
    out_dir of a killed sweep) it continues with the saved configuration. ``train`` False: the
    non-learned rows, the bound and the best observable reference only. Raises UserError / CacheError for bad input before
    anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    check_options(given, SweepConfig, "sweep")
    show = echo is not None and given.get("progress") is not False  # the phase lines (stdout)
    status("preparing the sweep: the cache, the splits, the devices ...", show)
    run = prepare(given, SweepConfig, command="sweep", out_prefix="sweep-", results_file=fr.FRONTIER_JSON, trains=train)
    cfg, st, cache, tc = run.cfg, run.setting, run.data.cache, run.cfg.train_config()
    with run.committed(say) as work:
        _announce(say, run)
        t0 = time.perf_counter()
        status(f"evaluating the non-learned rows, the bound and the best observable reference at "
               f"{len(cfg.alphas)} alpha(s) x {cfg.n_splits} splits ...", show)
        grid, fit, ref_s = _grid(run)
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": time.perf_counter() - t0, "best_observable_s": ref_s}
        learned: tuple[str, ...] = ()
        if train:
            block = run.execution.member_block
            say(f"  trainer: preset {cfg.preset}, {tc.iterations} iterations; {len(cfg.alphas)} alpha(s) x "
                f"{cfg.seeds} seed(s) x the learned rows, one program" + (f", {block} member(s) per block" if block else ""))
            status("training the learned rows at every alpha (the first chunk compiles first), then evaluating "
                   "them ...", show)
            got, t_learn = train_sweep(cfg, run.data, run.execution)
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
        add_frontier_guarantees(frontier, grid, cfg.guarantee_of)
        status("writing frontier.json, frontier.md and frontier.png ...", show)
        md = fr.write_frontier(work, frontier)
    out = run.out
    say("")
    say(md.rstrip("\n"))
    say("")
    say(f"wrote {out}/: {fr.FRONTIER_JSON}, {fr.FRONTIER_MD}, {fr.FRONTIER_PNG}, {RUN_FILE}"
        + "".join(f", {d}/" for d in (TB_DIR, CKPT_DIR) if (out / d).is_dir()))
    return SweepResult(out_dir=out, frontier=frontier, table=md)
