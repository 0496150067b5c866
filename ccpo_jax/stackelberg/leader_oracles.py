"""The learned leader against brute force (docs/stackelberg.md, "Leader oracles"): per controller and
environment, the best constant and the best (task, model) table of
:mod:`ccpo_jax.stackelberg.oracle`, the learned and the untrained leader, on the same fresh sessions."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.governance.session import N_TASKS, SessionEnv

from .acting import RolloutParams, make_act, make_follower
from .config import StackelbergConfig
from .evaluate import rollout_episodes
from .oracle import leader_candidates, oracle_search, paired_gap, score, session_summary


def leader_oracles(cfg: StackelbergConfig, params, ctrls: dict, u_head, key,
                   modes: tuple[str, ...] = ("surrogate", "replay")) -> dict:
    """Per controller kind and environment, the brute-force best constant and (task, model) table
    (:func:`ccpo_jax.stackelberg.oracle.oracle_search`) next to the learned and the untrained leader,
    all on the same fresh sessions. Environments: 'surrogate' (the follower's mean action, what the
    leader's PPO maximises) and 'replay' (grid replay, repaired follower actions, as evaluated).
    Each is chosen within its own environment; the Table 4 reference rows use the surrogate's. With both,
    replay also scores the surrogate's best constant (``replay.surrogate_constant``, its
    ``gap_to_constant`` to replay's best: the transfer gap, the replay gap of a leader that is exactly
    the surrogate's best constant).
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
            fol_pp = RolloutParams(fol=c.follower_params)
            # the surrogate's constant on replay: what a learner that is perfect in the surrogate plays there
            also = {"surrogate_constant": out[kind]["surrogate"]["constant_index"]} if "surrogate" in out[kind] else {}
            res = oracle_search(env, params, follower, fol_pp, cand, sel_keys, score_keys, also)
            act = make_act(c._replace(env=env), cfg, u_head, fmode)
            run = jax.jit(jax.vmap(lambda lp: rollout_episodes(env, act, score_keys, params, fol_pp._replace(leader=lp))))
            both = jax.tree.map(lambda a, b: jnp.stack([a, b]), c.leader_params, c.leader_init_params)
            s2 = session_summary(jax.tree.map(np.asarray, run(both)))
            for i, name in enumerate(("learned", "untrained")):
                s = {k: v[i] for k, v in s2.items()}
                res[name] = {**score(s), "per_session": s}
            for name in ("learned", "untrained", "table", *also):
                res[name]["gap_to_constant"] = paired_gap(res[name]["per_session"], res["constant"]["per_session"])
            res["learned"]["gap_to_table"] = paired_gap(res["learned"]["per_session"], res["table"]["per_session"])
            out[kind][mode] = res
    return out


def oracles_and_reference_tables(cfg: StackelbergConfig, params, ctrls: dict, u_head, key, log: Callable) -> dict:
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


def strip_sessions(x):
    if isinstance(x, dict):
        return {k: strip_sessions(v) for k, v in x.items() if k != "per_session"}
    return x
