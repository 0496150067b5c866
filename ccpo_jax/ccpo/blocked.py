"""The policy's forward pass in fixed-size row blocks, shared by the trainer's evaluation and the router.

XLA's CPU matmul rounds differently for different batch sizes, and kappa-hat equals one
calibration probability, so a 1-ulp difference could flip a set. Computed in blocks of
``BLOCK_ROWS`` rows (padded), the bits do not depend on how many rows there are: the
exported router (:mod:`ccpo_jax.ccpo.export`) reproduces the trainer's sets bit for bit.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ccpo_jax.core.networks import HIDDEN, masked_probs, policy_net
from ccpo_jax.serving.artifact import BLOCK_ROWS
from envs.cache.schema import N_ACTIONS


def in_blocks(fn, obs: jax.Array, avail: jax.Array):
    """``fn(obs [BLOCK_ROWS, F], avail [BLOCK_ROWS, 3]) -> pytree of [BLOCK_ROWS, ...]`` over a padded batch [b, ...]."""
    b, F = obs.shape
    n = (b + BLOCK_ROWS - 1) // BLOCK_ROWS
    pad = n * BLOCK_ROWS - b
    o = jnp.pad(obs, ((0, pad), (0, 0))).reshape(n, BLOCK_ROWS, F)
    a = jnp.pad(avail, ((0, pad), (0, 0)), constant_values=True).reshape(n, BLOCK_ROWS, N_ACTIONS)
    out = jax.lax.map(lambda oa: fn(oa[0], oa[1]), (o, a))
    return jax.tree.map(lambda x: x.reshape((n * BLOCK_ROWS,) + x.shape[2:])[:b], out)


def block_probs(policy_params: Any, hidden=None, ensemble: bool = False):
    """``fn(obs [rows, F], avail [rows, 3]) -> pi(.|o) [rows, 3]``: one policy's masked softmax, or with
    ``ensemble`` (every leaf with a leading member axis [M, ...]) the mean of the M members' (in member
    order, float32): the function the trainer's evaluation and the exported module both run per block."""
    net = policy_net(tuple(hidden) if hidden is not None else HIDDEN)
    if not ensemble:
        return lambda o, a: masked_probs(net.apply(policy_params, o), a)
    return lambda o, a: jnp.mean(jax.vmap(lambda p: masked_probs(net.apply(p, o), a))(policy_params), axis=0)


def blocked_policy_probs(policy_params: Any, obs: jax.Array, available: jax.Array, hidden=None,
                         ensemble: bool = False) -> jax.Array:
    """pi(.|o) ``[..., 3]`` for ``obs [..., F]``, computed in blocks of ``BLOCK_ROWS`` rows as the exported
    module computes it (``ensemble``: the members' mean, :func:`block_probs`). jit- and vmap-able."""
    lead = obs.shape[:-1]
    flat_o = obs.reshape((-1, obs.shape[-1]))
    flat_a = available.reshape((-1, N_ACTIONS))
    probs = in_blocks(block_probs(policy_params, hidden, ensemble), flat_o, flat_a)
    return probs.reshape(lead + (N_ACTIONS,))
