"""Names from a cache in reports and on the terminal (issue 41 item 7): a control character is
shown quoted, never raw (an ESC coloured the terminal, a newline broke the table), and ``|``
cannot split a markdown table cell. The oracle for the tables is a cell splitter written here
from the GFM rule (a cell ends at every ``|`` not preceded by a backslash)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run_cli
from envs.cache.values import md_cell, md_code, printable

ESC_MODEL = "gpt|4o\x1b[31m"
ESC_CACHE = "evil\x1b[2J|cache\nname"
ROWS = ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)")


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row: split at unescaped pipes, outer ones dropped."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    assert parts[0] == "" and parts[-1] == "", line
    return parts[1:-1]


def _tables(md: str) -> list[list[str]]:
    """Each table of ``md`` as its lines (a table: consecutive lines starting with '|')."""
    out, cur = [], []
    for ln in md.splitlines() + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            out.append(cur)
            cur = []
    return out


@pytest.mark.parametrize("text, shown", [
    ("gpt-4o", "gpt-4o"),
    ("Ünïcode 数学 a b", "Ünïcode 数学 a b"),
    ("a\x1b[31m", r"'a\x1b[31m'"),
    ("new\nline", r"'new\nline'"),
    ("nul\x00", r"'nul\x00'"),
    ("rtl\u202eoverride", r"'rtl\u202eoverride'"),
])
def test_printable_quotes_only_what_is_not_printable(text, shown):
    assert printable(text) == shown
    assert all(ch.isprintable() for ch in printable(text))


@pytest.mark.parametrize("text", ["a|b", "||", "x\x1b|y", "`code`", "a``b", "plain"])
def test_markdown_cells_and_code_spans_keep_the_table_whole(text):
    row = f"| {md_cell(text)} | {md_code(text)} | 1 |"
    assert len(_cells(row)) == 3 and "\x1b" not in row
    code = md_code(text)
    fence = re.match(r"`+", code).group(0)
    assert code.endswith(fence) and fence not in code[len(fence):-len(fence)]


@pytest.fixture(scope="module")
def odd_cache(tmp_path_factory) -> Path:
    """A synthetic cache whose name, base and EXIT / LLM-policy model names carry ESC, newline and '|',
    and whose groups carry '|'."""
    from envs.cache.fast import save_fast
    from envs.cache.schema import ResponseCache
    from envs.generators.synthetic import generate

    c = generate("hotpotqa-llama2", n_questions=100, seed=0)
    m = c.manifest
    man = dataclasses.replace(m, name=ESC_CACHE, base=dataclasses.replace(m.base, name="base\x1b[1m"),
                              exit_models=(ESC_MODEL, m.exit_models[1]),
                              llm_policy_models=(ESC_MODEL, m.llm_policy_models[1]),
                              provenance={**m.provenance, "note": "a\x1b[0m|b"})
    groups = np.array(["x|y", "z"] * 50)
    return save_fast(ResponseCache(man, {**c.arrays, "group": groups}).with_checksum(),
                     tmp_path_factory.mktemp("odd") / "c")


def test_reproduce_quotes_cache_names_in_table_md_and_on_the_terminal(tmp_path, odd_cache, monkeypatch):
    import ccpo_jax.ccpo.rows as rows_module
    from ccpo_jax.ccpo.rows import LearnedRows
    from ccpo_jax.ccpo.settings import METRICS

    def fake(run, data, execution):
        S = data.splits.test.shape[0]
        return LearnedRows(rows={r: {m: np.full(S, 0.5) for m in METRICS} for r in ROWS}, timing={})

    monkeypatch.setattr(rows_module, "learned_rows", fake)
    out = tmp_path / "run"
    r = run_cli(["reproduce", "--cache", str(odd_cache), "--splits", "2", "--split-sizes", "60,20,20",
                 "--no-progress", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    terminal = r.stdout + r.stderr
    md = (out / "table.md").read_text()
    for text in (terminal, md):
        assert not any(ch in text for ch in "\x1b\x00"), [ln for ln in text.splitlines() if "\x1b" in ln]
    assert repr(ESC_CACHE) in terminal and "'base\\x1b[1m'" not in md  # the base model is no row
    (table,) = [t for t in _tables(md) if t[0].startswith("| Policy")]
    widths = {len(_cells(ln)) for ln in table}
    assert widths == {len(_cells(table[0]))}, table
    names = [_cells(ln)[0].strip() for ln in table[2:]]
    assert md_cell(f"{ESC_MODEL} EXIT") in names and md_cell(f"LLM policy ({ESC_MODEL})") in names, names
    assert f"cache: {md_code(ESC_CACHE)}" in md and "note=" + printable("a\x1b[0m|b") in md


def test_data_check_quotes_model_and_cache_names(odd_cache):
    r = run_cli(["data", "check", str(odd_cache)])
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr
    assert f"name:        {ESC_CACHE!r}" in r.stdout and "base model:  'base\\x1b[1m'" in r.stdout
    assert f"  {ESC_MODEL!r} EXIT:" in r.stdout


def test_group_table_escapes_the_worst_groups_name():
    from ccpo_jax.ccpo.report import format_groups, group_entry

    cov = np.array([[[0.95, 0.70]]])  # 1 seed, 1 split, groups "ok" and "x|y"
    groups, summary = group_entry(cov, np.ones_like(cov), np.ones((1, 2)), np.ones((1, 2)), np.ones_like(cov),
                                  np.ones_like(cov), ["ok", "x|y\x1b"], 0.1)
    assert summary["min_group"] == "x|y\x1b"
    stats = {"mean": 1.0, "q05": 1.0, "q95": 1.0}
    results = {"calibration": {"n_groups": 2, "group_min": 1, "n_cal": 2, "own_groups": {"mean": 2, "min": 2, "max": 2},
                               "pooled_groups": {"mean": 0.0}, "pooled_questions": {"mean": 0.0}},
               "policies": {"CPO|batch": {"group_summary": summary, "cost_cents": stats, "coverage": stats}}}
    md = format_groups(results)
    (table,) = _tables(md)
    assert {len(_cells(ln)) for ln in table} == {7}, table
    assert "\x1b" not in md and _cells(table[2])[0].strip() == "CPO\\|batch"
    assert "('x\\|y\\x1b')" in table[2], table[2]


class _Stub(float):
    """Any number or sub-table of a Stackelberg ``results.json`` that the test does not care about."""

    def __new__(cls):
        return super().__new__(cls, 0.5)

    def __getitem__(self, key):
        return _Stub()

    def get(self, key, default=None):
        return _Stub()

    def items(self):
        return []

    def __contains__(self, key):
        return False


def test_stackelberg_table_escapes_the_grid_name_and_task_types(tmp_path):
    from ccpo_jax.stackelberg.tables import write_table

    tasks = ["a|b\x1b[31m", "plain"]
    res = {k: _Stub() for k in ("evaluation", "trap_audit", "surrogate", "sim_to_real", "tool_repair", "probes",
                                "config", "timing", "environment")}
    res["data"] = {"synthetic": False, "name": "grid|x\x1b[2J", "n_cells": 4, "provenance": {"kind": "real"},
                   "task_types": tasks}
    write_table(tmp_path / "table.md", res)
    md = (tmp_path / "table.md").read_text()
    assert "\x1b" not in md and f"Grid {md_code('grid|x' + chr(27) + '[2J')} (4 cells" in md
    (t5,) = [t for t in _tables(md) if t[0].startswith("| Task |")]
    assert {len(_cells(ln)) for ln in t5} == {len(_cells(t5[0]))}, t5
    assert [_cells(ln)[0].strip() for ln in t5[2:]] == [md_cell(t) for t in tasks]
