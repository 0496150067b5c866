"""Compare two ``results.json`` files of ``ccpo-jax reproduce`` value by value.

    python benchmarks/diff_results.py A/results.json B/results.json [--ignore timing,environment] [--tol 0]

Walks both JSON trees and prints every path where they differ (a missing key, another type, another
value; numbers equal when ``|a - b| <= tol``, NaN equal to NaN), then one summary line. Exit status 0 when
every compared value is equal, 1 otherwise. ``timing`` (wall-clock seconds) is ignored by default, and
so are the run's ``out`` paths; everything else, every split of every row, is compared.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator


def diff(a: Any, b: Any, path: str = "", tol: float = 0.0, ignore: frozenset = frozenset()) -> Iterator[str]:
    """Yield one line per difference between ``a`` and ``b`` (JSON values), with its path."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in ignore:
                continue
            p = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                yield f"{p}: only in {'B' if k not in a else 'A'}"
            else:
                yield from diff(a[k], b[k], p, tol, ignore)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from diff(x, y, f"{path}[{i}]", tol, ignore)
    elif _number(a) and _number(b):
        if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol):
            yield f"{path}: {a!r} != {b!r}"
    elif a != b:
        yield f"{path}: {a!r} != {b!r}"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def count_values(x: Any) -> int:
    """How many leaf values a JSON tree holds."""
    if isinstance(x, dict):
        return sum(count_values(v) for v in x.values())
    if isinstance(x, list):
        return sum(count_values(v) for v in x)
    return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--ignore", default="timing", help="comma-separated keys to skip at any depth (default: timing)")
    ap.add_argument("--tol", type=float, default=0.0, help="absolute tolerance for numbers (default 0: equal)")
    a = ap.parse_args(argv)
    ra, rb = (json.loads(p.read_text()) for p in (a.a, a.b))
    ignore = frozenset(k for k in a.ignore.split(",") if k)
    lines = list(diff(ra, rb, tol=a.tol, ignore=ignore))
    for ln in lines[:200]:
        print(ln)
    n = count_values({k: v for k, v in ra.items() if k not in ignore})
    print(f"{len(lines)} difference(s) over {n} values (ignored: {', '.join(sorted(ignore)) or 'none'})")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
