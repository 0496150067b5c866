"""The response cache: what the LLMs did, for Q questions and up to T rounds.

docs/caches.md. A cache is a :class:`Manifest` (names, prices, provenance)
plus dense NumPy arrays of shape ``[Q, T]`` (per round) or ``[Q]`` (per
question). Everything else (JSONL import/export, validation, synthetic
generators, importers of public data, the replay env) builds on this module.

Array fields (the fast format stores exactly these in ``arrays.npz``):

==========================  ========  ===========  ==========================================
name                        dtype     shape        meaning
==========================  ========  ===========  ==========================================
``round_mask``              bool      [Q, T]       round t exists for question q (prefix)
``base_answer``             int32     [Q, T]       base answer id (per-question vocabulary)
``base_correct``            bool      [Q, T]       base answer is correct
``base_tokens_in``          float32   [Q, T]       base prompt tokens
``base_tokens_out``         float32   [Q, T]       base completion tokens
``base_confidence``         float32   [Q, T]       base confidence in [0,1]; NaN = not given
``guide_verdict``           bool      [Q, T]       guide judged the base answer correct
``guide_answer``            int32     [Q, T]       guide corrected-answer id
``guide_correct``           bool      [Q, T]       guide answer is correct
``guide_tokens_in``         float32   [Q, T]       guide prompt tokens
``guide_tokens_out``        float32   [Q, T]       guide completion tokens
``guide_uncertainty``       float32   [Q, T]       guide uncertainty in [0,1]; NaN = not given
``question_ids``            unicode   [Q]          question id (unique)
``gold``                    unicode   [Q]          gold answer text ('' = not given)
``answer_text``             unicode   [Q, 2T]      answer id -> normalised answer text
``exit_correct``            bool      [Q, M]       cached LLM-EXIT run of model m correct
``exit_rounds``             int32     [Q, M]       ... its number of rounds
``exit_cost_cents``         float32   [Q, M]       ... its cost in cents
``exit_mask``               bool      [Q, M]       the EXIT run of model m exists for q
``llm_policy_actions``      int32     [Q, M2, T]   LLM-as-policy action per round, -1 = none
==========================  ========  ===========  ==========================================

Answer ids index ``answer_text[q]``; the same normalised string always gets the
same id within a question, so "distinct answers" is "distinct ids". Padding
rounds (``round_mask`` False) hold id -1, zeros and False.
The model names for the EXIT and LLM-policy columns are in the manifest
(``exit_models``, ``llm_policy_models``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

import numpy as np

from envs.cache.values import MAX_T, cache_problem, group_problem, lone_surrogate, model_names_problem, price_problem

SCHEMA_VERSION = 1

#: Actions of the orchestration policy (arXiv 2511.11828: base answer, guide answer, next round),
#: indexed by A_BASE, A_GUIDE, A_NEXT. The one definition: every action axis is N_ACTIONS long.
ACTION_NAMES = ("base", "guide", "next")
A_BASE, A_GUIDE, A_NEXT = 0, 1, 2
N_ACTIONS = len(ACTION_NAMES)

ROUND_FIELDS: dict[str, np.dtype] = {
    "round_mask": np.dtype(bool),
    "base_answer": np.dtype(np.int32),
    "base_correct": np.dtype(bool),
    "base_tokens_in": np.dtype(np.float32),
    "base_tokens_out": np.dtype(np.float32),
    "base_confidence": np.dtype(np.float32),
    "guide_verdict": np.dtype(bool),
    "guide_answer": np.dtype(np.int32),
    "guide_correct": np.dtype(bool),
    "guide_tokens_in": np.dtype(np.float32),
    "guide_tokens_out": np.dtype(np.float32),
    "guide_uncertainty": np.dtype(np.float32),
}
TEXT_FIELDS = ("question_ids", "gold", "answer_text")
BASELINE_FIELDS: dict[str, np.dtype] = {
    "exit_correct": np.dtype(bool),
    "exit_rounds": np.dtype(np.int32),
    "exit_cost_cents": np.dtype(np.float32),
    "exit_mask": np.dtype(bool),
    "llm_policy_actions": np.dtype(np.int32),
}
ALL_FIELDS = tuple(ROUND_FIELDS) + TEXT_FIELDS + tuple(BASELINE_FIELDS)


def cache_groups(arrays: dict[str, np.ndarray]) -> np.ndarray | None:
    """The [Q] group names of a cache, or None when it has none. ``group`` (unicode [Q]) is the one optional
    array, present only when the cache has it (a cache without it keeps its checksum): the question's group
    (MMLU subject, HotpotQA question type, ...) of the group-conditional (Mondrian) calibration
    (docs/calibration.md)."""
    g = arrays.get("group")
    return None if g is None else np.asarray(g)


class CacheError(ValueError):
    """A user-facing problem with a cache: names the place (file, line, field).

    The CLI prints ``str(err)`` and exits non-zero without a traceback.
    """


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """An LLM and its list price in USD per million tokens."""

    name: str
    price_in: float = 0.0
    price_out: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "price_in": self.price_in, "price_out": self.price_out}


def price_of(models: Any, key: str) -> Any:
    """A model's price (a Python float), or a ladder's per-round prices as float32 ``[T]``. Both
    enter float32 token arithmetic the same way (NumPy casts the float to float32 first), so a ladder
    whose rungs all cost the same prices every round bit for bit as the one model."""
    if isinstance(models, ModelInfo):
        return getattr(models, key)
    return np.asarray([getattr(m, key) for m in models], np.float32)


def round_cost_cents_of(arrays: Mapping[str, np.ndarray], base: Any, guide: Any) -> np.ndarray:
    """[Q, T] API cost of round t in cents (base + guide call; 0 on padding rounds), at round t's
    prices: ``base`` and ``guide`` are a :class:`ModelInfo` or a ladder of T of them; ``guide`` None
    is a guide-less cascade (the base call alone)."""
    a = arrays
    usd = a["base_tokens_in"] * price_of(base, "price_in") + a["base_tokens_out"] * price_of(base, "price_out")
    if guide is not None:
        usd = usd + a["guide_tokens_in"] * price_of(guide, "price_in") + a["guide_tokens_out"] * price_of(guide, "price_out")
    usd = usd / 1e6
    return np.where(a["round_mask"], usd * 100.0, 0.0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Per-cache metadata (docs/caches.md). ``provenance['kind']`` is 'synthetic' or 'real'."""

    name: str
    task: str
    T: int
    base: ModelInfo
    #: None: a guide-less cascade (``models.guide: null``; docs/caches.md): no guide call, no 'guide' action.
    guide: ModelInfo | None
    provenance: dict[str, Any]
    normalisation: str = "lower-strip-punct-articles"
    exit_models: tuple[str, ...] = ()
    llm_policy_models: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION
    #: sha256 over the arrays and :meth:`hashed_fields` (:func:`cache_checksum`).
    checksum: str = ""
    #: sha256 over the arrays alone (:func:`arrays_checksum`): tells a damaged arrays.npz from an edited manifest.
    arrays_checksum: str = ""
    #: A model ladder (docs/caches.md): round t's base / guide model is ``base_ladder[t]`` /
    #: ``guide_ladder[t]`` (T entries each, or empty: ``base`` / ``guide`` every round, which is
    #: then the ladder's first rung).
    base_ladder: tuple[ModelInfo, ...] = ()
    guide_ladder: tuple[ModelInfo, ...] = ()

    @property
    def is_synthetic(self) -> bool:
        return self.provenance.get("kind") == "synthetic"

    @property
    def has_guide(self) -> bool:
        """False for a guide-less cascade (``models.guide: null``)."""
        return self.guide is not None

    @property
    def is_ladder(self) -> bool:
        return bool(self.base_ladder or self.guide_ladder)

    def models_of(self, role: str) -> Any:
        """``role``'s model (a :class:`ModelInfo`), or its ladder (a tuple of T); None for the guide
        of a cascade."""
        lad = self.base_ladder if role == "base" else self.guide_ladder
        return lad or (self.base if role == "base" else self.guide)

    def rungs(self, role: str) -> tuple[ModelInfo, ...]:
        """``role``'s model of each round, T entries (none for the guide of a cascade)."""
        m = self.models_of(role)
        if m is None:
            return ()
        return (m,) * self.T if isinstance(m, ModelInfo) else m

    def hashed_fields(self) -> dict[str, Any]:
        """Every manifest field that changes results or labels (all but the checksums)."""
        d = self.to_dict()
        del d["checksum"], d["arrays_checksum"]
        return d

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "T": self.T,
            "models": {r: [m.to_dict() for m in lad] if lad else None if one is None else one.to_dict()
                       for r, one, lad in (("base", self.base, self.base_ladder), ("guide", self.guide, self.guide_ladder))},
            "provenance": dict(self.provenance),
            "normalisation": self.normalisation,
            "exit_models": list(self.exit_models),
            "llm_policy_models": list(self.llm_policy_models),
            "schema_version": self.schema_version,
            "checksum": self.checksum,
            "arrays_checksum": self.arrays_checksum,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> "Manifest":
        def need(obj: dict, key: str, typ, ctx: str):
            if not isinstance(obj, dict) or key not in obj:
                raise CacheError(f"{ctx}: missing field '{key}'")
            val = obj[key]
            if typ is float and isinstance(val, int) and not isinstance(val, bool):
                val = float(val)
            if not isinstance(val, typ) or isinstance(val, bool) and typ is not bool:
                raise CacheError(f"{ctx}.{key}: expected {typ.__name__}, got {type(val).__name__}")
            return val

        bad_text = lone_surrogate(d)
        if bad_text:
            raise CacheError(f"{where}.{bad_text[0]}: {bad_text[1]}")
        def model(m: Any, ctx: str, priced: bool) -> ModelInfo:
            if not isinstance(m, dict):
                raise CacheError(f"{ctx}: expected an object {{\"name\", \"price_in\", \"price_out\"}}, got "
                                 f"{type(m).__name__}")
            name = need(m, "name", str, ctx)
            prices = []
            for p in ("price_in", "price_out"):
                if priced and p not in m:
                    raise CacheError(f"{ctx}: missing field '{p}' (every rung of a ladder names its prices)")
                v = m.get(p, 0.0)
                problem = price_problem(v)
                if problem:
                    raise CacheError(f"{ctx}.{p}: {problem}")
                prices.append(float(v))
            return ModelInfo(name, *prices)

        T = need(d, "T", int, where)
        if not 1 <= T <= MAX_T:
            raise CacheError(f"{where}.T: must be between 1 and {MAX_T}, got {T}")
        models = need(d, "models", dict, where)
        infos, ladders = {}, {}
        for role in ("base", "guide"):
            ctx = f"{where}.models.{role}"
            if role not in models:
                raise CacheError(f"{where}.models: missing field '{role}'")
            m = models[role]
            if m is None and role == "guide":  # a guide-less cascade
                infos[role] = None
            elif isinstance(m, list):  # a ladder: round t's model is entry t
                if len(m) != T:
                    raise CacheError(f"{ctx}: a ladder lists one model per round: expected T = {T} entries, got {len(m)}")
                ladders[role] = tuple(model(x, f"{ctx}[{t}]", True) for t, x in enumerate(m))
                infos[role] = ladders[role][0]
            else:
                infos[role] = model(m, ctx, False)
        prov = need(d, "provenance", dict, where)
        if prov.get("kind") not in ("synthetic", "real"):
            raise CacheError(f"{where}.provenance.kind: must be 'synthetic' or 'real', got {prov.get('kind')!r}")
        model_lists = {}
        for key in ("exit_models", "llm_policy_models"):
            listed = d.get(key, [])
            problem = model_names_problem(listed)
            if problem:
                raise CacheError(f"{where}.{key}: {problem}")
            model_lists[key] = tuple(listed)
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise CacheError(f"{where}.schema_version: unsupported version {version!r} (this build reads {SCHEMA_VERSION})")
        return cls(
            name=need(d, "name", str, where),
            task=str(d.get("task", "unknown")),
            T=T,
            base=infos["base"],
            guide=infos["guide"],
            provenance=dict(prov),
            normalisation=str(d.get("normalisation", "lower-strip-punct-articles")),
            exit_models=model_lists["exit_models"],
            llm_policy_models=model_lists["llm_policy_models"],
            checksum=str(d.get("checksum", "")),
            arrays_checksum=str(d.get("arrays_checksum", "")),
            base_ladder=ladders.get("base", ()),
            guide_ladder=ladders.get("guide", ()),
        )


@dataclasses.dataclass(frozen=True)
class ResponseCache:
    """A manifest plus the dense arrays of the module docstring (NumPy, host memory)."""

    manifest: Manifest
    arrays: dict[str, np.ndarray]

    # -- shapes -----------------------------------------------------------
    @property
    def n_questions(self) -> int:
        return int(self.arrays["round_mask"].shape[0])

    @property
    def T(self) -> int:
        return self.manifest.T

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(name)

    # -- derived quantities -----------------------------------------------
    @property
    def n_rounds(self) -> np.ndarray:
        """[Q] number of existing rounds."""
        return self.arrays["round_mask"].sum(axis=1).astype(np.int32)

    @property
    def unsolvable(self) -> np.ndarray:
        """[Q] no answer of any existing round is correct (paper: Y* not in the answer set)."""
        a = self.arrays
        any_ok = ((a["base_correct"] | a["guide_correct"]) & a["round_mask"]).any(axis=1)
        return ~any_ok

    def round_cost_cents(self) -> np.ndarray:
        """[Q, T] API cost of round t in cents (base + guide call; 0 on padding rounds), at round t's
        models' prices."""
        m = self.manifest
        return round_cost_cents_of(self.arrays, m.models_of("base"), m.models_of("guide"))

    def checksum(self) -> str:
        """sha256 over the arrays and the manifest fields that change results or labels."""
        return manifest_checksum(arrays_checksum(self.arrays), self.manifest.hashed_fields())

    def with_checksum(self) -> "ResponseCache":
        asum = arrays_checksum(self.arrays)
        man = dataclasses.replace(self.manifest, checksum=manifest_checksum(asum, self.manifest.hashed_fields()),
                                  arrays_checksum=asum)
        return ResponseCache(man, self.arrays)

    def subset(self, idx: np.ndarray) -> "ResponseCache":
        """The cache restricted to questions ``idx`` (same manifest, new checksum)."""
        arrays = {k: v[idx] for k, v in self.arrays.items()}
        return ResponseCache(self.manifest, arrays).with_checksum()


def _canonical(v: np.ndarray) -> np.ndarray:
    """The representation that is hashed: equal data -> equal bytes, whatever the storage.

    Unicode arrays at their minimal width (``<U20`` and ``<U7`` holding the same
    texts hash alike), one NaN bit pattern, and -0.0 as 0.0, so a cache keeps its
    checksum through JSONL export and import.
    """
    if v.dtype.kind == "U":
        width = int(np.char.str_len(v).max()) if v.size else 0
        return v.astype(f"<U{max(width, 1)}")
    if v.dtype.kind == "f":
        return np.where(np.isnan(v), np.array(np.nan, v.dtype), v + v.dtype.type(0))
    return v


def arrays_checksum(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every array's name, dtype, shape and bytes, in sorted name order
    (of the canonical representation, :func:`_canonical`)."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        v = np.ascontiguousarray(_canonical(np.asarray(arrays[k])))
        h.update(k.encode())
        h.update(str(v.dtype.str).encode())
        h.update(str(v.shape).encode())
        h.update(v.tobytes())
    return "sha256:" + h.hexdigest()


def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"{type(v).__name__} is not JSON-serialisable")


def jsonable(x: Any) -> Any:
    """``x`` as plain JSON values: dict keys as strings, tuples as lists, numpy scalars and arrays
    through :func:`_json_default` (the one numpy-to-JSON conversion), a Python float NaN as None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)):
        return _json_default(x)
    if isinstance(x, float) and x != x:
        return None
    return x


def canonical_json(obj: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no spaces, UTF-8, shortest float repr.

    A manifest written to ``manifest.json`` (or a JSONL manifest line) and read
    back serialises to the same bytes, so the checksum survives every format.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=_json_default).encode("utf-8")


def manifest_checksum(arrays_sum: str, fields: dict[str, Any]) -> str:
    """The checksum of a cache or grid: sha256 over its arrays' checksum and the
    canonical serialisation (:func:`canonical_json`) of its manifest ``fields``
    (prices, models, T, provenance, normalisation, name, ...), so editing any of
    them is detected like damage to the arrays (docs/integrity.md)."""
    h = hashlib.sha256()
    h.update(b"ccpo-jax checksum v2\0")
    h.update(arrays_sum.encode())
    h.update(b"\0")
    h.update(canonical_json(fields))
    return "sha256:" + h.hexdigest()


def empty_arrays(Q: int, T: int, n_exit: int = 0, n_llm_policy: int = 0) -> dict[str, np.ndarray]:
    """Arrays of the right shapes, filled with padding values (ids -1, NaN for optional floats)."""
    out: dict[str, np.ndarray] = {}
    for k, dt in ROUND_FIELDS.items():
        if k in ("base_answer", "guide_answer"):
            out[k] = np.full((Q, T), -1, dt)
        elif k in ("base_confidence", "guide_uncertainty"):
            out[k] = np.full((Q, T), np.nan, dt)
        else:
            out[k] = np.zeros((Q, T), dt)
    out["question_ids"] = np.array([f"q-{i}" for i in range(Q)]) if Q else np.zeros((0,), "<U1")
    out["gold"] = np.full((Q,), "", dtype="<U1")
    out["answer_text"] = np.full((Q, 2 * T), "", dtype="<U1")
    out["exit_correct"] = np.zeros((Q, n_exit), bool)
    out["exit_rounds"] = np.zeros((Q, n_exit), np.int32)
    out["exit_cost_cents"] = np.zeros((Q, n_exit), np.float32)
    out["exit_mask"] = np.zeros((Q, n_exit), bool)
    out["llm_policy_actions"] = np.full((Q, n_llm_policy, T), -1, np.int32)
    return out


def check_arrays(manifest: Manifest, arrays: dict[str, np.ndarray], where: str, values: bool = True) -> None:
    """The checks shared by every loader and writer: names, dtypes, shapes, and (``values``)
    the value rules of :mod:`envs.cache.values` (ranges, contradictions, baselines)."""
    missing = [k for k in ALL_FIELDS if k not in arrays]
    if missing:
        raise CacheError(f"{where}: missing array(s) {', '.join(missing)}")
    T = manifest.T
    Q = arrays["round_mask"].shape[0] if arrays["round_mask"].ndim == 2 else -1
    for k, dt in ROUND_FIELDS.items():
        v = arrays[k]
        if v.shape != (Q, T):
            raise CacheError(f"{where}: array '{k}' has shape {v.shape}, expected (Q, T) = ({Q}, {T})")
        if v.dtype != dt:
            raise CacheError(f"{where}: array '{k}' has dtype {v.dtype}, expected {dt}")
    for k in ("question_ids", "gold"):
        if arrays[k].shape != (Q,) or arrays[k].dtype.kind != "U":
            raise CacheError(f"{where}: array '{k}' must be a unicode array of shape ({Q},)")
    if arrays["answer_text"].shape != (Q, 2 * T) or arrays["answer_text"].dtype.kind != "U":
        raise CacheError(f"{where}: array 'answer_text' must be a unicode array of shape ({Q}, {2 * T})")
    M, M2 = len(manifest.exit_models), len(manifest.llm_policy_models)
    for k in ("exit_correct", "exit_rounds", "exit_cost_cents", "exit_mask"):
        if arrays[k].shape != (Q, M) or arrays[k].dtype != BASELINE_FIELDS[k]:
            raise CacheError(f"{where}: array '{k}' must be {BASELINE_FIELDS[k]} of shape ({Q}, {M})")
    if arrays["llm_policy_actions"].shape != (Q, M2, T):
        raise CacheError(f"{where}: array 'llm_policy_actions' must have shape ({Q}, {M2}, {T})")
    mask = arrays["round_mask"]
    if Q and not mask[:, 0].all():
        q = int(np.argmin(mask[:, 0]))
        raise CacheError(f"{where}: question {str(arrays['question_ids'][q])!r} has no rounds")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise CacheError(f"{where}: round_mask must be a prefix (rounds 1..n) for every question")
    ids = arrays["question_ids"]
    if "group" in arrays:
        g = arrays["group"]
        if g.shape != (Q,) or g.dtype.kind != "U":
            raise CacheError(f"{where}: array 'group' must be a unicode array of shape ({Q},)")
        for i, name in enumerate(g):
            problem = group_problem(str(name))
            if problem:
                raise CacheError(f"{where}: question {str(ids[i])!r}: group: {problem}")
    if len(np.unique(ids)) != len(ids):
        vals, counts = np.unique(ids, return_counts=True)
        raise CacheError(f"{where}: duplicate question id {str(vals[counts > 1][0])!r}")
    if values:
        check_values(manifest, arrays, where)


def check_values(manifest: Manifest, arrays: dict[str, np.ndarray], where: str) -> None:
    """Raise the first value rule (:mod:`envs.cache.values`) the arrays break as ``WHERE: question 'ID': FIELD: problem``."""
    problem = values_problem(manifest, arrays)
    if problem:
        raise CacheError(problem_text(problem, where, arrays))


def values_problem(manifest: Manifest, arrays: dict[str, np.ndarray]):
    """The first value rule (:mod:`envs.cache.values`) that ``arrays`` under ``manifest`` break, or None."""
    from envs.cache.normalise import normalise_answer

    prices = {}  # every model the manifest names, each rung of a ladder under its field (base[1]), as the reader reads them
    for role in ("base", "guide"):
        lad, one = (manifest.base_ladder, manifest.base) if role == "base" else (manifest.guide_ladder, manifest.guide)
        models = {f"{role}[{t}]": m for t, m in enumerate(lad)} if lad else {role: one} if one is not None else {}
        prices.update({k: (m.price_in, m.price_out) for k, m in models.items()})
    return cache_problem(manifest.T, prices, manifest.exit_models, manifest.llm_policy_models, arrays,
                         normalise=normalise_answer, has_guide=manifest.has_guide)


def problem_text(problem, where: str, arrays: dict[str, np.ndarray]) -> str:
    """``WHERE: question 'ID': FIELD: problem`` (or ``WHERE: FIELD: problem`` for the manifest)."""
    if problem.question is None:
        return f"{where}: {problem.field}: {problem.message}"
    qid = str(arrays["question_ids"][problem.question])
    return f"{where}: question {qid!r}: {problem.field}: {problem.message}"
