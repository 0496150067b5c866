"""The Stackelberg pipeline end to end (paper §4, §6-8, §10): grid -> surrogate -> GAIL follower ->
PPO leader -> repair -> evaluation on grid replay; writes results.json, table.md, Pareto PNGs,
TensorBoard scalars and orbax checkpoints under ``out_dir``.

Training runs as jitted chunks of a ``lax.scan`` vmapped over seeds; after
each chunk the metrics go to TensorBoard, a checkpoint is saved, and a
progress bar advances. Output is built in the hidden work directory
``<parent>/.<name>.partial`` and renamed to ``out_dir`` when complete
(:mod:`ccpo_jax.runtime.workdir`, as ``reproduce``); ``run_pipeline(..., resume=True)``
continues a killed run from its last checkpoint, after checking that the configuration is the
saved one (the PRNG key is part of the state, so the result is the same as an uninterrupted
run; finished training phases are loaded, not recomputed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.errors import UserError
from ccpo_jax.runtime import loop, workdir
from ccpo_jax.runtime.scalars import ScalarWriter
from envs.atomic import atomic_write_text
from envs.cache import jsonable
from envs.published import STACKELBERG_SIM_TO_REAL, STACKELBERG_SURROGATE, STACKELBERG_TABLE4, STACKELBERG_TOOL_REPAIR
from envs.governance.grid import ResponseGrid, load_grid
from envs.governance.session import N_TASKS, SessionEnv, make_session_params
from envs.governance.synthetic import PROBE_TARGETS, generate_grid, probes
from envs.values import md_cell, md_code

from .config import StackelbergConfig
from .evaluate import BASELINE, STRATEGIES, pareto_front, pareto_plot, rollout_episodes, sim_to_real, summarise
from .gail import expert_demos, imitation_error, make_bc, make_gail
from .oracle import leader_candidates, oracle_search, paired_gap, score, session_summary
from .ppo import make_ppo
from .repair import fit_u_need, project_box, repair_action, trap_audit, u_need_labels
from .surrogate import fit_surrogate

class Controller(NamedTuple):
    """One trained controller ('scalar' or 'task' state), what :func:`train_controller` returns.

    ``env`` is the training (surrogate) env; evaluation swaps it with ``_replace(env=...)``.
    ``leader_tables`` (reference-row name -> leader table [K, M, 2]) is set by
    :func:`_oracles_and_reference_tables` on the scalar controller only."""
    env: Any
    policy: Any
    leader: Any
    leader_params: Any
    follower_params: Any
    leader_init_params: Any = None
    bc_params: Any = None
    best_seed: int = 0
    report: dict = {}
    leader_tables: dict = {}


class PlanEntry(NamedTuple):
    """One strategy of :func:`eval_plan`: the env kind it runs in, its controller kind (None for a static
    action), its :data:`MODES` mode and its static action (None for a learned one)."""
    env_kind: str
    controller: str | None
    mode: str
    static: tuple | None


def load_or_generate_grid(cfg: StackelbergConfig) -> ResponseGrid:
    g = cfg.grid
    if g.path:
        return load_grid(g.path)
    return generate_grid(g.profile, seed=g.seed, turns=g.turns, trials=g.trials)


def _train_chunks(name: str, init: Callable, run: Callable, args: tuple, in_axes: tuple, keys, iterations: int,
                  chunks: int, ckpt_root: Path, writer, progress: bool, meta: dict) -> tuple[Any, dict[str, np.ndarray]]:
    """jit(vmap(run)) over seeds, ``iterations`` in ``chunks`` pieces, through the shared host loop
    (:func:`ccpo_jax.runtime.loop.run_chunks`: TensorBoard, a checkpoint per chunk, resume after a
    configuration check). Metrics are [seeds, iterations, ...]."""
    st = jax.jit(jax.vmap(init))(*(keys if isinstance(keys, tuple) else (keys,)))
    f = jax.jit(jax.vmap(run, in_axes=(0, *in_axes, None)), static_argnums=len(args) + 1)

    def compile_chunk(n: int, placed):
        def step(s):
            s, m = f(s, *args, n)
            return s, {k: np.moveaxis(np.asarray(v), 1, -1) for k, v in m.items()}  # iterations last

        return step

    def scalars(m):  # [S, n] scalars: the seed mean
        return {f"{name}/{k}": v.mean(0) for k, v in m.items() if v.ndim == 2}

    res = loop.run_chunks(compile_chunk, st, iterations=iterations, chunk=math.ceil(iterations / chunks), desc=name,
                          ckpt_dir=ckpt_root / name, meta=dict(meta, phase=name, iterations=iterations, chunks=chunks),
                          tensorboard=writer, scalars=scalars, progress=progress)
    return res.state, {k: np.moveaxis(v, -1, 1) for k, v in res.metrics.items()}


def _take(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


def _train_follower(kind: str, env: SessionEnv, cfg: StackelbergConfig, params, key, ckpt_root: Path, writer,
                    progress: bool, meta: dict) -> dict:
    """Phase 1: behaviour cloning and GAIL on the same demonstrations, all seeds at once. The follower is
    the GAIL seed with the lowest imitation error on held-out expert states (against the noise-free
    expert action); BC's errors are reported beside it."""
    k_demo, k_bc, k_gail = jax.random.split(key, 3)
    demo_fn = jax.jit(lambda k, p: expert_demos(k, env, p, cfg.expert))
    demos = demo_fn(jax.random.fold_in(k_demo, cfg.expert.seed), params)
    held = demo_fn(jax.random.fold_in(k_demo, cfg.expert.seed + 7919), params)  # held-out expert states
    policy, bc_init, bc_run = make_bc(env.obs_dim + 2, 3, cfg.gail)
    bc_state, _ = _train_chunks(f"{kind}_follower_bc", bc_init, bc_run, (demos,), (None,),
                                jax.random.split(k_bc, cfg.seeds), cfg.gail.bc_steps, cfg.chunks, ckpt_root, writer,
                                progress, meta)
    _, _disc, g_init, g_run = make_gail(env.obs_dim + 2, 3, cfg.gail)
    g_keys = jax.random.split(k_gail, cfg.seeds)
    if cfg.gail.bc_init:  # GAIL starts from BC's policy (Adam's moments start at zero either way)
        init, g_keys = (lambda k, a: g_init(k).replace(actor=a)), (g_keys, bc_state[0])
    else:
        init = g_init
    g_state, g_metrics = _train_chunks(f"{kind}_follower_gail", init, g_run, (demos,), (None,), g_keys,
                                       cfg.gail.iterations, cfg.chunks, ckpt_root, writer, progress, meta)
    err = jax.jit(jax.vmap(lambda p: imitation_error(policy, p, held)))
    gail_err, bc_err = np.asarray(err(g_state.actor)), np.asarray(err(bc_state[0]))
    best = int(np.argmin(gail_err))
    demo_a = np.asarray(demos.action)
    return {"policy": policy, "params": _take(g_state.actor, best), "bc_params": _take(bc_state[0], int(np.argmin(bc_err))),
            "report": {
                "n_demos": int(demo_a.shape[0]), "demo_mean_action": [round(float(x), 4) for x in demo_a.mean(0)],
                "demo_trap_rate": trap_audit(demo_a, cfg.repair.trap)["trap_rate"],
                "demo_mean_t_ratio": float(np.asarray(demos.t_ratio).mean()),
                "gail_final": {k: [float(x) for x in v[:, -1]] for k, v in g_metrics.items() if v.ndim == 2},
                "imitation_error": {"gail": gail_err.tolist(), "bc": bc_err.tolist(),
                                    "label_noise": float(np.abs(np.asarray(held.action - held.clean_action)).mean()),
                                    "constant_mean_action": float(np.abs(np.asarray(held.clean_action)
                                                                         - demo_a.mean(0)).mean()),
                                    "n_held_out": int(held.obs.shape[0]), "bc_init": cfg.gail.bc_init},
                "follower_seed": best}}


def leader_raw(cfg: StackelbergConfig, a):
    """The raw leader output l~ from the leader policy's action a in [0,1]^2: widened by
    ``LeaderPPOConfig.output_margin`` m and clipped, clip((1 + 2m) a - m, 0, 1), so the corners of the
    box are reached at finite logits of the squashed policy."""
    m = cfg.leader.output_margin
    return jnp.clip((1.0 + 2.0 * m) * a - m, 0.0, 1.0) if m else a


def train_controller(kind: str, cfg: StackelbergConfig, params, key, ckpt_root: Path, writer, progress: bool) -> Controller:
    """Phase 1 (follower, :func:`_train_follower`) and phase 2 (PPO leader against that one follower) for the
    'scalar' or 'task' state; all seeds at once. The leader is the seed whose deterministic policy has the
    highest U_L on ``cfg.oracle.select_sessions`` surrogate sessions (not the scored ones)."""
    scfg = dataclasses.replace(cfg.session, state=kind, mode="surrogate")
    env = SessionEnv(scfg, n_models=int(params.grid_tokens.shape[1]))
    k_fol, k_lead, k_sel = jax.random.split(key, 3)
    meta = {"config": dataclasses.asdict(cfg), "state": kind}
    fol = _train_follower(kind, env, cfg, params, k_fol, ckpt_root, writer, progress, meta)
    policy = fol["policy"]

    def reset(k, ep):
        return env.reset(k, ep["env"])

    def step(k, s, a_leader, ep):
        x = env.observe(s)
        ell = env.commit(s, leader_raw(cfg, a_leader))
        obs = jnp.concatenate([x, ell])
        a = policy.mean(ep["fol"], obs) if cfg.leader.follower_deterministic else policy.sample(ep["fol"], obs, k)
        return env.step(jax.random.fold_in(k, 1), s, ell, a, ep["env"])

    leader, l_init, l_run = make_ppo(reset, step, env.obs_dim, 2, scfg.horizon, cfg.leader, cfg.leader.policy)
    ep = {"env": params, "fol": fol["params"]}
    l_keys = jax.random.split(k_lead, cfg.seeds)
    l_state, l_metrics = _train_chunks(f"{kind}_leader_ppo", l_init, l_run, (ep,), ({"env": None, "fol": None},),
                                       l_keys, cfg.leader.iterations, cfg.chunks, ckpt_root, writer, progress, meta)
    ctrl = Controller(env, policy, leader, leader_params=None, follower_params=fol["params"])
    act = make_act(ctrl, cfg, None, "raw")
    sel_keys = jax.random.split(k_sel, cfg.oracle.select_sessions)
    values = jax.jit(jax.vmap(lambda lp: rollout_episodes(env, act, sel_keys, params, {"leader": lp, "fol": fol["params"]})
                              ["u_leader"].sum(-1).mean()))(l_state.actor)
    values = np.asarray(values)
    best = int(np.argmax(values))
    ret = l_metrics["episode_return"]  # [S, iters]
    tail = max(1, ret.shape[1] // 10)
    return ctrl._replace(
        best_seed=best, bc_params=fol["bc_params"],
        leader_params=_take(l_state.actor, best), leader_init_params=jax.jit(l_init)(l_keys[best]).actor,
        report={
            "state_dim": env.obs_dim, **fol["report"],
            "leader_return_per_seed": [float(x) for x in ret[:, -tail:].mean(1)],
            "leader_selection_value_per_seed": values.tolist(),
            "selected_seed": best,
        })


def make_follower(policy, cfg: StackelbergConfig, u_head, mode: str):
    """``follower(pp, obs, state) -> (a_raw, a_exec)``: the follower's mean action on ``obs`` = [x, l], then
    nothing ('raw'), the projection onto A_real ('proj') or the projection and tool repair ('repair')."""
    def follower(pp, obs, st):
        a_raw = policy.mean(pp["fol"], obs)
        if mode == "raw":
            return a_raw, a_raw
        if mode == "proj":
            return a_raw, project_box(a_raw, cfg.repair.box_low, cfg.repair.box_high)
        return a_raw, repair_action(a_raw, u_head(st.task, st.model), cfg.repair)

    return follower


def make_act(ctrl: Controller | None, cfg: StackelbergConfig, u_head, mode: str, static=None):
    """``act(pp, x, state) -> (ell, a_raw, a_exec)`` for a static action or a learned controller.

    Mode 'table' plays the leader table ``pp["table"]`` [K, M, 2] (raw l~ per task and model
    condition: the brute-force oracles of :mod:`ccpo_jax.stackelberg.oracle`) instead of the
    learned leader, with the repaired follower."""
    ell0 = jnp.asarray(cfg.session.ell_init, jnp.float32)
    if static is not None:
        a = jnp.asarray(static, jnp.float32)
        return lambda pp, x, st: (ell0, a, a)
    env, policy, leader = ctrl.env, ctrl.policy, ctrl.leader
    follower = make_follower(policy, cfg, u_head, "repair" if mode == "table" else mode)

    def act(pp, x, st):
        raw = pp["table"][st.task, st.model] if mode == "table" else leader_raw(cfg, leader.mean(pp["leader"], x))
        ell = env.commit(st, raw)
        a_raw, a = follower(pp, jnp.concatenate([x, ell]), st)
        return ell, a_raw, a

    return act


def leader_oracles(cfg: StackelbergConfig, params, ctrls: dict, u_head, key,
                   modes: tuple[str, ...] = ("surrogate", "replay")) -> dict:
    """Per controller kind and environment, the brute-force best constant and (task, model) table
    (:func:`ccpo_jax.stackelberg.oracle.oracle_search`) next to the learned and the untrained leader,
    all on the same fresh sessions. Environments: 'surrogate' (the follower's mean action, what the
    leader's PPO maximises) and 'replay' (grid replay, repaired follower actions, as evaluated).
    Each is chosen within its own environment; the Table 4 reference rows use the surrogate's.
    ``modes``: the environments to search (a subset of those two)."""
    oc = cfg.oracle
    cand = leader_candidates(oc.levels)
    k_sel, k_score = jax.random.split(jax.random.fold_in(key, oc.seed))
    sel_keys = jax.random.split(k_sel, oc.select_sessions)
    score_keys = jax.random.split(k_score, oc.score_sessions)
    out: dict[str, dict] = {}
    for kind, c in ctrls.items():
        out[kind] = {}
        for mode, fmode, horizon in (("surrogate", "raw", cfg.session.horizon), ("replay", "repair", cfg.eval.turns)):
            if mode not in modes:
                continue
            env = SessionEnv(dataclasses.replace(cfg.session, state=kind, mode=mode, horizon=horizon), c.env.n_models)
            follower = make_follower(c.policy, cfg, u_head, fmode)
            fol_pp = {"fol": c.follower_params}
            res = oracle_search(env, params, follower, fol_pp, cand, sel_keys, score_keys)
            act = make_act(c._replace(env=env), cfg, u_head, fmode)
            run = jax.jit(jax.vmap(lambda lp: rollout_episodes(env, act, score_keys, params, dict(fol_pp, leader=lp))))
            both = jax.tree.map(lambda a, b: jnp.stack([a, b]), c.leader_params, c.leader_init_params)
            s2 = session_summary(jax.tree.map(np.asarray, run(both)))
            for i, name in enumerate(("learned", "untrained")):
                s = {k: v[i] for k, v in s2.items()}
                res[name] = {**score(s), "per_session": s}
            for name in ("learned", "untrained", "table"):
                res[name]["gap_to_constant"] = paired_gap(res[name]["per_session"], res["constant"]["per_session"])
            res["learned"]["gap_to_table"] = paired_gap(res["learned"]["per_session"], res["table"]["per_session"])
            out[kind][mode] = res
    return out


def _oracles_and_reference_tables(cfg: StackelbergConfig, params, ctrls: dict, u_head, key, log: Callable) -> dict:
    """:func:`leader_oracles`, logged; the surrogate's scalar choices become the leader tables of the
    'Best constant+R' and 'Best table+R' reference rows (``ctrls["scalar"].leader_tables``)."""
    oracles = leader_oracles(cfg, params, ctrls, u_head, key)
    so = oracles["scalar"]["surrogate"]
    M = int(params.grid_tokens.shape[1])
    ctrls["scalar"] = ctrls["scalar"]._replace(leader_tables={
        "Best constant+R": np.broadcast_to(np.asarray(so["constant"]["action"], np.float32), (N_TASKS, M, 2)),
        "Best table+R": np.asarray(so["table"]["actions"], np.float32)})
    for kind, r in oracles.items():
        for mode, o in r.items():
            log(f"leader oracle ({kind}, {mode}): U_L per session best constant {o['constant']['u_leader']:.3f} "
                f"{o['constant']['action']}, best table {o['table']['u_leader']:.3f}, learned {o['learned']['u_leader']:.3f}, "
                f"untrained {o['untrained']['u_leader']:.3f} (se {o['constant']['u_leader_se']:.3f})")
    return oracles


def _strip_sessions(x):
    if isinstance(x, dict):
        return {k: _strip_sessions(v) for k, v in x.items() if k != "per_session"}
    return x


REFERENCE_ROWS = ("Untrained+R", "Best constant+R", "Best table+R")
"""Table 4 reference rows (not strategies of the paper): what repair alone gives under an untrained leader,
and the brute-force leader oracles chosen in the surrogate (:func:`leader_oracles`)."""

MODES = ("static", "raw", "proj", "repair", "table")
"""Strategy modes; in one env kind the mode is a traced index into this tuple (see :func:`make_strategy_act`)."""


def eval_plan(cfg: StackelbergConfig) -> dict[str, PlanEntry]:
    """The five strategies of Table 4 (arXiv 2606.23026 §10.2) plus 'Scalar raw' and the projection-only
    variants of the audits (Table 7, §8): name -> (env kind, controller kind, mode, static action)."""
    return {
        "Middle": PlanEntry("scalar", None, "static", cfg.eval.middle),
        "Conservative": PlanEntry("scalar", None, "static", cfg.eval.conservative),
        "Task-aware raw": PlanEntry("task", "task", "raw", None),
        "Scalar+R": PlanEntry("scalar", "scalar", "repair", None),
        "Task-aware+R": PlanEntry("task", "task", "repair", None),
        "Scalar raw": PlanEntry("scalar", "scalar", "raw", None),
        "Scalar+proj": PlanEntry("scalar", "scalar", "proj", None),
        "Task-aware+proj": PlanEntry("task", "task", "proj", None),
        # reference rows (docs/stackelberg.md, "Leader oracles"): the same scalar follower and repair under
        # an untrained leader, the best constant and the best (task, model) table found by brute force
        "Untrained+R": PlanEntry("scalar", "scalar", "repair", None),
        "Best constant+R": PlanEntry("scalar", "scalar", "table", None),
        "Best table+R": PlanEntry("scalar", "scalar", "table", None),
    }


def make_strategy_act(ctrl: Controller, cfg: StackelbergConfig, u_head):
    """One ``act`` for every strategy of an env kind: ``pp["mode"]`` (an index into :data:`MODES`) picks
    the :func:`make_act` branch and ``pp["static"]`` is the static action; both are traced, so the
    strategies of a kind share one program (vmapped over them, the branches become a select)."""
    learned = [make_act(ctrl, cfg, u_head, m) for m in MODES[1:]]
    branches = [lambda pp, x, st: make_act(None, cfg, u_head, "static", pp["static"])(pp, x, st), *learned]
    return lambda pp, x, st: jax.lax.switch(pp["mode"], branches, pp, x, st)


def _episode_keys(key, i: int, episodes: int):
    """Strategy ``i``'s episode keys: those :func:`rollout` draws from ``fold_in(key, i)``."""
    return jax.random.split(jax.random.fold_in(key, i), episodes)


def evaluate_sizes(cfg: StackelbergConfig, params, ctrls: dict, u_head, sizes: list[tuple[int, Any]]) -> list[dict[str, dict]]:
    """The strategies of :func:`eval_plan` on grid replay for each ``(episodes, key)`` of ``sizes``
    (name -> per-turn arrays [N, H]), with one rollout program per env kind: the strategies of a
    kind are vmapped (traced mode, static action and episode keys; the kind's controller
    parameters shared) and the episode counts are concatenated along the episode axis."""
    n_models = int(params.grid_tokens.shape[1])
    plan = eval_plan(cfg)
    index = {name: i for i, name in enumerate(plan)}
    out: list[dict[str, dict]] = [{} for _ in sizes]
    for kind in ("scalar", "task"):
        names = [n for n, v in plan.items() if v.env_kind == kind]
        env = SessionEnv(dataclasses.replace(cfg.session, state=kind, mode="replay", horizon=cfg.eval.turns), n_models)
        c = ctrls[kind]
        ctrl = c._replace(env=env)  # commit() uses the same smoothing config in replay
        tables = c.leader_tables
        no_table = jnp.zeros((N_TASKS, n_models, 2), jnp.float32)
        init = c.leader_params if c.leader_init_params is None else c.leader_init_params
        leaders = [init if n == "Untrained+R" else c.leader_params for n in names]
        pp = {"leader": jax.tree.map(lambda *xs: jnp.stack(xs), *leaders), "fol": c.follower_params,
              "mode": jnp.asarray([MODES.index(plan[n].mode) for n in names], jnp.int32),
              "static": jnp.asarray([plan[n].static or (0.0, 0.0, 0.0) for n in names], jnp.float32),
              "table": jnp.stack([jnp.asarray(tables[n], jnp.float32) if n in tables else no_table for n in names])}
        keys = jnp.stack([jnp.concatenate([_episode_keys(k, index[n], e) for e, k in sizes]) for n in names])
        f = jax.jit(jax.vmap(lambda k, p, pp: rollout_episodes(env, make_strategy_act(ctrl, cfg, u_head), k, p, pp),
                             in_axes=(0, None, {"leader": 0, "fol": None, "mode": 0, "static": 0, "table": 0})))
        res = jax.tree.map(np.asarray, f(keys, params, pp))
        starts = np.cumsum([0] + [e for e, _ in sizes])
        for j, (e, _) in enumerate(sizes):
            for s, n in enumerate(names):
                out[j][n] = {k: v[s, starts[j]:starts[j] + e] for k, v in res.items()}
    return [{n: o[n] for n in plan} for o in out]


def _fmt_p(p) -> str:
    if p is None:
        return "-"
    if p != p:
        return "n/a"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def _oracle_table(res: dict) -> str:
    """The leader oracle section of table.md: U_L per session (se) and tokens per turn on fresh sessions."""
    oc = res["config"]["oracle"]
    lp = res.get("leader_profile") or {"name": "paper", "synthetic": False}
    tag = f"SYNTHETIC leader profile '{lp['name']}'; " if lp["synthetic"] else ""
    L = [f"\n## Leader oracles ({tag}U_L per session and tokens per turn on {oc['score_sessions']} fresh sessions; "
         f"best constant over a {oc['levels']}x{oc['levels']} grid of (q, alpha) and best (task, model) table, "
         f"both chosen on {oc['select_sessions']} other sessions)\n",
         "| Controller | Environment | Best constant (q, alpha) | Best constant | Best table | Learned (PPO) | Untrained | "
         "PPO - best constant (paired se) | PPO - best table (paired se) |", "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda o: f"{o['u_leader']:.3f} ({o['u_leader_se']:.3f}) / {o['tokens_per_turn']:.1f}"
    for kind, r in res.get("leader_oracle", {}).items():
        for mode, o in r.items():
            g, gt = o["learned"]["gap_to_constant"], o["learned"].get("gap_to_table")
            gt = f"{gt['mean']:+.3f} ({gt['se']:.3f})" if gt else "-"
            L.append(f"| {kind} | {mode} | {o['constant']['action']} | {cell(o['constant'])} | {cell(o['table'])} | "
                     f"{cell(o['learned'])} | {cell(o['untrained'])} | {g['mean']:+.3f} ({g['se']:.3f}) | {gt} |")
    return "\n".join(L)


def leader_profile_record(cfg: StackelbergConfig) -> dict:
    """results.json's ``leader_profile``: the leader utility's profile name, whether it is SYNTHETIC, its weights."""
    s = cfg.session
    return {"name": cfg.leader_profile, "synthetic": cfg.synthetic_leader,
            "w_savings": list(s.leader_w_s_task) if s.leader_w_s_task is not None else s.leader_w_s,
            "w_quality": list(s.leader_w_q_task) if s.leader_w_q_task is not None else s.leader_w_q,
            "w_subsidy": s.leader_w_alpha}


def leader_profile_line(res: dict) -> str:
    """table.md's line naming a SYNTHETIC leader utility profile ('' for the paper's)."""
    lp = res.get("leader_profile") or {"name": "paper", "synthetic": False}
    if not lp["synthetic"]:
        return ""
    return (f"Leader utility: SYNTHETIC profile '{lp['name']}' (not the paper's): per task type, savings weight "
            f"{lp['w_savings']}, quality weight {lp['w_quality']}, subsidy cost {lp['w_subsidy']} "
            f"(docs/stackelberg.md, \"A leader profile where state feedback matters\").\n")


def write_table(path: Path, res: dict) -> None:
    syn = res["data"]["synthetic"]
    L = []
    label = "SYNTHETIC response grid (not real LLM data)" if syn else "real response grid"
    L.append(f"# Stackelberg resource governance (arXiv 2606.23026): results on a {label}\n")
    if leader_profile_line(res):
        L.append(leader_profile_line(res))
    L.append(f"Grid {md_code(res['data']['name'])} ({res['data']['n_cells']} cells, provenance {md_cell(res['data']['provenance'].get('kind'))}); "
             f"pipeline wall time {res['timing']['total_s']:.1f} s on {res['environment']['backend']}.\n")
    for key, title in (("paper_size", "paper size"), ("large", "large")):
        ev = res["evaluation"][key]
        L.append(f"\n## Table 4 ({title}: {ev['episodes']} episodes x {ev['turns']} turns, grid replay{', SYNTHETIC' if syn else ''})\n")
        L.append("| Policy | Tok./turn | Q | Eff. (Q/T x 1e3) | dTok vs Cons. | p tokens (Welch) | p quality (Welch) | Pareto | Paper Tok. / Q / Eff. |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for n in STRATEGIES:
            r = ev["strategies"][n]
            pt = STACKELBERG_TABLE4[n]
            L.append(f"| {n} | {r['tokens_per_turn']:.1f} | {r['quality']:.3f} | {r['efficiency']:.3f} | "
                     f"{100 * r['token_change_vs_conservative']:+.1f}% | {_fmt_p(r['p_tokens_vs_conservative'])} | "
                     f"{_fmt_p(r['p_quality_vs_conservative'])} | {'yes' if n in ev['pareto_front'] else 'no'} | "
                     f"{pt[0]} / {pt[1]} / {pt[2]} |")
        for n, r in ev.get("reference", {}).items():
            L.append(f"| *{n}* (reference) | {r['tokens_per_turn']:.1f} | {r['quality']:.3f} | {r['efficiency']:.3f} | "
                     f"{100 * r['token_change_vs_conservative']:+.1f}% | {_fmt_p(r['p_tokens_vs_conservative'])} | "
                     f"{_fmt_p(r['p_quality_vs_conservative'])} | - | - |")
    L.append(_oracle_table(res))
    ev = res["evaluation"]["large"]
    L.append(f"\n## Table 5 (per task, tokens / quality, large run{', SYNTHETIC' if syn else ''})\n")
    L.append("| Task | " + " | ".join(STRATEGIES) + " |")
    L.append("|---|" + "---|" * len(STRATEGIES))
    tasks = res["data"]["task_types"]
    for t in tasks:
        cells = []
        for n in STRATEGIES:
            pt = ev["strategies"][n]["per_task"].get(t)
            cells.append(f"{pt['tokens']:.0f} / {pt['quality']:.2f}" if pt else "-")
        L.append(f"| {md_cell(t)} | " + " | ".join(cells) + " |")
    L.append("\n## Table 7 (trap audit: c > 0.9 or p > 0.7 or u > 0.5; large run)\n")
    L.append("| Mode | Mean action [c, p, u] | Trap rate |")
    L.append("|---|---|---|")
    for n, a in res["trap_audit"].items():
        L.append(f"| {n} | {a['mean_action']} | {100 * a['trap_rate']:.1f}% |")
    s = res["surrogate"]
    L.append("\n## Table 3 (surrogate payoff oracle, held-out split)\n")
    L.append("| Quantity | Ours | Paper |")
    L.append("|---|---|---|")
    ps = STACKELBERG_SURROGATE
    L.append(f"| Samples (train / test) | {s['n_train']} / {s['n_test']} | {ps['n']} |")
    L.append(f"| Token R^2 (MAE) | {s['token_r2']:.3f} ({s['token_mae']:.1f} tokens) | {ps['token_r2']} ({ps['token_mae']}) |")
    L.append(f"| Quality R^2 (MAE) | {s['quality_r2']:.3f} ({s['quality_mae']:.3f}) | {ps['quality_r2']} ({ps['quality_mae']:.3f}) |")
    f = res["sim_to_real"]
    L.append("\n## Sim-to-real token fit (surrogate vs replay, every evaluated turn of the large run)\n")
    pf = STACKELBERG_SIM_TO_REAL
    L.append(f"T_corr = {f['a']:.4f} T_sim + {f['b']:.1f} (paper {pf['a']} T_sim + {pf['b']}); token r = {f['token_pearson_r']:.3f} "
             f"(paper {pf['token_pearson_r']}); quality r = {f['quality_pearson_r']:.3f} (paper {pf['quality_pearson_r']}); mean tokens sim {f['mean_tokens_sim']:.0f} "
             f"vs replay {f['mean_tokens_real']:.0f}.\n")
    tr = res["tool_repair"]
    L.append("## Coding-aware tool repair (large run, Scalar controller)\n")
    L.append(f"Low-tool miss rate on tasks that need tools: projection only {100 * tr['miss_rate_projection_only']:.1f}% -> "
             f"projection + tool repair {100 * tr['miss_rate_repaired']:.1f}% (paper {100 * STACKELBERG_TOOL_REPAIR['miss_rate_projection_only']:.1f}% -> "
             f"{100 * STACKELBERG_TOOL_REPAIR['miss_rate_repaired']:.1f}%); u_need-hat per task: {tr['u_need_hat']}.\n")
    pr = res["probes"]
    L.append("## Grid probes (measured vs paper target)\n")
    L.append("| Probe | Measured | Target |")
    L.append("|---|---|---|")
    for k, v in pr["measured"].items():
        tgt = pr["targets"].get(k)
        L.append(f"| {k} | {v:.3f} | {'' if tgt is None else f'{tgt:.3f}'} |")
    atomic_write_text(path, "\n".join(L) + "\n")


def miss_rate(run: dict, true_need: np.ndarray, tol: float) -> float:
    """The low-tool miss rate of one strategy's rollout (``run`` with 'task', 'model', 'a_exec'): the share
    of turns on tasks that need tools (grid u_need > 1e-6) whose executed tool budget u falls more than
    ``tol`` below the need; NaN when no turn needs tools."""
    need = true_need[run["task"], run["model"]]
    coding = need > 1e-6
    return float(np.mean(run["a_exec"][..., 2][coding] < need[coding] - tol)) if coding.any() else float("nan")


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
        except (KeyError, TypeError) as e:
            raise UserError(f"resume: {work / RUN_FILE} is damaged ({e})", field="resume") from None
        diff = _first_difference(old, saved)
        if diff is not None:
            raise UserError(f"resume: the interrupted run used {diff[0]}={diff[1]!r}, not {diff[2]!r}; pass the "
                            "options of that run", field="resume")
    else:
        out = Path(out_dir)
        workdir.check_new_out(out, field="out_dir")
        work = workdir.work_dir(out)
        work.mkdir(parents=True)
        atomic_write_text(work / RUN_FILE, json.dumps({"config": saved}, indent=2) + "\n")
    try:
        res = _run_in(cfg, work, progress, log)
        os.replace(work, out)
    except BaseException as e:
        workdir.after_failure(e, work, created=not resume,
                              resume_hint=f"continue with the same options and `--resume {out}`")
        raise
    return res


def _run_in(cfg: StackelbergConfig, out: Path, progress: bool, log: Callable) -> dict:
    """The pipeline itself, writing into the work directory ``out``."""
    t_start = time.time()
    grid = load_or_generate_grid(cfg)
    syn = grid.manifest.is_synthetic
    tag = "SYNTHETIC" if syn else "real"
    log(f"response grid {grid.manifest.name!r} ({tag}, {grid.n_cells} cells)")
    if cfg.synthetic_leader:
        log(f"leader utility: SYNTHETIC profile '{cfg.leader_profile}' ({leader_profile_record(cfg)})")
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
        ctrls[kind] = train_controller(kind, cfg, params, jax.random.fold_in(key, i), out / "checkpoints", writer, progress)
        log(f"trained {kind} controller: leader surrogate return per seed {ctrls[kind].report['leader_return_per_seed']}")
    writer.close()
    train_s = time.time() - t_train
    t_oracle = time.time()
    oracles = _oracles_and_reference_tables(cfg, params, ctrls, u_head, key, log)
    oracle_s = time.time() - t_oracle
    t_eval = time.time()
    ekey = jax.random.PRNGKey(cfg.eval.seed)
    evals, raw_runs = {}, {}
    sizes = (("paper_size", cfg.eval.paper_episodes), ("large", cfg.eval.episodes))
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
        "leader_oracle": _strip_sessions(oracles),
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
