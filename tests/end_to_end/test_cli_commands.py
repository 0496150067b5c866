"""The command line registers only the command it is given (``ccpo_jax.cli.main.command_modules``): the map of
commands to modules is what the modules register, and ``reproduce`` does not import the gateway's web stack."""
from __future__ import annotations

import subprocess
import sys

from ccpo_jax.cli import main as cli
from tests.helpers import REPO


def _commands(parser) -> set[str]:
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(sub.choices)


def test_the_map_is_what_the_modules_register():
    assert _commands(cli.build_parser()) == set(cli.COMMANDS)
    for name, module in cli.COMMANDS.items():
        assert name in _commands(cli.build_parser([name, "--x"])), name
        assert cli.command_modules([name]) == (module,)
    for argv in ([], ["--version"], ["--help"], ["reproduc"]):  # the full parser answers these
        assert cli.command_modules(argv) == cli.COMMAND_MODULES


def test_reproduce_imports_no_web_stack():
    code = ("import sys; from ccpo_jax.cli.main import build_parser; "
            "build_parser(['reproduce', '--help']).parse_known_args(['reproduce']); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'starlette', 'uvicorn', 'pydantic'}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.stdout.strip() == "[]", p.stderr[-2000:]
