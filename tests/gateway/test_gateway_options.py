"""Typed options of ``gateway``, ``live-eval``, ``route`` and ``serve`` (issue 52, item 6).

Oracle: a literal snapshot of the flags of R0's parser (tag ``refactor-base``, the hand-written
``add_argument`` calls): the same flags, fields, defaults, required flags and choices.
"""
from __future__ import annotations

import argparse

import pytest

#: (option strings, field, default, required, choices) of each flag of R0's parser (refactor-base, a9126a3)
R0 = {
    'gateway': [
        ((), 'artifact', None, True, None),
        (('--base',), 'base', None, True, None),
        (('--guide',), 'guide', None, False, None),
        (('--base-key-env',), 'base_key_env', None, False, None),
        (('--guide-key-env',), 'guide_key_env', None, False, None),
        (('--retries',), 'retries', 2, False, None),
        (('--timeout',), 'timeout', 60.0, False, None),
        (('--attempt-timeout',), 'attempt_timeout', 120.0, False, None),
        (('--max-retry-after',), 'max_retry_after', 10.0, False, None),
        (('--max-batch',), 'max_batch', 64, False, None),
        (('--price',), 'price', None, False, None),
        (('--on-empty',), 'on_empty', 'guide', False, ('guide', 'base', 'abstain')),
        (('--round-protocol',), 'round_protocol', None, False, ('json', 'paper')),
        (('--online-kappa',), 'online_kappa', None, False, None),
        (('--host',), 'host', '127.0.0.1', False, None),
        (('--port',), 'port', 8080, False, None),
        (('--journal',), 'journal', None, False, None),
        (('--max-body-bytes',), 'max_body_bytes', 1048576, False, None),
        (('--read-timeout',), 'read_timeout', 10.0, False, None),
        (('--keep-alive',), 'keep_alive', 5, False, None),
        (('--max-clients',), 'max_clients', None, False, None),
        (('--max-header-bytes',), 'max_header_bytes', 65536, False, None),
        (('--window',), 'window', 200, False, None),
        (('--no-access-log',), 'no_access_log', False, False, None),
        (('--state',), 'state', None, False, None),
        (('--workers',), 'workers', 1, False, None),
        (('--spool',), 'spool', 'ccpo-gateway-spool', False, None),
        (('--state-timeout',), 'state_timeout', 0.5, False, None),
        (('--new-deployment',), 'new_deployment', False, False, None),
    ],
    'live-eval': [
        ((), 'artifact', None, True, None),
        (('--base',), 'base', None, True, None),
        (('--guide',), 'guide', None, False, None),
        (('--base-key-env',), 'base_key_env', None, False, None),
        (('--guide-key-env',), 'guide_key_env', None, False, None),
        (('--retries',), 'retries', 2, False, None),
        (('--timeout',), 'timeout', 60.0, False, None),
        (('--attempt-timeout',), 'attempt_timeout', 120.0, False, None),
        (('--max-retry-after',), 'max_retry_after', 10.0, False, None),
        (('--max-batch',), 'max_batch', 64, False, None),
        (('--price',), 'price', None, False, None),
        (('--on-empty',), 'on_empty', 'guide', False, ('guide', 'base', 'abstain')),
        (('--round-protocol',), 'round_protocol', None, False, ('json', 'paper')),
        (('--online-kappa',), 'online_kappa', None, False, None),
        (('--questions',), 'questions', None, True, None),
        (('--journal',), 'journal', None, True, None),
        (('--results',), 'results', None, False, None),
        (('--cache',), 'cache', None, False, None),
        (('--budget-cents',), 'budget_cents', None, False, None),
        (('--concurrency',), 'concurrency', 4, False, None),
        (('--report',), 'report', None, False, None),
    ],
    'route': [
        ((), 'artifact', None, True, None),
        (('--input',), 'input', None, True, None),
        (('--out',), 'out', None, False, None),
        (('--every-round',), 'every_round', False, False, None),
    ],
    'serve': [
        ((), 'artifact', None, True, None),
        (('--port',), 'port', None, True, None),
        (('--host',), 'host', '127.0.0.1', False, None),
        (('--max-bytes',), 'max_bytes', 1048576, False, None),
        (('--max-batch',), 'max_batch', 1024, False, None),
        (('--backlog',), 'backlog', 1024, False, None),
        (('--max-connections',), 'max_connections', 64, False, None),
        (('--request-timeout',), 'request_timeout', 10.0, False, None),
        (('--idle-timeout',), 'idle_timeout', 30.0, False, None),
        (('--verbose',), 'verbose', False, False, None),
    ],
}

#: The arguments each command needs to parse.
REQUIRED = {"gateway": ["ART", "--base", "u,m"], "live-eval": ["ART", "--base", "u,m", "--questions", "q.jsonl",
                                                              "--journal", "j.jsonl"],
            "route": ["ART", "--input", "in.jsonl"], "serve": ["ART", "--port", "0"]}


def _options_class(command: str) -> type:
    from ccpo_jax.cli.serve import RouteOptions, ServeOptions
    from ccpo_jax.gateway.options import GatewayOptions, LiveEvalOptions

    return {"gateway": GatewayOptions, "live-eval": LiveEvalOptions, "route": RouteOptions,
            "serve": ServeOptions}[command]


@pytest.mark.parametrize("command", sorted(R0))
def test_flags_and_defaults_are_r0s(command):
    from ccpo_jax.cli.main import build_parser
    from ccpo_jax.runtime.options import given

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [(tuple(a.option_strings), a.dest, a.required, tuple(a.choices) if a.choices else None)
             for a in sub._actions if a.dest != "help"]
    assert flags == [(o, d, r, c) for o, d, _, r, c in R0[command]]
    # each default, now written once (an option's field default, GatewayConfig's for the gateway's)
    cls = _options_class(command)
    opts = cls(**given(cls, sub.parse_args(REQUIRED[command])))
    for _, dest, default, required, _ in R0[command]:
        if not required:
            got = getattr(opts, dest)
            assert got == default or (default is None and got == ()), (dest, got, default)


def test_gateway_defaults_are_gateway_configs():
    from ccpo_jax.gateway.options import GatewayOptions, LiveEvalOptions
    from ccpo_jax.gateway.service import GatewayConfig

    args = dict(artifact="a", base=("http://127.0.0.1:9/v1,b",), guide=("http://127.0.0.1:9/v1,g",))
    plain = GatewayConfig(base=(), guide=None)
    for cfg in (GatewayOptions(**args).config(), LiveEvalOptions(**args, questions="q", journal="j").config()):
        for name in ("retry", "window", "max_body_bytes", "server", "max_batch", "on_empty", "spool",
                     "state_timeout_s", "prices", "access_log"):
            assert getattr(cfg, name) == getattr(plain, name), name


@pytest.mark.parametrize("argv,message", [
    (["serve", "ART", "--port", "70000"], "error: --port: expected 0..65535, got 70000"),
    (["serve", "ART", "--port", "0", "--max-batch", "0"], "error: --max-batch: expected an integer >= 1, got 0"),
    (["serve", "ART", "--port", "0", "--request-timeout", "nan"], "error: --request-timeout: expected a number of "
     "seconds > 0, got nan"),
    (["gateway", "ART", "--base", "u,m", "--window", "0"], "error: --window: expected an integer >= 1, got 0"),
    (["gateway", "ART", "--base", "u,m", "--max-body-bytes", "10"], "error: --max-body-bytes: expected at least "
     "1024, got 10"),
    (["gateway", "ART", "--base", "u,m", "--workers", "99"], "error: --workers: expected an integer in [1, 64], got 99"),
    (["live-eval", "ART", "--base", "u,m", "--questions", "q", "--journal", "j", "--concurrency", "0"],
     "error: --concurrency: expected an integer >= 1, got 0"),
])
def test_bad_options_are_one_line_naming_the_flag(argv, message, tmp_path):
    from tests.helpers import run_cli

    res = run_cli(argv, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == message and list(tmp_path.iterdir()) == []
