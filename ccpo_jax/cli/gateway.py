"""``ccpo-jax gateway | live-eval``: the exported router in front of live endpoints (docs/gateway.md).

Each command's options are one typed dataclass (:mod:`ccpo_jax.gateway.options`), their defaults read
from GatewayConfig.
"""
from __future__ import annotations

import argparse

from ccpo_jax.gateway.options import GATEWAY_FLAGS, LIVE_EVAL_FLAGS, GatewayOptions, LiveEvalOptions
from ccpo_jax.runtime.options import add_flags, given


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gateway", help="an OpenAI-compatible proxy that runs the CCPO protocol per request",
                       description="POST /v1/chat/completions runs the base-guide protocol against --base and "
                       "--guide and stops when the exported router's set says so (docs/gateway.md).")
    add_flags(g, GatewayOptions)
    g.set_defaults(func=_gateway)
    e = sub.add_parser("live-eval", help="send questions with gold through the gateway in-process and compare "
                       "realised cost and coverage with the replay prediction",
                       description="Runs each question of --questions through the gateway's code (no HTTP), "
                       "journals them as a cache, and prints realised cost and coverage (Clopper-Pearson 95%%) "
                       "beside the training run's replay prediction (docs/gateway.md).")
    add_flags(e, LiveEvalOptions)
    e.set_defaults(func=_live_eval)


def _options(cls: type, args: argparse.Namespace, flags: dict[str, str]):
    """The command's options and its GatewayConfig; a bad value is one UserError naming the flag."""
    from ccpo_jax.errors import UserError

    try:
        opts = cls(**given(cls, args))
        return opts, opts.config()
    except UserError as e:
        raise e.for_cli(flags) from None


def _state_line(gw) -> str:
    """The start-up line of a replica: the store, the deployment it created or joined, kappa and its version."""
    st = gw.state
    v = st.view()
    how = "created" if st.created else "joined"
    return (f"gateway: state {st.public_url}: {how} deployment {st.epoch} (kappa {v.kappa:.6g}, version "
            f"{v.version}; {len(st.spool.records)} record(s) waiting in the spool {st.spool.path})")


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

    opts, cfg = _options(GatewayOptions, args, GATEWAY_FLAGS)
    try:
        # --workers: the parent checks the configuration and joins the store once (no compilation); each
        # worker loads its own gateway
        gw = Gateway(Router.load(opts.artifact), cfg) if opts.workers > 1 else load_gateway(opts.artifact, cfg)
    except UserError as e:
        raise e.for_cli(GATEWAY_FLAGS) from None
    sock = socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if opts.workers > 1:  # each worker listens on its own socket of this port; the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((opts.host, opts.port))
    except OSError as e:  # (bound here, so that a taken port is one error line, not uvicorn's exit)
        sock.close()
        raise UserError(f"--port: cannot listen on {opts.host}:{opts.port} ({e.strerror or e})") from None
    # the gateway's own lines (the drift alarm, request failures); not httpx's line per upstream call
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ccpo_jax.gateway").setLevel(logging.INFO)
    r = gw.router
    from ccpo_jax.ccpo.settings import served_row
    from ccpo_jax.ccpo.table import COVERAGE_RULE

    row = served_row(r.manifest["policy"]["row"], r.manifest.get("seed_rule"))
    banner = (f"gateway: model {MODEL_ID!r} = router {row!r} (alpha {r.alpha:g}, kappa "
              f"{float(r.kappa):.6g}{', online' if cfg.online_eta else ''}, T {r.T}); {_upstreams(gw)}; "
              f"http://{opts.host}:{opts.port}/v1")
    if cfg.state is not None:
        print(_state_line(gw), flush=True)
    if opts.workers <= 1:  # (with --workers, serve_workers prints it)
        print(banner, flush=True)
    print(price_line(gw.prices, {role: [e.model for e in gw.rungs[role]] for role in gw.roles},
                     {name for name, _, _ in cfg.prices}), flush=True)
    print(f"gateway: coverage = {COVERAGE_RULE} (target "
          f"{1 - r.alpha:g}); measured from POST /v1/feedback; "
          + ("a line per request on stderr (--no-access-log: none)" if cfg.access_log else "no access log"),
          flush=True)
    if opts.workers > 1:
        from ccpo_jax.gateway.workers import serve_workers

        gw.state.spool.close()  # (the workers take the spools)
        return serve_workers(opts.artifact, cfg, sock, opts.workers, banner)
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

    opts, cfg = _options(LiveEvalOptions, args, LIVE_EVAL_FLAGS)
    try:
        report = live_eval(opts.artifact, cfg, opts.questions, results=opts.results, cache=opts.cache, budget_cents=opts.budget_cents,
                           concurrency=opts.concurrency, echo=print)
        if opts.report:
            import json

            from envs.cache.atomic import atomic_write_text

            atomic_write_text(opts.report, json.dumps(report, indent=1) + "\n")
    except UserError as e:
        raise e.for_cli(LIVE_EVAL_FLAGS) from None
    return 0
