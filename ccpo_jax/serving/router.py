"""``Router``: a loaded, verified exported router (docs/export.md).

Needs jax, NumPy and the featuriser in ``envs`` only: no optax, orbax,
tensorboardX, flax or ``ccpo_jax.ccpo.train``.
"""
from __future__ import annotations

import math

from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ccpo_jax.core.guarantee import GUARANTEES, Marginal
from ccpo_jax.serving import features as feats
from ccpo_jax.serving.artifact import BLOCK_ROWS, RUNG_FEATURES_SINCE, ArtifactError, RouterInputError, read_verified
from envs.cache.schema import ACTION_NAMES, N_ACTIONS, ModelInfo
from envs.replay.features import feature_names, ladder_roles


def bucket_sizes(max_rows: int = BLOCK_ROWS) -> tuple[int, ...]:
    """The batch shapes a Router compiles: powers of two 1, 2, 4, ... up to ``max_rows``."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return tuple(out) + (int(max_rows),)


#: Screened decisions (:meth:`Router.decide_many` with ``screen=True``): a row whose float64
#: probability of some available action lies within this distance of its threshold is decided by
#: the exported module; every other row's set is decided by the float64 forward pass. The float32
#: module and the float64 pass differ by at most 7e-7 on the test networks, sharp ones included
#: (tests/serving/test_router_screen.py bounds it at 1e-5 over extreme inputs), so outside the margin both
#: give the same set.
SCREEN_MARGIN = 1e-4


def _rungs(manifest: Mapping, role: str) -> list[tuple[str, Mapping]]:
    """(``"[t]"`` or ``""``, model dict) of ``role``: each rung of a ladder, or the one model (none: the
    guide of a guide-less cascade)."""
    m = manifest["models"][role]
    if m is None and role == "guide":
        return []
    return [(f"[{t}]", x) for t, x in enumerate(m)] if isinstance(m, list) else [("", m)]


def feature_ladder(manifest: Mapping) -> tuple[str, ...]:
    """The roles whose rung prices are features of this artefact's router: the laddered roles from
    format version 2 on; none before (a version-1 router of a ladder was trained without them)."""
    if manifest["format_version"] < RUNG_FEATURES_SINCE:
        return ()
    return ladder_roles(manifest["models"]["base"], manifest["models"]["guide"])


def _models(manifest: Mapping, role: str) -> ModelInfo | tuple[ModelInfo, ...] | None:
    if manifest["models"][role] is None:  # the guide of a cascade
        return None
    infos = [ModelInfo(str(m["name"]), float(m["price_in"]), float(m["price_out"])) for _, m in _rungs(manifest, role)]
    return tuple(infos) if isinstance(manifest["models"][role], list) else infos[0]


def dense_layers(manifest: Mapping, params: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The (kernel, bias) pairs of an ``mlp-tanh`` policy in float64, from the manifest's leaf names
    (``params/Dense_i/kernel`` and ``.../bias``; an ensemble's with a leading member axis), or None for any
    other network (no screening)."""
    net = manifest.get("policy", {}).get("network", {})
    names = [leaf["name"] for leaf in manifest["params"]["leaves"]]
    if net.get("type") != "mlp-tanh":
        return None
    by_name = dict(zip(names, params))
    n = len(net.get("hidden", ())) + 1
    want = [(f"params/Dense_{i}/kernel", f"params/Dense_{i}/bias") for i in range(n)]
    if sorted(names) != sorted(x for pair in want for x in pair):
        return None
    return [(np.asarray(by_name[k], np.float64), np.asarray(by_name[b], np.float64)) for k, b in want]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``n`` rows (``n`` <= the largest bucket)."""
    return next(b for b in buckets if b >= n)


#: Largest ``module.block_rows`` accepted (export writes BLOCK_ROWS; a bucket is at most this many rows).
MAX_BLOCK_ROWS = 1 << 16


def _check_manifest_values(manifest: dict, where: str) -> None:
    """The values a verified manifest must hold before a router is built from it: a rehashed
    manifest passes the checksum, so the types and ranges are checked here (one line each)."""
    module = manifest.get("module", {})
    if not isinstance(module, dict):
        raise ArtifactError(f"{where}: module: expected an object, got {type(module).__name__} {module!r}")
    rows = module.get("block_rows", BLOCK_ROWS)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_BLOCK_ROWS:
        raise ArtifactError(f"{where}: module.block_rows: expected an integer in [1, {MAX_BLOCK_ROWS}], got {rows!r}")
    for key, lo, hi, closed in (("kappa", 0.0, 1.0, True), ("alpha", 0.0, 1.0, False)):
        v = manifest[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
            lo <= v <= hi if closed else lo < v < hi)
        if not ok:
            interval = f"[{lo:g}, {hi:g}]" if closed else f"({lo:g}, {hi:g})"
            raise ArtifactError(f"{where}: {key}: expected a number in {interval}, got {v!r}")
    mond = manifest.get("mondrian")
    if mond is not None:
        if not isinstance(mond, dict) or not isinstance(mond.get("kappas"), dict):
            raise ArtifactError(f"{where}: mondrian: expected an object with 'kappas' and 'rest_kappa'")
        for name, v in [*((f"kappas.{g}", k) for g, k in mond["kappas"].items()), ("rest_kappa", mond.get("rest_kappa"))]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ArtifactError(f"{where}: mondrian.{name}: expected a number in [0, 1], got {v!r}")
    g = manifest.get("guarantee")
    if g is not None:
        if not isinstance(g, dict) or g.get("kind") not in GUARANTEES:
            raise ArtifactError(f"{where}: guarantee.kind: expected {' or '.join(map(repr, GUARANTEES))}, got "
                                f"{g.get('kind') if isinstance(g, dict) else g!r}")
        d = g.get("delta")
        if GUARANTEES[g["kind"]].uses_delta and (isinstance(d, bool) or not isinstance(d, (int, float))
                                                 or not 0.0 < d < 1.0):
            raise ArtifactError(f"{where}: guarantee.delta: expected a number in (0, 1) for a {g['kind']} guarantee, "
                                f"got {d!r}")
    for role in ("base", "guide"):
        for at, m in _rungs(manifest, role):
            for key in ("price_in", "price_out"):
                v = m[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                    raise ArtifactError(f"{where}: models.{role}{at}.{key}: expected a finite number >= 0, got {v!r}")


class Router:
    """The conformal action set C_{pi,kappa}(o) = {a available : pi(a|o) >= kappa} (paper Eq. 2)
    of an exported policy, with kappa the artefact's calibrated threshold.

    Build with :meth:`load`. Attributes: ``manifest`` (dict), ``T``, ``F``,
    ``actions`` (``("base", "guide", "next")``), ``feature_names``, ``kappa``, ``alpha``.
    """

    def __init__(self, manifest: dict, exported: Any, params: tuple[np.ndarray, ...], source: str):
        self.manifest = manifest
        self.source = source
        self._exported = exported
        self._params = tuple(jax.device_put(p) for p in params)
        self._call = jax.jit(exported.call)
        self._dense = dense_layers(manifest, params)
        # Every batch is padded to one of these row counts, so a server compiles at most
        # len(buckets) executables whatever batch sizes its clients send (memory stays
        # flat). The module maps over blocks of block_rows rows, so padding changes no bit.
        self.buckets = bucket_sizes(int(manifest.get("module", {}).get("block_rows", BLOCK_ROWS)))
        fs = manifest["features"]
        self.T = int(manifest["T"])
        self.F = int(fs["count"])
        self.feature_names = tuple(fs["names"])
        self.actions = tuple(manifest["actions"])
        self.kappa = np.float32(manifest["kappa"])
        self.alpha = float(manifest["alpha"])
        mond = manifest.get("mondrian")
        #: Per-group thresholds of a Mondrian router (``{group: kappa}``), else None.
        self.group_kappas = None if mond is None else {g: np.float32(k) for g, k in mond["kappas"].items()}
        self.rest_kappa = None if mond is None else np.float32(mond["rest_kappa"])
        g = manifest.get("guarantee") or {"kind": Marginal.kind, "delta": None}  # artefacts before --guarantee
        #: What the thresholds guarantee, stated in every decision: ``{"kind", "alpha", "delta"}``.
        self.guarantee = {"kind": g["kind"], "alpha": self.alpha, "delta": g.get("delta"),
                          **{k: g[k] for k in ("guide_cap", "cost_cap") if g.get(k) is not None}}
        # one model per role, or a ladder (round t's model; docs/caches.md)
        self._base, self._guide = (_models(manifest, r) for r in ("base", "guide"))
        #: False for a guide-less cascade's router: rounds have no guide object and "guide" is never in a set.
        self.has_guide = self._guide is not None
        #: The roles whose rung prices the features hold (:func:`feature_ladder`).
        self.ladder = feature_ladder(manifest)

    # -- loading ----------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "Router":
        """Load and verify an artefact written by ``ccpo-jax export`` (raises :class:`ArtifactError`)."""
        from jax import export as jax_export

        manifest, module, arrays = read_verified(path)
        where = f"{Path(path)}/manifest.json"
        try:
            T = int(manifest["T"])
            fs = manifest["features"]
            names = list(fs["names"])
            leaves = [leaf["name"] for leaf in manifest["params"]["leaves"]]
            float(manifest["kappa"]), float(manifest["alpha"])
            dict(manifest["cache"]["provenance"]), str(manifest["policy"]["row"])
            for role in ("base", "guide"):
                for _, m in _rungs(manifest, role):
                    str(m["name"]), float(m["price_in"]), float(m["price_out"])
                if isinstance(manifest["models"][role], list) and len(manifest["models"][role]) != T:
                    raise ValueError(f"models.{role}: a ladder of {len(manifest['models'][role])} models, T = {T}")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{where}: missing or malformed field ({e!r})") from None
        _check_manifest_values(manifest, where)
        ladder = feature_ladder(manifest)
        if names != list(feature_names(T, ladder)) or fs.get("count") != len(names):
            # The featuriser of this build differs from the one the policy was trained with.
            raise ArtifactError(
                f"{where}: features.names do not match envs.replay.features.feature_names({T}, {ladder}) of this build; "
                "the policy was trained on other features (re-export with a matching ccpo-jax)"
            )
        if tuple(manifest.get("actions", ())) != ACTION_NAMES:
            raise ArtifactError(f"{where}: actions must be {list(ACTION_NAMES)}, got {manifest.get('actions')}")
        try:
            exported = jax_export.deserialize(bytearray(module))
        except Exception as e:  # noqa: BLE001 - a corrupt or incompatible module, whatever the cause
            raise ArtifactError(f"{Path(path)}/policy.jaxexport: cannot deserialize the jax.export module ({e})") from None
        params = tuple(arrays[n] for n in leaves)
        return cls(manifest, exported, params, str(path))

    # -- array API ----------------------------------------------------------
    def _check_obs(self, obs: Any) -> np.ndarray:
        a = np.asarray(obs)
        if a.dtype.kind not in "iuf":
            raise RouterInputError(f"obs: expected real numbers, got dtype {a.dtype}")
        if a.ndim != 2 or a.shape[1] != self.F:
            raise RouterInputError(f"obs: expected shape [B, {self.F}] (features: {', '.join(self.feature_names)}), got {list(a.shape)}")
        a = a.astype(np.float32)
        bad = ~np.isfinite(a)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise RouterInputError(f"obs[{r}, {c}] ({self.feature_names[c]}): not finite ({a[r, c]})")
        return a

    def _check_available(self, available: Any, B: int) -> np.ndarray:
        if available is None:
            return np.ones((B, N_ACTIONS), bool)
        v = np.asarray(available)
        if v.dtype != bool:
            if v.dtype.kind not in "iu" or not np.isin(v, (0, 1)).all():
                raise RouterInputError(f"available: expected booleans (or 0/1), got dtype {v.dtype}")
            v = v.astype(bool)
        if v.shape != (B, N_ACTIONS):
            raise RouterInputError(
                f"available: expected shape [{B}, {N_ACTIONS}] ({', '.join(ACTION_NAMES)}), got {list(v.shape)}")
        none = ~v.any(axis=1)
        if none.any():
            raise RouterInputError(f"available[{int(np.argmax(none))}]: no action is available")
        return v

    def _run(self, obs: np.ndarray, available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        B = obs.shape[0]
        if B == 0:
            return np.zeros((0, N_ACTIONS), np.float32), np.zeros((0, N_ACTIONS), bool)
        top = self.buckets[-1]
        if B > top:  # whole blocks of the largest bucket, then the rest
            parts = [self._run(obs[i:i + top], available[i:i + top]) for i in range(0, B, top)]
            return np.concatenate([p for p, _ in parts]), np.concatenate([s for _, s in parts])
        b = bucket_for(B, self.buckets)
        if b != B:  # padding rows: zero features, every action available (no empty mask)
            obs = np.concatenate([obs, np.zeros((b - B, obs.shape[1]), obs.dtype)])
            available = np.concatenate([available, np.ones((b - B, N_ACTIONS), bool)])
        probs, in_set = self._call(self._params, obs, available, self.kappa)
        return np.asarray(probs)[:B], np.asarray(in_set)[:B]

    def probs64(self, obs: np.ndarray, available: np.ndarray) -> np.ndarray:
        """pi(.|o) in float64 by NumPy: the mlp-tanh and the softmax over available actions of
        :func:`ccpo_jax.core.networks.masked_probs`, for screening (not bit-equal to the module)."""
        # An ensemble's leaves carry a leading member axis (manifest policy.network.ensemble): every
        # member in one stacked matmul per layer ([B, F] @ [M, F, H] -> [M, B, H]), then the members'
        # mean, instead of a Python loop of M forward passes (faster:
        # docs/performance.md#figures-behind-code-comments).
        h = obs.astype(np.float64)
        for W, b in self._dense[:-1]:
            h = np.tanh(h @ W + b[..., None, :])
        W, b = self._dense[-1]
        z = np.where(available, h @ W + b[..., None, :], -np.inf)
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        return p if p.ndim == 2 else p.mean(axis=0)

    def _run_screened(self, obs: np.ndarray, available: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(probs, in_set) at per-row thresholds ``k`` [B] (float32): the float64 pass, and the module for
        the rows within SCREEN_MARGIN of their threshold, so every set equals the module's."""
        k = k.astype(np.float32)[:, None]
        if self._dense is None:
            probs, _ = self._run(obs, available)
            return probs, (probs >= k) & available
        p = self.probs64(obs, available)
        exact = ((np.abs(p - k) <= SCREEN_MARGIN) & available).any(axis=1)
        probs, in_set = p.astype(np.float32), (p >= k) & available
        if exact.any():
            pe, _ = self._run(obs[exact], available[exact])
            probs[exact], in_set[exact] = pe, (pe >= k[exact]) & available[exact]
        return probs, in_set

    def warm_up(self, max_rows: int | None = None) -> int:
        """Compile every bucket up to ``max_rows`` (default: all) now, not on first use; returns how many."""
        n = 0
        for b in self.buckets:
            if max_rows is not None and b > bucket_for(min(max_rows, self.buckets[-1]), self.buckets):
                break
            self._run(np.zeros((b, self.F), np.float32), np.ones((b, N_ACTIONS), bool))
            n += 1
        return n

    def probs(self, obs: Any, available: Any = None) -> np.ndarray:
        """pi(a|o) ``[B, 3]`` float32 for observations ``[B, F]`` (``available`` ``[B, 3]``, default all)."""
        o = self._check_obs(obs)
        return self._run(o, self._check_available(available, o.shape[0]))[0]

    def action_set(self, obs: Any, available: Any = None) -> np.ndarray:
        """C_{pi,kappa}(o) as bool ``[B, 3]`` (may be empty when kappa > 1/|available|)."""
        o = self._check_obs(obs)
        return self._run(o, self._check_available(available, o.shape[0]))[1]

    # -- raw-round API -----------------------------------------------------------
    def featurise(self, requests: Sequence[Mapping], where: str = "request") -> tuple[np.ndarray, np.ndarray, list]:
        """``(obs [B, F], available [B, 3], parsed)`` for requests ``{"rounds": [...], "can_continue"?}``."""
        parsed = []
        for i, req in enumerate(requests):
            ctx = where if len(requests) == 1 and where != "batch" else f"{where}[{i}]"
            if not isinstance(req, Mapping):
                raise RouterInputError(f"{ctx}: expected an object with 'rounds', got {feats._type(req)}")
            if "rounds" not in req:
                raise RouterInputError(f"{ctx}.rounds: missing")
            parsed.append(feats.parse_request(req["rounds"], req.get("can_continue"), self.T, ctx, self.has_guide))
        if not parsed:
            return np.zeros((0, self.F), np.float32), np.zeros((0, N_ACTIONS), bool), parsed
        raw, last = feats.raw_arrays(parsed, self.T, self._base, self._guide, self.ladder)
        obs, avail = feats.observe(raw, last, self.T, self.has_guide, self.ladder)
        return obs, avail, parsed

    def kappa_for(self, group: Any, where: str = "request") -> tuple[np.float32, str]:
        """The threshold of a request's ``group`` and where it comes from (a Mondrian router: the
        group's own, else the pooled rest; a marginal router: its one kappa, whatever the group)."""
        if group is not None and not isinstance(group, str):
            raise RouterInputError(f"{where}.group: expected a string (the question's group), got {feats._type(group)}")
        if self.group_kappas is None:
            return self.kappa, "marginal"
        if group is None:
            return self.rest_kappa, "pooled: the request gives no group"
        if group in self.group_kappas:
            return self.group_kappas[group], f"group {group!r}"
        return self.rest_kappa, f"pooled: group {group!r} has no threshold of its own"

    def decide_many(self, requests: Sequence[Mapping], where: str = "batch", *, screen: bool = False,
                    kappa: float | None = None) -> list[dict]:
        """One decision (see :meth:`decide`) per request, computed in one batch. A Mondrian
        router takes each request's ``group`` (optional) and says which threshold it used.

        ``kappa``: one threshold for every request instead of the artefact's (the gateway's online
        threshold). ``screen``: decide with the float64 pass where it is safely away from the
        threshold (:data:`SCREEN_MARGIN`) and with the exported module elsewhere: the same sets as
        without, the probabilities within 1e-5 of the module's rather than bit-equal, and a few
        microseconds a row instead of a block of the module (the gateway's decisions)."""
        obs, avail, parsed = self.featurise(requests, where)
        kappas = [(self.kappa, "marginal")] * len(parsed)
        if kappa is not None:
            kappas = [(np.float32(kappa), "given")] * len(parsed)
        elif self.group_kappas is not None:
            kappas = [self.kappa_for(req.get("group"), where if len(requests) == 1 and where != "batch"
                                     else f"{where}[{i}]") for i, req in enumerate(requests)]
        k = np.asarray([x for x, _ in kappas], np.float32)
        if screen and len(parsed):
            probs, in_set = self._run_screened(obs, avail, k)
        else:
            probs, in_set = self._run(obs, avail)
            if kappa is not None or self.group_kappas is not None:
                in_set = (probs >= k[:, None]) & avail  # C = {a available : pi(a|o) >= kappa}, as conformal_set computes it
        out = []
        for i, (vals, texts, cont) in enumerate(parsed):
            s = [a for a, k in zip(self.actions, in_set[i]) if k]
            extra = {} if self.group_kappas is None or kappa is not None else {
                "group": requests[i].get("group"), "kappa_source": kappas[i][1]}
            out.append({
                "round": len(texts),
                "action_set": s,
                "continue": "next" in s,
                "answers": {a: texts[-1][a] for a in ("base", "guide") if a in s},
                "probs": {a: float(p) for a, p in zip(self.actions, probs[i])},
                "available": [a for a, k in zip(self.actions, avail[i]) if k],
                "kappa": float(kappas[i][0]),
                "guarantee": self.guarantee,
                **extra,
            })
        return out

    def decide(self, rounds_so_far: Sequence[Mapping], can_continue: bool | None = None,
               group: str | None = None) -> dict:
        """Decision after the last of ``rounds_so_far`` (per-round dicts as in the human JSONL format).

        Returns ``{"round", "action_set", "continue", "answers", "probs", "available", "kappa",
        "guarantee"}`` (``guarantee``: kind, alpha, delta of the calibrated threshold):
        the set-valued policy (docs/environment.md) collects the base and/or guide answer of
        this round when they are in the set and runs another round iff "next" is.
        """
        req = {"rounds": rounds_so_far}
        if can_continue is not None:
            req["can_continue"] = can_continue
        if group is not None:
            req["group"] = group
        return self.decide_many([req], where="request")[0]

    def describe(self) -> dict:
        """A short summary (the body of ``GET /healthz``)."""
        m = self.manifest
        return {
            "status": "ok",
            "format": m["format"],
            "format_version": m["format_version"],
            "policy": m["policy"]["row"],
            "alpha": self.alpha,
            "kappa": float(self.kappa),
            "guarantee": self.guarantee,
            "calibration": "marginal" if self.group_kappas is None else
                           {"kind": "mondrian", "groups": sorted(self.group_kappas), "rest_kappa": float(self.rest_kappa)},
            "T": self.T,
            "features": self.F,
            "actions": list(self.actions),
            "cache": {"name": m["cache"]["name"], "provenance_kind": m["cache"]["provenance"].get("kind")},
        }
