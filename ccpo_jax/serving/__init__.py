"""Serving an exported router (docs/export.md): load it without the training code and decide.

::

    from ccpo_jax.serving import Router
    router = Router.load("artifacts/ccpo")       # verifies checksums and format version
    router.action_set(obs, available)            # bool [B, 3] (base, guide, next)
    router.decide([{"base": {...}, "guide": {...}}])   # raw rounds -> decision

Imports jax, NumPy and ``envs`` (the featuriser) only: no optax, orbax,
tensorboardX, flax or ``ccpo_jax.ccpo.train``. The HTTP endpoint is
:mod:`ccpo_jax.serving.app` (Starlette on :mod:`ccpo_jax.serving.server`, the gateway's server).
"""
from ccpo_jax.serving.artifact import (  # noqa: F401
    FORMAT_NAME,
    FORMAT_VERSION,
    ArtifactError,
    RouterInputError,
)
from ccpo_jax.serving.router import Router  # noqa: F401

__all__ = ["Router", "ArtifactError", "RouterInputError", "FORMAT_NAME", "FORMAT_VERSION"]
