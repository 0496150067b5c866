"""The size limits of the house (issue 39): no module over 600 lines and no function over 110,
in the library (ccpo_jax/, envs/) and in benchmarks/ (the host side too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ccpo_jax", "envs", "benchmarks")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 110


def _over_the_limits(path: Path, text: str) -> list[str]:
    out = []
    n = len(text.splitlines())
    if n > MAX_MODULE_LINES:
        out.append(f"{path}: {n} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return out


def test_no_module_over_600_lines_and_no_function_over_110():
    files = [p for f in FOLDERS for p in sorted((ROOT / f).rglob("*.py"))]
    assert len(files) > 80
    bad = [x for p in files for x in _over_the_limits(p.relative_to(ROOT), p.read_text())]
    assert bad == []


def test_the_limit_check_can_fail():
    long_function = "def f():\n" + "    x = 1\n" * 110
    assert _over_the_limits(Path("a.py"), long_function) == ["a.py:1 f: 111 lines"]
    assert _over_the_limits(Path("b.py"), "x = 1\n" * 601) == ["b.py: 601 lines"]
    assert _over_the_limits(Path("c.py"), "def f():\n" + "    x = 1\n" * 109) == []
