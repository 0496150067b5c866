"""``ccpo-jax route | serve``: batch decisions of an exported router, and its HTTP endpoint (docs/export.md).

Each command's options are one typed dataclass (:mod:`ccpo_jax.runtime.options`): one field per flag,
checked once, the messages naming the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import add_flags, given, option
from envs.cache.atomic import atomic_write_text


def _at_least(lo: float, what: str = "an integer"):
    def check(name: str, v: Any, cfg: Any) -> Any:
        if v is None or not v >= lo:  # (also NaN)
            raise UserError(f"{name}: expected {what} >= {lo:g}, got {v!r}", field=name)
        return v
    return check


def _positive_s(name: str, v: Any, cfg: Any) -> float:
    if not v > 0:  # (also NaN)
        raise UserError(f"{name}: expected a number of seconds > 0, got {v!r}", field=name)
    return v


def _port(name: str, v: Any, cfg: Any) -> int:
    if v is None or not 0 <= v <= 65535:
        raise UserError(f"{name}: expected 0..65535, got {v}", field=name)
    return v


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """``ccpo-jax route``: one decision per JSONL line (or per round of each line)."""

    artifact: str = option("ARTIFACT", help="an exported router (the --out of 'ccpo-jax export')")
    input: str = option("--input", help="JSONL file of requests", metavar="FILE.jsonl", required=True)
    out: str | None = option("--out", help="output JSONL file, written atomically", metavar="FILE.jsonl",
                             default_doc="stdout")
    every_round: bool = option("--every-round", help="a decision after every round of each line (round t may "
                               "continue iff the line has more rounds), as the replay environment sees a cached "
                               "question", switch=True, default=False)

    def __post_init__(self) -> None:
        options.resolve(self)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """``ccpo-jax serve``: the router over HTTP; the server's bounds map onto ``ServerLimits``
    (``max_connections`` -> ``max_clients``, ``request_timeout`` -> ``read_timeout_s``, ``idle_timeout``
    -> ``keep_alive_s``)."""

    artifact: str = option("ARTIFACT", help="an exported router (the --out of 'ccpo-jax export')")
    port: int = option("--port", help="TCP port (0: any free port)", type=int, required=True, check=_port)
    host: str = option("--host", help="bind address", default="127.0.0.1", default_doc="127.0.0.1, loopback only")
    max_bytes: int = option("--max-bytes", help="largest request body in bytes; larger -> 413", type=int,
                            default=1 << 20, default_doc="1 MiB", check=_at_least(1))
    max_batch: int = option("--max-batch", help="most requests in one 'batch'", type=int, default=1024,
                            check=_at_least(1))
    backlog: int = option("--backlog", help="listen backlog: connections queued before accept", type=int,
                          default=1024, check=_at_least(1))
    max_connections: int = option("--max-connections", help="most client connections at once; past it the oldest "
                                  "connection with no request in progress is closed, or the new one gets 503",
                                  type=int, default=64, check=_at_least(1))
    request_timeout: float = option("--request-timeout", help="seconds a client has to send a request's line and "
                                    "headers (from connecting or from the previous answer), and again its body; "
                                    "slower -> 408, connection closed", type=float, default=10.0, metavar="S",
                                    default_doc="10", check=_positive_s)
    idle_timeout: float = option("--idle-timeout", help="seconds an idle keep-alive connection is kept, at most "
                                 "--request-timeout", type=float, default=30.0, metavar="S", default_doc="30",
                                 check=_positive_s)
    verbose: bool = option("--verbose", help="log every request to stderr", switch=True, default=False)

    def __post_init__(self) -> None:
        options.resolve(self)


ROUTE_FLAGS, SERVE_FLAGS = options.flag_names(RouteOptions), options.flag_names(ServeOptions)


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "route", help="batch decisions of an exported router for a JSONL file of rounds",
        description="Each input line is {\"rounds\": [...], \"can_continue\"?: bool, \"id\"?: any} (a question line "
        "of the human cache format works too; a {\"manifest\": ...} line is skipped). Writes one JSON decision per line.")
    add_flags(r, RouteOptions)
    r.set_defaults(func=_route)
    s = sub.add_parser(
        "serve", help="serve an exported router over HTTP (POST /v1/route, GET /healthz)",
        description="JSON endpoint on loopback by default. See docs/export.md for the request format.")
    add_flags(s, ServeOptions)
    s.set_defaults(func=_serve)


def _opts(cls: type, args: argparse.Namespace, flags: dict[str, str]) -> Any:
    try:
        return cls(**given(cls, args))
    except UserError as e:  # the options name their fields; say which flag that is
        raise e.for_cli(flags) from None


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
    from ccpo_jax.serving import features as feats

    opts: RouteOptions = _opts(RouteOptions, args, ROUTE_FLAGS)
    router = Router.load(opts.artifact)
    reqs, echo = _read_requests(Path(opts.input), opts.every_round)
    # Validate line by line so an error names FILE:LINE, then decide in one batch.
    for r in reqs:
        if "rounds" not in r:
            raise RouterInputError(f"{r['_where']}: missing field 'rounds'")
        feats.parse_request(r["rounds"], r.get("can_continue"), router.T, r["_where"], router.has_guide)
        router.kappa_for(r.get("group"), r["_where"])  # a group that is not a string: named by its line
    decisions = router.decide_many([{k: v for k, v in r.items() if k != "_where"} for r in reqs]) if reqs else []
    text = "".join(json.dumps({**e, **d}) + "\n" for e, d in zip(echo, decisions))
    if opts.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    print(f"wrote {len(decisions)} decisions to {out} (coverage target {1 - router.alpha:g}: {COVERAGE_RULE}, "
          "counting a question no model answers correctly as covered)", file=sys.stderr)
    return 0


def _serve(args) -> int:
    from ccpo_jax.serving import Router
    from ccpo_jax.serving.app import LOOPBACK, listen, server as make_server
    from ccpo_jax.serving.server import ServerLimits

    opts: ServeOptions = _opts(ServeOptions, args, SERVE_FLAGS)
    limits = ServerLimits(read_timeout_s=opts.request_timeout, keep_alive_s=opts.idle_timeout,
                          max_clients=opts.max_connections)
    router = Router.load(opts.artifact)
    try:
        sock = listen(opts.host, opts.port, opts.backlog)
    except OSError as e:
        raise UserError(f"--host {opts.host} --port {opts.port}: cannot listen ({e.strerror})") from None
    # (compiles every batch bucket up to --max-batch before it accepts a connection)
    server = make_server(router, max_bytes=opts.max_bytes, max_batch=opts.max_batch, limits=limits,
                         backlog=opts.backlog, verbose=opts.verbose)
    if opts.host not in LOOPBACK:
        print(f"warning: listening on {opts.host}, not loopback; the endpoint has no authentication", file=sys.stderr)
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
