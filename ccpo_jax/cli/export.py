"""``ccpo-jax export``: a trained row of a run as a router artefact (docs/export.md; ``route`` and ``serve``
are :mod:`ccpo_jax.cli.serve`)."""
from __future__ import annotations

import argparse

from ccpo_jax.ccpo.run_config import ExportConfig
from ccpo_jax.runtime.options import add_flags


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "export", help="write a trained policy of a run as a self-describing router artefact (jax.export)",
        description="Export the policy of one row of a 'ccpo-jax reproduce' run (RUN_DIR/policies/) as a directory "
        "with manifest.json, policy.jaxexport and params.npz, loadable by ccpo_jax.serving.Router.")
    add_flags(e, ExportConfig)  # one flag per field of the typed options
    e.set_defaults(func=_export)


def _export(args) -> int:
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.serving.artifact import read_verified

    from ccpo_jax.errors import UserError

    from ccpo_jax.ccpo.run_config import EXPORT_FLAGS
    from ccpo_jax.runtime.options import given

    try:
        cfg = ExportConfig(**given(ExportConfig, args))
        out = export_router(cfg.run_dir, cfg.out, row=cfg.row, force=cfg.force, echo=print,
                            calibration=cfg.calibration, guarantee=cfg.guarantee)
    except UserError as e:  # the library names its arguments; say which flag that is
        raise e.for_cli(EXPORT_FLAGS) from None
    m = read_verified(out)[0]
    kind = m["cache"].get("provenance", {}).get("kind", "?")
    tag = " (trained on a SYNTHETIC cache)" if kind == "synthetic" else ""
    mond = m.get("mondrian")
    groups = "" if not mond else (f"; Mondrian: {len(mond['kappas'])} group thresholds, rest {mond['rest_kappa']:.6g}"
                                  f" for {len(mond['rest_groups'])} pooled group(s), unknown or missing groups")
    from ccpo_jax.core.guarantee import guarantee_from_json

    g = guarantee_from_json(m.get("guarantee"))  # (the object says whether it has a delta: no kind == "pac")
    groups += f"; guarantee {g.kind}" + (f" (delta {g.delta:g})" if g.uses_delta else "")
    from ccpo_jax.ccpo.settings import served_row

    print(f"exported {served_row(m['policy']['row'], m.get('seed_rule'))!r} (alpha={m['alpha']}, kappa="
          f"{m['kappa']:.6g}{groups}, T={m['T']}, F={m['features']['count']}){tag} to {out}")
    return 0
