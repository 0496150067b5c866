"""CPO trust-region step (CCPO paper, arXiv 2511.11828, Eq. 7; CPO: Achiam et al. 2017, arXiv 1705.10528).

Local problem, on the flat parameter step x = theta - theta_k:

    maximise  g'x   subject to   c + b'x <= 0   and   0.5 x'Hx <= delta

g: gradient of the objective surrogate to MAXIMISE; b: gradient of the
constraint surrogate in "<= 0" form; c: current constraint value minus its
limit (c > 0 = infeasible); H: Fisher matrix = Hessian of the mean KL, used
only through Hessian-vector products.

Sign convention for CCPO (coverage constraint J >= 1 - alpha, arXiv 2511.11828 Eq. 7):
    constraint_fn(theta) = -J_surrogate(theta),   c = (1 - alpha) - J(theta_k)
so that c + b'x ~ (1 - alpha) - J(theta_k + x) <= 0. Example: alpha = 0.1 and
an estimated coverage J = 0.85 give c = +0.05 (infeasible, recovery cases);
J = 0.95 gives c = -0.05 (feasible).

Dual, in THIS (maximise) convention, with v = H^-1 g, w = H^-1 b,
q = g'v, r = g'w, s = b'w, A = q - r^2/s, B = 2 delta - c^2/s:
    x*(lam, nu) = (v - nu w) / lam,   nu*(lam) = max(0, lam c + r) / s,
    f_a(lam) = -(A/lam + B lam)/2 + r c / s   on {lam > 0: lam c + r > 0},
    f_b(lam) = -(q/lam + 2 delta lam)/2         on {lam > 0: lam c + r <= 0},
each maximised by projecting sqrt(A/B), resp. sqrt(q/(2 delta)), onto its
interval; lam* = the better of the two. (Achiam/OmniSafe write nu = (lam c - r)/s
and -r c/s: that is the same dual with r measured on the LOSS gradient -g. Mixing
"maximise g'x" with those formulas is a sign error; the KKT tests catch it.)

Cases (OmniSafe numbering):
    4: b ~ 0 and c < 0        -> TRPO step sqrt(2 delta / q) v
    3: c < 0 and B < 0        -> whole trust region feasible, TRPO step
    2: c < 0 <= B             -> partially feasible, dual step
    1: c >= 0 and B >= 0      -> feasible recovery, dual step
    0: c >= 0 and B < 0       -> infeasible recovery, x = -sqrt(2 delta / s) w
                                 (x = 0 when b ~ 0: the constraint cannot be moved)

Every division is guarded (``jnp.where``); a non-finite direction becomes 0.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.flatten_util import ravel_pytree

Array = jax.Array

_TINY = 1e-12  # floor for q, s, A, B, lam (float32-safe)
_B_ZERO = 1e-8  # ||b||^2 below this counts as "no constraint gradient" (OmniSafe uses 1e-6..1e-8)


@struct.dataclass
class DirectionInfo:
    """Diagnostics of :func:`cpo_direction` (all scalars)."""

    case: Array  # int32, 0..4 as in the module docstring
    lam: Array  # dual variable of the trust region (0 in case 0)
    nu: Array  # dual variable of the linear constraint (0 in cases 3, 4, 0)
    q: Array
    r: Array
    s: Array
    A: Array
    B: Array
    expected_improvement: Array  # g'x
    predicted_constraint: Array  # c + b'x


def conjugate_gradient(hvp: Callable[[Array], Array], rhs: Array, iters: int = 10) -> Array:
    """Approximate H^-1 rhs with ``iters`` CG iterations (``jax.scipy.sparse.linalg.cg``,
    tol = atol = 0 so it runs ``iters`` iterations unless the residual is exactly 0).
    A non-finite result (breakdown on a singular H) is replaced by 0."""
    x, _ = jax.scipy.sparse.linalg.cg(hvp, rhs, tol=0.0, atol=0.0, maxiter=iters)
    return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.zeros_like(x))


def fisher_vector_product(logp_fn: Callable[[Array], Array], weights: Array, theta: Array) -> Callable[[Array], Array]:
    """u -> F u, the Fisher matrix of the weighted distributions ``exp(logp_fn(theta))`` at ``theta``.

    ``logp_fn``: flat parameters ``[P]`` -> log-probabilities ``[..., A]`` (normalised over the
    last axis; ``-inf`` = an impossible action, whose tangent must be 0); ``weights`` ``[...]``.
    F = sum_i w_i J_i' diag(p_i) J_i with J_i = d log p_i / d theta. It equals the Hessian of
    ``sum_i w_i KL(p_i(theta) || p_i(theta'))`` in theta' at theta' = theta, because there
    -sum_a p_a d2 log p_a = sum_a p_a (d log p_a)(d log p_a)' - d2 (sum_a p_a) and sum_a p_a = 1
    (tests/core/test_trust_region.py checks it against ``jax.hessian``). Applied as one linear forward
    tangent and its transpose, with the forward pass done once: cheaper than a forward-over-reverse
    product of the KL's gradient.
    """
    logp, jvp = jax.linearize(logp_fn, theta)
    p = jnp.where(jnp.isfinite(logp), jnp.exp(logp), 0.0)
    vjp = jax.linear_transpose(jvp, theta)
    wp = jax.lax.stop_gradient(p * weights[..., None])

    def product(u: Array) -> Array:
        t = jnp.where(p > 0, jvp(u), 0.0)
        return vjp(wp * t)[0]

    return product


def _interval_max(f, lam_unc, lo, hi, nonempty):
    lam = jnp.clip(lam_unc, jnp.maximum(lo, _TINY), jnp.maximum(hi, _TINY))
    return lam, jnp.where(nonempty, f(lam), -jnp.inf)


def cpo_direction(
    g: Array,
    b: Array,
    c: Array | float,
    hvp: Callable[[Array], Array],
    delta: float,
    cg_iters: int = 10,
    damping: float = 0.0,
) -> tuple[Array, DirectionInfo]:
    """Solve max g'x s.t. c + b'x <= 0, 0.5 x'Hx <= delta (module docstring).

    Args:
      g, b: ``[P]`` flat gradients. c: scalar. hvp: ``[P] -> [P]`` product with H.
      delta: trust-region radius (paper 0.01). cg_iters: fixed CG iterations.
      damping: extra damping added to ``hvp`` (0 when hvp is already damped).
    Returns:
      x ``[P]`` and :class:`DirectionInfo`.
    """
    c = jnp.asarray(c, g.dtype)
    delta = jnp.asarray(delta, g.dtype)

    def Hd(u):
        return hvp(u) + damping * u

    # Both solves share one batched CG (vmapped Hessian-vector products).
    v, w = jax.vmap(lambda rhs: conjugate_gradient(Hd, rhs, cg_iters))(jnp.stack([g, b]))
    q = jnp.maximum(g @ v, 0.0)
    r = g @ w
    s = b @ w
    b_zero = (b @ b <= _B_ZERO) | (s <= _TINY) | ~jnp.isfinite(s)
    s_safe = jnp.where(b_zero, 1.0, s)
    q_safe = jnp.maximum(q, _TINY)
    A = jnp.maximum(q - r * r / s_safe, _TINY)
    B = 2.0 * delta - c * c / s_safe  # meaningless (s replaced by 1) when b ~ 0

    feasible = c < 0
    case = jnp.where(
        b_zero, jnp.where(feasible, 4, 0),
        jnp.where(feasible & (B < 0), 3, jnp.where(feasible, 2, jnp.where(B >= 0, 1, 0))),
    ).astype(jnp.int32)

    # --- dual (cases 1, 2) ---------------------------------------------------------------
    c_nz = jnp.where(c == 0, 1.0, c)
    mid = jnp.where(c == 0, 0.0, jnp.maximum(-r / c_nz, 0.0))
    inf = jnp.asarray(jnp.inf, g.dtype)
    # f_a lives where lam c + r > 0
    a_lo = jnp.where(c > 0, mid, 0.0)
    a_hi = jnp.where(c > 0, inf, jnp.where(c < 0, mid, inf))
    a_ok = jnp.where(c > 0, True, jnp.where(c < 0, mid > 0, r > 0))
    # f_b lives where lam c + r <= 0
    b_lo = jnp.where(c < 0, mid, 0.0)
    b_hi = jnp.where(c < 0, inf, jnp.where(c > 0, mid, inf))
    b_ok = jnp.where(c < 0, True, jnp.where(c > 0, mid > 0, r <= 0))

    B_pos = jnp.maximum(B, _TINY)
    f_a = lambda lam: -0.5 * (A / lam + B_pos * lam) + r * c / s_safe
    f_b = lambda lam: -0.5 * (q_safe / lam + 2.0 * delta * lam)
    lam_a, fa = _interval_max(f_a, jnp.sqrt(A / B_pos), a_lo, a_hi, a_ok)
    lam_b, fb = _interval_max(f_b, jnp.sqrt(q_safe / (2.0 * delta)), b_lo, b_hi, b_ok)
    lam_dual = jnp.maximum(jnp.where(fa >= fb, lam_a, lam_b), _TINY)
    nu_dual = jnp.maximum(lam_dual * c + r, 0.0) / s_safe
    x_dual = (v - nu_dual * w) / lam_dual

    # --- closed-form cases -----------------------------------------------------------------
    x_trpo = jnp.where(q > _TINY, jnp.sqrt(2.0 * delta / q_safe), 0.0) * v
    x_recover = jnp.where(b_zero, 0.0, -jnp.sqrt(2.0 * delta / s_safe)) * w

    x = jnp.where(case >= 3, x_trpo, jnp.where(case == 0, x_recover, x_dual))
    x = jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.zeros_like(x))
    lam = jnp.where(case >= 3, jnp.sqrt(q_safe / (2.0 * delta)), jnp.where(case == 0, 0.0, lam_dual))
    nu = jnp.where((case == 1) | (case == 2), nu_dual, 0.0)
    info = DirectionInfo(case=case, lam=lam, nu=nu, q=q, r=r, s=s, A=A, B=B,
                         expected_improvement=g @ x, predicted_constraint=c + b @ x)
    return x, info


@struct.dataclass
class CPOInfo:
    """Diagnostics of :func:`cpo_update` (all scalars)."""

    direction: DirectionInfo
    accepted: Array  # bool: some candidate passed the line search
    step_frac: Array  # accepted beta^j (0 when none passed)
    n_backtracks: Array  # int32 j of the accepted candidate (= steps when none passed)
    kl: Array  # KL at the accepted step (0 when none)
    improvement: Array  # objective(new) - objective(old)
    constraint_change: Array  # constraint_fn(new) - constraint_fn(old)
    step_norm: Array  # ||theta_new - theta_old||


def cpo_update(
    params,
    objective_fn: Callable,
    constraint_fn: Callable,
    kl_fn: Callable,
    c: Array | float,
    delta: float = 0.01,
    *,
    cg_iters: int = 10,
    damping: float = 1e-5,
    backtrack_decay: float = 0.8,
    backtrack_steps: int = 15,
    kl_slack: float = 1.5,
    constraint_tol: float = 1e-6,
    fisher: tuple[Callable, Array] | None = None,
):
    """One CPO step on a parameter pytree (Achiam et al. 2017; arXiv 2511.11828, Eq. 7).

    Args:
      params: current policy parameters theta_k (pytree).
      objective_fn: params -> scalar surrogate to MAXIMISE (e.g. mean ratio x reward advantage);
        its gradient at theta_k is g, and "improved" means objective_fn(new) >= objective_fn(theta_k).
      constraint_fn: params -> scalar surrogate whose gradient at theta_k is b, in the form
        c + b'x <= 0 (for CCPO: -coverage surrogate; see the module docstring for an example).
      kl_fn: params -> mean KL(S~_{theta_k} || S~_params) (0 at theta_k); its Hessian is H.
      c: constraint value minus limit at theta_k (c > 0 = infeasible).
      delta: KL radius (paper 0.01).
      cg_iters, damping: CG iterations and Fisher damping (jachiam: 10, 1e-5).
      backtrack_decay, backtrack_steps: candidates theta_k + decay^j x, j = 0..steps-1, all
        evaluated at once (vmap).
      kl_slack: accept KL <= kl_slack * delta (OmniSafe 1.5; use 1.0 for a hard radius).
      constraint_tol: absolute slack on the constraint test, so that a step landing exactly on
        the linearised boundary (case 2) is not rejected by float32 rounding.
      fisher: optional ``(logp_fn, weights)`` with ``kl_fn(theta) = sum(weights * KL(p_k || p_theta))``
        for the distributions ``exp(logp_fn(theta))`` over the last axis (``-inf`` = impossible
        action): H is then applied as the Fisher product :func:`fisher_vector_product` (one
        forward tangent and one transpose per product) instead of differentiating ``kl_fn``
        twice; at theta_k the two are the same matrix (module docstring of :func:`fisher_vector_product`).

    Line search: the largest candidate (smallest j) that is finite, has KL <= kl_slack * delta,
    constraint change <= max(-c, 0) (stays feasible when feasible; does not worsen when not),
    and, outside the recovery cases 0 and 1, objective improvement >= 0. A candidate accepted at
    the LAST j is kept (jax-cpo drops it). If none passes, params are returned unchanged.

    Returns:
      (new_params, :class:`CPOInfo`).
    """
    flat, unravel = ravel_pytree(params)
    obj = lambda z: objective_fn(unravel(z))
    con = lambda z: constraint_fn(unravel(z))
    kl = lambda z: kl_fn(unravel(z))
    c = jnp.asarray(c, flat.dtype)

    obj0, g = jax.value_and_grad(obj)(flat)
    con0, b = jax.value_and_grad(con)(flat)
    if fisher is None:
        _, hvp_lin = jax.linearize(jax.grad(kl), flat)  # forward pass once; each HVP is a jvp
    else:
        logp_fn, weights = fisher
        hvp_lin = fisher_vector_product(lambda z: logp_fn(unravel(z)), weights, flat)
    hvp = lambda u: hvp_lin(u) + damping * u
    x, dinfo = cpo_direction(g, b, c, hvp, delta, cg_iters)

    fracs = backtrack_decay ** jnp.arange(backtrack_steps, dtype=flat.dtype)
    cand = flat[None, :] + fracs[:, None] * x[None, :]
    o, cc, k = jax.vmap(lambda z: (obj(z), con(z), kl(z)))(cand)
    improve, dcon = o - obj0, cc - con0
    ok = (
        jnp.isfinite(o) & jnp.isfinite(cc) & jnp.isfinite(k)
        & (k <= kl_slack * delta)
        & (dcon <= jnp.maximum(-c, 0.0) + constraint_tol)
        & ((improve >= 0) | (dinfo.case <= 1))
    )
    accepted = jnp.any(ok)
    j = jnp.where(accepted, jnp.argmax(ok), backtrack_steps).astype(jnp.int32)
    jj = jnp.minimum(j, backtrack_steps - 1)
    frac = jnp.where(accepted, fracs[jj], 0.0)
    new_flat = flat + frac * x
    info = CPOInfo(
        direction=dinfo,
        accepted=accepted,
        step_frac=frac,
        n_backtracks=j,
        kl=jnp.where(accepted, k[jj], 0.0),
        improvement=jnp.where(accepted, improve[jj], 0.0),
        constraint_change=jnp.where(accepted, dcon[jj], 0.0),
        step_norm=frac * jnp.linalg.norm(x),
    )
    return unravel(new_flat), info
