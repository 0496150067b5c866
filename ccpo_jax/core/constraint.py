"""Importance-weighted coverage estimate J-bar and its CPO surrogate (CCPO paper, arXiv 2511.11828, Eq. 8).

Coverage of the set-valued policy splits into two disjoint events (C(Q) is a
subset of the reachable answers; arXiv 2511.11828, the derivation of Eq. 8):

    Pr[Y* in C(Q) or Y* unreachable] = Pr[Y* in C(Q)] + Pr[Y* unreachable]
                                    >= Pr[S_{pi,kappa}(Q) = Y*] + Pr[unsolvable]

and Pr[S(Q) = Y*] = E_{tau ~ pi}[ prod_t (S/pi)(a_t|o_t) 1[answer(tau) correct] ], so

    J-bar = mean_episodes( 1[unsolvable] + (1 - 1[unsolvable]) prod_t rho_t 1[answer correct] ).

Choice (the issue leaves it open): ratios are UNCLIPPED by default. Then J-bar is an
unbiased estimate of Pr[S(Q) = Y*] + Pr[unsolvable], which is itself <= the set coverage
whenever the sets along the chain are non-empty (kappa <= 1/3 guarantees it for 3 actions;
with the empty-set fallback of :func:`ccpo_jax.core.conformal.stochastic_conformal_policy` S may
answer where the set is empty, and the inequality can fail there). So in expectation J-bar
UNDER-estimates coverage: enforcing J-bar >= 1 - alpha is conservative. The unclipped form also
matches the unclipped constraint gradient of paper section 6 and makes the surrogate's value at
theta_k equal J-bar, so the CPO linearisation c + b'x is consistent. ``clip_rho=1`` gives the
paper's rho_t of Eq. 6 (min(1, S/pi)); since min(1, rho) <= rho, that estimate is biased further
DOWN (more conservative, lower variance).

CPO form (see :mod:`ccpo_jax.core.trust_region`): c = (1 - alpha) - J-bar(theta_k) and
constraint_fn(theta) = -coverage_surrogate(theta).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def _mean(x: Array, weights: Optional[Array]) -> Array:
    if weights is None:
        return jnp.mean(x)
    return jnp.sum(weights * x) / jnp.maximum(jnp.sum(weights), 1e-30)


def episode_weights(rho_t: Array, mask: Optional[Array] = None, clip_rho: Optional[float] = None) -> Array:
    """prod_t rho_t over the steps of each episode. ``rho_t``, ``mask``: ``[..., T]`` -> ``[...]``.
    Padding steps (mask False) count as 1. ``clip_rho``: None = unclipped, else min(clip_rho, rho)."""
    r = rho_t if clip_rho is None else jnp.minimum(clip_rho, rho_t)
    if mask is not None:
        r = jnp.where(mask, r, 1.0)
    return jnp.prod(r, axis=-1)


def coverage_estimate(
    rho_t: Array,
    success: Array,
    unsolvable: Array,
    mask: Optional[Array] = None,
    clip_rho: Optional[float] = None,
    weights: Optional[Array] = None,
) -> Array:
    """J-bar (module docstring) from episodes sampled with the behaviour policy pi.

    Args:
      rho_t: ``[B, T]`` S(a_t|o_t) / pi(a_t|o_t) of the actions taken.
      success: ``[B]`` 1[the answer the episode ended with is correct] (the constraint signal
        c_t summed over t, without the unsolvable part).
      unsolvable: ``[B]`` bool, no reachable answer is correct.
      mask: ``[B, T]`` bool, False after the episode ended.
      clip_rho: None (default, unbiased for Pr[S(Q) = Y*]) or e.g. 1.0 (paper's Eq. 6 ratio).
      weights: optional ``[B]`` episode weights (weighted mean; padding episodes get 0).
    Returns: scalar.
    """
    w = episode_weights(rho_t, mask, clip_rho)
    per = jnp.where(unsolvable, 1.0, w * success.astype(w.dtype))
    return _mean(per, weights)


def coverage_surrogate(
    target_logp_t: Array,
    behaviour_logp_t: Array,
    success: Array,
    unsolvable: Array,
    mask: Optional[Array] = None,
    weights: Optional[Array] = None,
) -> Array:
    """Differentiable J-bar for the CPO step: the unclipped IS product with the target policy
    S~_theta (softmask policy, differentiable in theta) against the fixed behaviour policy pi_k.

        J(theta) = mean( 1[unsolvable] + (1 - 1[unsolvable]) exp(sum_t log S~_theta(a_t|o_t)
                                                                 - log pi_k(a_t|o_t)) 1[correct] )

    Its expectation under pi_k equals Pr[S~_theta(Q) = Y*] + Pr[unsolvable] for EVERY theta, so
    its gradient is an unbiased estimate of that probability's gradient; at theta_k it equals
    :func:`coverage_estimate` with rho = S~_k / pi_k.

    Args:
      target_logp_t: ``[B, T]`` log S~_theta(a_t|o_t) (carries the gradient).
      behaviour_logp_t: ``[B, T]`` log pi_k(a_t|o_t) (treated as constant).
      success, unsolvable, mask, weights: as in :func:`coverage_estimate`.
    Returns: scalar.
    """
    d = target_logp_t - jax.lax.stop_gradient(behaviour_logp_t)
    if mask is not None:
        d = jnp.where(mask, d, 0.0)
    per = jnp.where(unsolvable, 1.0, jnp.exp(jnp.sum(d, axis=-1)) * success.astype(d.dtype))
    return _mean(per, weights)


def coverage_constraint_value(coverage: Array, alpha: Array | float) -> Array:
    """c = (1 - alpha) - coverage: the CPO constraint value in "c + b'x <= 0" form (c > 0 = violated)."""
    return (1.0 - alpha) - coverage
