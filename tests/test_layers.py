"""The import layering (pyproject.toml [tool.importlinter]) and the absence of import cycles.

import-linter checks the layers contracts (experiments above ccpo_jax above envs; inside
ccpo_jax the folders are the layers, cli > ccpo | stackelberg | collect > serving | runtime >
core > errors; inside ccpo_jax.ccpo and ccpo_jax.cli their modules; core without I/O; the
router without the trainer), and every module of ccpo_jax sits in exactly one layer. Independently of it, an AST walk over every import statement of the library,
function-level ones included, checks that no module imports experiments/ or benchmarks/
and that the module graph has no cycle.
"""
from __future__ import annotations

import ast
import os
import tomllib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("ccpo_jax", "envs")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LIBRARY:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(path: Path, name: str, is_pkg: bool, modules=()) -> set[str]:
    """Every module named by an import statement of ``path`` (relative imports resolved;
    ``from pkg import sub`` names ``pkg.sub`` when that is one of ``modules``, else ``pkg``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in _imports(path, name, path.name == "__init__.py", mods):
            parts = imp.split(".")  # the deepest library module the import names
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in mods:
                    if cand != name:
                        targets.add(cand)
                    break
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_anywhere_in_the_library():
    graph = _graph()
    assert len(graph) > 50 and "ccpo_jax.ccpo.train" in graph["ccpo_jax.ccpo.members"]
    assert _cycles(graph) == []


def test_the_library_never_imports_experiments_or_benchmarks():
    bad = [(name, imp) for name, path in _modules().items()
           for imp in _imports(path, name, path.name == "__init__.py")
           if imp.split(".")[0] in ("experiments", "benchmarks", "tests")]
    assert bad == []


def test_import_linter_contracts_are_kept():
    pytest.importorskip("importlinter")
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    r = subprocess.run(cmd + ["--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def _layers(container: str) -> list[set[str]]:
    """The layers (each a set of sibling names) of the layers contract on ``container``."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = [c for c in cfg["contracts"] if c.get("containers") == [container]]
    assert len(found) == 1, container
    return [{n.strip() for n in layer.split("|")} for layer in found[0]["layers"]]


def _uncovered(modules, container: str, layers: list[set[str]]) -> list[str]:
    """Modules directly inside ``container`` (the first name after it) in no layer, or in more than one."""
    out = []
    for m in modules:
        if not m.startswith(container + "."):
            continue
        head = m[len(container) + 1:].split(".")[0]
        if sum(head in layer for layer in layers) != 1:
            out.append(m)
    return out


def test_every_module_of_ccpo_jax_sits_in_exactly_one_layer():
    mods = sorted(m for m in _modules() if m.startswith("ccpo_jax."))
    top = _layers("ccpo_jax")
    assert _uncovered(mods, "ccpo_jax", top) == []
    # the folders with a contract of their own (the method and the CLI) cover each of their modules too
    for folder in ("ccpo_jax.ccpo", "ccpo_jax.cli"):
        assert _uncovered(mods, folder, _layers(folder)) == [], folder
    # a module nobody placed is found (the check can fail)
    assert _uncovered(mods + ["ccpo_jax.stray"], "ccpo_jax", top) == ["ccpo_jax.stray"]
    assert _uncovered(["ccpo_jax.ccpo.stray"], "ccpo_jax.ccpo", _layers("ccpo_jax.ccpo")) == ["ccpo_jax.ccpo.stray"]


def test_every_module_of_envs_sits_in_exactly_one_stage():
    """envs/ is split by stage (pyproject: importers | generators | governance > replay > cache | published):
    a module left at the top of envs/, or a new stage nobody placed, is found."""
    mods = sorted(m for m in _modules() if m.startswith("envs."))
    stages = _layers("envs")
    assert len(mods) > 20 and _uncovered(mods, "envs", stages) == []
    assert _uncovered(mods + ["envs.stray"], "envs", stages) == ["envs.stray"]
