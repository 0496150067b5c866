"""Policy and critic networks (arXiv 2511.11828 §5.1: three layers of 64 units, trained from scratch).

Params are plain pytrees, so they ``vmap`` over splits and seeds. The policy
masks unavailable actions ("next" at a question's last round) before the
softmax, so ``pi(next | o) = 0`` exactly there.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from envs.cache.schema import N_ACTIONS

HIDDEN = (64, 64, 64)


class MLP(nn.Module):
    """tanh MLP with ``len(hidden)`` hidden layers and a linear head of ``out`` units.

    Weights: ``variance_scaling(scale, mode, distribution)`` with scale ``hidden_scale``
    on the hidden layers and ``final_scale**2`` on the head; biases zero. The default is
    Glorot-uniform (scale 1, ``fan_avg``, ``uniform``: the CCPO networks); the Stackelberg
    networks use He-style ``(2.0, "fan_in", "truncated_normal")``
    (:func:`ccpo_jax.stackelberg.nets.mlp`).

    Variance scaling, not flax's orthogonal initialiser: that one runs a LAPACK QR, and
    batched QR under vmap froze XLA:CPU (jaxlib 0.10.2) in this project.
    """

    out: int
    hidden: Sequence[int] = HIDDEN
    final_scale: float = 0.01
    hidden_scale: float = 1.0
    mode: str = "fan_avg"
    distribution: str = "uniform"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = lambda scale: nn.initializers.variance_scaling(scale, self.mode, self.distribution)  # noqa: E731
        for h in self.hidden:
            x = jnp.tanh(nn.Dense(h, kernel_init=init(self.hidden_scale))(x))
        return nn.Dense(self.out, kernel_init=init(self.final_scale**2))(x)


def policy_net(hidden: Sequence[int] = HIDDEN) -> MLP:
    """Logits over (base, guide, next); a small final scale starts near uniform."""
    return MLP(out=N_ACTIONS, hidden=tuple(hidden), final_scale=0.01)


def critic_net(hidden: Sequence[int] = HIDDEN) -> MLP:
    return MLP(out=1, hidden=tuple(hidden), final_scale=1.0)


def masked_probs(logits: jax.Array, available: jax.Array) -> jax.Array:
    """Softmax over available actions. ``logits``, ``available``: ``[..., 3]``."""
    logits = jnp.where(available, logits, -1e9)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.where(available, p, 0.0)
