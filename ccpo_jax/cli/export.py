"""``ccpo-jax export | route | serve``: export a trained router, batch decisions, HTTP endpoint (docs/export.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ccpo_jax.ccpo.run_config import ExportConfig
from ccpo_jax.runtime.options import add_flags
from envs.cache.atomic import atomic_write_text


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "export", help="write a trained policy of a run as a self-describing router artefact (jax.export)",
        description="Export the policy of one row of a 'ccpo-jax reproduce' run (RUN_DIR/policies/) as a directory "
        "with manifest.json, policy.jaxexport and params.npz, loadable by ccpo_jax.serving.Router.")
    add_flags(e, ExportConfig)  # one flag per field of the typed options
    e.set_defaults(func=_export)

    r = sub.add_parser(
        "route", help="batch decisions of an exported router for a JSONL file of rounds",
        description="Each input line is {\"rounds\": [...], \"can_continue\"?: bool, \"id\"?: any} (a question line "
        "of the human cache format works too; a {\"manifest\": ...} line is skipped). Writes one JSON decision per line.")
    r.add_argument("artifact", metavar="ARTIFACT")
    r.add_argument("--input", required=True, help="JSONL file of requests")
    r.add_argument("--out", default=None, help="output JSONL file (default: stdout); written atomically")
    r.add_argument("--every-round", action="store_true",
                   help="a decision after every round of each line (round t may continue iff the line has more rounds), "
                   "as the replay environment sees a cached question")
    r.set_defaults(func=_route)

    s = sub.add_parser(
        "serve", help="serve an exported router over HTTP (POST /v1/route, GET /healthz)",
        description="JSON endpoint on loopback by default. See docs/export.md for the request format.")
    s.add_argument("artifact", metavar="ARTIFACT")
    s.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    s.add_argument("--max-bytes", type=int, default=1 << 20, help="largest request body in bytes (default: 1 MiB; larger -> 413)")
    s.add_argument("--max-batch", type=int, default=1024, help="most requests in one 'batch' (default: 1024)")
    s.add_argument("--backlog", type=int, default=1024, help="listen backlog: connections queued before accept (default: 1024)")
    s.add_argument("--max-connections", type=int, default=64,
                   help="most client connections at once; past it the oldest connection with no request in progress "
                   "is closed, or the new one gets 503 (default: 64)")
    s.add_argument("--request-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a client has to send a request's line and headers (from connecting or from the "
                   "previous answer), and again its body; slower -> 408, connection closed (default: 10)")
    s.add_argument("--idle-timeout", type=float, default=30.0, metavar="S",
                   help="seconds an idle keep-alive connection is kept, at most --request-timeout (default: 30)")
    s.add_argument("--verbose", action="store_true", help="log every request to stderr")
    s.set_defaults(func=_serve)


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
    g = m.get("guarantee") or {"kind": "marginal"}
    groups += f"; guarantee {g['kind']}" + (f" (delta {g['delta']:g})" if g["kind"] == "pac" else "")
    from ccpo_jax.ccpo.settings import served_row

    print(f"exported {served_row(m['policy']['row'], m.get('seed_rule'))!r} (alpha={m['alpha']}, kappa="
          f"{m['kappa']:.6g}{groups}, T={m['T']}, F={m['features']['count']}){tag} to {out}")
    return 0


def _read_requests(path: Path, every_round: bool) -> tuple[list[dict], list[dict]]:
    """(requests for the router, per-request echo fields {line, id?, round?})."""
    from ccpo_jax.serving import RouterInputError

    reqs, echo = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RouterInputError(f"--input {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise RouterInputError(f"--input {path}: not UTF-8 text") from None

    def no_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line, parse_constant=no_constant)
        except ValueError as e:
            raise RouterInputError(f"{where}: invalid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise RouterInputError(f"{where}: expected a JSON object with 'rounds'")
        if "manifest" in obj and "rounds" not in obj:
            continue
        rounds = obj.get("rounds")
        ident = {"line": i, **({"id": obj["id"]} if "id" in obj else {})}
        if every_round and isinstance(rounds, list) and rounds:
            for t in range(len(rounds)):
                reqs.append({"rounds": rounds[: t + 1], "can_continue": t + 1 < len(rounds), "_where": where,
                             **({"group": obj["group"]} if "group" in obj else {})})
                echo.append(ident)
        else:
            reqs.append({**obj, "_where": where})
            echo.append(ident)
    return reqs, echo


def _route(args) -> int:
    from ccpo_jax.serving import Router, RouterInputError

    router = Router.load(args.artifact)
    reqs, echo = _read_requests(Path(args.input), args.every_round)
    # Validate line by line so an error names FILE:LINE, then decide in one batch.
    from ccpo_jax.serving import features as feats

    for r in reqs:
        if "rounds" not in r:
            raise RouterInputError(f"{r['_where']}: missing field 'rounds'")
        feats.parse_request(r["rounds"], r.get("can_continue"), router.T, r["_where"], router.has_guide)
        router.kappa_for(r.get("group"), r["_where"])  # a group that is not a string: named by its line
    decisions = router.decide_many([{k: v for k, v in r.items() if k != "_where"} for r in reqs]) if reqs else []
    text = "".join(json.dumps({**e, **d}) + "\n" for e, d in zip(echo, decisions))
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    print(f"wrote {len(decisions)} decisions to {out} (coverage target {1 - router.alpha:g}: {COVERAGE_RULE}, "
          "counting a question no model answers correctly as covered)", file=sys.stderr)
    return 0


def _serve(args) -> int:
    from ccpo_jax.errors import UserError
    from ccpo_jax.serving import Router
    from ccpo_jax.serving.app import LOOPBACK, listen, server as make_server
    from ccpo_jax.serving.server import ServerLimits

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: expected 0..65535, got {args.port}")
    if args.max_bytes < 1 or args.max_batch < 1:
        raise UserError("--max-bytes and --max-batch must be >= 1")
    if args.backlog < 1 or args.max_connections < 1:
        raise UserError("--backlog and --max-connections must be >= 1")
    if not (args.request_timeout > 0 and args.idle_timeout > 0):
        raise UserError("--request-timeout and --idle-timeout must be > 0 seconds")
    limits = ServerLimits(read_timeout_s=args.request_timeout, keep_alive_s=args.idle_timeout,
                          max_clients=args.max_connections)
    router = Router.load(args.artifact)
    try:
        sock = listen(args.host, args.port, args.backlog)
    except OSError as e:
        raise UserError(f"--host {args.host} --port {args.port}: cannot listen ({e.strerror})") from None
    # (compiles every batch bucket up to --max-batch before it listens)
    server = make_server(router, max_bytes=args.max_bytes, max_batch=args.max_batch, limits=limits,
                         backlog=args.backlog, verbose=args.verbose)
    if args.host not in LOOPBACK:
        print(f"warning: listening on {args.host}, not loopback; the endpoint has no authentication", file=sys.stderr)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    from ccpo_jax.ccpo.settings import served_row
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    m = router.manifest
    print(f"serving {served_row(m['policy']['row'], m.get('seed_rule'))!r} on {url} (POST /v1/route, GET "
          f"/healthz); Ctrl-C stops", file=sys.stderr)
    print(f"coverage target {1 - router.alpha:g}: {COVERAGE_RULE} (a decision's set is the actions to take; "
          "docs/export.md)", file=sys.stderr, flush=True)
    import signal

    # uvicorn re-raises the signal it stopped on once it has shut down: a SIGTERM (docker stop, systemd)
    # then lands here and the stop is clean, as Ctrl-C's
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    # Leave without interpreter teardown: tearing down the XLA:CPU client after a signal
    # occasionally aborted the process (exit -6 seen once in CI); the server is closed and
    # nothing else is pending, so a direct exit is the clean stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
