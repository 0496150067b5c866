"""The multi-turn session environment of the Stackelberg game (arXiv 2606.23026 §2-3).

Functional and jit/vmap-able. One episode is a session of ``H`` turns with a
fixed task type k, executor-model condition m and task complexity. Each turn:

1. the leader sees x_t (:meth:`SessionEnv.observe`) and outputs a raw
   l~_t = (q~, alpha~) in [0,1]^2;
2. :meth:`SessionEnv.commit` smooths it (paper §3.3):
   l_t = Pi_{[0,1] cap [l_{t-1} - delta, l_{t-1} + delta]}(rho l_{t-1} + (1 - rho) l~_t);
3. the follower chooses a_t = (c, p, u) in [0,1]^3 from (x_t, q_t, alpha_t);
4. :meth:`SessionEnv.step` draws (T_t, Q_t) from the surrogate or replays the
   response grid, pays the utilities (paper Eq. 8 and §3.2) and moves the state.

State vector (arXiv 2606.23026 §2.3, §6.2 and Table 2; the order and scaling are
ours, the paper leaves them open):

==  ====================  ==============================================
 i  scalar (9)            meaning / scaling
==  ====================  ==============================================
 0  complexity            task complexity in [0, 1] (per-task level + noise)
 1  context length        cumulative session tokens / ``context_scale``
 2  turn index            t / H
 3  avg cost per turn     mean tokens of past turns / ``token_scale``
 4  recent quality        quality of the previous turn (``q_prior`` at t = 0)
 5  cost trend            (T_{t-1} - avg of earlier turns) / ``token_scale``
 6  model condition       m / (M - 1)
 7  task type             k / (K - 1)       (task-aware: 6-way one-hot, 14 dims)
 8  budget B_t            remaining fraction of ``budget_tokens``
==  ====================  ==============================================

l_{t-1} lives in the state (it drives the smoothing) but is not one of the
counted dims, as in the paper's 9/14 arithmetic (Table 2).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

N_TASKS = 6
STATE_DIMS = {"scalar": 9, "task": 14}


LEADER_PROFILES: dict[str, dict] = {
    "paper": {},
    # SYNTHETIC (not from the paper): on the first three task types (casual chat, simple QA, text writing)
    # the operator bills the tokens on to its customer, so the leader gains from spending (savings weight
    # -1); on the last three (code generation, data analysis, complex reasoning) it pays them (+1, the
    # paper's). Its best policy depends on the task: the largest subsidy and quality target on the first
    # three, none on the last three (docs/stackelberg.md, "A leader profile where state feedback matters").
    "state-feedback": {"leader_w_s_task": (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0)},
}
"""Leader utility profiles: SessionConfig field overrides (``SessionConfig(**LEADER_PROFILES[name])``);
``ccpo-jax stackelberg --leader-profile NAME`` (default 'paper'). Every profile but 'paper' is SYNTHETIC."""

LEADER_PROFILE_FIELDS = ("leader_w_s", "leader_w_q", "leader_w_alpha", "leader_w_q_task", "leader_w_s_task")
"""The SessionConfig fields a leader profile may set (all others keep their values)."""


def with_leader_profile(cfg: "SessionConfig", name: str) -> "SessionConfig":
    """``cfg`` with the leader utility of profile ``name``: the profile's fields of
    :data:`LEADER_PROFILE_FIELDS` set, the others back at the SessionConfig defaults."""
    if name not in LEADER_PROFILES:
        raise ValueError(f"leader profile must be one of {sorted(LEADER_PROFILES)}, got {name!r}")
    base = {f.name: f.default for f in dataclasses.fields(SessionConfig) if f.name in LEADER_PROFILE_FIELDS}
    return dataclasses.replace(cfg, **{**base, **LEADER_PROFILES[name]})


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """Static settings of the session game (hashable; closed over by jit)."""

    state: str = "scalar"
    """'scalar' (9-dim state, task type as k/(K-1)) or 'task' (14-dim, task one-hot)."""
    mode: str = "surrogate"
    """Transition law: 'surrogate' (T-hat, Q-hat plus residual noise) or 'replay' (the response grid)."""
    horizon: int = 3
    """H: turns per session (paper §10.2 evaluates 3 turns)."""
    rho: float = 0.5
    """EMA weight on the previous commitment (paper §3.3; value silent)."""
    delta: float = 0.2
    """Rate limit delta on each commitment coordinate per turn (paper §3.3; value silent)."""
    smooth_q: bool = True
    """Smooth the quality target q like alpha (the paper states the rule for alpha only)."""
    ell_init: tuple[float, float] = (0.8, 0.5)
    """l_{-1} = (q, alpha) before the first turn."""
    w_q: float = 1.0
    """Follower weight on quality Q (Eq. 8)."""
    w_c: float = 0.15
    """Follower weight on perceived token cost (1 - alpha) T / T_0 (Eq. 8)."""
    w_g: float = 2.0
    """Follower weight on the quality-gap hinge [q - Q]_+ (Eq. 8)."""
    leader_w_s: float = 1.0
    """Leader weight on savings S = clip(1 - T/T_0, -kappa, 1) (§3.2)."""
    leader_w_q: float = 2.0
    """Leader weight on quality Q (our choice; U_L beyond S is missing in the paper)."""
    leader_w_alpha: float = 0.1
    """Leader cost of the subsidy alpha it pays (our choice)."""
    leader_w_q_task: tuple[float, ...] | None = None
    """Per-task leader weights on quality (one per task type), replacing ``leader_w_q``; None = ``leader_w_q``
    for every task. A SYNTHETIC utility profile (not the paper's): see :data:`LEADER_PROFILES`."""
    leader_w_s_task: tuple[float, ...] | None = None
    """Per-task leader weights on savings, replacing ``leader_w_s`` (SYNTHETIC, as ``leader_w_q_task``)."""
    kappa: float = 1.0
    """Lower clip of the savings term S (§3.2; value silent)."""
    ref_action: tuple[float, float, float] = (0.2, 0.5, 0.2)
    """Action whose surrogate tokens define the reference cost T_0(x) (the Conservative baseline)."""
    budget_tokens: float = 3000.0
    """Session token budget; B_t = max(0, 1 - cumulative tokens / budget_tokens)."""
    token_scale: float = 1000.0
    """Scale of the per-turn token features."""
    context_scale: float = 5000.0
    """Scale of the context-length feature."""
    q_prior: float = 0.85
    """Recent-quality feature before the first turn."""
    complexity_noise: float = 0.1
    """Half-width of the uniform noise on the per-task complexity level."""
    sample_noise: bool = True
    """Surrogate mode: add the surrogate's residual noise to T-hat and Q-hat."""

    def __post_init__(self):
        if self.state not in STATE_DIMS:
            raise ValueError(f"SessionConfig.state must be one of {sorted(STATE_DIMS)}, got {self.state!r}")
        if self.mode not in ("surrogate", "replay"):
            raise ValueError(f"SessionConfig.mode must be 'surrogate' or 'replay', got {self.mode!r}")
        for name in ("leader_w_q_task", "leader_w_s_task"):
            w = getattr(self, name)
            if w is not None and len(w) != N_TASKS:
                raise ValueError(f"SessionConfig.{name} must have one weight per task type ({N_TASKS}), got {len(w)}")

    @property
    def obs_dim(self) -> int:
        return STATE_DIMS[self.state]


@struct.dataclass
class SurrogateWeights:
    """Ridge weights of the surrogate payoff oracle on :func:`surrogate_features` (paper §6.3)."""

    w_log_tokens: jax.Array  # [F]
    w_quality: jax.Array  # [F]
    sigma_log_tokens: jax.Array  # [] residual sd of log tokens (train split)
    sigma_quality: jax.Array  # []


@struct.dataclass
class SessionParams:
    """Device arrays of the session game."""

    grid_tokens: jax.Array  # [K, M, C, P, U, Hg, R]
    grid_quality: jax.Array  # [K, M, C, P, U, Hg, R]
    levels_c: jax.Array  # [C]
    levels_p: jax.Array  # [P]
    levels_u: jax.Array  # [U]
    complexity: jax.Array  # [K] per-task complexity level in [0, 1]
    surrogate: SurrogateWeights


@struct.dataclass
class SessionState:
    task: jax.Array  # i32 []
    model: jax.Array  # i32 []
    complexity: jax.Array  # f32 []
    trial: jax.Array  # i32 [] replay trial of this session
    turn: jax.Array  # i32 []
    cum_tokens: jax.Array
    last_tokens: jax.Array
    prev_avg: jax.Array  # mean tokens of turns before the last one
    recent_quality: jax.Array
    ell_prev: jax.Array  # [2] (q, alpha)


#: Per-task complexity levels (our choice): chat < QA < writing < data < code < reasoning.
DEFAULT_COMPLEXITY = (0.1, 0.2, 0.4, 0.7, 0.6, 0.9)


def surrogate_features(task: jax.Array, model: jax.Array, a: jax.Array, turn: jax.Array, n_models: int = 2) -> jax.Array:
    """Features of the surrogate payoff oracle: task and model indicators and (c, p, u) (paper §6.3).

    Args: ``task``, ``model``, ``turn`` int ``[...]``; ``a`` ``[..., 3]``. Returns ``[..., F]``:
    all monomials of (c, p, u) up to degree 3, each alone and times the
    history flag 1[turn >= 2] (our addition: the grid has turns, the paper's
    single-turn grid did not), task and model one-hots, and their products
    with (c, p, u, u^2). Pure jnp; NumPy input works too.
    """
    a = jnp.asarray(a, jnp.float32)
    batch = jnp.broadcast_shapes(a.shape[:-1], jnp.shape(task), jnp.shape(model), jnp.shape(turn))
    a = jnp.broadcast_to(a, batch + (3,))
    task, model, turn = (jnp.broadcast_to(jnp.asarray(v), batch) for v in (task, model, turn))
    c, p, u = a[..., 0], a[..., 1], a[..., 2]
    mono = [jnp.ones_like(c)]
    base = (c, p, u)
    for i in range(3):
        mono.append(base[i])
        for j in range(i, 3):
            mono.append(base[i] * base[j])
            for k in range(j, 3):
                mono.append(base[i] * base[j] * base[k])
    mono = jnp.stack(mono, -1)  # [..., 20]
    hist = (jnp.asarray(turn) >= 1).astype(jnp.float32)[..., None]
    t1 = jax.nn.one_hot(task, N_TASKS)
    m1 = jax.nn.one_hot(model, n_models)
    lin = jnp.stack([c, p, u, u * u], -1)  # [..., 4]
    inter_t = (t1[..., :, None] * lin[..., None, :]).reshape(*t1.shape[:-1], -1)
    inter_m = (m1[..., :, None] * lin[..., None, :]).reshape(*m1.shape[:-1], -1)
    return jnp.concatenate([mono, mono * hist, t1, m1, inter_t, inter_m, t1 * hist], -1)


def surrogate_predict(w: SurrogateWeights, task, model, a, turn, n_models: int = 2) -> tuple[jax.Array, jax.Array]:
    """Mean tokens (log-normal smearing) and quality (clipped to [0, 1]) of the surrogate. ``[...]``."""
    f = surrogate_features(task, model, a, turn, n_models)
    log_t = f @ w.w_log_tokens
    tokens = jnp.exp(log_t + 0.5 * w.sigma_log_tokens**2)
    quality = jnp.clip(f @ w.w_quality, 0.0, 1.0)
    return tokens, quality


def smooth_commitment(ell_prev: jax.Array, ell_raw: jax.Array, rho: float, delta: float) -> jax.Array:
    """Paper §3.3: Pi_{[0,1] cap [l_prev - delta, l_prev + delta]}(rho l_prev + (1 - rho) l_raw), per coordinate.

    The intersection is the interval [max(0, l_prev - delta), min(1, l_prev + delta)]
    (non-empty because l_prev is in [0, 1]); projecting onto an interval is a clip.
    """
    target = rho * ell_prev + (1.0 - rho) * ell_raw
    lo = jnp.maximum(0.0, ell_prev - delta)
    hi = jnp.minimum(1.0, ell_prev + delta)
    return jnp.clip(target, lo, hi)


def nearest_level(levels: jax.Array, x: jax.Array) -> jax.Array:
    """Index of the grid level nearest x (ties to the lower level). ``levels`` [L], ``x`` [...]."""
    return jnp.argmin(jnp.abs(levels - x[..., None]), axis=-1)


class SessionEnv:
    """The session game under a static :class:`SessionConfig`. Methods are pure and vmap-able."""

    def __init__(self, cfg: SessionConfig, n_models: int = 2):
        self.cfg = cfg
        self.n_models = n_models

    @property
    def obs_dim(self) -> int:
        return self.cfg.obs_dim

    def reset(self, key: jax.Array, params: SessionParams, task: jax.Array | None = None) -> tuple[jax.Array, SessionState]:
        """Draw task type (uniform unless given), model condition, complexity and replay trial."""
        k1, k2, k3, k4 = jax.random.split(key, 4)
        if task is None:
            task = jax.random.randint(k1, (), 0, N_TASKS)
        model = jax.random.randint(k2, (), 0, self.n_models)
        noise = jax.random.uniform(k3, (), minval=-self.cfg.complexity_noise, maxval=self.cfg.complexity_noise)
        trial = jax.random.randint(k4, (), 0, params.grid_tokens.shape[-1])
        f0 = jnp.float32(0.0)
        state = SessionState(
            task=jnp.asarray(task, jnp.int32), model=model.astype(jnp.int32),
            complexity=jnp.clip(params.complexity[task] + noise, 0.0, 1.0), trial=trial.astype(jnp.int32),
            turn=jnp.int32(0), cum_tokens=f0, last_tokens=f0, prev_avg=f0,
            recent_quality=jnp.float32(self.cfg.q_prior), ell_prev=jnp.asarray(self.cfg.ell_init, jnp.float32),
        )
        return self.observe(state), state

    def observe(self, state: SessionState) -> jax.Array:
        """x_t: ``[9]`` (scalar) or ``[14]`` (task-aware); see the module table."""
        cfg = self.cfg
        t = state.turn.astype(jnp.float32)
        avg = jnp.where(state.turn > 0, state.cum_tokens / jnp.maximum(t, 1.0), 0.0)
        trend = jnp.where(state.turn > 1, state.last_tokens - state.prev_avg, 0.0)
        budget = jnp.maximum(0.0, 1.0 - state.cum_tokens / cfg.budget_tokens)
        head = jnp.stack([state.complexity, state.cum_tokens / cfg.context_scale, t / cfg.horizon,
                          avg / cfg.token_scale, state.recent_quality, trend / cfg.token_scale,
                          state.model.astype(jnp.float32) / max(self.n_models - 1, 1)])
        if cfg.state == "scalar":
            task = (state.task.astype(jnp.float32) / (N_TASKS - 1))[None]
        else:
            task = jax.nn.one_hot(state.task, N_TASKS)
        return jnp.concatenate([head, task, budget[None]]).astype(jnp.float32)

    def commit(self, state: SessionState, ell_raw: jax.Array) -> jax.Array:
        """Smoothed commitment l_t = (q_t, alpha_t) from the raw leader output ``[2]``."""
        cfg = self.cfg
        ell_raw = jnp.clip(ell_raw, 0.0, 1.0)
        ell = smooth_commitment(state.ell_prev, ell_raw, cfg.rho, cfg.delta)
        if not cfg.smooth_q:
            ell = ell.at[0].set(ell_raw[0])
        return ell

    def reference_tokens(self, state: SessionState, params: SessionParams) -> jax.Array:
        """T_0(x): surrogate tokens of the reference action in this state (> 0)."""
        t0, _ = surrogate_predict(params.surrogate, state.task, state.model, jnp.asarray(self.cfg.ref_action), state.turn, self.n_models)
        return jnp.maximum(t0, 1.0)

    def response(self, key: jax.Array, state: SessionState, a: jax.Array, params: SessionParams) -> tuple[jax.Array, jax.Array]:
        """(T_t, Q_t) for action ``a`` [3] under the configured transition law."""
        a = jnp.clip(a, 0.0, 1.0)
        if self.cfg.mode == "replay":
            ic = nearest_level(params.levels_c, a[0])
            ip = nearest_level(params.levels_p, a[1])
            iu = nearest_level(params.levels_u, a[2])
            h = jnp.minimum(state.turn, params.grid_tokens.shape[5] - 1)
            idx = (state.task, state.model, ic, ip, iu, h, state.trial)
            return params.grid_tokens[idx], params.grid_quality[idx]
        w = params.surrogate
        tok, q = surrogate_predict(w, state.task, state.model, a, state.turn, self.n_models)
        if self.cfg.sample_noise:
            k1, k2 = jax.random.split(key)
            s = w.sigma_log_tokens
            tok = tok * jnp.exp(s * jax.random.normal(k1) - 0.5 * s**2)
            q = jnp.clip(q + w.sigma_quality * jax.random.normal(k2), 0.0, 1.0)
        return tok, q

    def utilities(self, tokens, quality, t0, ell, task=None) -> tuple[jax.Array, jax.Array]:
        """(U_L, U_F) of one turn. U_F: paper Eq. 8 with T normalised by T_0; U_L: see SessionConfig
        (``task`` picks the leader's quality weight under ``leader_w_q_task``)."""
        cfg = self.cfg
        q_target, alpha = ell[..., 0], ell[..., 1]
        ratio = tokens / t0
        gap = jnp.maximum(q_target - quality, 0.0)
        u_f = cfg.w_q * quality - cfg.w_c * (1.0 - alpha) * ratio - cfg.w_g * gap
        savings = jnp.clip(1.0 - ratio, -cfg.kappa, 1.0)
        w_s, w_q = cfg.leader_w_s, cfg.leader_w_q
        if cfg.leader_w_q_task is not None or cfg.leader_w_s_task is not None:
            if task is None:
                raise ValueError("SessionEnv.utilities: per-task leader weights need the task")
            if cfg.leader_w_q_task is not None:
                w_q = jnp.asarray(cfg.leader_w_q_task, jnp.float32)[task]
            if cfg.leader_w_s_task is not None:
                w_s = jnp.asarray(cfg.leader_w_s_task, jnp.float32)[task]
        u_l = w_s * savings + w_q * quality - cfg.leader_w_alpha * alpha
        return u_l, u_f

    def step(self, key: jax.Array, state: SessionState, ell: jax.Array, a: jax.Array, params: SessionParams):
        """Execute action ``a`` [3] under commitment ``ell`` [2] (already smoothed).

        Returns ``(obs, state, reward_leader, done, info)``; ``done`` is True
        after the H-th turn (the caller resets). ``info``: tokens, quality,
        t0, u_follower, action, ell, task.
        """
        tokens, quality = self.response(key, state, a, params)
        t0 = self.reference_tokens(state, params)
        u_l, u_f = self.utilities(tokens, quality, t0, ell, state.task)
        t = state.turn.astype(jnp.float32)
        prev_avg = jnp.where(state.turn > 0, state.cum_tokens / jnp.maximum(t, 1.0), 0.0)
        new = state.replace(
            turn=state.turn + 1, cum_tokens=state.cum_tokens + tokens, last_tokens=tokens,
            prev_avg=prev_avg, recent_quality=quality, ell_prev=ell,
        )
        done = new.turn >= self.cfg.horizon
        info: dict[str, Any] = {"tokens": tokens, "quality": quality, "t0": t0, "u_follower": u_f,
                                "action": jnp.clip(a, 0.0, 1.0), "ell": ell, "task": state.task}
        return self.observe(new), new, u_l, done, info


def make_session_params(grid, surrogate: SurrogateWeights, complexity=DEFAULT_COMPLEXITY) -> SessionParams:
    """Device arrays from a :class:`envs.governance.grid.ResponseGrid` and fitted surrogate weights."""
    return SessionParams(
        grid_tokens=jnp.asarray(grid.tokens), grid_quality=jnp.asarray(grid.quality),
        levels_c=jnp.asarray(grid.levels_array("c")), levels_p=jnp.asarray(grid.levels_array("p")),
        levels_u=jnp.asarray(grid.levels_array("u")), complexity=jnp.asarray(complexity, jnp.float32),
        surrogate=surrogate,
    )
