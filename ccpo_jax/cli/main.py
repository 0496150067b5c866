"""The ``ccpo-jax`` console entry point: one command, several subcommands.

User errors (:data:`ccpo_jax.errors.USER_ERRORS`, and a full disk: :func:`ccpo_jax.errors.disk_full_message`) are printed as one line
``error: ...`` on stderr with exit status 2 and no traceback; Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module registers its own subcommand(s); keep this list sorted by name.
COMMAND_MODULES = (
    "ccpo_jax.cli.data",
    "ccpo_jax.cli.export",
    "ccpo_jax.cli.gateway",
    "ccpo_jax.cli.multihost",
    "ccpo_jax.cli.reproduce",
    "ccpo_jax.cli.serve",
    "ccpo_jax.cli.stackelberg",
    "ccpo_jax.cli.sweep",
)


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``), or ``unknown`` when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ccpo-jax")
    except PackageNotFoundError:
        return "unknown (not installed; run from a checkout)"


#: The module that registers each command. A command line that names one imports that module alone: the
#: others' options pull in their stacks (the gateway's aiohttp, Starlette, pydantic;
#: docs/performance.md#figures-behind-code-comments). tests/end_to_end/test_cli_commands.py checks this map
#: against what the modules register.
COMMANDS = {"data": "ccpo_jax.cli.data", "export": "ccpo_jax.cli.export", "gateway": "ccpo_jax.cli.gateway",
            "live-eval": "ccpo_jax.cli.gateway", "multihost": "ccpo_jax.cli.multihost",
            "reproduce": "ccpo_jax.cli.reproduce", "route": "ccpo_jax.cli.serve", "serve": "ccpo_jax.cli.serve",
            "stackelberg": "ccpo_jax.cli.stackelberg", "sweep": "ccpo_jax.cli.sweep"}


def command_modules(argv: list[str] | None) -> tuple[str, ...]:
    """The modules to register for ``argv``: the named command's, or all of them (no command yet, ``--help``,
    ``--version``, a name no module registers: the full parser answers those)."""
    return (COMMANDS[argv[0]],) if argv and argv[0] in COMMANDS else COMMAND_MODULES


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``ccpo-jax`` parser; with ``argv``, only the command it names (:func:`command_modules`)."""
    parser = argparse.ArgumentParser(
        prog="ccpo-jax",
        description="Cost-aware LLM orchestration: CCPO training/evaluation on cached LLM responses, "
        "and Stackelberg resource governance.",
    )
    parser.add_argument("--version", action="version", version=f"ccpo-jax {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in command_modules(argv):
        importlib.import_module(name).register(sub)
    return parser


FORCE_HOST_DEVICES = "--xla_force_host_platform_device_count"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def force_host_devices(devices) -> None:
    """``--devices N`` on a CPU host: ask XLA for N host devices, before JAX starts its backends;
    ``--devices all``: one per usable core (:func:`usable_cores`).

    Appends ``--xla_force_host_platform_device_count=N`` to ``XLA_FLAGS`` unless
    the variable already sets it (the user's value wins) or JAX has already
    started (then ``--devices`` checks the devices that exist). The flag only
    shapes the CPU backend, so it is harmless where the devices are GPUs or TPUs
    (there ``all`` is every accelerator).
    """
    if isinstance(devices, str) and devices.strip().lower() == "all":
        devices = usable_cores()
    try:
        n = int(devices)
    except (TypeError, ValueError):
        return  # None or junk (the command reports junk)
    flags = os.environ.get("XLA_FLAGS", "")
    if n <= 1 or FORCE_HOST_DEVICES in flags or os.environ.get("CCPO_JAX_DISTRIBUTED"):
        return
    if "jax" in sys.modules:
        try:  # private API; if it moves, assume started and leave XLA_FLAGS alone
            from jax._src import xla_bridge

            started = xla_bridge.backends_are_initialized()
        except Exception:
            started = True
        if started:
            return
    os.environ["XLA_FLAGS"] = f"{flags} {FORCE_HOST_DEVICES}={n}".strip()


def main(argv: list[str] | None = None) -> int:
    from ccpo_jax.errors import USER_ERRORS, hints

    from ccpo_jax.runtime import progress

    progress.restart_clock()  # the phase lines count seconds from the command's start
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(given)
    args = parser.parse_args(given)
    force_host_devices(getattr(args, "devices", None))
    from ccpo_jax.runtime.compile_cache import configure

    # JAX's persistent compilation cache (off: CCPO_JAX_COMPILATION_CACHE=off; docs/performance.md), and the big
    # programs' executables beside it when this is the process's own command line
    configure(executables=argv is None)
    if os.environ.get("CCPO_JAX_DISTRIBUTED"):
        # Multi-host: jax.distributed.initialize() before any other JAX call
        # (ccpo_jax.runtime.sharding.init_distributed reads the variable; unset = single host).
        from ccpo_jax.runtime.sharding import init_distributed

        init_distributed()
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows up here at the latest
    except BrokenPipeError:
        # SIGPIPE: the reader closed the pipe; stop quietly, as `cat FILE | head` does. Point
        # stdout at /dev/null so the interpreter's final flush cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the status a shell reports for a command killed by it
    except USER_ERRORS as e:
        print(f"error: {e}{hints(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a full disk anywhere (reproduce, export, data, stackelberg) is a user error too
        from ccpo_jax.errors import disk_full_message

        msg = disk_full_message(e)
        if msg is None:
            raise
        print(f"error: {msg}{hints(e)}", file=sys.stderr)
        return 2
    rc = int(rc or 0)
    if argv is None and args.command in FAST_EXIT:
        exit_now(rc)
    return rc


#: Commands whose process, run from the command line (``main()`` without ``argv``), ends with :func:`exit_now`.
FAST_EXIT = ("reproduce",)


def exit_now(rc: int) -> None:
    """End the process now that the command has finished and closed its files: run the ``atexit`` handlers
    (JAX's, orbax's, tensorboardX's, as a normal exit would), flush stdout and stderr, and leave with
    ``os._exit``, without the interpreter's teardown of its modules and of XLA's backends after them,
    which takes a noticeable part of a second (docs/performance.md#figures-behind-code-comments)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
