"""``python -m ccpo_jax.cli``: the same as the ``ccpo-jax`` console command."""
import sys

from ccpo_jax.cli.main import main

sys.exit(main())
