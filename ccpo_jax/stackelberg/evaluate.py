"""Evaluation of the five strategies on grid replay (paper §10.2, Tables 4, 5, 7; §10.3 sim-to-real fit).

Each strategy plays ``episodes`` sessions of ``turns`` turns in the session
env in 'replay' mode (the response grid stands in for the real API). Each
strategy gets its own episode keys (independent samples, as Welch's test
assumes). Per turn we record tokens, quality, task, the raw and executed
actions and the surrogate's prediction for the executed action (T_sim,
Q_sim) for the sim-to-real fit T_corr = a T_sim + b.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from scipy import stats

from envs.cache.atomic import atomic_path
from envs.governance.grid import TASK_TYPES
from envs.governance.session import SessionEnv, SessionParams, surrogate_predict
from envs.published import STACKELBERG_SIM_TO_REAL

from .repair import trap_audit

STRATEGIES = ("Middle", "Conservative", "Task-aware raw", "Scalar+R", "Task-aware+R")
BASELINE = "Conservative"


def rollout(env: SessionEnv, act: Callable, key, params: SessionParams, pp, n_episodes: int) -> dict[str, jax.Array]:
    """Play ``n_episodes`` sessions; ``act(pp, x, state) -> (ell [2], a_raw [3], a_exec [3])``.

    Returns per-turn arrays ``[N, H]`` (actions ``[N, H, 3]``).
    """
    return rollout_episodes(env, act, jax.random.split(key, n_episodes), params, pp)


def rollout_episodes(env: SessionEnv, act: Callable, keys, params: SessionParams, pp) -> dict[str, jax.Array]:
    """:func:`rollout` given the episode keys ``[N]`` (one session each), so ``N`` is a shape, not a constant."""
    H = env.cfg.horizon

    def episode(k):
        k0, kr = jax.random.split(k)
        x, st = env.reset(k0, params)

        def turn(carry, kt):
            x, st = carry
            ell, a_raw, a = act(pp, x, st)
            t_sim, q_sim = surrogate_predict(params.surrogate, st.task, st.model, a, st.turn, env.n_models)
            nx, nst, r, _, info = env.step(kt, st, ell, a, params)
            out = {"tokens": info["tokens"], "quality": info["quality"], "task": st.task, "model": st.model,
                   "a_raw": a_raw, "a_exec": a, "ell": ell, "t_sim": t_sim, "q_sim": q_sim, "u_leader": r}
            return (nx, nst), out

        _, out = jax.lax.scan(turn, (x, st), jax.random.split(kr, H))
        return out

    return jax.vmap(episode)(keys)


def welch(x: np.ndarray, y: np.ndarray) -> float:
    """Two-sided Welch t-test p-value (scipy.stats.ttest_ind, equal_var=False)."""
    if len(x) < 2 or len(y) < 2 or (np.std(x) == 0 and np.std(y) == 0):
        return float("nan")
    return float(stats.ttest_ind(x, y, equal_var=False).pvalue)


def summarise(runs: dict[str, dict[str, np.ndarray]], trap_thresholds=(0.9, 0.7, 0.5)) -> dict:
    """Tables 4 (+ Welch p vs Conservative), 5 (per task), the sim-to-real fit, per strategy."""
    base = runs[BASELINE]
    bt, bq = base["tokens"].reshape(-1), base["quality"].reshape(-1)
    out = {}
    for name, r in runs.items():
        t, q = r["tokens"].reshape(-1).astype(np.float64), r["quality"].reshape(-1).astype(np.float64)
        row = {
            "tokens_per_turn": float(t.mean()), "quality": float(q.mean()),
            "efficiency": float(q.mean() / t.mean() * 1e3),
            "efficiency_per_turn_mean": float(np.mean(q / np.maximum(t, 1.0)) * 1e3),
            "tokens_sd": float(t.std(ddof=1)) if t.size > 1 else 0.0,
            "quality_sd": float(q.std(ddof=1)) if q.size > 1 else 0.0,
            "n_turns": int(t.size),
            "token_change_vs_conservative": float(t.mean() / bt.mean() - 1.0),
            "p_tokens_vs_conservative": welch(t, bt) if name != BASELINE else None,
            "p_quality_vs_conservative": welch(q, bq) if name != BASELINE else None,
            "trap_audit_raw": trap_audit(r["a_raw"].reshape(-1, 3), trap_thresholds),
            "trap_audit_executed": trap_audit(r["a_exec"].reshape(-1, 3), trap_thresholds),
        }
        task = r["task"].reshape(-1)
        row["per_task"] = {
            TASK_TYPES[k]: {"tokens": float(t[task == k].mean()), "quality": float(q[task == k].mean()), "n": int((task == k).sum())}
            for k in range(len(TASK_TYPES)) if (task == k).any()
        }
        out[name] = row
    return out


def sim_to_real(runs: dict[str, dict[str, np.ndarray]]) -> dict:
    """Pool every evaluated turn: T_real ~ a T_sim + b (scipy.stats.linregress), Pearson r of tokens and quality."""
    ts = np.concatenate([r["t_sim"].reshape(-1) for r in runs.values()]).astype(np.float64)
    tr = np.concatenate([r["tokens"].reshape(-1) for r in runs.values()]).astype(np.float64)
    qs = np.concatenate([r["q_sim"].reshape(-1) for r in runs.values()]).astype(np.float64)
    qr = np.concatenate([r["quality"].reshape(-1) for r in runs.values()]).astype(np.float64)
    fit = stats.linregress(ts, tr)
    qr_r = float(stats.pearsonr(qs, qr).statistic) if np.std(qs) > 0 and np.std(qr) > 0 else float("nan")
    return {"a": float(fit.slope), "b": float(fit.intercept), "token_pearson_r": float(fit.rvalue),
            "quality_pearson_r": qr_r, "mean_tokens_sim": float(ts.mean()), "mean_tokens_real": float(tr.mean()),
            "mean_quality_sim": float(qs.mean()), "mean_quality_real": float(qr.mean()), "n": int(ts.size),
            "paper": dict(STACKELBERG_SIM_TO_REAL)}


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the non-dominated (tokens lower, quality higher) strategies."""
    names = []
    for n, (t, q) in points.items():
        dominated = any((t2 <= t and q2 >= q) and (t2 < t or q2 > q) for m, (t2, q2) in points.items() if m != n)
        if not dominated:
            names.append(n)
    return names


def pareto_plot(summary: dict, path, title: str) -> None:
    """Tokens-vs-quality scatter of the strategies, the non-dominated ones joined; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = {n: (r["tokens_per_turn"], r["quality"]) for n, r in summary.items()}
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for n, (t, q) in pts.items():
        ax.scatter([t], [q], s=60, marker="o" if n in front else "x")
        ax.annotate(n, (t, q), textcoords="offset points", xytext=(5, 4), fontsize=8)
    fr = sorted((pts[n] for n in front))
    if len(fr) > 1:
        ax.plot([p[0] for p in fr], [p[1] for p in fr], "--", lw=1, color="grey")
    ax.set_xlabel("tokens per turn")
    ax.set_ylabel("quality")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
