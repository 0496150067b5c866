"""Replay-exact expected cost and success of a policy over cached chains (beyond the paper).

Each question's episode is one fixed chain of rounds (answering ends it), so a
pointwise policy P(a | o_t) -- pi itself for CPO, the softmasked conformal
policy S~_{pi,kappa} for CCPO (paper Eq. 3 with the softmask of section 4) --
induces closed-form outcome probabilities along the chain:

    reach_t   = prod_{s < t} P(next | o_s)                   (reach_0 = 1)
    E[cost]   = sum_t reach_t J_t                            (J_t paid at every reached round)
    Pr[succ]  = 1[unsolvable] + (1 - 1[unsolvable]) sum_t reach_t (P(base|o_t) 1[base correct at t]
                                                                   + P(guide|o_t) 1[guide correct at t])

These are the quantities the paper's sampled estimators target: E[cost] is
what the V-trace reward critic estimates, Pr[succ] is the expectation of
J-bar (paper Eq. 8) under the behaviour policy. Here they are computed
exactly and are differentiable in the policy parameters, with no sampling
variance and no critics. "next" must already be masked where no round
follows (``ccpo_jax.core.networks.masked_probs`` and the conformal policies do
that), so reach is 0 on padding rounds.

:func:`soft_set_size` is the expected number of answers collected by the
set-valued rollout of C_{pi,kappa} when each action is included with its
softmask probability sigmoid((pi - kappa) / eps) (exactly |C(Q)| counted with
multiplicity as eps -> 0); it carries the lambda penalty of paper Eq. 4.

All functions take one batch of questions with a leading axis ``[N, T, ...]``
and return ``[N]``; vmap for more axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ccpo_jax.core.conformal import BASE, GUIDE, NEXT, softmask

Array = jax.Array


def reach_probs(p_next: Array) -> Array:
    """``[N, T]`` probability of reaching round t: the exclusive cumulative product of P(next)."""
    ones = jnp.ones(p_next.shape[:-1] + (1,), p_next.dtype)
    return jnp.concatenate([ones, jnp.cumprod(p_next[..., :-1], axis=-1)], axis=-1)


def expected_cost(probs: Array, cost: Array) -> Array:
    """``[N]`` E[sum of J_t over the rounds reached]. ``probs`` [N, T, 3], ``cost`` [N, T] (0 on padding)."""
    return jnp.sum(reach_probs(probs[..., NEXT]) * cost, axis=-1)


def success_probability(probs: Array, base_correct: Array, guide_correct: Array, unsolvable: Array) -> Array:
    """``[N]`` Pr[the episode ends with a correct answer, or the question is unsolvable] (paper Eq. 5)."""
    reach = reach_probs(probs[..., NEXT])
    p_ans = probs[..., BASE] * base_correct + probs[..., GUIDE] * guide_correct
    return jnp.where(unsolvable, 1.0, jnp.sum(reach * p_ans, axis=-1))


def expected_length(probs: Array) -> Array:
    """``[N]`` E[number of rounds reached]."""
    return jnp.sum(reach_probs(probs[..., NEXT]), axis=-1)


def soft_set_size(pi: Array, kappa: Array | float, available: Array, eps: float = 0.01) -> Array:
    """``[N]`` expected answers collected by C_{pi,kappa} with softmask inclusion probabilities."""
    m = jnp.where(available, softmask(pi, kappa, eps), 0.0)
    reach = reach_probs(m[..., NEXT])
    return jnp.sum(reach * (m[..., BASE] + m[..., GUIDE]), axis=-1)


def occupancy_weights(probs: Array, round_mask: Array) -> Array:
    """``[N, T]`` reach probabilities on existing rounds (constant): the state weights of the KL."""
    return jax.lax.stop_gradient(jnp.where(round_mask, reach_probs(probs[..., NEXT]), 0.0))


def soft_set_outcomes(pi: Array, kappa: Array | float, available: Array, base_correct: Array, guide_correct: Array,
                      unsolvable: Array, cost: Array, eps: float = 0.01) -> tuple[Array, Array, Array]:
    """``([N], [N], [N])`` expected cost, coverage and set size of the set-valued rollout of
    C_{pi,kappa} when each available action a at round t is in the set independently with
    its softmask probability m_t(a) = sigmoid((pi(a|o_t) - kappa) / eps).

    The rollout reaches round t with probability reach_t = prod_{s<t} m_s(next) and stops
    after round t with probability reach_t (1 - m_t(next)) (m(next) = 0 where no round
    follows). A reached round yields a correct answer with h_t = 1 - (1 - m_t(base) 1[base
    correct]) (1 - m_t(guide) 1[guide correct]), so

        Pr[not covered] = sum_t reach_t (1 - m_t(next)) prod_{s <= t} (1 - h_s)

    (unsolvable questions are covered). As eps -> 0 these are the hard set's cost, coverage
    and size (answers counted with multiplicity) of ``envs.replay.env.evaluate_sets``.
    """
    m = jnp.where(available, softmask(pi, kappa, eps), 0.0)
    reach = reach_probs(m[..., NEXT])
    h = 1.0 - (1.0 - m[..., BASE] * base_correct) * (1.0 - m[..., GUIDE] * guide_correct)
    miss_so_far = jnp.cumprod(1.0 - h, axis=-1)
    stop = reach * (1.0 - m[..., NEXT]) * jnp.any(available, axis=-1)
    coverage = jnp.where(unsolvable, 1.0, 1.0 - jnp.sum(stop * miss_so_far, axis=-1))
    size = jnp.sum(reach * (m[..., BASE] + m[..., GUIDE]), axis=-1)
    return jnp.sum(reach * cost, axis=-1), coverage, size
