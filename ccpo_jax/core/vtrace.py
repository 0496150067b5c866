"""V-trace targets and advantages for one trajectory (CCPO paper, arXiv 2511.11828, Eq. 6;
IMPALA, Espeholt et al. 2018, arXiv 1802.01561).

rlax-style: small pure functions over one *unbatched* trajectory (time axis
``[T]``); batch with ``jax.vmap``. Naming follows rlax: ``v_tm1`` = V(o_t),
``v_t`` = V(o_{t+1}), ``r_t``, ``discount_t`` and ``rho_tm1`` the importance
ratio S_{pi,kappa}(a_t|o_t) / pi(a_t|o_t) of the action taken at o_t.

Equations (IMPALA's V-trace with the CCPO paper's rho-bar = c-bar = 1 (§6), lambda = 1):
  delta_t = min(rho_bar, rho_t) (r_t + gamma_t V(o_{t+1}) - V(o_t))
  v_t     = V(o_t) + delta_t + gamma_t min(c_bar, rho_t) (v_{t+1} - V(o_{t+1}))
  A_t     = rho_t^{pg} (r_t + gamma_t v_{t+1} - V(o_t)),  v_{T+1} := V(o_{T+1}) = v_t[-1]
with rho^{pg} = min(1, rho) for the *reward* policy gradient and the raw rho
for the *constraint* policy gradient (paper section 6: "we apply clipping only
to the reward gradient ... leaving the cost gradient unclipped").

Episodes that end early: put ``discount_t = 0`` at the terminal step (so
nothing bootstraps across the end) and ``mask = False`` on the padding steps
after it. Padded steps get ``targets = v_tm1`` and zero advantages / errors,
and they do not leak into the valid steps (the reverse scan resets there).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


class VTraceReturns(NamedTuple):
    """Outputs of :func:`vtrace`, each ``[T]``.

    targets: v_t, the critic's regression target (gradient stopped).
    advantages_clipped: min(clip_pg_rho, rho_t) (r_t + gamma_t v_{t+1} - V(o_t)),
      for the reward policy gradient.
    advantages_unclipped: rho_t (r_t + gamma_t v_{t+1} - V(o_t)), for the
      constraint policy gradient (the paper's §6 asymmetry, see the module docstring).
    td_errors: targets - v_tm1 (rlax's V-trace "errors"); the critic loss is
      0.5 * td_errors**2 with v_tm1 carrying the gradient.
    """

    targets: Array
    advantages_clipped: Array
    advantages_unclipped: Array
    td_errors: Array


def vtrace(
    v_tm1: Array,
    v_t: Array,
    r_t: Array,
    discount_t: Array,
    rho_tm1: Array,
    clip_rho: float = 1.0,
    clip_c: float = 1.0,
    mask: Optional[Array] = None,
    clip_pg_rho: float = 1.0,
    stop_target_gradients: bool = True,
) -> VTraceReturns:
    """V-trace targets and both policy-gradient advantages for ONE trajectory.

    Args:
      v_tm1: ``[T]`` V(o_t) for t = 1..T.
      v_t: ``[T]`` V(o_{t+1}) (bootstrap values; only ``v_t[-1]`` and the
        TD errors use it; set to 0 after a terminal step or use discount 0).
      r_t: ``[T]`` reward (or constraint signal c_t for the constraint critic).
      discount_t: ``[T]`` gamma_t; 0 at the terminal step.
      rho_tm1: ``[T]`` unclipped ratio S(a_t|o_t)/pi(a_t|o_t) (>= 0).
      clip_rho: rho-bar for the TD errors (paper: 1).
      clip_c: c-bar for the trace coefficients (paper: 1).
      mask: ``[T]`` bool, False on steps after the episode ended; default all True.
      clip_pg_rho: clip of the ratio in ``advantages_clipped`` (paper: 1).
      stop_target_gradients: stop gradients through the targets (as rlax).

    Returns:
      :class:`VTraceReturns`, each ``[T]``.
    """
    chex.assert_rank([v_tm1, v_t, r_t, discount_t, rho_tm1], 1)
    chex.assert_equal_shape([v_tm1, v_t, r_t, discount_t, rho_tm1])
    if mask is None:
        mask = jnp.ones_like(v_tm1, dtype=bool)
    chex.assert_equal_shape([v_tm1, mask])
    m = mask.astype(v_tm1.dtype)

    rho_clipped = jnp.minimum(clip_rho, rho_tm1)
    c_tm1 = jnp.minimum(clip_c, rho_tm1)
    td = m * rho_clipped * (r_t + discount_t * v_t - v_tm1)

    def body(acc, xs):
        td_s, disc_s, c_s, m_s = xs
        # Padded steps reset the accumulator, so nothing crosses a mask boundary.
        acc = m_s * (td_s + disc_s * c_s * acc)
        return acc, acc

    _, errors = jax.lax.scan(body, jnp.zeros((), v_tm1.dtype), (td, discount_t, c_tm1, m), reverse=True)
    targets = v_tm1 + errors
    if stop_target_gradients:
        targets = jax.lax.stop_gradient(targets)
        errors = targets - v_tm1

    # q_t = r_t + gamma_t v_{t+1}; at the last step bootstrap from V(o_{T+1}).
    next_target = jnp.concatenate([targets[1:], v_t[-1:]])
    # If step t+1 is padding, its "target" is v_tm1 there, which is only used
    # when discount_t > 0 (a truncated, not terminated, episode): bootstrap value.
    q = r_t + discount_t * next_target
    diff = q - v_tm1
    adv_clipped = m * jnp.minimum(clip_pg_rho, rho_tm1) * diff
    adv_unclipped = m * rho_tm1 * diff
    return VTraceReturns(
        targets=targets,
        advantages_clipped=adv_clipped,
        advantages_unclipped=adv_unclipped,
        td_errors=m * errors,
    )
