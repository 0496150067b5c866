"""``ccpo-jax data collect``: its options (:class:`~ccpo_jax.collect.options.CollectOptions`) -> the run's
settings and execution, and the glue to :func:`ccpo_jax.collect.collector.collect`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from ccpo_jax.collect.options import CollectOptions
from ccpo_jax.errors import UserError
from envs.cache.values import price_problem


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected IN,OUT in USD per million tokens, e.g. 2.5,10") from None
    problem = price_problem(a) or price_problem(b)  # the cache's own rule (envs.cache.values)
    if problem:
        raise UserError(f"{flag} {text!r}: {problem}")
    return a, b


def _pricing_file(path: str) -> dict[str, tuple[float, float]]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"--pricing {p}: cannot read ({e.strerror or e})") from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        from envs.importers.pricing import yaml_error_text

        if p.suffix.lower() in (".yaml", ".yml"):  # PyYAML's own text spans several lines
            raise UserError(f"--pricing {p}: {yaml_error_text(e)}") from None
        raise UserError(f"--pricing {p}: not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"--pricing {p}: expected a mapping model -> {{price_in, price_out}}")
    out = {}
    for model, v in data.items():
        if isinstance(v, dict) and "price_in" in v and "price_out" in v:
            vals = (v["price_in"], v["price_out"])
        elif isinstance(v, list) and len(v) == 2:
            vals = tuple(v)
        else:
            raise UserError(f"--pricing {p}: {model}: expected {{price_in, price_out}} (USD per million tokens)")
        problem = next(filter(None, map(price_problem, vals)), None)  # the cache's own rule (envs.cache.values)
        if problem:
            raise UserError(f"--pricing {p}: {model}: {problem}")
        out[str(model)] = (float(vals[0]), float(vals[1]))
    return out


def _base_prices(args, roles: list[str]) -> dict[str, str | None]:
    """The --base-price given for each base role: once for one base model, once per rung or not at
    all for a ladder."""
    given = args.base_price or []
    if not given:
        return {r: None for r in roles}
    if len(given) != len(roles):
        want = "once" if len(roles) == 1 else f"once per rung of the ladder ({len(roles)} times) or not at all"
        raise UserError(f"--base-price: given {len(given)} times; give it {want}")
    return dict(zip(roles, given))


def resolve_prices(args, models: dict[str, str]) -> tuple[dict, dict]:
    """role -> (price_in, price_out) and role -> where it came from (roles: ``base`` or a ladder's
    ``base@t``, and ``guide``)."""
    from envs.importers.pricing import PRICES

    table = _pricing_file(args.pricing) if args.pricing else {}
    prices, sources = {}, {}
    base_given = _base_prices(args, [r for r in models if r != "guide"])
    for role in models:
        flag = "--guide-price" if role == "guide" else "--base-price"
        m = models[role]
        given = args.guide_price if role == "guide" else base_given[role]
        if given is not None:
            prices[role] = _pair(given, flag)
            sources[role] = f"{flag} {given}"
        elif m in table:
            prices[role] = table[m]
            sources[role] = f"--pricing {Path(args.pricing).name}"
        elif m in PRICES:
            pr = PRICES[m]
            prices[role] = (pr.price_in, pr.price_out)
            sources[role] = f"envs/importers/pricing.py: {pr.source}"
        else:
            raise UserError(f"no price for the {role} model {m!r}: give {flag} IN,OUT (USD per million tokens; "
                            "0,0 for a local server) or a --pricing file")
    return prices, sources


def _roles(text: str, flag: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in roles if r not in ("base", "guide")]
    if bad:
        raise UserError(f"{flag}: expected base, guide or base,guide, got {', '.join(bad)}")
    return tuple(dict.fromkeys(roles))


def _with_ladder_file(args: CollectOptions) -> CollectOptions:
    """``args`` with the ``--ladder`` file's rungs (and guide) as the flags it stands for
    (:meth:`~ccpo_jax.collect.ladderfile.LadderFile.flags`), so that the collection is the one those
    flags make; a flag given in both places is refused, as is a missing ``--base`` / ``--guide``."""
    from ccpo_jax.collect.ladderfile import read_ladder_file

    if args.ladder is None:
        if not args.base:
            raise UserError("--base: missing; give --base URL,MODEL (once, or once per round for a ladder), "
                            "or --ladder FILE")
    else:
        if args.base or args.base_price:
            flag = "--base" if args.base else "--base-price"
            raise UserError(f"--ladder {args.ladder}: give the base models and their prices either in the file or as "
                            f"--base / --base-price, not both ({flag} given)")
        lf = read_ladder_file(args.ladder)
        if lf.guide_given and (args.guide is not None or args.guide_price is not None):
            flag = "--guide" if args.guide is not None else "--guide-price"
            raise UserError(f"--ladder {args.ladder}: the file gives the guide (\"guide\": "
                            f"{'null' if lf.guide is None else repr(lf.guide.model)}); give it either there or as "
                            f"--guide / --guide-price, not both ({flag} given)")
        args = dataclasses.replace(args, **lf.flags())
        if args.rounds is None:
            args = dataclasses.replace(args, rounds=len(lf.rungs))
        elif len(lf.rungs) not in (1, args.rounds):
            raise UserError(f"--ladder {args.ladder}: {len(lf.rungs)} rungs, but --rounds {args.rounds}; list one "
                            "rung per round (or one rung for one base model), or leave --rounds out")
    if args.guide is None:
        raise UserError("--guide: missing; give --guide URL,MODEL, or --guide none for a guide-less cascade "
                        "(no guide calls)")
    if args.rounds is None:
        args = dataclasses.replace(args, rounds=4)
    return args


def _check_cascade(args: CollectOptions, n_bases: int, exit_roles: tuple[str, ...],
                   policy_roles: tuple[str, ...]) -> None:
    """Flags that cannot apply to a guide-less cascade (``--guide none``) are refused, naming the flag."""
    for flag, v in (("--guide-price", args.guide_price), ("--guide-key-env", args.guide_key_env)):
        if v is not None:
            raise UserError(f"{flag}: --guide none: a guide-less cascade has no guide model to price or call")
    if "guide" in exit_roles:
        raise UserError("--exit-baselines: guide: --guide none: a guide-less cascade has no guide model")
    if policy_roles:
        raise UserError("--policy-baselines: the LLM-as-policy chooses between a base and a guide answer; "
                        "a guide-less cascade (--guide none) has no guide")
    if n_bases == 1 and args.rounds > 1:
        # every round would send one model the same request (round 1's prompt): T copies of one answer
        raise UserError(f"--guide none: a guide-less cascade of one base model would ask it the same question "
                        f"every round; give --base once per round (a ladder of --rounds {args.rounds} models), "
                        "or --rounds 1")


def settings_from_options(args: CollectOptions):
    """The collection's :class:`~ccpo_jax.collect.settings.Settings` and questions; a bad option is a
    UserError naming its flag."""
    from ccpo_jax.collect.settings import Settings
    from ccpo_jax.llm.questions import load_questions
    from ccpo_jax.llm.wire import parse_endpoint

    from ccpo_jax.llm import protocols

    args = _with_ladder_file(args)
    proto = protocols.get(args.round_protocol, "--round-protocol")
    base_max = proto.base_max_tokens if args.base_max_tokens is None else args.base_max_tokens
    guide_max = proto.guide_max_tokens if args.guide_max_tokens is None else args.guide_max_tokens
    if not 1 <= args.rounds <= 64:
        raise UserError(f"--rounds {args.rounds}: must be between 1 and 64")
    for flag, v in (("--base-max-tokens", base_max), ("--guide-max-tokens", guide_max),
                    ("--decision-max-tokens", args.decision_max_tokens)):
        if v < 1:
            raise UserError(f"{flag} {v}: must be >= 1")
    if args.f1 is not None and not 0.0 < args.f1 <= 1.0:
        raise UserError(f"--f1 {args.f1}: must be in (0, 1]")
    if not 0.0 < args.policy_coverage < 1.0:
        raise UserError(f"--policy-coverage {args.policy_coverage}: must be in (0, 1)")
    try:
        temps = [float(x) for x in args.base_temperature.split(",")]
    except ValueError:
        temps = []
    if len(temps) == 1:
        temps = temps * 2
    if len(temps) != 2 or not all(0.0 <= t <= 2.0 for t in temps):
        raise UserError(f"--base-temperature {args.base_temperature!r}: expected FIRST[,LATER] in [0, 2]")
    if not 0.0 <= args.guide_temperature <= 2.0:
        raise UserError(f"--guide-temperature {args.guide_temperature}: must be in [0, 2]")
    if args.seed.lower() == "none":
        seed = None
    else:
        try:
            seed = int(args.seed)
        except ValueError:
            raise UserError(f"--seed {args.seed!r}: expected an integer or 'none'") from None
    bases = [parse_endpoint(b, "--base", args.base_key_env) for b in args.base]
    if len(bases) not in (1, args.rounds):
        raise UserError(f"--base: given {len(bases)} times; give it once (one base model) or once per round "
                        f"(a ladder of --rounds {args.rounds} models)")
    ladder = tuple(bases) if len(bases) > 1 else ()
    exit_roles = _roles(args.exit_baselines, "--exit-baselines")
    policy_roles = _roles(args.policy_baselines, "--policy-baselines")
    cascade = args.guide.strip().lower() == "none"
    if cascade:
        _check_cascade(args, len(bases), exit_roles, policy_roles)
    guide = None if cascade else parse_endpoint(args.guide, "--guide", args.guide_key_env)
    for flag, roles in (("--exit-baselines", exit_roles), ("--policy-baselines", policy_roles)):
        if ladder and "base" in roles:
            raise UserError(f"{flag}: base: a ladder has one base model per round, so there is no one base model "
                            "to run this baseline with; give guide or nothing")
    questions, sha = load_questions(args.questions)
    models = {(f"base@{t + 1}" if ladder else "base"): b.model for t, b in enumerate(bases)}
    prices, sources = resolve_prices(args, {**models, **({} if guide is None else {"guide": guide.model})})
    s = Settings(
        T=args.rounds, base=bases[0], guide=guide, prices=prices, price_sources=sources, ladder=ladder,
        questions_file=Path(args.questions).name, questions_sha256=sha,
        base_max_tokens=base_max, guide_max_tokens=guide_max,
        decision_max_tokens=args.decision_max_tokens, base_temperature=(temps[0], temps[1]),
        guide_temperature=args.guide_temperature, seed=seed, logprobs=not args.no_logprobs,
        f1_threshold=args.f1, exit_roles=exit_roles, policy_roles=policy_roles, policy_coverage=args.policy_coverage,
        name=args.name or Path(args.out).stem, task=args.task, license=args.license, protocol=proto.name,
    )
    return s, questions


def execution_from_options(args: CollectOptions):
    """How the collection runs (:class:`~ccpo_jax.collect.settings.Execution`): concurrency, retries,
    timeouts, the cost cap; a bad option is a UserError naming its flag."""
    from ccpo_jax.collect.settings import Execution
    from ccpo_jax.llm.wire import RetryPolicy

    if args.concurrency < 1:
        raise UserError(f"--concurrency {args.concurrency}: must be >= 1")
    if args.retries < 0:
        raise UserError(f"--retries {args.retries}: must be >= 0")
    if args.max_reply_bytes < 1:
        raise UserError(f"--max-reply-bytes {args.max_reply_bytes}: must be >= 1")
    for flag, v in (("--timeout", args.timeout), ("--attempt-timeout", args.attempt_timeout),
                    ("--backoff", args.backoff), ("--max-retry-after", args.max_retry_after)):
        if not (math.isfinite(v) and v > 0):
            raise UserError(f"{flag} {v}: must be > 0")
    if args.max_cost_usd is not None and not (math.isfinite(args.max_cost_usd) and args.max_cost_usd >= 0):
        raise UserError(f"--max-cost-usd {args.max_cost_usd}: must be >= 0")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be >= 1")
    retry = RetryPolicy(retries=args.retries, backoff_s=args.backoff, max_backoff_s=max(60.0, args.backoff),
                        max_retry_after_s=args.max_retry_after, timeout_s=args.timeout,
                        attempt_timeout_s=args.attempt_timeout, max_reply_bytes=args.max_reply_bytes)
    return Execution(concurrency=args.concurrency, retry=retry, max_cost_usd=args.max_cost_usd,
                     progress=not args.no_progress, limit=args.limit, resume=args.resume, dry_run=args.dry_run,
                     allow_unlisted_model=args.allow_unlisted_model)


def _ignore_further_interrupts() -> None:
    """The run has stopped and its files are closed: a further Ctrl-C while the process exits would
    only land in the interpreter's teardown (a traceback, or a death by SIGINT). Main thread only."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


#: collect()'s and load_questions()'s arguments -> this command's flags (for error messages).
FLAGS = {"questions": "--questions", "out": "--out", "resume": "--resume", "ladder": "--ladder"}


def run(args: argparse.Namespace) -> int:
    """``ccpo-jax data collect``: 0 = complete, 3 = stopped by --max-cost-usd; errors exit 2 (cli)."""
    from ccpo_jax.collect.collector import EXIT_BUDGET, collect
    from ccpo_jax.collect.settings import CollectError
    from ccpo_jax.collect.summary import summary

    args = CollectOptions.from_args(args)
    try:
        s, questions = settings_from_options(args)
        ex = execution_from_options(args)
        o = collect(s, questions, args.out, ex)
    except UserError as e:  # the library names its arguments; say which flag that is
        raise e.for_cli(FLAGS) from None
    except KeyboardInterrupt:
        _ignore_further_interrupts()
        print(f"interrupted: finished questions are in {args.out}; continue with the same flags and --resume",
              file=sys.stderr)
        raise
    if ex.dry_run:
        return 0
    print(summary(o, s))
    if o.stopped == "budget":
        saved = ("nothing was paid, no files kept; rerun with a higher --max-cost-usd" if o.removed else
                 f"{o.done}/{o.total} questions are in {o.out}; continue with --resume and a higher --max-cost-usd")
        print(f"stopped by --max-cost-usd {ex.max_cost_usd:g}: the next call could have crossed it. {saved}",
              file=sys.stderr)
        return EXIT_BUDGET
    if o.stopped:
        saved = ("nothing was paid or saved (no files kept); fix the cause and rerun" if o.removed else
                 f"{o.done}/{o.total} questions are saved in {o.out}; fix the cause and rerun with --resume "
                 "(paid calls are replayed)")
        raise CollectError(f"{o.stopped}. {saved}")
    return 0
