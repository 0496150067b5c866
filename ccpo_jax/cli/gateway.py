"""``ccpo-jax gateway | live-eval``: the exported router in front of live endpoints (docs/gateway.md)."""
from __future__ import annotations

import argparse
import math

FLAGS = {"base": "--base", "guide": "--guide", "on_empty": "--on-empty", "journal": "--journal", "online_eta": "--online-kappa", "questions": "--questions",
         "budget_cents": "--budget-cents", "results": "--results", "row": "--row", "spool": "--spool"}


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="ARTIFACT", help="an exported router (the --out of 'ccpo-jax export')")
    p.add_argument("--base", required=True, metavar="URL,MODEL", action="append",
                   help="the base model's OpenAI-compatible endpoint; for a ladder artefact once per round, in "
                   "round order: round t's base call goes to the t-th")
    p.add_argument("--guide", default=None, metavar="URL,MODEL", action="append",
                   help="the guide model's endpoint (once per round for a guide ladder); none for a guide-less "
                   "cascade artefact")
    p.add_argument("--base-key-env", default=None, metavar="VAR", help="environment variable holding the base "
                   "endpoints' API key (every rung's; default: send none)")
    p.add_argument("--guide-key-env", default=None, metavar="VAR", help="likewise for the guide")
    p.add_argument("--retries", type=int, default=2, help="retries per upstream call (default: 2)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds of upstream silence before an attempt fails (default: 60)")
    p.add_argument("--attempt-timeout", type=float, default=120.0, metavar="S",
                   help="seconds one upstream attempt may take in all (default: 120)")
    p.add_argument("--max-retry-after", type=float, default=10.0, metavar="S",
                   help="longest Retry-After honoured; a longer one fails the request (default: 10)")
    p.add_argument("--max-batch", type=int, default=64, help="most decisions of concurrent requests in one router "
                   "call; compiled for every power of two up to it at start-up (default: 64)")
    p.add_argument("--price", default=None, action="append", metavar="MODEL=IN,OUT",
                   help="an upstream model's own prices, USD per million tokens in and out (repeatable); costs, "
                   "cost caps and the journal use them for the rounds MODEL serves. Default: the router's "
                   "trained prices (the artefact's models)")
    p.add_argument("--on-empty", default="guide", choices=("guide", "base", "abstain"),
                   help="the reply when the router's final set is empty: guide / base = that role's answer of the "
                   "last round (marked in the reply's ccpo.fallback as outside the guaranteed set), abstain = empty "
                   "content (default: guide; docs/gateway.md#empty-sets)")
    p.add_argument("--round-protocol", default=None, choices=("json", "paper"),
                   help="the round protocol (docs/real-llms.md); default: the one the artefact's cache was collected "
                   "with (paper for caches that do not record one)")
    p.add_argument("--online-kappa", type=float, default=None, metavar="ETA",
                   help="update kappa online from feedback (Eq. 9, eta_k = ETA k^-0.6); default: the artefact's kappa")


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gateway", help="an OpenAI-compatible proxy that runs the CCPO protocol per request",
                       description="POST /v1/chat/completions runs the base-guide protocol against --base and "
                       "--guide and stops when the exported router's set says so (docs/gateway.md).")
    _endpoint_args(g)
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    g.add_argument("--journal", default=None, metavar="FILE.jsonl",
                   help="append every request to this cache file; needed for POST /v1/feedback")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    g.add_argument("--read-timeout", type=float, default=10.0, metavar="S", help="seconds a client has to send a "
                   "request's line and headers (from connecting or from the previous response), and again its body; "
                   "then 408 and the connection is closed (default: 10)")
    g.add_argument("--keep-alive", type=int, default=5, metavar="S", help="seconds an idle keep-alive connection is "
                   "kept (uvicorn's timeout_keep_alive; default: 5)")
    g.add_argument("--max-clients", type=int, default=None, metavar="N", help="most client connections at once; past "
                   "it the oldest connection with no request in progress is closed, or the new one gets 503 (default: "
                   "half the file-descriptor limit left after 64, at most 1024)")
    g.add_argument("--max-header-bytes", type=int, default=64 << 10, metavar="N", help="longest request line and "
                   "headers; longer: 431 (default: 64 KiB)")
    g.add_argument("--window", type=int, default=200, help="feedback outcomes in the rolling coverage (default: 200)")
    g.add_argument("--no-access-log", action="store_true",
                   help="no line per request on stderr (default: one line per request at INFO)")
    g.add_argument("--state", default=None, metavar="redis://HOST:PORT/DB",
                   help="keep the deployment's state (journal, feedback, online kappa, coverage) in this Redis "
                   "database: every gateway started with the same --state and artefact is one gateway "
                   "(docs/gateway.md, Replicas); default: this process's memory and --journal")
    g.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N processes behind one port (N > 1 needs --state; default: 1)")
    g.add_argument("--spool", default="ccpo-gateway-spool", metavar="DIR",
                   help="with --state: where journal records wait while the store does not answer (default: "
                   "./ccpo-gateway-spool)")
    g.add_argument("--state-timeout", type=float, default=0.5, metavar="S",
                   help="with --state: the longest one store call may take before the request goes on without "
                   "it (default: 0.5)")
    g.add_argument("--new-deployment", action="store_true",
                   help="with --state: start a new deployment in an empty store although --spool belonged to one "
                   "(after Redis lost its data)")
    g.set_defaults(func=_gateway)

    e = sub.add_parser("live-eval", help="send questions with gold through the gateway in-process and compare "
                       "realised cost and coverage with the replay prediction",
                       description="Runs each question of --questions through the gateway's code (no HTTP), "
                       "journals them as a cache, and prints realised cost and coverage (Clopper-Pearson 95%%) "
                       "beside the training run's replay prediction (docs/gateway.md).")
    _endpoint_args(e)
    e.add_argument("--questions", required=True, metavar="Q.jsonl", help="{id, question, gold} per line (as data collect)")
    e.add_argument("--journal", required=True, metavar="FILE.jsonl", help="the journal (a cache) to write")
    e.add_argument("--results", default=None, metavar="results.json",
                   help="the training run's results.json (default: RUN_DIR/results.json of the artefact's run if found)")
    e.add_argument("--budget-cents", type=float, default=None, help="stop before a question whose worst case would "
                   "cross this total")
    e.add_argument("--concurrency", type=int, default=4, help="questions in flight (default: 4)")
    e.add_argument("--report", default=None, metavar="FILE.json", help="also write the report (every figure of the "
                   "table, the intervals, the prediction) as JSON")
    e.set_defaults(func=_live_eval)


def _config(args, journal):
    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.service import GatewayConfig
    from ccpo_jax.llm.wire import RetryPolicy, parse_endpoint

    for flag, v, lo in (("--retries", args.retries, 0), ("--timeout", args.timeout, 1e-3),
                        ("--attempt-timeout", args.attempt_timeout, 1e-3), ("--max-retry-after", args.max_retry_after, 0)):
        if not (math.isfinite(v) and v >= lo):
            raise UserError(f"{flag}: expected a number >= {lo:g}, got {v!r}")
    eta = args.online_kappa
    if eta is not None and not (math.isfinite(eta) and eta > 0):
        raise UserError(f"--online-kappa: expected a step > 0, got {eta!r}")
    retry = RetryPolicy(retries=args.retries, backoff_s=0.5, max_backoff_s=5.0, max_retry_after_s=args.max_retry_after,
                        timeout_s=args.timeout, attempt_timeout_s=args.attempt_timeout)
    base = tuple(parse_endpoint(b, "--base", args.base_key_env) for b in args.base)
    if args.guide is None and args.guide_key_env is not None:
        raise UserError("--guide-key-env: given without --guide (a guide-less cascade calls no guide)")
    guide = None if args.guide is None else tuple(parse_endpoint(g, "--guide", args.guide_key_env) for g in args.guide)
    if not 1 <= args.max_batch <= 4096:
        raise UserError(f"--max-batch: expected an integer in [1, 4096], got {args.max_batch}")
    kw = {"max_batch": args.max_batch}
    if getattr(args, "window", None) is not None:
        if args.window < 1:
            raise UserError(f"--window: expected an integer >= 1, got {args.window}")
        kw["window"] = args.window
    if getattr(args, "max_body_bytes", None) is not None:
        if args.max_body_bytes < 1024:
            raise UserError(f"--max-body-bytes: expected at least 1024, got {args.max_body_bytes}")
        kw["max_body_bytes"] = args.max_body_bytes
    kw["prices"] = _prices(args.price or [], base, guide)
    if getattr(args, "read_timeout", None) is not None:
        kw["server"] = _server_limits(args)
    if getattr(args, "no_access_log", False):
        kw["access_log"] = False
    kw.update(_state_config(args))
    from ccpo_jax.gateway.engine import ProtocolConfig

    return GatewayConfig(base=base, guide=guide, retry=retry, journal=journal, online_eta=eta,
                         on_empty=args.on_empty, protocol=ProtocolConfig(round_protocol=args.round_protocol), **kw)


def _prices(specs: list[str], base, guide) -> tuple[tuple[str, float, float], ...]:
    """``--price MODEL=IN,OUT`` values -> (model, in, out); MODEL must be one of the upstream models."""
    from ccpo_jax.errors import UserError

    models = {e.model for e in (*base, *(guide or ()))}
    out = {}
    for spec in specs:
        name, eq, pair = spec.rpartition("=")
        try:
            p_in, p_out = (float(x) for x in pair.split(","))
        except ValueError:
            p_in = p_out = float("nan")
        if not eq or not name or not (math.isfinite(p_in) and math.isfinite(p_out) and min(p_in, p_out) >= 0):
            raise UserError(f"--price {spec!r}: expected MODEL=IN,OUT, two prices >= 0 in USD per million tokens "
                            "(e.g. gpt-4o=2.5,10)")
        if name not in models:
            raise UserError(f"--price {spec!r}: {name!r} is not an upstream model (--base/--guide name "
                            f"{', '.join(sorted(models))})")
        out[name] = (p_in, p_out)
    return tuple((k, *v) for k, v in out.items())


def _state_config(args) -> dict:
    """The --state flags as GatewayConfig fields (none for live-eval)."""
    from ccpo_jax.errors import UserError

    if not hasattr(args, "state"):  # (live-eval)
        return {}
    state, workers = args.state, args.workers
    if not 1 <= workers <= 64:
        raise UserError(f"--workers: expected an integer in [1, 64], got {workers}")
    if state is None:
        if workers > 1:
            raise UserError(f"--workers {workers}: needs --state redis://HOST:PORT/DB: without a shared store each "
                            "worker would keep its own pending feedback, kappa and journal (feedback sent to another "
                            "worker would be a 404, and several writers on one journal file would interleave)")
        if args.new_deployment:
            raise UserError("--new-deployment: only with --state")
        return {}
    from ccpo_jax.gateway.redis_state import parse_state_url

    parse_state_url(state)
    if not (math.isfinite(args.state_timeout) and 0.001 <= args.state_timeout <= 60):
        raise UserError(f"--state-timeout: expected seconds in [0.001, 60], got {args.state_timeout!r}")
    return {"state": state, "spool": args.spool, "state_timeout_s": args.state_timeout,
            "new_deployment": args.new_deployment, "replica": f"{args.host}:{args.port}" if args.port else None}


def _state_line(gw) -> str:
    """The start-up line of a replica: the store, the deployment it created or joined, kappa and its version."""
    st = gw.state
    v = st.view()
    how = "created" if st.created else "joined"
    return (f"gateway: state {st.public_url}: {how} deployment {st.epoch} (kappa {v.kappa:.6g}, version "
            f"{v.version}; {len(st.spool.records)} record(s) waiting in the spool {st.spool.path})")


def _server_limits(args):
    """The server's bounds on every client (ccpo_jax.serving.server.ServerLimits) from the gateway's flags."""
    from ccpo_jax.errors import UserError
    from ccpo_jax.serving.server import ServerLimits

    if not (math.isfinite(args.read_timeout) and args.read_timeout > 0):
        raise UserError(f"--read-timeout: expected a number of seconds > 0, got {args.read_timeout!r}")
    for flag, v, lo in (("--keep-alive", args.keep_alive, 1), ("--max-clients", args.max_clients, 1),
                        ("--max-header-bytes", args.max_header_bytes, 1024)):
        if v is not None and v < lo:
            raise UserError(f"{flag}: expected an integer >= {lo}, got {v}")
    return ServerLimits(read_timeout_s=args.read_timeout, keep_alive_s=args.keep_alive, max_clients=args.max_clients,
                        max_header_bytes=args.max_header_bytes)


def _upstreams(gw) -> str:
    """The start-up line's upstreams: each role's endpoint, a ladder's rungs in round order."""
    parts = []
    for role in gw.roles:
        v = gw.role_value(role, lambda e: f"{e.model} at {e.public_url}")
        parts.append(f"{role} {v}" if isinstance(v, str) else f"{role} ladder {', '.join(v)}")
    return "; ".join(parts + ([] if "guide" in gw.roles else ["no guide (a guide-less cascade)"]))


def _gateway(args) -> int:
    import logging
    import socket

    import uvicorn

    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.access import price_line, stop_line
    from ccpo_jax.gateway.service import MODEL_ID, Gateway, load_gateway
    from ccpo_jax.gateway.app import build_app
    from ccpo_jax.serving import Router
    from ccpo_jax.serving.server import uvicorn_config

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: expected 0..65535, got {args.port}")
    try:
        cfg = _config(args, args.journal)
        # --workers: the parent checks the configuration and joins the store once (no compilation); each
        # worker loads its own gateway
        gw = Gateway(Router.load(args.artifact), cfg) if args.workers > 1 else load_gateway(args.artifact, cfg)
    except UserError as e:
        raise e.for_cli(FLAGS) from None
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.workers > 1:  # each worker listens on its own socket of this port; the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:  # (bound here, so that a taken port is one error line, not uvicorn's exit)
        sock.close()
        raise UserError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    # the gateway's own lines (the drift alarm, request failures); not httpx's line per upstream call
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ccpo_jax.gateway").setLevel(logging.INFO)
    r = gw.router
    from ccpo_jax.ccpo.settings import served_row
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    row = served_row(r.manifest["policy"]["row"], r.manifest.get("seed_rule"))
    banner = (f"gateway: model {MODEL_ID!r} = router {row!r} (alpha {r.alpha:g}, kappa "
              f"{float(r.kappa):.6g}{', online' if cfg.online_eta else ''}, T {r.T}); {_upstreams(gw)}; "
              f"http://{args.host}:{args.port}/v1")
    if cfg.state is not None:
        print(_state_line(gw), flush=True)
    if args.workers <= 1:  # (with --workers, serve_workers prints it)
        print(banner, flush=True)
    print(price_line(gw.prices, {role: [e.model for e in gw.rungs[role]] for role in gw.roles},
                     {name for name, _, _ in cfg.prices}), flush=True)
    print(f"gateway: coverage = {COVERAGE_RULE} (target "
          f"{1 - r.alpha:g}); measured from POST /v1/feedback; "
          + ("a line per request on stderr (--no-access-log: none)" if cfg.access_log else "no access log"),
          flush=True)
    if args.workers > 1:
        from ccpo_jax.gateway.workers import serve_workers

        gw.state.spool.close()  # (the workers take the spools)
        return serve_workers(args.artifact, cfg, sock, args.workers, banner)
    app = build_app(gw)
    server = uvicorn.Server(uvicorn_config(app, cfg.server, timeout_graceful_shutdown=5))
    import signal

    # uvicorn re-raises the signal it stopped on once it has shut down: catch it here to say what was kept
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    lines = None
    if cfg.journal is not None:
        with open(cfg.journal, "rb") as f:
            lines = sum(1 for _ in f)
    print(stop_line(app.answered(), cfg.journal, lines, gw.coverage.kappa if cfg.online_eta else None), flush=True)
    return 0


def _live_eval(args) -> int:
    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.liveeval import live_eval

    try:
        cfg = _config(args, args.journal)
        if args.concurrency < 1:
            raise UserError(f"--concurrency: expected an integer >= 1, got {args.concurrency}")
        report = live_eval(args.artifact, cfg, args.questions, results=args.results, budget_cents=args.budget_cents,
                           concurrency=args.concurrency, echo=print)
        if args.report:
            import json

            from envs.cache.atomic import atomic_write_text

            atomic_write_text(args.report, json.dumps(report, indent=1) + "\n")
    except UserError as e:
        raise e.for_cli(FLAGS) from None
    return 0
