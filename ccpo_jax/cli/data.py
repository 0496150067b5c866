"""``ccpo-jax data {check,synth,import,export,collect,pull}``: inspect, generate, convert, collect and pull
response caches. Each action's options are a typed dataclass (:mod:`ccpo_jax.runtime.options`; ``collect``'s:
:class:`ccpo_jax.collect.options.CollectOptions`)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ccpo_jax.runtime.options import add_flags, given, option

_OUT = "output: a directory (fast format) or a .jsonl file (human format)"


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """``data check``."""

    path: str | None = option("path", help="cache: a human-format .jsonl file or a fast-format directory")


@dataclasses.dataclass(frozen=True)
class SynthOptions:
    """``data synth``."""

    profile: str = option("--profile", help="generator profile", default="hotpotqa-llama2")
    questions: int = option("--questions", help="number of questions", default=1400, type=int)
    seed: int = option("--seed", help="seed of the generator", default=0, type=int)
    out: str | None = option("--out", help=_OUT, required=True)


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    """``data import``."""

    format: str | None = option(
        "--format", required=True,
        help="jsonl, or the name of a public-data importer (see --help of 'data formats')")
    src: str | None = option("src", help="source file or directory")
    out: str | None = option("--out", help=_OUT, required=True)


@dataclasses.dataclass(frozen=True)
class CacheExportOptions:
    """``data export``."""

    path: str | None = option("path", help="cache: a human-format .jsonl file or a fast-format directory")
    out: str | None = option("--out", help="output .jsonl file", required=True)


@dataclasses.dataclass(frozen=True)
class PullOptions:
    """``data pull``."""

    url: str | None = option("redis://HOST:PORT/DB", help="the gateway's --state")
    out: str | None = option("--out", help="output .jsonl file (replaced atomically)", metavar="FILE.jsonl",
                             required=True)


def _action(dsub: argparse._SubParsersAction, name: str, cls: type | None, func, **kw) -> argparse.ArgumentParser:
    """The ``data NAME`` parser: ``cls``'s flags; ``func`` gets ``cls``'s options (the parsed flags when None)."""
    p = dsub.add_parser(name, **kw)
    if cls is not None:
        add_flags(p, cls)
    p.set_defaults(func=lambda args: func(cls(**given(cls, args)) if cls is not None else args))
    return p


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="inspect, generate and convert response caches")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    dsub.required = True

    _action(dsub, "check", CheckOptions, _check,
            help="validate a cache (JSONL file or fast-format dir) and print its statistics")
    _action(dsub, "synth", SynthOptions, _synth, help="generate a SYNTHETIC cache calibrated to the paper's marginals")
    _action(dsub, "import", ImportOptions, _import,
            help="import a cache from the human JSONL format or a public dataset")
    _action(dsub, "export", CacheExportOptions, _export, help="write a cache (either format) as human-format JSONL")
    _action(dsub, "pull", PullOptions, _pull,
            help="write the journal of a gateway deployment's shared state as a cache",
            description="Reads the journal of record of the gateway replicas started with --state URL "
            "and writes it as a human-format cache (one line per request: its latest, labelled when "
            "feedback labelled it), which data check and reproduce --cache read (docs/gateway.md).")
    _action(dsub, "formats", None, _formats, help="list the import formats and synthetic profiles")

    from ccpo_jax.collect.options import add_arguments

    co = dsub.add_parser("collect", help="collect a cache from live OpenAI-compatible endpoints (docs/collect.md)",
                         description="Run the CCPO base-guide protocol against live chat-completions endpoints and "
                         "write a human-format cache, resumably, with a cost bound printed first (docs/collect.md).")
    add_arguments(co)
    co.set_defaults(func=_collect)


def _check(args: CheckOptions) -> int:
    from envs.cache.formats import load_cache
    from envs.replay.report import describe

    from envs.cache.jsonl import NoQuestions, awaiting_feedback

    try:
        cache = load_cache(args.path)
    except NoQuestions as e:  # its manifest was checked: a valid cache that holds no question yet
        if "await feedback" in str(e):
            print(f"{e}; the lines are valid. `reproduce` and `data import` need at least one labelled question")
            return 0
        print(f"{args.path}: a valid manifest and no questions yet (e.g. a collection stopped, or still "
              "running, before its first question finished); nothing else to check. `reproduce` and "
              "`data import` need at least one question")
        return 0
    print(describe(cache, source=args.path))
    waiting = awaiting_feedback(args.path) if Path(args.path).is_file() else 0
    if waiting:
        print(f"note: {waiting} gateway request line(s) await feedback: checked, not questions of the cache yet")
    return 0


def _synth(args: SynthOptions) -> int:
    from envs.cache.formats import save_cache
    from envs.generators.synthetic import generate

    cache = generate(args.profile, n_questions=args.questions, seed=args.seed)
    out = save_cache(cache, args.out)
    print(f"wrote SYNTHETIC cache {cache.manifest.name!r} ({cache.n_questions} questions, T={cache.T}) to {out}")
    return 0


def _import(args: ImportOptions) -> int:
    from envs.cache.formats import save_cache

    if args.format == "jsonl":
        # The human format needs no importer (and none of the importers' dependencies).
        from envs.cache.jsonl import read_jsonl

        cache = read_jsonl(args.src)
    else:
        from envs.importers import import_cache

        cache = import_cache(args.format, args.src)
    out = save_cache(cache, args.out)
    kind = cache.manifest.provenance.get("kind")
    print(f"imported {kind} cache {cache.manifest.name!r} ({cache.n_questions} questions, T={cache.T}) to {out}")
    return 0


def _export(args: CacheExportOptions) -> int:
    from envs.cache.formats import load_cache
    from envs.cache.jsonl import write_jsonl

    out = write_jsonl(load_cache(args.path), Path(args.out))
    print(f"wrote {out}")
    return 0


def _collect(args: argparse.Namespace) -> int:
    from ccpo_jax.collect.command import run

    return run(args)


def _pull(args: PullOptions) -> int:
    import json

    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.redis_state import pull_journal
    from envs.cache.atomic import atomic_write_text

    if not str(args.out).endswith(".jsonl"):
        raise UserError(f"--out: the journal is a human-format cache; give a file name ending in .jsonl, got {args.out}")
    manifest, lines = pull_journal(args.url)
    text = "".join(json.dumps(x, ensure_ascii=False, allow_nan=False) + "\n" for x in [{"manifest": manifest}, *lines])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    labelled = sum(1 for x in lines if "gold" in x or "correct" in x["rounds"][0]["base"])
    print(f"wrote {out}: {len(lines)} request(s), {labelled} labelled, of deployment "
          f"{manifest['provenance']['journal']['deployment']['epoch']} (router manifest sha256 "
          f"{manifest['provenance']['journal']['router_manifest_sha256']})")
    return 0


def _formats(args: argparse.Namespace) -> int:
    from envs.importers import IMPORTERS
    from envs.generators.synthetic import PROFILES

    print("import formats:")
    print("  jsonl            the human JSONL format (docs/caches.md)")
    for name, imp in IMPORTERS.items():
        print(f"  {name:16s} {imp.description}")
    print("synthetic profiles:")
    for name, prof in PROFILES.items():
        print(f"  {name:16s} {prof.description}")
    return 0
