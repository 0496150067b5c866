"""The Stackelberg pipeline end to end (paper §4, §6-8, §10): grid -> surrogate -> GAIL follower ->
leader (PPO by default) -> repair -> evaluation on grid replay; writes results.json, table.md, Pareto
PNGs, TensorBoard scalars and orbax checkpoints under ``out_dir``. The stages live in their modules:
:mod:`~ccpo_jax.stackelberg.training` (controllers), :mod:`~ccpo_jax.stackelberg.leader_oracles`,
:mod:`~ccpo_jax.stackelberg.strategies` (evaluation), :mod:`~ccpo_jax.stackelberg.tables` (table.md).

Output is built in the hidden work directory ``<parent>/.<name>.partial`` and renamed to ``out_dir``
when complete (:mod:`ccpo_jax.runtime.workdir`, as ``reproduce``); ``run_pipeline(..., resume=True)``
continues a killed run from its last checkpoint, after checking that the configuration is the saved
one (the PRNG key is part of the state, so the result is the same as an uninterrupted run; finished
training phases are loaded, not recomputed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.runtime.progress import status
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import workdir
from ccpo_jax.runtime.scalars import ScalarWriter
from envs.cache.atomic import atomic_write_text
from envs.cache.schema import jsonable
from envs.governance.grid import ResponseGrid, load_grid
from envs.governance.session import make_session_params
from envs.governance.synthetic import PROBE_TARGETS, generate_grid, probes
from envs.published import STACKELBERG_SURROGATE, STACKELBERG_TABLE4

from .config import StackelbergConfig
from .evaluate import BASELINE, STRATEGIES, pareto_front, pareto_plot, sim_to_real, summarise
from .leader_oracles import oracles_and_reference_tables, strip_sessions
from .leaders import leader_learner
from .repair import fit_u_need, trap_audit, u_need_labels
from .strategies import REFERENCE_ROWS, evaluate_sizes, miss_rate
from .surrogate import fit_surrogate
from .tables import leader_profile_record, write_table
from .training import train_controller


def load_or_generate_grid(cfg: StackelbergConfig) -> ResponseGrid:
    g = cfg.grid
    if g.path:
        return load_grid(g.path)
    return generate_grid(g.profile, seed=g.seed, turns=g.turns, trials=g.trials)


RUN_FILE = "run.json"
"""The saved configuration of a run, in its work directory (what ``--resume`` checks)."""


def _first_difference(old, new, where: str = "") -> tuple[str, Any, Any] | None:
    """The first (dotted key, old, new) where two JSON values differ, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            d = _first_difference(old.get(k), new.get(k), f"{where}.{k}" if where else k)
            if d is not None:
                return d
        return None
    return None if old == new else (where, old, new)


def run_pipeline(cfg: StackelbergConfig, out_dir: str | os.PathLike, progress: bool = True, log: Callable = print,
                 resume: bool = False) -> dict:
    """Run everything and write ``out_dir``/{results.json, table.md, pareto_*.png, tb/, checkpoints/, run.json}.

    The run is built in ``<parent>/.<name>.partial`` and renamed when complete; ``out_dir`` must not
    exist. ``resume=True`` continues the killed run of ``out_dir`` (or of that work directory), whose
    saved configuration must equal ``cfg`` (else a :class:`UserError` naming the first differing field).
    A run that fails before its first checkpoint leaves nothing behind; after it, the work directory
    stays for ``--resume``."""
    try:
        leader_learner(cfg.leader_learner)
    except ValueError as e:
        raise UserError(str(e), field="leader_learner") from None
    saved = jsonable(dataclasses.asdict(cfg))
    if resume:
        out, work = workdir.interrupted_run(Path(out_dir), RUN_FILE, field="resume")
        try:
            old = json.loads((work / RUN_FILE).read_text())
        except ValueError as e:
            raise UserError(f"resume: {work / RUN_FILE} is damaged ({e})", field="resume") from None
        workdir.refuse_other_command(old, "stackelberg", out)
        try:
            old = old["config"]
            old.setdefault("leader_learner", "ppo")  # a run saved before the field existed: the paper's PPO
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"resume: {work / RUN_FILE} is damaged ({e})", field="resume") from None
        diff = _first_difference(old, saved)
        if diff is not None:
            raise UserError(f"resume: the interrupted run used {diff[0]}={diff[1]!r}, not {diff[2]!r}; pass the "
                            "options of that run", field="resume")
    else:
        out = Path(out_dir)
        workdir.check_new_out(out, field="out_dir")

    def save(work: Path) -> None:
        atomic_write_text(work / RUN_FILE, json.dumps({"config": saved}, indent=2) + "\n")

    with workdir.committed(out, resuming=resume, resume=f"ccpo-jax stackelberg --resume {out} (with the run's options)",
                           save=save, say=log) as work:
        res = _run_in(cfg, work, progress, log)
    return res


def _run_in(cfg: StackelbergConfig, out: Path, progress: bool, log: Callable) -> dict:
    """The pipeline itself, writing into the work directory ``out``."""
    t_start = time.time()
    status("loading the response grid ...", progress)
    grid = load_or_generate_grid(cfg)
    syn = grid.manifest.is_synthetic
    tag = "SYNTHETIC" if syn else "real"
    log(f"response grid {grid.manifest.name!r} ({tag}, {grid.n_cells} cells)")
    if cfg.synthetic_leader:
        log(f"leader utility: SYNTHETIC profile '{cfg.leader_profile}' ({leader_profile_record(cfg)})")
    status("fitting the surrogate and the tool-need head ...", progress)
    fit = fit_surrogate(grid, cfg.surrogate)
    log(f"surrogate (held-out): token R^2 {fit.metrics['token_r2']:.3f} MAE {fit.metrics['token_mae']:.1f}; "
        f"quality R^2 {fit.metrics['quality_r2']:.3f} MAE {fit.metrics['quality_mae']:.3f}")
    params = make_session_params(grid, fit.weights)
    u_head = fit_u_need(grid, cfg.repair)
    key = jax.random.PRNGKey(cfg.seed)
    writer = ScalarWriter(out / "tb", ".stackelberg")  # synchronous: a full disk raises, never hangs
    t_train = time.time()
    ctrls = {}
    for i, kind in enumerate(("scalar", "task")):
        status(f"training the {kind} controller (GAIL follower, then the leader; each chunk compiles first) ...",
               progress)
        ctrls[kind] = train_controller(kind, cfg, params, jax.random.fold_in(key, i), out / "checkpoints", writer, progress)
        log(f"trained {kind} controller: leader surrogate return per seed {ctrls[kind].report['leader_return_per_seed']}")
    writer.close()
    train_s = time.time() - t_train
    t_oracle = time.time()
    status("the oracle leaders and the reference tables ...", progress)
    oracles = oracles_and_reference_tables(cfg, params, ctrls, u_head, key, log)
    oracle_s = time.time() - t_oracle
    t_eval = time.time()
    ekey = jax.random.PRNGKey(cfg.eval.seed)
    evals, raw_runs = {}, {}
    sizes = (("paper_size", cfg.eval.paper_episodes), ("large", cfg.eval.episodes))
    status(f"evaluating the strategies ({cfg.eval.paper_episodes} and {cfg.eval.episodes} episodes) and writing "
           "the Pareto plots ...", progress)
    all_runs = evaluate_sizes(cfg, params, ctrls, u_head, [(n, jax.random.fold_in(ekey, n)) for _, n in sizes])
    for (size, n), runs in zip(sizes, all_runs):
        raw_runs[size] = runs
        main = {k: runs[k] for k in STRATEGIES}
        summ = summarise(main, cfg.repair.trap)
        front = pareto_front({k: (v["tokens_per_turn"], v["quality"]) for k, v in summ.items()})
        ref = summarise({BASELINE: runs[BASELINE], **{k: runs[k] for k in REFERENCE_ROWS}}, cfg.repair.trap)
        evals[size] = {"episodes": n, "turns": cfg.eval.turns, "strategies": summ, "pareto_front": front,
                       "reference": {k: ref[k] for k in REFERENCE_ROWS}}
        pareto_plot(summ, out / f"pareto_{size}.png",
                    f"{n} episodes x {cfg.eval.turns} turns, grid replay{' (SYNTHETIC grid)' if syn else ''}")
    large = raw_runs["large"]
    audit = {name: trap_audit(large[src][field].reshape(-1, 3), cfg.repair.trap) for name, src, field in (
        ("Scalar raw", "Scalar raw", "a_exec"), ("Task-aware raw", "Task-aware raw", "a_exec"),
        ("Scalar + proj.", "Scalar+proj", "a_exec"), ("Task-aware + proj.", "Task-aware+proj", "a_exec"),
        ("Scalar+R", "Scalar+R", "a_exec"), ("Task-aware+R", "Task-aware+R", "a_exec"))}
    lab = u_need_labels(grid, cfg.repair)
    K, M = len(grid.manifest.task_types), len(grid.manifest.model_conditions)
    true_need = np.zeros((K, M))
    np.add.at(true_need, (lab["task"], lab["model"]), lab["u_need"])
    true_need /= grid.manifest.trials
    miss_p, miss_r = (miss_rate(large[n], true_need, cfg.repair.miss_tolerance) for n in ("Scalar+proj", "Scalar+R"))
    u_hat = np.asarray(jax.vmap(lambda k: u_head(k, 0))(jnp.arange(K)))
    tool = {"miss_rate_projection_only": miss_p, "miss_rate_repaired": miss_r,
            "u_need_hat": {grid.manifest.task_types[k]: round(float(u_hat[k]), 3) for k in range(K)},
            "u_need_grid": {grid.manifest.task_types[k]: round(float(true_need[k].mean()), 3) for k in range(K)}}
    s2r = sim_to_real({k: large[k] for k in STRATEGIES})
    eval_s = time.time() - t_eval
    pr = probes(grid)
    res = {
        "method": "stackelberg (arXiv 2606.23026)",
        "data": {"name": grid.manifest.name, "provenance": grid.manifest.provenance, "synthetic": syn,
                 "checksum": grid.checksum(), "n_cells": grid.n_cells, "task_types": list(grid.manifest.task_types),
                 "model_conditions": list(grid.manifest.model_conditions)},
        "leader_profile": leader_profile_record(cfg),
        "probes": {"measured": pr, "targets": PROBE_TARGETS},
        "surrogate": {**fit.metrics, "paper": dict(STACKELBERG_SURROGATE)},
        "training": {k: v.report for k, v in ctrls.items()},
        "leader_oracle": strip_sessions(oracles),
        "evaluation": evals,
        "paper_table4": {k: {"tokens_per_turn": v[0], "quality": v[1], "efficiency": v[2]} for k, v in STACKELBERG_TABLE4.items()},
        "trap_audit": audit,
        "tool_repair": tool,
        "sim_to_real": s2r,
        "timing": {"total_s": time.time() - t_start, "train_s": train_s, "oracle_s": oracle_s, "eval_s": eval_s},
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]},
        "config": dataclasses.asdict(cfg),
    }
    res = jsonable(res)
    atomic_write_text(out / "results.json", json.dumps(res, indent=2) + "\n")
    write_table(out / "table.md", res)
    return res
