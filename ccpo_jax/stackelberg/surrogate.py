"""Surrogate payoff oracle P-hat: token and quality predictors fit on the response grid (paper §6.3, Table 3).

Model class (silent in the paper): ridge regression on
:func:`envs.governance.session.surrogate_features` (task and model
indicators, (c, p, u) polynomials, a history flag), log tokens for T-hat
(with log-normal smearing back to the token scale) and raw quality for
Q-hat. Fit on a fixed train/test split of grid cells; held-out R^2 and MAE
are reported on the token and quality scales, as in Table 3.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from envs.governance.grid import ResponseGrid
from envs.governance.session import SurrogateWeights, surrogate_features, surrogate_predict

from .config import SurrogateConfig


def ridge_fit(X: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """argmin_w ||X w - y||^2 + lam ||w||^2 via the normal equations. ``X`` [N, F], ``y`` [N] -> [F]."""
    X = np.asarray(X, np.float64)
    A = X.T @ X + lam * np.eye(X.shape[1])
    return np.linalg.solve(A, X.T @ np.asarray(y, np.float64))


def r2_score(y: np.ndarray, yhat: np.ndarray) -> float:
    """Coefficient of determination 1 - SS_res / SS_tot."""
    y, yhat = np.asarray(y, np.float64), np.asarray(yhat, np.float64)
    return float(1.0 - ((y - yhat) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-12))


@dataclasses.dataclass(frozen=True)
class GridSamples:
    """The grid flattened to samples: ``task, model, turn`` [N] int, ``action`` [N, 3], ``tokens, quality`` [N]."""

    task: np.ndarray
    model: np.ndarray
    turn: np.ndarray
    action: np.ndarray
    tokens: np.ndarray
    quality: np.ndarray

    def take(self, idx: np.ndarray) -> "GridSamples":
        return GridSamples(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))

    def __len__(self) -> int:
        return len(self.tokens)


def grid_samples(grid: ResponseGrid) -> GridSamples:
    m = grid.manifest
    shape = m.shape
    idx = np.indices(shape).reshape(len(shape), -1)
    k, mo, ic, ip, iu, h, _ = idx
    L = {d: grid.levels_array(d) for d in ("c", "p", "u")}
    action = np.stack([L["c"][ic], L["p"][ip], L["u"][iu]], -1).astype(np.float32)
    return GridSamples(k.astype(np.int32), mo.astype(np.int32), h.astype(np.int32), action,
                       grid.tokens.reshape(-1).astype(np.float64), grid.quality.reshape(-1).astype(np.float64))


@dataclasses.dataclass(frozen=True)
class SurrogateFit:
    weights: SurrogateWeights
    metrics: dict[str, float]
    """n_train, n_test, token_r2, token_mae, quality_r2, quality_mae (held-out) and train R^2s."""
    n_models: int


def fixed_split(n: int, cfg: SurrogateConfig) -> tuple[np.ndarray, np.ndarray]:
    """The fixed train/test split of sample indices (seeded permutation)."""
    rng = np.random.default_rng(cfg.split_seed)
    perm = rng.permutation(n)
    if cfg.max_samples is not None:
        perm = perm[: cfg.max_samples]
    n_test = max(1, int(round(len(perm) * cfg.test_fraction)))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def fit_surrogate(grid: ResponseGrid, cfg: SurrogateConfig = SurrogateConfig()) -> SurrogateFit:
    """Fit T-hat (log tokens) and Q-hat on the train split; score both on the test split."""
    s = grid_samples(grid)
    M = len(grid.manifest.model_conditions)
    tr, te = fixed_split(len(s), cfg)
    X = np.asarray(surrogate_features(s.task, s.model, s.action, s.turn, M), np.float64)
    log_t = np.log(np.maximum(s.tokens, 1.0))
    w_t = ridge_fit(X[tr], log_t[tr], cfg.ridge)
    w_q = ridge_fit(X[tr], s.quality[tr], cfg.ridge)
    sig_t = float(np.std(log_t[tr] - X[tr] @ w_t))
    sig_q = float(np.std(s.quality[tr] - X[tr] @ w_q))
    w = SurrogateWeights(jnp.asarray(w_t, jnp.float32), jnp.asarray(w_q, jnp.float32),
                         jnp.float32(sig_t), jnp.float32(sig_q))
    t_hat, q_hat = (np.asarray(v, np.float64) for v in surrogate_predict(w, s.task, s.model, s.action, s.turn, M))
    metrics = {
        "n_train": int(len(tr)), "n_test": int(len(te)),
        "token_r2": r2_score(s.tokens[te], t_hat[te]),
        "token_mae": float(np.abs(s.tokens[te] - t_hat[te]).mean()),
        "quality_r2": r2_score(s.quality[te], q_hat[te]),
        "quality_mae": float(np.abs(s.quality[te] - q_hat[te]).mean()),
        "token_r2_train": r2_score(s.tokens[tr], t_hat[tr]),
        "quality_r2_train": r2_score(s.quality[tr], q_hat[tr]),
        "sigma_log_tokens": sig_t, "sigma_quality": sig_q,
    }
    return SurrogateFit(w, metrics, M)
