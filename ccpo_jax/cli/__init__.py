"""The ``ccpo-jax`` command line: :mod:`.main` (the entry point and the error handling) and one
module per subcommand. Each defines ``register(subparsers)``; heavy imports (jax, flax ...)
happen inside the command function, so ``ccpo-jax --help`` is fast."""
