"""``ccpo-jax data collect``'s options as one typed dataclass (:mod:`ccpo_jax.runtime.options`):
one field per flag, the same flags, defaults, help and argument groups as before (a test compares
the parser with refactor-base's); :func:`ccpo_jax.collect.command.settings_from_options` and
:func:`~ccpo_jax.collect.command.execution_from_options` turn them into the run's
:class:`~ccpo_jax.collect.settings.Settings` and :class:`~ccpo_jax.collect.settings.Execution`."""
from __future__ import annotations

import argparse
import dataclasses

from ccpo_jax.runtime.options import add_flags, given, option, resolve


@dataclasses.dataclass(frozen=True)
class CollectOptions:
    """The flags of ``ccpo-jax data collect`` (docs/collect.md, "Options"). Values are the flags' text
    where the flag is text (``--seed 0``, ``--base-temperature 0,1``): settings_from_options checks
    and converts them, naming the flag."""

    # what to collect
    questions: str | None = option(
        "--questions", metavar="FILE", required=True,
        help="questions: .jsonl (id, question, gold: a string or an array of aliases) or .csv (id,question,gold)")
    base: tuple[str, ...] | None = option(
        "--base", metavar="URL,MODEL", repeat=True,
        help="base model: chat-completions API base URL and model, e.g. "
             "http://127.0.0.1:8000/v1,meta-llama/Llama-3.2-3B-Instruct; give it once per round (--rounds times) "
             "for a ladder: round t's base model is the t-th")
    ladder: str | None = option(
        "--ladder", metavar="FILE",
        help='the base ladder in a JSON file instead of --base/--base-price: {"rungs": [{url, model, price_in, '
             'price_out}, ...], "guide": {url, model, price_in, price_out} or null (optional)} (docs/collect.md)')
    guide: str | None = option(
        "--guide", metavar="URL,MODEL",
        help="guide model, e.g. https://api.openai.com/v1,gpt-4o; or 'none' for a guide-less cascade of a ladder "
             "(each round is its base call alone; no guide call)")
    out: str | None = option(
        "--out", metavar="CACHE.jsonl", required=True,
        help="output cache (human JSONL format); its call log is CACHE.jsonl.calls")
    rounds: int | None = option(
        "--rounds", default_doc="4, the paper's; with --ladder, its number of rungs", metavar="T", type=int,
        help="base-guide rounds per question")
    exit_baselines: str = option(
        "--exit-baselines", default="", default_doc="none", metavar="ROLES",
        help="collect LLM-EXIT runs of these models: base, guide or base,guide")
    policy_baselines: str = option(
        "--policy-baselines", default="", default_doc="none", metavar="ROLES",
        help="collect LLM-as-policy actions of these models: base, guide or base,guide")
    policy_coverage: float = option(
        "--policy-coverage", default=0.9, metavar="C", type=float,
        help="coverage the LLM-as-policy prompt aims at")
    f1: float | None = option(
        "--f1", default_doc="exact match only", metavar="THRESHOLD", type=float,
        help="also count an answer correct when its token F1 with a gold answer is >= THRESHOLD")
    name: str | None = option("--name", help="cache name in the manifest", default_doc="the --out file's stem")
    task: str = option("--task", help="task name in the manifest", default="unknown")
    license: str = option("--license", help="license of the questions, for the provenance", default="unknown")

    # keys and prices (USD per million tokens)
    base_key_env: str | None = option(
        "--base-key-env", default_doc="send none", metavar="VAR",
        help="environment variable holding the base endpoint's API key")
    guide_key_env: str | None = option(
        "--guide-key-env", default_doc="send none", metavar="VAR",
        help="environment variable holding the guide endpoint's API key, e.g. OPENAI_API_KEY")
    base_price: tuple[str, ...] | None = option(
        "--base-price", metavar="IN,OUT", repeat=True,
        help="base model price, e.g. 0,0 for a local server; for a ladder once per round, or none (--pricing or "
             "the list prices)")
    guide_price: str | None = option(
        "--guide-price", metavar="IN,OUT",
        help="guide model price, e.g. 2.5,10 for gpt-4o")
    pricing: str | None = option(
        "--pricing", metavar="FILE",
        help="JSON or YAML file {model: {price_in, price_out}}; flags win; else the list prices in "
             "envs/importers/pricing.py")

    # requests
    round_protocol: str = option(
        "--round-protocol", default="json", default_doc="json; docs/real-llms.md", choices=("json", "paper"),
        help="round protocol: json (structured replies that small real models follow: a JSON schema in "
             "response_format, multiple-choice answers constrained to the option letters) or paper (the CCPO "
             "paper's free text: chain of thought, 'Answer: ...', 'Yes' / 'No [answer]')")
    base_max_tokens: int | None = option(
        "--base-max-tokens", default_doc="48 under --round-protocol json, 512 under paper", type=int,
        help="max_tokens of a base answer")
    guide_max_tokens: int | None = option(
        "--guide-max-tokens", default_doc="48 under --round-protocol json, 32 under paper", type=int,
        help="max_tokens of a guide verdict")
    decision_max_tokens: int = option(
        "--decision-max-tokens", default=8, type=int,
        help="max_tokens of an EXIT / policy decision")
    base_temperature: str = option(
        "--base-temperature", default="0,1", default_doc="0,1, the paper's MMLU setting", metavar="FIRST[,LATER]",
        help="base temperature in round 1 and later rounds")
    guide_temperature: float = option(
        "--guide-temperature", default=0.0, default_doc="0", type=float,
        help="guide temperature")
    seed: str = option("--seed", help="request seed sent to the endpoints, or 'none'", default="0")
    no_logprobs: bool = option(
        "--no-logprobs", default=False, switch=True,
        help="do not ask for token log-probs (then no uncertainty / confidence is stored)")

    # execution
    concurrency: int = option("--concurrency", help="questions in flight at once", default=8, type=int)
    timeout: float = option(
        "--timeout", default=120.0, default_doc="120", type=float,
        help="seconds of silence per read of an HTTP attempt")
    attempt_timeout: float = option(
        "--attempt-timeout", default=600.0, default_doc="600", metavar="S", type=float,
        help="seconds for a whole HTTP attempt, headers and body; a trickling server is cut off")
    max_reply_bytes: int = option(
        "--max-reply-bytes", default=8 << 20, default_doc="8388608, 8 MiB", metavar="N", type=int,
        help="largest reply body; a larger one fails the call, not retried")
    retries: int = option(
        "--retries", default=6, type=int,
        help="retries per call on timeouts, 429, 5xx, malformed bodies")
    backoff: float = option(
        "--backoff", default=1.0, default_doc="1", type=float,
        help="first retry wait in seconds, doubled each retry, with jitter")
    max_retry_after: float = option(
        "--max-retry-after", default=600.0, default_doc="600", type=float,
        help="fail a call whose server asks (Retry-After) to wait longer than this many seconds")
    max_cost_usd: float | None = option(
        "--max-cost-usd", type=float,
        help="stop cleanly before a call whose worst-case cost would take the collection's total past this")
    limit: int | None = option("--limit", help="collect only the first N questions", metavar="N", type=int)
    resume: bool = option(
        "--resume", default=False, switch=True,
        help="continue the collection in --out (same settings), replaying paid calls")
    dry_run: bool = option(
        "--dry-run", default=False, switch=True,
        help="print the cost bound and exit without calling any endpoint")
    no_progress: bool = option("--no-progress", help="no progress bar", default=False, switch=True)
    allow_unlisted_model: bool = option(
        "--allow-unlisted-model", default=False, switch=True,
        help="call a model that the endpoint's GET /models does not list (gateways that do not list)")

    def __post_init__(self) -> None:
        resolve(self)  # defaults for None, repeated flags as tuples

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CollectOptions":
        """The options the command line set; the rest at their defaults."""
        return cls(**given(cls, args))


#: The --help sections: title -> the fields it lists, in order.
GROUPS = (
    ("what to collect", ("questions", "base", "ladder", "guide", "out", "rounds", "exit_baselines", "policy_baselines",
        "policy_coverage", "f1", "name", "task", "license",)),
    ("keys and prices (USD per million tokens)",
     ("base_key_env", "guide_key_env", "base_price", "guide_price", "pricing",)),
    ("requests", ("round_protocol", "base_max_tokens", "guide_max_tokens", "decision_max_tokens", "base_temperature",
        "guide_temperature", "seed", "no_logprobs",)),
    ("execution", ("concurrency", "timeout", "attempt_timeout", "max_reply_bytes", "retries", "backoff",
        "max_retry_after", "max_cost_usd", "limit", "resume", "dry_run", "no_progress",
        "allow_unlisted_model",)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of :class:`CollectOptions`, in its --help section."""
    for title, names in GROUPS:
        add_flags(parser.add_argument_group(title), CollectOptions, only=names)
