"""The policy store: trained policies on disk, ``RUN_DIR/policies/<slug>/``, for ``ccpo-jax export``.

``params.msgpack`` holds the flax-serialised policy parameters, ``policy.json`` the row,
its calibrated kappa, the network shape, the feature names, the cache's provenance and
checksum and the calibration diagnostics (:func:`ccpo_jax.ccpo.evaluation.calibration_diagnostics`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.ccpo.rowid import RowId, Twin
from ccpo_jax.ccpo.settings import ENSEMBLE_RULE, KEPT_RULE
from ccpo_jax.core.guarantee import Guarantee
from ccpo_jax.core.networks import policy_net
from envs.cache.atomic import atomic_write_bytes, atomic_write_text
from envs.cache.schema import ACTION_NAMES
from envs.replay.features import feature_names, ladder_roles, n_features

POLICIES_DIR = "policies"
POLICY_PARAMS = "params.msgpack"
POLICY_META = "policy.json"


def policy_slug(row: str) -> str:
    """Directory name of a row's policy: 'CCPO (lambda=2e-4)' -> 'ccpo-lambda-2e-4'."""
    return re.sub(r"[^a-z0-9.]+", "-", row.lower().replace("=", "-")).strip("-").replace(".", "p")


def policy_row(var: Variant) -> str | None:
    """The row a variant's saved policy serves: its own for CCPO, ``CPO batch`` for CPO; None for a
    CPO policy that serves only the pointwise row (nothing to export: a router is a calibrated set)."""
    if var.conformal:
        return var.name
    return "CPO batch" if "CPO batch" in var.table_rows() else None


def save_policies(out: Path, cfg: TrainConfig, variants: list[Variant], state, kappas, cache, protocol: str,
                  diagnostics: dict | None = None, mondrian: dict | None = None, guarantee: Guarantee | None = None,
                  seeds: dict[str, int] | None = None, ensembles: bool = False) -> None:
    """Write every trained policy of split 0 to ``out/<slug>/``: of seed ``seeds[row]`` (the row's kept seed,
    ``ccpo_jax.ccpo.rows.saved_seed``; 0 when not given); with ``ensembles`` also each row's ensemble
    ``ROW [ensemble]`` (all N seeds of split 0 as one policy, leaves [N, ...], ``"ensemble": N``).

    ``state`` leaves are [V, S_train, N, ...]; ``kappas[row]`` [N, S] the calibrated kappas
    (``kappas[ROW [ensemble]]`` [1, S]); ``policy.json`` gets the row name, the seed, alpha, the
    batch-calibrated kappa of split 0, the final online kappa, T, the network shape, the feature names
    and the cache's provenance and checksum; ``diagnostics[row]`` (optional) goes to ``calibration``,
    which ``ccpo-jax export`` reads to refuse a degenerate router and to pick its default row;
    ``mondrian[row]`` (optional, ``reproduce --calibration mondrian``) goes to ``mondrian``: the
    per-group thresholds that ``ccpo-jax export --calibration mondrian`` puts in the router;
    ``guarantee`` goes to ``guarantee`` (kind, alpha, delta: what the thresholds guarantee).
    """
    out.mkdir(parents=True, exist_ok=True)
    for v, var in enumerate(variants):
        row = policy_row(var)
        if row is None:
            continue
        seed = int((seeds or {}).get(row, 0))
        pol = jax.tree.map(lambda x: np.asarray(x[v, 0, seed]), state.policy)  # split 0, the saved seed
        meta = _meta(row, var, cfg, cache, protocol, float(np.asarray(kappas[row])[seed, 0]),
                     float(np.asarray(state.kappa[v, 0, seed])))
        meta.update(seed=seed, seed_rule=f"the kept seed: {KEPT_RULE}" if seeds and row in seeds else "seed 0")
        _write(out, row, pol, meta, diagnostics, mondrian, guarantee, var)
        ens = RowId.parse(row).twin_of(Twin.ENSEMBLE).name  # row: a name of the trainer's kappas
        if ensembles and ens in kappas:
            members = jax.tree.map(lambda x: np.asarray(x[v, 0]), state.policy)  # split 0, every seed [N, ...]
            n = int(np.asarray(state.kappa).shape[2])
            meta = _meta(ens, var, cfg, cache, protocol, float(np.asarray(kappas[ens])[0, 0]),
                         float(np.mean(np.asarray(state.kappa[v, 0]))))
            meta.update(seed=None, ensemble=n, seed_rule=f"all {n} seeds as one policy: {ENSEMBLE_RULE}",
                        kappa_note="kappa is the batch-calibrated threshold of the ensemble on split 0; kappa_online "
                                   "the mean of its members' online thresholds")
            _write(out, ens, members, meta, diagnostics, mondrian, guarantee, var)


def _meta(row: str, var: Variant, cfg: TrainConfig, cache, protocol: str, kappa: float, kappa_online: float) -> dict:
    m = cache.manifest
    return {
        "row": row,
        "conformal_training": bool(var.conformal),
        "lambda": float(var.lam),
        "constraint_z": var.margin(cfg),
        "alpha": float(var.alpha),
        "kappa": kappa,
        "kappa_online": kappa_online,
        "kappa_note": "kappa is the batch-calibrated threshold of the saved policy on split 0; kappa_online the "
                      "online one",
        "protocol": protocol,
        "split": 0,
        "T": int(m.T),
        "hidden": list(cfg.hidden),
        "actions": list(ACTION_NAMES),
        "feature_names": list(feature_names(m.T, ladder_roles(m.models_of("base"), m.models_of("guide")))),
        "cache": {"name": m.name, "provenance": m.provenance, "checksum": m.checksum or cache.checksum()},
        "models": m.to_dict()["models"],  # a ladder: one entry per round
        "train_config": dict(dataclasses.asdict(cfg), alpha=float(var.alpha)),  # the policy's alpha (Variant.alpha)
        "jax": jax.__version__,
    }


def _write(out: Path, row: str, pol, meta: dict, diagnostics: dict | None, mondrian: dict | None,
           guarantee: Guarantee | None, var: Variant) -> None:
    """One policy directory: ``params.msgpack`` and ``policy.json`` (with the row's diagnostics, Mondrian
    thresholds and guarantee when given)."""
    d = out / policy_slug(row)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(d / POLICY_PARAMS, serialization.to_bytes(pol))
    if diagnostics and row in diagnostics:
        meta["calibration"] = diagnostics[row]
    if guarantee is not None:
        meta["guarantee"] = guarantee.describe(var.alpha)
    if mondrian and row in mondrian:
        meta["mondrian"] = mondrian[row]
    atomic_write_text(d / POLICY_META, json.dumps(meta, indent=2, default=str) + "\n")


def load_policy(path: Path) -> tuple[Any, dict]:
    """(params, meta) of a policy saved by :func:`save_policies` (an ensemble's leaves: [N, ...])."""
    path = Path(path)
    meta = json.loads((path / POLICY_META).read_text())
    net = policy_net(tuple(meta["hidden"]))
    # the features the policy was trained on (a ladder's rung prices included)
    F = len(meta["feature_names"]) if "feature_names" in meta else n_features(meta["T"])
    template = net.init(jax.random.PRNGKey(0), jnp.zeros((F,), jnp.float32))
    if meta.get("ensemble"):  # N members stacked on a leading axis
        template = jax.tree.map(lambda x: jnp.zeros((int(meta["ensemble"]),) + x.shape, x.dtype), template)
    params = serialization.from_bytes(template, (path / POLICY_PARAMS).read_bytes())
    shapes = jax.tree.map(np.shape, params), jax.tree.map(np.shape, template)
    if shapes[0] != shapes[1]:  # from_bytes takes any shapes: a policy of another width than its features
        raise ValueError(f"{POLICY_PARAMS} does not fit the {F} features of {POLICY_META} (shapes {shapes[0]})")
    return params, meta
