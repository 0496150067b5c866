"""The ``ccpo-jax`` console entry point: one command, several subcommands.

User errors (:data:`ccpo_jax.errors.USER_ERRORS`) are printed as one line
``error: ...`` on stderr with exit status 2 and no traceback; Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module registers its own subcommand(s); keep this list sorted by name.
COMMAND_MODULES = (
    "ccpo_jax.commands.data",
    "ccpo_jax.commands.export",
    "ccpo_jax.commands.reproduce",
    "ccpo_jax.commands.stackelberg",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ccpo-jax",
        description="Cost-aware LLM orchestration: CCPO training/evaluation on cached LLM responses, "
        "and Stackelberg resource governance.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ccpo_jax.errors import USER_ERRORS

    parser = build_parser()
    args = parser.parse_args(argv)
    if os.environ.get("CCPO_JAX_DISTRIBUTED"):
        # Multi-host: jax.distributed.initialize() before any other JAX call
        # (ccpo_jax.sharding.init_distributed reads the variable; unset = single host).
        from ccpo_jax.sharding import init_distributed

        init_distributed()
    try:
        rc = args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
