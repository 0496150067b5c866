"""The documentation cannot drift: README.md and docs/*.md are checked here.

Every ```bash block carries a marker on the line above it:

The executing tests are marked ``docs``: the default ``pytest`` command leaves them out
(``addopts`` in ``pyproject.toml``; they train and export for several minutes of CPU) and
``.ci/run`` runs them with ``python -m pytest -q tests/test_docs.py -m docs``.

- ``<!-- runnable -->``: executed by :func:`test_runnable_blocks`, the blocks of one page in
  order as one script (``bash -eu``), in a scratch directory laid out like a clone: the
  checkout's ``tests/`` and ``benchmarks/`` are linked in, and ``../shared/data`` is the
  full data when it is present. Commands are run as written, so they are written cheaply
  (small ``--splits``/``--iterations``) where the page says what the full run is.
- ``<!-- runnable: full data -->``: the same, on the full data only (skipped without it,
  an error under CI=true, as the other full-data tests).
- ``<!-- runnable by .ci/run -->``: the README's two fresh-machine commands (they create a
  virtual environment and install); ``.ci/run`` executes both verbatim.
- ``<!-- not runnable: REASON -->``: a long-running server, a GPU, several hosts, a full
  training run; the reason is required.

Relative links (``[x](docs/y.md#z)``) must name an existing file and heading.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import IN_CI, REPO, SHARED_DATA

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- (runnable(?:: full data| by \.ci/run)?|not runnable: .+) -->$")
FENCE = re.compile(r"^\s*```(\w*)\s*$")


def _blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, marker or '', code) of every fenced block of ``path``."""
    out, lines, i = [], path.read_text(encoding="utf-8").split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mk = MARK.match(prev)
            out.append((i + 1, m.group(1), mk.group(1) if mk else "", "\n".join(lines[i + 1 : j])))
            i = j + 1
        else:
            i += 1
    return out


def _runnable(path: Path, full: bool) -> str:
    want = "runnable: full data" if full else "runnable"
    return "\n".join(code for _, lang, mk, code in _blocks(path) if lang == "bash" and mk == want)


def test_every_bash_block_is_marked():
    bad = [f"{p.relative_to(REPO)}:{line}" for p in PAGES for line, lang, mk, _ in _blocks(p) if lang == "bash" and not mk]
    assert not bad, f"```bash blocks without a runnable / not runnable marker: {bad}"


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    first = [(mk, code) for _, lang, mk, code in _blocks(REPO / "README.md") if lang == "bash"][:2]
    assert [mk for mk, _ in first] == ["runnable by .ci/run"] * 2
    assert first[0][1].rstrip().endswith("ccpo-jax reproduce") and "pip install -e ." in first[0][1]
    assert first[1][1].strip() == ci_test_command()


def ci_test_command() -> str:
    """The README's test command, as ``.ci/run`` extracts and runs it."""
    r = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--print-test-command"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_ci_runs_every_tier_the_default_command_leaves_out():
    """Each marker that ``addopts`` deselects (``-m 'not docs and not slow'``) has its own pytest
    step in ``.ci/run``, and docs/testing.md's table of slow tests names the files that mark any."""
    import tomllib

    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    left_out = re.findall(r"not (\w+)", re.search(r"-m '([^']+)'", addopts).group(1))
    assert sorted(left_out) == ["docs", "slow"]
    ci = (REPO / ".ci" / "run").read_text()
    for marker in left_out:
        assert re.search(rf"python -m pytest -q tests\S* -m {marker}\b", ci), marker
    slow_mark = re.compile(r"(@|= |marks=|\[)pytest\.mark\.slow\b")
    marked = {p.relative_to(REPO / "tests").as_posix() for p in (REPO / "tests").rglob("test_*.py")
              if slow_mark.search(p.read_text())}
    table = set(re.findall(r"^\| `((?:\w+/)?test_\w+\.py)` \| \d+ \|", (REPO / "docs" / "testing.md").read_text(), re.M))
    assert table == marked


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


#: Pages being written in parallel, which links may name before they land (none now).
PENDING: set[Path] = set()


def test_relative_links_resolve():
    bad = []
    for p in PAGES:
        text = re.sub(r"```.*?```", "", p.read_text(encoding="utf-8"), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (p.parent / file).resolve() if file else p
            if not dest.exists() and dest not in PENDING:
                bad.append(f"{p.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.exists() and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{p.relative_to(REPO)}: {target} (no such heading)")
    assert not bad, bad


RECORD = re.compile(r"`((?:benchmarks|experiments)/results/[^`*{}<\s]+)`( at commits? )?")


def test_cited_records_exist_and_experiment_records_are_indexed():
    """A record that a page, or a script of experiments/ or benchmarks/, quotes (``benchmarks/results/F``,
    ``experiments/results/S/F``) is in the tree unless the page names the commit that holds it (``... at
    commit H``); every experiment record is a row of experiments/results/INDEX.md (file | script | command |
    commit | date)."""
    bad = []
    for p in [*PAGES, REPO / "CHANGELOG.md"]:
        for m in RECORD.finditer(p.read_text(encoding="utf-8")):
            if not m.group(2) and not (REPO / m.group(1)).exists():
                bad.append(f"{p.relative_to(REPO)}: {m.group(1)} (not in the tree and no commit named)")
    for src in sorted([*(REPO / "experiments").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]):
        for m in re.finditer(r"(?:benchmarks|experiments)/results/[\w./-]+\.jsonl?", src.read_text(encoding="utf-8")):
            if not (REPO / m.group(0)).exists():
                bad.append(f"{src.relative_to(REPO)}: {m.group(0)} (not in the tree)")
    root = REPO / "experiments" / "results"
    index = (root / "INDEX.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)`", index, re.M))
    bad += [f"experiments/results/{f} not in INDEX.md" for f in
            sorted(str(q.relative_to(root)) for q in root.rglob("*") if q.is_file() and q.name != "INDEX.md")
            if f not in listed]
    assert not bad, bad


CODE_LINK = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
TIMING = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|us|µs)\b|\b\d+(?:\.\d+)?x (?:faster|slower|longer)\b")


def test_code_names_doc_anchors_that_exist_and_carries_no_timings():
    """``docs/PAGE.md#anchor`` in the library's source names a heading that exists; a comment or docstring
    says why a choice was made and points to docs/performance.md for the timing instead of carrying it
    (``N ms``, ``N us``, ``Nx faster``), which goes stale unseen."""
    import io
    import tokenize

    bad = []
    for src in sorted([*(REPO / "ccpo_jax").rglob("*.py"), *(REPO / "envs").rglob("*.py")]):
        text = src.read_text(encoding="utf-8")
        for m in CODE_LINK.finditer(text):
            page = REPO / "docs" / m.group(1)
            if not page.exists() or m.group(2) not in _anchors(page):
                bad.append(f"{src.relative_to(REPO)}: docs/{m.group(1)}#{m.group(2)} (no such heading)")
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            prose = tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")))
            if prose and TIMING.search(tok.string):
                bad.append(f"{src.relative_to(REPO)}:{tok.start[0]}: {TIMING.search(tok.string).group(0)!r} in a comment")
    assert not bad, bad


def _run_page(page: Path, full: bool, tmp_path: Path) -> None:
    script = _runnable(page, full)
    clone = tmp_path / "clone"
    clone.mkdir()
    for d in ("tests", "benchmarks"):
        (clone / d).symlink_to(REPO / d)
    if full:
        if not (SHARED_DATA / "SOURCES.md").is_file():
            msg = f"full data not found at {SHARED_DATA}"
            pytest.fail(f"CI=true and {msg}", pytrace=False) if IN_CI else pytest.skip(msg)
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(SHARED_DATA)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    r = subprocess.run(["bash", "-euc", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{page.name} runnable blocks failed ({r.returncode}):\n{script}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"


@pytest.mark.docs
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p, False)], ids=lambda p: p.name)
def test_runnable_blocks(page, tmp_path):
    _run_page(page, False, tmp_path)


@pytest.mark.docs
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p, True)], ids=lambda p: p.name)
def test_runnable_blocks_on_full_data(page, tmp_path):
    _run_page(page, True, tmp_path)


OPTIONS = re.compile(r"<!-- options: ([\w.]+) -->\n(.*?)<!-- end options -->\n", re.S)


def test_option_lists_are_generated_from_the_run_configurations():
    """Each ``<!-- options: module.Class -->`` block of a page is ``options.markdown(Class)``:
    the docs' option list comes from the same fields as the flags (rewrite a stale block with
    ``CCPO_WRITE_OPTIONS=1 pytest tests/test_docs.py -k option_lists``)."""
    import importlib
    import os

    from ccpo_jax.runtime.options import markdown

    found = 0
    for page in PAGES:
        text = page.read_text()

        def block(m):
            mod, cls = m.group(1).rsplit(".", 1)
            return f"<!-- options: {m.group(1)} -->\n{markdown(getattr(importlib.import_module(mod), cls))}<!-- end options -->\n"

        want = OPTIONS.sub(block, text)
        found += len(OPTIONS.findall(text))
        if want != text and os.environ.get("CCPO_WRITE_OPTIONS"):
            page.write_text(want)
            continue
        assert want == text, f"{page.name}: an option list differs from its run configuration"
    assert found >= 1


def test_reproduce_docs_name_the_trainer_keywords_it_is_called_with():
    """docs/reproduce.md "For developers" lists the keywords of ``LearnedRowsFn`` (it drifted once)."""
    import inspect

    from ccpo_jax.ccpo.rows import LearnedRowsFn

    text = (REPO / "docs" / "reproduce.md").read_text()
    line = text.split("<!-- trainer keywords -->\n", 1)[1].split("\n", 1)[0]
    documented = re.findall(r"(\w+)=", line)
    wanted = [p for p in inspect.signature(LearnedRowsFn.__call__).parameters if p != "self"]
    assert documented == wanted
