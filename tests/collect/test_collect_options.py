"""The typed options of ``ccpo-jax data`` (issue 52, item 6): the parser built from the options
dataclasses keeps every flag of refactor-base (a9126a3): option strings, default, required, nargs.

The snapshot below was printed from refactor-base's parser (``build_parser()``, the ``data``
subcommands, every action but --help). A flag built by :func:`ccpo_jax.runtime.options.add_flags`
parses to None when left out and the dataclass fills the field's default, so the default compared is
the one the command gets: argparse's, else the options field's.
"""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from ccpo_jax.cli.data import CacheExportOptions, CheckOptions, ImportOptions, PullOptions, SynthOptions
from ccpo_jax.cli.main import build_parser
from ccpo_jax.collect.options import GROUPS, CollectOptions

#: data subcommand -> its options dataclass (``formats`` has no options).
OPTION_CLASSES: dict[str, type] = {"check": CheckOptions, "synth": SynthOptions, "import": ImportOptions,
                                   "export": CacheExportOptions, "pull": PullOptions, "collect": CollectOptions}

#: refactor-base's flags: (option strings or positional dest, default, required, nargs).
SNAPSHOT = {
    "check": [
        ("path", None, True, None),
    ],
    "synth": [
        (("--profile",), "hotpotqa-llama2", False, None),
        (("--questions",), 1400, False, None),
        (("--seed",), 0, False, None),
        (("--out",), None, True, None),
    ],
    "import": [
        (("--format",), None, True, None),
        ("src", None, True, None),
        (("--out",), None, True, None),
    ],
    "export": [
        ("path", None, True, None),
        (("--out",), None, True, None),
    ],
    "pull": [
        ("url", None, True, None),
        (("--out",), None, True, None),
    ],
    "formats": [
    ],
    "collect": [
        (("--questions",), None, True, None),
        (("--base",), None, False, None),
        (("--ladder",), None, False, None),
        (("--guide",), None, False, None),
        (("--out",), None, True, None),
        (("--rounds",), None, False, None),
        (("--exit-baselines",), "", False, None),
        (("--policy-baselines",), "", False, None),
        (("--policy-coverage",), 0.9, False, None),
        (("--f1",), None, False, None),
        (("--name",), None, False, None),
        (("--task",), "unknown", False, None),
        (("--license",), "unknown", False, None),
        (("--base-key-env",), None, False, None),
        (("--guide-key-env",), None, False, None),
        (("--base-price",), None, False, None),
        (("--guide-price",), None, False, None),
        (("--pricing",), None, False, None),
        (("--round-protocol",), "json", False, None),
        (("--base-max-tokens",), None, False, None),
        (("--guide-max-tokens",), None, False, None),
        (("--decision-max-tokens",), 8, False, None),
        (("--base-temperature",), "0,1", False, None),
        (("--guide-temperature",), 0.0, False, None),
        (("--seed",), "0", False, None),
        (("--no-logprobs",), False, False, 0),
        (("--concurrency",), 8, False, None),
        (("--timeout",), 120.0, False, None),
        (("--attempt-timeout",), 600.0, False, None),
        (("--max-reply-bytes",), 8388608, False, None),
        (("--retries",), 6, False, None),
        (("--backoff",), 1.0, False, None),
        (("--max-retry-after",), 600.0, False, None),
        (("--max-cost-usd",), None, False, None),
        (("--limit",), None, False, None),
        (("--resume",), False, False, 0),
        (("--dry-run",), False, False, 0),
        (("--no-progress",), False, False, 0),
        (("--allow-unlisted-model",), False, False, 0),
    ],
}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def _defaults(cls: type | None) -> dict:
    return {} if cls is None else {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("command", list(SNAPSHOT))
def test_data_parsers_keep_refactor_base_flags(command):
    sub = _subparser(_subparser(build_parser(), "data"), command)
    fields = _defaults(OPTION_CLASSES.get(command))
    got = [(tuple(a.option_strings) or a.dest, a.default if a.default is not None else fields.get(a.dest),
            a.required, a.nargs) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    assert got == SNAPSHOT[command]


def test_every_collect_option_is_in_one_help_section():
    names = [n for _, ns in GROUPS for n in ns]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(CollectOptions))
    assert len(names) == len(set(names))


def test_collect_options_from_a_command_line():
    args = build_parser().parse_args(
        ["data", "collect", "--questions", "q.jsonl", "--out", "c.jsonl", "--base", "http://h/v1,a",
         "--base", "http://h/v1,b", "--guide", "none", "--seed", "none", "--no-logprobs", "--concurrency", "3"])
    o = CollectOptions.from_args(args)
    assert (o.questions, o.out, o.base, o.guide, o.seed, o.no_logprobs, o.concurrency) == (
        "q.jsonl", "c.jsonl", ("http://h/v1,a", "http://h/v1,b"), "none", "none", True, 3)
    # left out: the defaults refactor-base's parser had
    assert (o.rounds, o.base_price, o.exit_baselines, o.round_protocol, o.base_temperature, o.timeout,
            o.max_reply_bytes, o.resume) == (None, None, "", "json", "0,1", 120.0, 8 << 20, False)
