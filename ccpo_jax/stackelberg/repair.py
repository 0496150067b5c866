"""Action repair (paper §7.3, §8, Theorem 5.3) and the trap audit (Table 7).

- :func:`project_box`: Euclidean projection onto A_real = [0.10,0.40] x
  [0.35,0.65] x [0.00,0.50]; for a box it is the coordinate-wise clip.
- :func:`tool_repair`: u_final = min(0.50, max(u_base, u_need-hat)) (§8).
- :class:`UNeedHead`: the repair head estimating the minimum necessary tool
  budget (its model and inputs are silent in the paper): a ridge regression
  on task and model-condition indicators, trained on labels read off the
  response grid's training trials (the lowest tool level whose mean quality
  is within ``need_tolerance`` of the best level at most ``u_cap``, with c and
  p at the A_real levels).
- :func:`is_trap` / :func:`trap_audit`: c > 0.9 or p > 0.7 or u > 0.5.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import struct

from envs.governance.grid import ResponseGrid
from envs.governance.session import N_TASKS

from .config import RepairConfig
from .surrogate import ridge_fit


def project_box(a: jax.Array, low, high) -> jax.Array:
    """argmin_{b in [low, high]} ||b - a||_2 = clip(a, low, high). ``a`` [..., 3]."""
    return jnp.clip(a, jnp.asarray(low, a.dtype), jnp.asarray(high, a.dtype))


def tool_repair(u_base: jax.Array, u_need: jax.Array, cap: float = 0.5) -> jax.Array:
    """Coding-aware tool-budget repair (§8): min(cap, max(u_base, u_need))."""
    return jnp.minimum(cap, jnp.maximum(u_base, u_need))


@struct.dataclass
class UNeedHead:
    """u_need-hat = clip([onehot(task), onehot(model)] @ w, 0, cap)."""

    w: jax.Array  # [6 + M]
    n_models: int = struct.field(pytree_node=False, default=2)

    def __call__(self, task: jax.Array, model: jax.Array) -> jax.Array:
        f = jnp.concatenate([jax.nn.one_hot(task, N_TASKS), jax.nn.one_hot(model, self.n_models)], -1)
        return jnp.clip(f @ self.w, 0.0, 1.0)


def u_need_labels(grid: ResponseGrid, cfg: RepairConfig, trials: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Minimum necessary tool level per (task, model, trial) read off the grid (see module docstring).

    Returns arrays ``task, model, u_need`` [N] over the given ``trials`` (default all).
    """
    Lc, Lp, Lu = (grid.levels_array(d) for d in ("c", "p", "u"))
    lo, hi = cfg.box_low, cfg.box_high
    mc = (Lc >= lo[0] - 1e-6) & (Lc <= hi[0] + 1e-6)
    mp = (Lp >= lo[1] - 1e-6) & (Lp <= hi[1] + 1e-6)
    mu = Lu <= cfg.u_cap + 1e-6
    if not (mc.any() and mp.any() and mu.any()):
        raise ValueError("the response grid has no c/p/u level inside A_real; the u_need head needs one")
    trials = np.arange(grid.manifest.trials) if trials is None else np.asarray(trials)
    q = grid.quality[:, :, mc][:, :, :, mp][:, :, :, :, mu][..., trials]  # [K, M, c, p, u, H, R]
    q = q.mean(axis=(2, 3, 5))  # [K, M, u, R]
    best = q.max(axis=2, keepdims=True)
    ok = q >= best - cfg.need_tolerance
    first = np.argmax(ok, axis=2)  # [K, M, R] lowest acceptable level
    u = Lu[mu][first]
    K, M, R = u.shape
    kk, mm, _ = np.meshgrid(np.arange(K), np.arange(M), np.arange(R), indexing="ij")
    return {"task": kk.reshape(-1), "model": mm.reshape(-1), "u_need": u.reshape(-1).astype(np.float32)}


def fit_u_need(grid: ResponseGrid, cfg: RepairConfig, trials: np.ndarray | None = None) -> UNeedHead:
    lab = u_need_labels(grid, cfg, trials)
    M = len(grid.manifest.model_conditions)
    X = np.concatenate([np.eye(N_TASKS)[lab["task"]], np.eye(M)[lab["model"]]], -1)
    w = ridge_fit(X, lab["u_need"], cfg.ridge)
    return UNeedHead(jnp.asarray(w, jnp.float32), M)


def repair_action(a: jax.Array, u_need: jax.Array, cfg: RepairConfig) -> jax.Array:
    """Projection onto A_real, then the coding-aware tool repair. ``a`` [..., 3], ``u_need`` [...]."""
    b = project_box(a, cfg.box_low, cfg.box_high)
    return b.at[..., 2].set(tool_repair(b[..., 2], u_need, cfg.u_cap))


def is_trap(a, thresholds=(0.9, 0.7, 0.5)):
    """Table 7 any-trap: c > 0.9 or p > 0.7 or u > 0.5. ``a`` [..., 3] -> bool [...]."""
    a = jnp.asarray(a)
    return (a[..., 0] > thresholds[0]) | (a[..., 1] > thresholds[1]) | (a[..., 2] > thresholds[2])


def trap_audit(actions: np.ndarray, thresholds=(0.9, 0.7, 0.5)) -> dict:
    """Mean action, any-trap rate and per-coordinate trap rates over ``actions`` [N, 3]."""
    a = np.asarray(actions, np.float64).reshape(-1, 3)
    return {
        "mean_action": [round(float(x), 4) for x in a.mean(0)],
        "trap_rate": float(np.mean(np.asarray(is_trap(a, thresholds)))),
        "trap_rate_c": float(np.mean(a[:, 0] > thresholds[0])),
        "trap_rate_p": float(np.mean(a[:, 1] > thresholds[1])),
        "trap_rate_u": float(np.mean(a[:, 2] > thresholds[2])),
        "n": int(a.shape[0]),
    }
