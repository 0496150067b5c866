"""V-trace (arXiv 2511.11828 Eq. 6; IMPALA) against rlax and a hand-computed example."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from ccpo_jax.core.vtrace import vtrace



def _random_batch(key, B=100, T=4):
    k = jax.random.split(key, 5)
    v_tm1 = jax.random.normal(k[0], (B, T))
    v_t = jnp.concatenate([v_tm1[:, 1:], jax.random.normal(k[1], (B, 1))], axis=1)
    r_t = jax.random.normal(k[2], (B, T))
    discount_t = jax.random.uniform(k[3], (B, T), minval=0.5, maxval=1.0)
    # ratios spread over [0, 3] so both clipped and unclipped regimes occur
    rho = jax.random.uniform(k[4], (B, T), minval=0.0, maxval=3.0)
    return v_tm1, v_t, r_t, discount_t, rho


def test_hand_computed_three_steps():
    # Derivation (rho_bar = c_bar = 1):
    #   rho = [0.5, 2, 1] -> clipped [0.5, 1, 1]
    #   td  = [0.5*(0.5+2-1), 1*(-1+3-2), 1*(2+0-3)] = [0.75, 0, -1]
    #   err = [0.75 + 0.5*(-1), 0 + 1*(-1), -1] = [0.25, -1, -1]
    #   targets = v_tm1 + err = [1.25, 1, 2]
    #   q = [0.5 + 1, -1 + 2, 2 + 0] = [1.5, 1, 2];  q - v_tm1 = [0.5, -1, -1]
    #   adv clipped = [0.25, -1, -1], unclipped = [0.25, -2, -1]
    out = vtrace(
        jnp.array([1.0, 2.0, 3.0]), jnp.array([2.0, 3.0, 0.0]), jnp.array([0.5, -1.0, 2.0]),
        jnp.array([1.0, 1.0, 0.0]), jnp.array([0.5, 2.0, 1.0]))
    np.testing.assert_allclose(out.targets, [1.25, 1.0, 2.0], atol=1e-6)
    np.testing.assert_allclose(out.td_errors, [0.25, -1.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(out.advantages_clipped, [0.25, -1.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(out.advantages_unclipped, [0.25, -2.0, -1.0], atol=1e-6)


def test_matches_rlax_on_random_batches():
    v_tm1, v_t, r_t, d_t, rho = _random_batch(jax.random.PRNGKey(0))
    ours = jax.jit(jax.vmap(vtrace))(v_tm1, v_t, r_t, d_t, rho)
    ref = jax.vmap(lambda *a: rlax.vtrace_td_error_and_advantage(*a, lambda_=1.0, clip_rho_threshold=1.0,
                                                                 clip_pg_rho_threshold=1.0))(
        v_tm1, v_t, r_t, d_t, rho)
    ref_unc = jax.vmap(lambda *a: rlax.vtrace_td_error_and_advantage(*a, clip_pg_rho_threshold=1e9))(
        v_tm1, v_t, r_t, d_t, rho)
    np.testing.assert_allclose(ours.td_errors, ref.errors, atol=1e-5)
    np.testing.assert_allclose(ours.targets, ref.errors + v_tm1, atol=1e-5)
    np.testing.assert_allclose(ours.advantages_clipped, ref.pg_advantage, atol=1e-5)
    np.testing.assert_allclose(ours.advantages_unclipped, ref_unc.pg_advantage, atol=1e-5)
    # the asymmetry is real on this batch
    assert np.abs(np.asarray(ours.advantages_clipped - ours.advantages_unclipped)).max() > 0.1


def test_early_termination_with_mask_matches_rlax_on_truncated_episode():
    v_tm1, v_t, r_t, d_t, rho = [x[0] for x in _random_batch(jax.random.PRNGKey(1), B=1, T=4)]
    L = 2  # episode ends at step index 1 (terminal: discount 0), steps 2,3 are padding
    d_t = d_t.at[L - 1].set(0.0)
    mask = jnp.arange(4) < L
    # garbage in the padding must not matter
    garbage = dict(v=v_tm1.at[L:].set(1e3), r=r_t.at[L:].set(-1e3))
    out = vtrace(garbage["v"], v_t, garbage["r"], d_t, rho, mask=mask)
    ref = rlax.vtrace_td_error_and_advantage(v_tm1[:L], v_t[:L], r_t[:L], d_t[:L], rho[:L],
                                             clip_pg_rho_threshold=1.0)
    np.testing.assert_allclose(out.targets[:L], ref.errors + v_tm1[:L], atol=1e-5)
    np.testing.assert_allclose(out.advantages_clipped[:L], ref.pg_advantage, atol=1e-5)
    np.testing.assert_allclose(out.targets[L:], garbage["v"][L:])
    np.testing.assert_array_equal(out.advantages_clipped[L:], 0.0)
    np.testing.assert_array_equal(out.advantages_unclipped[L:], 0.0)
    np.testing.assert_array_equal(out.td_errors[L:], 0.0)


def test_jit_vmap_equal_unbatched_and_no_retrace():
    v_tm1, v_t, r_t, d_t, rho = _random_batch(jax.random.PRNGKey(2), B=100)
    mask = jnp.arange(4)[None, :] < jax.random.randint(jax.random.PRNGKey(3), (100, 1), 1, 5)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def batched(*a):
        return jax.vmap(vtrace)(*a[:5], mask=a[5])

    out = batched(v_tm1, v_t, r_t, d_t, rho, mask)
    out2 = batched(v_tm1 + 1.0, v_t, r_t, d_t, rho, mask)  # same shapes: no retrace
    assert out2.targets.shape == (100, 4)
    for i in (0, 17, 99):
        single = vtrace(v_tm1[i], v_t[i], r_t[i], d_t[i], rho[i], mask=mask[i])
        for a, b in zip(single, out):
            np.testing.assert_allclose(a, b[i], atol=1e-6)
