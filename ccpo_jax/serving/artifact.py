"""The exported-router artefact: file names, manifest checksum, verified loading (docs/export.md).

An artefact is a directory::

    ARTIFACT/
      manifest.json       everything a serving layer needs to know (see docs/export.md)
      policy.jaxexport    serialized jax.export module (batch-polymorphic, params as inputs)
      params.npz          the policy parameters, one array per flax leaf

``manifest.json`` lists the sha256 of every other file (``files``) and carries
``manifest_sha256``, the sha256 of its own canonical JSON without that field,
so an edited byte anywhere is refused. This is an integrity check, not a
signature: anyone who can write the directory can recompute the hashes.

Light on purpose: NumPy and the standard library only (jax.export is imported
by :mod:`ccpo_jax.serving.router`), no training code.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ccpo_jax.errors import UserError

FORMAT_NAME = "ccpo-jax-router"
#: 2: a ladder's router has its rung-price features (envs/replay/features.py; docs/export.md). A
#: one-model router is the same in both versions.
FORMAT_VERSION = 2
#: Versions this build reads (1: a ladder's router without the rung-price features, as exported).
SUPPORTED_VERSIONS = (1, 2)
#: The first version whose routers have a ladder's rung-price features.
RUNG_FEATURES_SINCE = 2
MANIFEST = "manifest.json"
MODULE_FILE = "policy.jaxexport"
PARAMS_FILE = "params.npz"
#: Rows per block of the exported forward pass (see ccpo_jax/ccpo/export.py: why a fixed block).
BLOCK_ROWS = 2048


class ArtifactError(UserError):
    """An exported-router artefact that cannot be used: missing file, bad checksum, unknown version..."""


class RouterInputError(UserError):
    """A request or observation that does not match the artefact's feature spec."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The bytes that ``manifest_sha256`` hashes: sorted keys, no whitespace, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_checksum(manifest: dict) -> str:
    """sha256 of the canonical JSON of ``manifest`` without its ``manifest_sha256`` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return sha256_bytes(canonical_json(body))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_verified(path: str | Path) -> tuple[dict, bytes, dict[str, np.ndarray]]:
    """Read and verify an artefact: ``(manifest, module bytes, params by leaf name)``.

    Raises :class:`ArtifactError` naming the file and the problem for: a missing
    directory or file, unreadable JSON, another format or an unknown format
    version, a manifest whose ``manifest_sha256`` does not match, a file whose
    sha256 does not match ``files``, or params that do not match the manifest.
    """
    root = Path(path)
    if root.is_file() and root.name == MANIFEST:
        root = root.parent
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artefact directory (expected the --out of 'ccpo-jax export')")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: missing; not an exported router")
    try:
        manifest = json.loads(mpath.read_bytes(), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e})") from None
    except RecursionError:  # e.g. 100,000 nested lists
        raise ArtifactError(f"{mpath}: not valid JSON (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: expected a JSON object")
    if manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{mpath}: format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise ArtifactError(
            f"{mpath}: format_version {version!r} is not supported by this build (reads {list(SUPPORTED_VERSIONS)}); "
            "re-export the router with this version of ccpo-jax"
        )
    want = manifest.get("manifest_sha256")
    try:
        got = manifest_checksum(manifest)
    except ValueError:  # a number JSON cannot write back (1e400 parses to inf): export never wrote it
        got = None
    if not isinstance(want, str) or got != want:
        raise ArtifactError(f"{mpath}: manifest checksum mismatch (manifest_sha256); the manifest was edited or damaged")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {MODULE_FILE, PARAMS_FILE}:
        raise ArtifactError(f"{mpath}: 'files' must list exactly {MODULE_FILE} and {PARAMS_FILE}")
    blobs = {}
    for name, rec in files.items():
        fp = root / name
        if not fp.is_file():
            raise ArtifactError(f"{fp}: missing file of the artefact")
        data = fp.read_bytes()
        if not isinstance(rec, dict) or sha256_bytes(data) != rec.get("sha256"):
            raise ArtifactError(f"{fp}: sha256 mismatch with {MANIFEST}; the file was edited or damaged")
        blobs[name] = data
    import io

    try:
        with np.load(io.BytesIO(blobs[PARAMS_FILE]), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - any unreadable npz is the same user-facing problem
        raise ArtifactError(f"{root / PARAMS_FILE}: unreadable ({e})") from None
    try:
        leaves = manifest["params"]["leaves"]
        names = [leaf["name"] for leaf in leaves]
        specs = [(list(leaf["shape"]), str(leaf["dtype"])) for leaf in leaves]
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{mpath}: malformed params.leaves ({e!r})") from None
    if sorted(names) != sorted(arrays) or len(set(names)) != len(names):
        raise ArtifactError(f"{root / PARAMS_FILE}: arrays {sorted(arrays)} do not match manifest params.leaves {names}")
    for name, (shape, dtype) in zip(names, specs):
        a = arrays[name]
        if list(a.shape) != shape or str(a.dtype) != dtype:
            raise ArtifactError(
                f"{root / PARAMS_FILE}: {name} has shape {list(a.shape)} {a.dtype}, manifest says {shape} {dtype}"
            )
    return manifest, blobs[MODULE_FILE], arrays
