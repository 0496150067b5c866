"""The evaluated strategies (paper §10.2, Table 4, and the audits of §8) and their rollouts on grid replay:
one rollout program per env kind, the strategies of a kind vmapped over a traced mode."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.governance.session import N_TASKS, SessionEnv

from .acting import Controller, RolloutParams, make_act
from .config import StackelbergConfig
from .evaluate import rollout_episodes


class PlanEntry(NamedTuple):
    """One strategy of :func:`eval_plan`: the env kind it runs in, its controller kind (None for a static
    action), its :data:`MODES` mode, its static action (None for a learned one) and its follower: the
    controller's GAIL follower ('gail') or the behaviour-cloning one trained beside it ('bc')."""
    env_kind: str
    controller: str | None
    mode: str
    static: tuple | None
    follower: str = "gail"


REFERENCE_ROWS = ("Untrained+R", "Best constant+R", "Best table+R", "Scalar+R, BC follower", "Task-aware+R, BC follower")
"""Table 4 reference rows (not strategies of the paper): what repair alone gives under an untrained leader,
the brute-force leader oracles chosen in the surrogate (:func:`ccpo_jax.stackelberg.leader_oracles.leader_oracles`),
and the two repaired controllers with their behaviour-cloning follower in place of GAIL's (the same leader:
the two follower learners side by side)."""

MODES = ("static", "raw", "proj", "repair", "table")
"""Strategy modes; in one env kind the mode is a traced index into this tuple (see :func:`make_strategy_act`)."""


def eval_plan(cfg: StackelbergConfig) -> dict[str, PlanEntry]:
    """The five strategies of Table 4 (arXiv 2606.23026 §10.2) plus 'Scalar raw' and the projection-only
    variants of the audits (Table 7, §8) and the reference rows: name -> :class:`PlanEntry`."""
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
        # the follower learners side by side: the same leaders and repair with the BC follower (appended
        # last, so every other row keeps its episode keys)
        "Scalar+R, BC follower": PlanEntry("scalar", "scalar", "repair", None, "bc"),
        "Task-aware+R, BC follower": PlanEntry("task", "task", "repair", None, "bc"),
    }


def make_strategy_act(ctrl: Controller, cfg: StackelbergConfig, u_head):
    """One ``act`` for every strategy of an env kind: ``pp.mode`` (an index into :data:`MODES`) picks
    the :func:`make_act` branch and ``pp.static`` is the static action; both are traced, so the
    strategies of a kind share one program (vmapped over them, the branches become a select)."""
    learned = [make_act(ctrl, cfg, u_head, m) for m in MODES[1:]]
    branches = [lambda pp, x, st: make_act(None, cfg, u_head, "static", pp.static)(pp, x, st), *learned]
    return lambda pp, x, st: jax.lax.switch(pp.mode, branches, pp, x, st)


def _episode_keys(key, i: int, episodes: int):
    """Strategy ``i``'s episode keys: those :func:`rollout` draws from ``fold_in(key, i)``."""
    return jax.random.split(jax.random.fold_in(key, i), episodes)


def evaluate_sizes(cfg: StackelbergConfig, params, ctrls: dict, u_head, sizes: list[tuple[int, Any]]) -> list[dict[str, dict]]:
    """The strategies of :func:`eval_plan` on grid replay for each ``(episodes, key)`` of ``sizes``
    (name -> per-turn arrays [N, H]), with one rollout program per env kind: the strategies of a
    kind are vmapped (traced mode, static action, leader and follower parameters and episode keys)
    and the episode counts are concatenated along the episode axis."""
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
        fols = [c.bc_params if plan[n].follower == "bc" else c.follower_params for n in names]
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731
        pp = RolloutParams(
            leader=stack(leaders), fol=stack(fols),
            mode=jnp.asarray([MODES.index(plan[n].mode) for n in names], jnp.int32),
            static=jnp.asarray([plan[n].static or (0.0, 0.0, 0.0) for n in names], jnp.float32),
            table=jnp.stack([jnp.asarray(tables[n], jnp.float32) if n in tables else no_table for n in names]))
        keys = jnp.stack([jnp.concatenate([_episode_keys(k, index[n], e) for e, k in sizes]) for n in names])
        f = jax.jit(jax.vmap(lambda k, p, pp: rollout_episodes(env, make_strategy_act(ctrl, cfg, u_head), k, p, pp),
                             in_axes=(0, None, RolloutParams(leader=0, fol=0, mode=0, static=0, table=0))))
        res = jax.tree.map(np.asarray, f(keys, params, pp))
        starts = np.cumsum([0] + [e for e, _ in sizes])
        for j, (e, _) in enumerate(sizes):
            for s, n in enumerate(names):
                out[j][n] = {k: v[s, starts[j]:starts[j] + e] for k, v in res.items()}
    return [{n: o[n] for n in plan} for o in out]


def miss_rate(run: dict, true_need: np.ndarray, tol: float) -> float:
    """The low-tool miss rate of one strategy's rollout (``run`` with 'task', 'model', 'a_exec'): the share
    of turns on tasks that need tools (grid u_need > 1e-6) whose executed tool budget u falls more than
    ``tol`` below the need; NaN when no turn needs tools."""
    need = true_need[run["task"], run["model"]]
    coding = need > 1e-6
    return float(np.mean(run["a_exec"][..., 2][coding] < need[coding] - tol)) if coding.any() else float("nan")
