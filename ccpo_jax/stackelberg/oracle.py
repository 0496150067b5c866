"""Brute-force leader oracles: the best constant commitment and the best per-(task, model) table.

The learned leader (PPO, :mod:`ccpo_jax.stackelberg.ppo`) is read against the best
policy that a brute-force search finds in two simple families, under the same
follower and the same environment:

- **constant**: one raw leader output l~ = (q, alpha) on a ``levels`` x ``levels``
  grid over [0, 1]^2, played on every turn of every session;
- **table**: one grid point per (task, model condition) cell. A session's task and
  model condition are fixed, so a table's sessions in cell g behave exactly as the
  constant candidate it assigns to g; the table's arg max is therefore the
  per-cell arg max of the constant candidates, which makes the search exact.

Both are chosen on one set of sessions (``select`` keys) and scored on fresh ones
(``score`` keys): the score is an unbiased estimate of the chosen policy's value.
All candidates share each session's keys (common random numbers), so their
comparison is paired. The value is the leader utility U_L summed over the
session's turns (what PPO maximises, undiscounted), per session.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.governance.session import N_TASKS, SessionEnv, SessionParams

from .acting import RolloutParams
from .evaluate import rollout_episodes


def leader_candidates(levels: int) -> np.ndarray:
    """All ``levels``^2 raw leader outputs (q, alpha) of a regular grid on [0, 1]^2. ``[levels**2, 2]``."""
    g = np.linspace(0.0, 1.0, levels)
    return np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)


def session_summary(runs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-session U_L (sum over turns), tokens per turn, quality per turn, task and model. ``[..., N]``."""
    return {"u_leader": runs["u_leader"].sum(-1), "tokens": runs["tokens"].mean(-1), "quality": runs["quality"].mean(-1),
            "task": runs["task"][..., 0], "model": runs["model"][..., 0]}


def table_act(env: SessionEnv, follower: Callable) -> Callable:
    """``act(pp, x, st)`` of a table leader: l~ = ``pp.table[task, model]``; ``follower(pp, obs, st) -> (a_raw, a_exec)``."""
    def act(pp, x, st):
        ell = env.commit(st, pp.table[st.task, st.model])
        a_raw, a = follower(pp, jnp.concatenate([x, ell]), st)
        return ell, a_raw, a

    return act


def candidate_values(env: SessionEnv, params: SessionParams, follower: Callable, fol_pp: RolloutParams, cand: np.ndarray, keys,
                     chunk: int = 64) -> dict[str, np.ndarray]:
    """Per-session summaries of every constant candidate ``cand`` [C, 2] on the sessions ``keys`` [N]:
    arrays ``[C, N]`` (task, model ``[N]``). Candidates are vmapped in chunks of ``chunk``."""
    M = env.n_models
    act = table_act(env, follower)

    @jax.jit
    def run(tables):
        return jax.vmap(lambda t: rollout_episodes(env, act, keys, params, fol_pp._replace(table=t)))(tables)

    cand = np.asarray(cand, np.float32)
    outs = []
    for i in range(0, len(cand), chunk):
        c = cand[i:i + chunk]
        pad = chunk - len(c)
        c = np.concatenate([c, np.repeat(c[-1:], pad, 0)]) if pad else c
        tables = jnp.broadcast_to(jnp.asarray(c)[:, None, None, :], (chunk, N_TASKS, M, 2))
        res = session_summary(jax.tree.map(np.asarray, run(tables)))
        outs.append({k: v[: chunk - pad] for k, v in res.items()})
    out = {k: np.concatenate([o[k] for o in outs]) for k in ("u_leader", "tokens", "quality")}
    out["task"], out["model"] = outs[0]["task"][0], outs[0]["model"][0]
    return out


def best_constant(u: np.ndarray) -> int:
    """Index of the candidate with the highest mean value. ``u`` [C, N]."""
    return int(np.argmax(u.mean(1)))


def best_table(u: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """Per group, the candidate index with the highest mean value over that group's sessions
    (groups without a session get the best constant). ``u`` [C, N], ``group`` [N] -> ``[n_groups]``."""
    fallback = best_constant(u)
    idx = np.full(n_groups, fallback, np.int64)
    for g in range(n_groups):
        sel = group == g
        if sel.any():
            idx[g] = int(np.argmax(u[:, sel].mean(1)))
    return idx


def pick(values: dict[str, np.ndarray], per_session: np.ndarray) -> dict[str, np.ndarray]:
    """The sessions' summaries when session n plays candidate ``per_session[n]``. -> ``[N]`` arrays."""
    n = np.arange(per_session.shape[0])
    return {k: values[k][per_session, n] for k in ("u_leader", "tokens", "quality")}


def score(s: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean per-session U_L with its standard error, tokens and quality per turn."""
    u = np.asarray(s["u_leader"], np.float64)
    return {"u_leader": float(u.mean()), "u_leader_se": float(u.std(ddof=1) / np.sqrt(len(u))),
            "tokens_per_turn": float(np.mean(s["tokens"])), "quality": float(np.mean(s["quality"]))}


def oracle_search(env: SessionEnv, params: SessionParams, follower: Callable, fol_pp: RolloutParams, cand: np.ndarray,
                  select_keys, score_keys, also: dict[str, int] | None = None) -> dict:
    """Best constant and best (task, model) table chosen on ``select_keys`` and scored on ``score_keys``.

    Returns the chosen actions and the fresh-session values: ``constant`` and ``table`` each hold
    ``score()`` fields plus ``per_session`` (the fresh per-session summaries, for paired comparisons);
    ``constant_index`` is the constant's row of ``cand``. ``also``: name -> a row of ``cand`` to score
    on the same fresh sessions as well (a constant chosen elsewhere), returned under that name."""
    M = env.n_models
    n_sel = select_keys.shape[0]
    both = candidate_values(env, params, follower, fol_pp, cand, jnp.concatenate([select_keys, score_keys]))  # one program
    sel = {k: v[..., :n_sel] for k, v in both.items()}
    fresh = {k: v[..., n_sel:] for k, v in both.items()}
    c = best_constant(sel["u_leader"])
    tab = best_table(sel["u_leader"], sel["task"] * M + sel["model"], N_TASKS * M)
    const_s = pick(fresh, np.full(fresh["task"].shape, c))
    tab_s = pick(fresh, tab[fresh["task"] * M + fresh["model"]])
    return {
        "constant": {**score(const_s), "action": [round(float(x), 4) for x in cand[c]], "per_session": const_s},
        "table": {**score(tab_s), "actions": cand[tab].reshape(N_TASKS, M, 2).round(4).tolist(), "per_session": tab_s},
        "constant_selection_value": float(sel["u_leader"][c].mean()),
        "constant_index": c,
        "n_candidates": int(len(cand)),
        **{name: {**score(s), "action": [round(float(x), 4) for x in cand[i]], "per_session": s}
           for name, i in (also or {}).items() for s in [pick(fresh, np.full(fresh["task"].shape, i))]},
    }


def paired_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean and standard error of the per-session U_L difference a - b on the same sessions."""
    d = np.asarray(a["u_leader"], np.float64) - np.asarray(b["u_leader"], np.float64)
    return {"mean": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(len(d)))}
