"""ccpo-jax: JAX-accelerated simulator and trainer for cost-aware LLM agent orchestration.

Subpackages and modules are imported lazily; ``import ccpo_jax`` stays cheap.
"""
__version__ = "0.1.0"
