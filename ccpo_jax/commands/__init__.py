"""CLI subcommands. Each module defines ``register(subparsers)``; heavy imports
(jax, flax ...) happen inside the command function, so ``ccpo-jax --help`` is fast."""
