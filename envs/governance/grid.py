"""The response grid: what an executor LLM did under each resource action (arXiv 2606.23026 §6.3, Table 3).

The grid crosses task types x executor-model conditions x context / prompt /
tool-budget levels x turns of a session x repeated trials, and records the
tokens spent and the judged quality of each response. It trains the surrogate
payoff oracle (T-hat, Q-hat) and is replayed as the "real" environment.

Arrays (fast format ``arrays.npz``; shape ``[K, M, C, P, U, H, R]``):

=============  =======  ==========================================================
name           dtype    meaning
=============  =======  ==========================================================
``tokens``     float32  tokens of the response (finite, >= 0)
``quality``    float32  judged quality / completeness in [0, 1]
``tool_fail``  bool     a phantom-tool failure was observed (False if unknown)
=============  =======  ==========================================================

K task types, M model conditions, C/P/U action levels (in [0, 1], strictly
increasing), H turns (turn h is the (h+1)-th turn of a session held at that
action), R repeated trials. The manifest names the axes and holds the
provenance (``kind`` 'synthetic' or 'real') and two checksums: ``arrays_checksum``
over the arrays and ``checksum`` over the arrays and every other manifest field
(axes, levels, provenance, name), so an edited manifest is refused on load.

**Human format** (JSON Lines): an optional first line ``{"manifest": {...}}``
with the same fields as ``manifest.json`` (checksum not needed), then one
line per cell::

    {"task": "code generation", "model": "executor-a", "c": 0.2, "p": 0.4,
     "u": 0.0, "turn": 1, "trial": 0, "tokens": 512.0, "quality": 0.91,
     "tool_fail": false}

``turn`` is 1-based, ``trial`` 0-based; ``tool_fail`` is optional. Every cell
of the crossing must be present exactly once. Errors name file, line and field
and raise :class:`envs.cache.schema.CacheError`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from envs.cache.atomic import atomic_path
from envs.cache.fast import read_fast_dir, verify_checksum, write_fast_dir
from envs.cache.schema import CacheError, arrays_checksum, manifest_checksum

GRID_SCHEMA_VERSION = 1

#: The paper's six coarse task types (§6.2), in one-hot order.
TASK_TYPES = (
    "casual chat",
    "simple QA",
    "text writing",
    "code generation",
    "data analysis",
    "complex reasoning",
)
ACTION_DIMS = ("c", "p", "u")
GRID_FIELDS = {"tokens": np.dtype(np.float32), "quality": np.dtype(np.float32), "tool_fail": np.dtype(bool)}
MANIFEST_FILE = "manifest.json"
ARRAYS_FILE = "arrays.npz"


@dataclasses.dataclass(frozen=True)
class GridManifest:
    """Axes, provenance and checksum of a response grid."""

    name: str
    task_types: tuple[str, ...]
    model_conditions: tuple[str, ...]
    levels: dict[str, tuple[float, ...]]  # "c", "p", "u" -> increasing levels in [0, 1]
    turns: int
    trials: int
    provenance: dict[str, Any]
    schema_version: int = GRID_SCHEMA_VERSION
    checksum: str = ""  # arrays + hashed_fields() (envs.cache.schema.manifest_checksum)
    arrays_checksum: str = ""  # arrays alone

    def hashed_fields(self) -> dict[str, Any]:
        """Every manifest field (all but the checksums): each changes results or labels."""
        d = self.to_dict()
        del d["checksum"], d["arrays_checksum"]
        return d

    @property
    def is_synthetic(self) -> bool:
        return self.provenance.get("kind") == "synthetic"

    @property
    def shape(self) -> tuple[int, ...]:
        L = self.levels
        return (len(self.task_types), len(self.model_conditions), len(L["c"]), len(L["p"]), len(L["u"]), self.turns, self.trials)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task_types": list(self.task_types),
            "model_conditions": list(self.model_conditions),
            "levels": {k: list(v) for k, v in self.levels.items()},
            "turns": self.turns,
            "trials": self.trials,
            "provenance": dict(self.provenance),
            "schema_version": self.schema_version,
            "checksum": self.checksum,
            "arrays_checksum": self.arrays_checksum,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "GridManifest":
        if not isinstance(d, dict):
            raise CacheError(f"{where}: manifest must be a JSON object")

        def need(key: str, typ):
            if key not in d:
                raise CacheError(f"{where}: missing field '{key}'")
            v = d[key]
            if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
                raise CacheError(f"{where}.{key}: expected {typ.__name__}, got {type(v).__name__}")
            return v

        name = need("name", str)
        tasks = need("task_types", list)
        models = need("model_conditions", list)
        for key, vals in (("task_types", tasks), ("model_conditions", models)):
            if not vals or not all(isinstance(v, str) and v for v in vals) or len(set(vals)) != len(vals):
                raise CacheError(f"{where}.{key}: must be a non-empty list of distinct non-empty strings")
        levels_d = need("levels", dict)
        levels = {}
        for k in ACTION_DIMS:
            v = levels_d.get(k)
            if not isinstance(v, list) or not v:
                raise CacheError(f"{where}.levels.{k}: must be a non-empty list of numbers")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise CacheError(f"{where}.levels.{k}: every level must be a finite number")
            arr = [float(x) for x in v]
            if any(x < 0 or x > 1 for x in arr) or any(b <= a for a, b in zip(arr, arr[1:])):
                raise CacheError(f"{where}.levels.{k}: levels must lie in [0, 1] and strictly increase, got {arr}")
            levels[k] = tuple(arr)
        turns = need("turns", int)
        trials = need("trials", int)
        if not 1 <= turns <= 64:
            raise CacheError(f"{where}.turns: must be between 1 and 64, got {turns}")
        if not 1 <= trials <= 10_000:
            raise CacheError(f"{where}.trials: must be between 1 and 10000, got {trials}")
        prov = need("provenance", dict)
        if prov.get("kind") not in ("synthetic", "real"):
            raise CacheError(f"{where}.provenance.kind: must be 'synthetic' or 'real', got {prov.get('kind')!r}")
        version = d.get("schema_version", GRID_SCHEMA_VERSION)
        if version != GRID_SCHEMA_VERSION:
            raise CacheError(f"{where}.schema_version: unsupported version {version!r} (this build reads {GRID_SCHEMA_VERSION})")
        return cls(name, tuple(tasks), tuple(models), levels, turns, trials, dict(prov), checksum=str(d.get("checksum", "")),
                   arrays_checksum=str(d.get("arrays_checksum", "")))


@dataclasses.dataclass(frozen=True)
class ResponseGrid:
    """A manifest plus the arrays of the module docstring (NumPy, ``[K, M, C, P, U, H, R]``)."""

    manifest: GridManifest
    arrays: dict[str, np.ndarray]

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays["tokens"]

    @property
    def quality(self) -> np.ndarray:
        return self.arrays["quality"]

    @property
    def tool_fail(self) -> np.ndarray:
        return self.arrays["tool_fail"]

    @property
    def n_cells(self) -> int:
        return int(self.tokens.size)

    def checksum(self) -> str:
        """sha256 over the arrays and every manifest field (envs.cache.schema.manifest_checksum)."""
        return manifest_checksum(arrays_checksum(self.arrays), self.manifest.hashed_fields())

    def with_checksum(self) -> "ResponseGrid":
        asum = arrays_checksum(self.arrays)
        man = dataclasses.replace(self.manifest, checksum=manifest_checksum(asum, self.manifest.hashed_fields()),
                                  arrays_checksum=asum)
        return ResponseGrid(man, self.arrays)

    def levels_array(self, dim: str) -> np.ndarray:
        return np.asarray(self.manifest.levels[dim], np.float32)


def check_grid(manifest: GridManifest, arrays: dict[str, np.ndarray], where: str) -> None:
    """Names, dtypes, shapes, finiteness and ranges of the grid arrays."""
    shape = manifest.shape
    for k, dt in GRID_FIELDS.items():
        if k not in arrays:
            raise CacheError(f"{where}: missing array '{k}'")
        v = arrays[k]
        if v.shape != shape:
            raise CacheError(f"{where}: array '{k}' has shape {v.shape}, expected [K,M,C,P,U,H,R] = {shape}")
        if v.dtype != dt:
            raise CacheError(f"{where}: array '{k}' has dtype {v.dtype}, expected {dt}")
    tok, qual = arrays["tokens"], arrays["quality"]
    bad = ~np.isfinite(tok) | (tok < 0) | (tok > 1e7)
    if bad.any():
        raise CacheError(f"{where}: tokens at cell {_cell_name(manifest, np.argwhere(bad)[0])} = {tok[tuple(np.argwhere(bad)[0])]} (must be finite, >= 0 and <= 1e7)")
    bad = ~np.isfinite(qual) | (qual < 0) | (qual > 1)
    if bad.any():
        raise CacheError(f"{where}: quality at cell {_cell_name(manifest, np.argwhere(bad)[0])} = {qual[tuple(np.argwhere(bad)[0])]} (must be in [0, 1])")


def _cell_name(m: GridManifest, idx) -> str:
    k, mo, ic, ip, iu, h, r = (int(i) for i in idx)
    L = m.levels
    return (f"(task={m.task_types[k]!r}, model={m.model_conditions[mo]!r}, c={L['c'][ic]}, p={L['p'][ip]}, "
            f"u={L['u'][iu]}, turn={h + 1}, trial={r})")


# -- fast format ---------------------------------------------------------------

def save_grid_fast(grid: ResponseGrid, path: str | os.PathLike) -> Path:
    """Write ``path/manifest.json`` + ``path/arrays.npz`` atomically (temp dir, then rename)."""
    path = Path(path)
    grid = grid.with_checksum()
    check_grid(grid.manifest, grid.arrays, str(path))
    return write_fast_dir(path, grid.manifest.to_dict(), grid.arrays)


def load_grid_fast(path: str | os.PathLike) -> ResponseGrid:
    """Read a fast-format grid directory and verify its checksum."""
    path = Path(path)
    mdict, arrays = read_fast_dir(path, "response grid")
    manifest = GridManifest.from_dict(mdict, str(path / MANIFEST_FILE))
    check_grid(manifest, arrays, str(path / ARRAYS_FILE))
    verify_checksum(path, mdict, arrays, manifest.hashed_fields(), "grid",
                    reimport="regenerate it, or convert its JSONL form: ccpo-jax stackelberg --grid G.jsonl --write-grid PATH")
    return ResponseGrid(manifest, arrays)


# -- human format (JSON Lines) ---------------------------------------------------

def write_grid_jsonl(grid: ResponseGrid, path: str | os.PathLike) -> Path:
    """One manifest line, then one line per cell; written to a temp name and renamed."""
    path = Path(path)
    grid = grid.with_checksum()
    m = grid.manifest
    L = m.levels
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:  # streamed: a grid can be large
        f.write(json.dumps({"manifest": m.to_dict()}) + "\n")
        tok, qual, fail = grid.tokens, grid.quality, grid.tool_fail
        for idx in np.ndindex(*m.shape):
            k, mo, ic, ip, iu, h, r = idx
            rec = {"task": m.task_types[k], "model": m.model_conditions[mo], "c": L["c"][ic], "p": L["p"][ip],
                   "u": L["u"][iu], "turn": h + 1, "trial": r, "tokens": round(float(tok[idx]), 3),
                   "quality": round(float(qual[idx]), 6), "tool_fail": bool(fail[idx])}
            f.write(json.dumps(rec) + "\n")
    return path


def read_grid_jsonl(path: str | os.PathLike) -> ResponseGrid:
    """Parse and validate the human format; the first line must hold the manifest."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"{path}: no such file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CacheError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        lines = raw.decode("utf-8-sig").splitlines(keepends=True)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise CacheError(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None
    if not lines:
        raise CacheError(f"{path}: empty file")

    def parse(i: int) -> Any:
        try:
            return json.loads(lines[i])
        except json.JSONDecodeError as e:
            raise CacheError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise CacheError(f"{path}:{i + 1}: JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer with more than 4300 digits
            raise CacheError(f"{path}:{i + 1}: not valid JSON ({e})") from None

    head = parse(0)
    if not isinstance(head, dict) or "manifest" not in head:
        raise CacheError(f"{path}:1: the first line must be {{\"manifest\": {{...}}}} (names the grid axes)")
    m = GridManifest.from_dict(head["manifest"], f"{path}:1: manifest")
    m = dataclasses.replace(m, checksum="", arrays_checksum="")
    shape = m.shape
    tok = np.full(shape, np.nan, np.float32)
    qual = np.full(shape, np.nan, np.float32)
    fail = np.zeros(shape, bool)
    seen = np.zeros(shape, bool)
    task_ix = {t: i for i, t in enumerate(m.task_types)}
    model_ix = {t: i for i, t in enumerate(m.model_conditions)}
    level_ix = {d: {v: i for i, v in enumerate(m.levels[d])} for d in ACTION_DIMS}
    for i in range(1, len(lines)):
        if not lines[i].strip():
            continue
        rec = parse(i)
        where = f"{path}:{i + 1}"
        if not isinstance(rec, dict):
            raise CacheError(f"{where}: each line must be a JSON object")

        def field(key: str, kind: str):
            if key not in rec:
                raise CacheError(f"{where}: missing field '{key}'")
            v = rec[key]
            if kind == "str" and not isinstance(v, str):
                raise CacheError(f"{where}: field '{key}': expected a string, got {type(v).__name__}")
            if kind == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise CacheError(f"{where}: field '{key}': expected an integer, got {type(v).__name__}")
            if kind == "num":
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise CacheError(f"{where}: field '{key}': expected a number, got {type(v).__name__}")
                if not math.isfinite(v):
                    raise CacheError(f"{where}: field '{key}': must be finite, got {v}")
            return v

        task, model = field("task", "str"), field("model", "str")
        if task not in task_ix:
            raise CacheError(f"{where}: field 'task': unknown task type {task!r} (manifest lists {list(m.task_types)})")
        if model not in model_ix:
            raise CacheError(f"{where}: field 'model': unknown model condition {model!r} (manifest lists {list(m.model_conditions)})")
        lv = []
        for d in ACTION_DIMS:
            v = float(field(d, "num"))
            if v not in level_ix[d]:
                raise CacheError(f"{where}: field '{d}': {v} is not one of the manifest levels {list(m.levels[d])}")
            lv.append(level_ix[d][v])
        turn, trial = field("turn", "int"), field("trial", "int")
        if not 1 <= turn <= m.turns:
            raise CacheError(f"{where}: field 'turn': {turn} outside 1..{m.turns}")
        if not 0 <= trial < m.trials:
            raise CacheError(f"{where}: field 'trial': {trial} outside 0..{m.trials - 1}")
        t, q = float(field("tokens", "num")), float(field("quality", "num"))
        if t < 0 or t > 1e7:
            raise CacheError(f"{where}: field 'tokens': {t} (must be >= 0 and <= 1e7)")
        if not 0 <= q <= 1:
            raise CacheError(f"{where}: field 'quality': {q} (must be in [0, 1])")
        tf = rec.get("tool_fail", False)
        if not isinstance(tf, bool):
            raise CacheError(f"{where}: field 'tool_fail': expected true/false, got {type(tf).__name__}")
        idx = (task_ix[task], model_ix[model], *lv, turn - 1, trial)
        if seen[idx]:
            raise CacheError(f"{where}: duplicate cell {_cell_name(m, idx)}")
        seen[idx] = True
        tok[idx], qual[idx], fail[idx] = t, q, tf
    if not seen.all():
        missing = np.argwhere(~seen)
        raise CacheError(f"{path}: {len(missing)} of {seen.size} grid cells missing, e.g. {_cell_name(m, missing[0])}")
    arrays = {"tokens": tok, "quality": qual, "tool_fail": fail}
    check_grid(m, arrays, str(path))
    return ResponseGrid(m, arrays).with_checksum()


def load_grid(path: str | os.PathLike) -> ResponseGrid:
    """A fast-format directory or a human ``.jsonl`` file."""
    path = Path(path)
    if not path.exists():
        raise CacheError(f"{path}: no such file or directory")
    return load_grid_fast(path) if path.is_dir() else read_grid_jsonl(path)


def save_grid(grid: ResponseGrid, out: str | os.PathLike) -> Path:
    """``*.jsonl`` -> human format; anything else -> fast-format directory."""
    out = Path(out)
    return write_grid_jsonl(grid, out) if out.suffix == ".jsonl" else save_grid_fast(grid, out)
