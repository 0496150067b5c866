"""``ccpo-jax export``: a trained policy -> a self-describing router artefact (docs/export.md).

Reads ``RUN_DIR/policies/<slug>/`` (written by :func:`ccpo_jax.ccpo.policy_store.save_policies`)
and writes the directory described in :mod:`ccpo_jax.serving.artifact`:

* ``policy.jaxexport``: ``jax.export`` of
  ``f(params, obs [b, F] f32, available [b, 3] bool, kappa f32[]) -> (probs [b, 3] f32, in_set [b, 3] bool)``
  with a symbolic batch ``b``, lowered for cpu, cuda and tpu. It runs the trainer's
  own code: ``masked_probs(policy_net(hidden).apply(params, obs), available)``
  and ``conformal_set(probs, kappa, available)`` (paper Eq. 2).
* ``params.npz``: the parameters, passed to the module as inputs (not baked in
  as constants), so they are checksummed and inspectable on their own;
  ``kappa`` is an input too and comes from the manifest.
* ``manifest.json``: see :func:`build_manifest`.

Why blocks of ``BLOCK_ROWS`` rows: XLA's CPU matmul picks its kernel by size,
and kernels for 48..~1,100 rows sum in another order than larger ones, so the
same row can come out 1 ulp apart at different batch sizes. kappa-hat is exactly
the probability of some calibration observation (exact calibration), so a 1-ulp
change can move an action across the threshold. The module therefore pads the
batch to whole blocks of 2,048 rows and maps over them: every row is computed
by one kernel whatever the batch size, the same one the trainer's evaluation
uses on a large cache (rows >= 2,048) and that a reference forward pass over
10,000 observations uses (tests/serving/test_export.py checks this bit for bit).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from ccpo_jax.ccpo.blocked import block_probs, in_blocks
from ccpo_jax.ccpo.policy_store import POLICIES_DIR, POLICY_META, load_policy, policy_slug
from ccpo_jax.ccpo.pick import (DEFAULT_ROW, _describe, _n_test, _policy_metas, _usable,  # noqa: F401 - moved
                                 _why_degenerate, choose_default_row, export_default)
from ccpo_jax.ccpo.rowid import RowId, Twin
from ccpo_jax.core.conformal import conformal_set
from ccpo_jax.ccpo.calibration import CALIBRATIONS, GUARANTEES, Calibration, guarantee_manifest, mondrian_manifest
from ccpo_jax.errors import UserError
from ccpo_jax.runtime.progress import status
from ccpo_jax.serving import Router
from envs.replay.features import RAW_KEYS, SCALES, feature_names, ladder_roles, rung_feature
from envs.cache.normalise import NORMALISATION
from envs.cache.atomic import atomic_dir
from envs.cache.schema import ACTION_NAMES, N_ACTIONS
from ccpo_jax.serving.artifact import (
    BLOCK_ROWS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MODULE_FILE,
    PARAMS_FILE,
    manifest_checksum,
    sha256_file,
)

PLATFORMS = ("cpu", "cuda", "tpu")


def policy_forward(hidden, treedef, ensemble: bool = False):
    """``f(flat_params, obs [b, F], available [b, 3], kappa) -> (probs [b, 3], in_set [b, 3])``, in blocks
    (``ensemble``: leaves [N, ...], pi the members' mean, as the trainer's evaluation computes it)."""

    def f(flat, obs, avail, kappa):
        p = jax.tree_util.tree_unflatten(treedef, list(flat))
        probs_of = block_probs(p, hidden, ensemble)

        def block(o, a):
            probs = probs_of(o, a)
            return probs, conformal_set(probs, kappa, a)

        return in_blocks(block, obs, avail)

    return f


def export_module(params: Any, hidden, F: int, ensemble: bool = False) -> tuple[bytes, list[str], list[np.ndarray]]:
    """Serialized batch-polymorphic module, leaf names and leaf arrays (in the module's input order)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in with_path]
    leaves = [np.asarray(x, np.float32) for _, x in with_path]
    (b,) = jax_export.symbolic_shape("b")
    specs = (
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves),
        jax.ShapeDtypeStruct((b, F), jnp.float32),
        jax.ShapeDtypeStruct((b, N_ACTIONS), jnp.bool_),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    exp = jax_export.export(jax.jit(policy_forward(hidden, treedef, ensemble)), platforms=PLATFORMS)(*specs)
    return bytes(exp.serialize()), names, leaves


def find_policy(run_dir: Path, row: str | None, calibration: str = "marginal") -> Path:
    """The policy directory of ``row`` (a row name or its slug) in ``run_dir`` (or ``run_dir`` itself); None:
    the default row for ``calibration`` (:func:`choose_default_row`)."""
    run_dir = Path(run_dir)
    if (run_dir / POLICY_META).is_file() and row is None:
        return run_dir
    pdir = run_dir / POLICIES_DIR
    if not pdir.is_dir():
        raise UserError(f"{run_dir}: no {POLICIES_DIR}/ folder; expected the --out of 'ccpo-jax reproduce' "
                        "(a run that trained CPO/CCPO rows)")
    if row is None:
        return choose_default_row(pdir, calibration)[0]
    rid = RowId.parse(row)  # --row: a name given on the command line
    if rid.twin is Twin.KEPT_SEED:  # policies/ROW holds ROW's kept seed
        row = rid.base.name
    for cand in (policy_slug(row), row):
        if (pdir / cand / POLICY_META).is_file():
            return pdir / cand
    rows = []
    for d in sorted(pdir.iterdir()):
        try:
            rows.append(json.loads((d / POLICY_META).read_text())["row"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
    raise UserError(f"row: no policy {row!r} in {pdir} (available: {', '.join(repr(r) for r in rows) or 'none'})",
                    field="row")


def _versions() -> dict[str, str]:
    import flax

    import ccpo_jax

    out = {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__,
           "flax": flax.__version__, "ccpo_jax": ccpo_jax.__version__}
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except ImportError:  # pragma: no cover - jaxlib ships with jax
        pass
    return out


def policy_ladder(meta: dict) -> tuple[str, ...]:
    """The laddered roles of a saved policy's cache (its rung-price features), from ``models``."""
    models = meta.get("models") or {}
    return ladder_roles(models.get("base"), models.get("guide"))


def policy_features(meta: dict, policy_dir: Path) -> list[str]:
    """The feature names of this build for the saved policy's cache; refused if the policy was
    trained on others (before its parameters meet a module of another width)."""
    T, ladder = int(meta["T"]), policy_ladder(meta)
    fnames = list(feature_names(T, ladder))
    if list(meta.get("feature_names", fnames)) != fnames:
        raise UserError(
            f"{policy_dir}/policy.json: feature_names differ from envs.replay.features.feature_names({T}, {ladder}) "
            "of this build; the policy was trained with another featuriser (a ladder run saved before the rung "
            "features: re-run reproduce)"
        )
    return fnames


def build_manifest(meta: dict, names: list[str], leaves: list[np.ndarray], policy_dir: Path,
                   run_dir: Path, module_info: dict) -> dict:
    """Everything a serving layer needs, except ``files`` and ``manifest_sha256`` (added by the writer)."""
    T = int(meta["T"])
    ladder = policy_ladder(meta)
    fnames = policy_features(meta, policy_dir)
    results = {}
    rpath = run_dir / "results.json"
    if rpath.is_file():
        try:
            results = json.loads(rpath.read_text())
        except ValueError:
            results = {}
    conformal = bool(meta.get("conformal_training", True))
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "policy": {
            "kind": "conformal-set",
            "row": meta["row"],
            "training": "ccpo" if conformal else "cpo",
            "lambda": float(meta.get("lambda", 0.0)),
            "network": {"type": "mlp-tanh", "hidden": [int(h) for h in meta["hidden"]], "outputs": N_ACTIONS,
                        "probs": "softmax over available actions (ccpo_jax.core.networks.masked_probs)",
                        **({"ensemble": int(meta["ensemble"]),
                            "ensemble_probs": "the mean of the members' probs (every leaf [members, ...]; "
                                              "ccpo_jax.ccpo.blocked.block_probs)"} if meta.get("ensemble") else {})},
            "set_rule": "C(o) = {a available : pi(a|o) >= kappa} (paper Eq. 2); may be empty",
        },
        "alpha": float(meta["alpha"]),
        "kappa": float(meta["kappa"]),
        "kappa_online": meta.get("kappa_online"),
        "kappa_note": meta.get("kappa_note", "kappa is the batch-calibrated threshold"),
        "protocol": meta.get("protocol"),
        "split": meta.get("split"),
        "seed": meta.get("seed"),
        "seed_rule": meta.get("seed_rule", "seed 0"),
        "actions": list(ACTION_NAMES),
        "T": T,
        "features": {
            "count": len(fnames),
            "names": fnames,
            "dtype": "float32",
            "builder": "envs.replay.features.build_features (raw [.., T] -> [.., T, F]); documented in envs/replay/features.py",
            "raw_keys": list(RAW_KEYS) + [rung_feature(r) for r in ladder],
            **({"rung_price": "price_in + price_out of round t's model / the largest over the role's rungs "
                              "(0 if all are free); per role of a ladder"} if ladder else {}),
            "scales": dict(SCALES),
            "cumulative_transform": "log1p(cumulative sum / scale)",
            "missing_unit_value": 0.5,
            "answer_normalisation": NORMALISATION,
        },
        "models": meta["models"],
        "cache": meta["cache"],
        "train_config": meta.get("train_config", {}),
        "module": {
            "file": MODULE_FILE,
            "api": "jax.export",
            "signature": "f(params: tuple[leaves], obs: f32[b, F], available: bool[b, 3], kappa: f32[]) "
                         "-> (probs: f32[b, 3], in_set: bool[b, 3])",
            "batch": "symbolic b >= 1",
            "block_rows": BLOCK_ROWS,
            **module_info,
        },
        "params": {"file": PARAMS_FILE, "leaves": [
            {"name": n, "shape": list(x.shape), "dtype": str(x.dtype)} for n, x in zip(names, leaves)]},
        "source": {
            "policy_dir": str(policy_dir.resolve()),
            "setting": results.get("setting"),
            "trained_with_jax": meta.get("jax"),
        },
        "versions": _versions(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def export_router(run_dir: str | os.PathLike, out: str | os.PathLike, row: str | None = None,
                  force: bool = False, echo=None, calibration: str = "marginal", guarantee: str | None = None) -> Path:
    """Write the artefact of ``row`` of ``run_dir`` to ``out`` (must not exist).

    ``row`` None: the cheapest calibrated row whose calibration coverage holds
    (:func:`choose_default_row`). A degenerate router (kappa-hat at 0, or the set
    holding every available action for nearly every calibration question) is refused
    unless ``force``, naming the row that would serve better. ``echo`` gets one line
    saying which row was chosen and why.

    ``calibration`` "mondrian": the router carries the row's per-group thresholds (saved by
    ``reproduce --calibration mondrian``) and a request's ``group`` picks its threshold.
    ``guarantee`` ("marginal" / "pac", None: the run's): the guarantee the router must carry; the
    thresholds were chosen by ``reproduce --guarantee``, so another one is refused.

    Atomic: everything is written into a temporary sibling directory, loaded
    back with :class:`ccpo_jax.serving.Router` and checked against the trainer's
    forward pass, then renamed to ``out``; on any failure nothing is left.
    """
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise UserError(f"out {out}: already exists; choose a new path (an artefact is never overwritten)", field="out")
    if guarantee is not None and guarantee not in GUARANTEES:
        raise UserError(f"guarantee: unknown guarantee {guarantee!r}; valid: {', '.join(GUARANTEES)}", field="guarantee")
    if calibration not in CALIBRATIONS:
        raise UserError(f"calibration: unknown calibration {calibration!r}; valid: {', '.join(CALIBRATIONS)}",
                        field="calibration")
    policy_dir = find_policy(run_dir, row, calibration)
    try:
        params, meta = load_policy(policy_dir)
    except RecursionError:  # e.g. 100,000 nested lists in policy.json
        raise UserError(f"{policy_dir}: cannot read the trained policy (JSON nested too deeply)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # incl. invalid UTF-8 (a ValueError)
        raise UserError(f"{policy_dir}: cannot read the trained policy ({type(e).__name__}: {e})") from None
    cal = meta.get("calibration")
    if cal and cal.get("ltt_feasible") is False:
        g = meta.get("guarantee") or {}
        caps = "".join(f", {what} <= {g[k]:g}{unit}" for k, what, unit in (
            ("guide_cap", "guide-call rate", ""), ("cost_cap", "mean cost", " cents a question")) if g.get(k) is not None)
        raise UserError(f"row: {meta['row']!r} has no threshold that meets its caps (coverage >= {1 - meta['alpha']:g}"
                        f"{caps}, delta {g.get('delta')}) on the saved calibration split: infeasible; choose another "
                        "row or looser caps", field="row")
    if cal and cal["degenerate"] and not force:
        better = ""
        try:
            _, reason = choose_default_row(policy_dir.parent)
            better = f"; {reason.split(' (')[0]} would serve better"
        except UserError:
            better = "; no other calibrated row of this run is usable either"
        raise UserError(f"{_why_degenerate(meta)}: a degenerate router{better}; pass `force` to export it anyway")
    if echo is not None:
        if row is None and (run_dir / "policies").is_dir():
            echo(f"row: {choose_default_row(run_dir / 'policies', calibration, _n_test(run_dir))[1]}")
        elif cal and cal["degenerate"]:
            echo(f"warning: exporting a degenerate router (forced): {_why_degenerate(meta)}")

    if echo is not None:
        status(f"lowering the policy for {', '.join(PLATFORMS)} (jax.export) ...")
    F = len(policy_features(meta, policy_dir))
    blob, names, leaves = export_module(params, meta["hidden"], F, bool(meta.get("ensemble")))

    exp = jax_export.deserialize(bytearray(blob))
    info = {"platforms": list(exp.platforms), "calling_convention_version": int(exp.calling_convention_version)}
    manifest = build_manifest(meta, names, leaves, policy_dir, run_dir, info)
    manifest["guarantee"] = guarantee_manifest(meta, policy_dir, guarantee)
    if Calibration(calibration) is Calibration.MONDRIAN:
        manifest["mondrian"] = mondrian_manifest(meta, policy_dir)

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, overwrite=False) as tmp:  # an artefact is never overwritten
        (tmp / MODULE_FILE).write_bytes(blob)
        np.savez(tmp / PARAMS_FILE, **dict(zip(names, leaves)))
        manifest["files"] = {n: {"sha256": sha256_file(tmp / n), "bytes": (tmp / n).stat().st_size}
                             for n in (MODULE_FILE, PARAMS_FILE)}
        manifest["manifest_sha256"] = manifest_checksum(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n")
        if echo is not None:
            status("writing the artefact and checking it against the trainer's forward pass ...")
        _self_check(tmp, params, meta)
    return out


def _self_check(path: Path, params: Any, meta: dict, n: int = 4096) -> None:
    """Load the artefact back and compare its sets with the trainer's on random observations."""
    router = Router.load(path)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(n, router.F)).astype(np.float32)
    avail = rng.random((n, N_ACTIONS)) < 0.8
    avail[:, 0] = True
    ens = bool(meta.get("ensemble"))
    kappa = np.float32(meta["kappa"])
    ref = jax.jit(lambda p, o, a: conformal_set(block_probs(p, meta["hidden"], ens)(o, a), kappa, a))
    if not np.array_equal(np.asarray(ref(params, obs, avail)), router.action_set(obs, avail)):
        raise UserError(f"{path}: the exported module's action sets differ from the trainer's; export aborted")

