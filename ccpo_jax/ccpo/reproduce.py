"""``ccpo-jax reproduce``: one paper table, end to end.

:func:`reproduce` reads top to bottom: the run configuration (a new
:class:`ccpo_jax.ccpo.run_config.ReproduceConfig`, or the saved one of a killed run) -> load
the cache -> replay env params -> splits -> the non-learned rows (Random, LLM policies, LLM-EXIT, UALA; ``ccpo_jax.ccpo.baselines``)
-> training and evaluation of the learned rows (CPO, CPO batch, CPO online, CCPO;
``ccpo_jax.ccpo.rows.learned_rows``) -> outputs (``results.json``, ``table.md``, box plots,
``run.json``; ``ccpo_jax.ccpo.report``). Row names and metrics: docs/reproduce.md "Outputs".

Output is built in a hidden work directory beside ``out_dir``
(``<parent>/.<name>.partial``) and renamed to ``out_dir`` only when complete, so
``out_dir`` never holds a half-written run. A run killed during training leaves the
work directory (with the trainer's checkpoints) behind; ``reproduce(resume=OUT)``
continues it with the configuration saved in its ``run.json``.

Errors are :class:`ccpo_jax.errors.UserError` whose ``field`` is the argument of
:func:`reproduce` at fault; the CLI (``ccpo_jax.cli.reproduce``) names its flags.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo import rows as learned
from ccpo_jax.ccpo.baselines import left_out_rows, non_learned_rows
from ccpo_jax.ccpo.calibration import (add_group_guarantees, add_guarantees, check_feasible,  # noqa: F401 - the
                                       describe_pooling, format_guarantees, group_spec, run_guarantee)  # names moved
from ccpo_jax.ccpo.policy_store import POLICIES_DIR
from ccpo_jax.ccpo.presets import deviations
from ccpo_jax.ccpo.rows import LearnedRows, LearnedRowsFn
from ccpo_jax.ccpo.evaluation import question_cost_max
from ccpo_jax.ccpo.observable import BEST_OBS_ROW, best_observable_row, describe, seconds
from ccpo_jax.ccpo.run_config import ReproduceConfig, check_cost_cap
from ccpo_jax.ccpo.settings import METRICS, Setting, get_setting
from ccpo_jax.ccpo.splits import check_split_sizes, splits_for_protocol
from ccpo_jax.core.conformal import calibration_size_warning
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options, sharding, workdir
from envs.cache.atomic import atomic_write_text
from envs.replay.bound import BOUND_ROW, bound_of_params
from envs.cache.schema import ResponseCache
from envs.cache.formats import load_cache
from envs.replay.env import make_env_params
from envs.generators.synthetic import generate
from envs.cache.values import printable

RUN_FILE = "run.json"
TB_DIR = "tensorboard"
CKPT_DIR = "checkpoints"


@dataclasses.dataclass
class ReproduceResult:
    """What :func:`reproduce` returns: the final directory, the results.json dict and the table text."""

    out_dir: Path
    results: dict[str, Any]
    table: str
    notes: list[str]


# -- the output directory ----------------------------------------------------------------

def _default_out(setting: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{setting}-{stamp}"


def resolve_mesh(devices: int | str | None):
    """``devices``: None/1 -> no mesh; N or "all" -> a 1-D mesh over the first N devices."""
    if devices is None:
        return None
    available = jax.devices()
    bad = UserError(f"devices: an integer >= 1 or 'all', got {devices!r}", field="devices")
    if isinstance(devices, str) and devices.strip().lower() == "all":
        n = len(available)
    else:
        try:
            n = int(devices)
        except (TypeError, ValueError):
            raise bad from None
        if isinstance(devices, float) and devices != n:
            raise bad
    if n < 1:
        raise bad
    if n > len(available):
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (f"; on a CPU the ccpo-jax command forces N host devices itself; from Python, set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
        raise UserError(f"devices {n}: only {len(available)} {jax.default_backend()} device(s) available{hint}",
                        field="devices")
    return None if n == 1 else sharding.make_mesh(n)


def _resume_config(resume: Path, given: Mapping[str, Any], cls: type = ReproduceConfig,
                   results_file: str = report.RESULTS_FILE, command: str = "reproduce") -> tuple[Path, Any]:
    """Find the work dir of a killed run at ``resume`` (its out_dir) and read its run.json.

    ``given`` holds the options of this call: the saved ones must be None or equal to the
    saved values (:func:`ccpo_jax.runtime.options.resume_mismatch`); the execution options
    (devices, member block, progress) are this call's. A run made by another command
    (:func:`ccpo_jax.runtime.workdir.made_by`) is refused naming it, and so is a saved value that the checks refuse.
    """
    out, work = workdir.interrupted_run(resume, RUN_FILE, results_file)
    unsaved = {k: given.get(k) for k in ("devices", "member_block", "progress", "discard_failed")}
    run_file = work / RUN_FILE
    try:
        saved = json.loads(run_file.read_text())
    except (ValueError, OSError) as e:  # invalid UTF-8 is a ValueError
        raise UserError(f"resume: {run_file} is damaged ({e})", field="resume") from None
    workdir.refuse_other_command(saved, command, out)
    try:
        cfg = options.from_saved(cls, saved, out_dir=out, resume=resume, **unsaved)
    except UserError as e:
        if e.field == "cache":  # the cache moved or was deleted: restoring it resumes the run
            raise
        # e.g. --group-min 2147483648 saved before values past int32 were refused at the start
        why = str(e)[len(f"{e.field}: "):] if e.field and str(e).startswith(f"{e.field}: ") else str(e)
        what = f"`{e.field}`" if e.field else "configuration"
        raise UserError(f"resume: {run_file}: the saved {what} is refused now ({why}); this run cannot be "
                        f"resumed: delete {work} and start it afresh", field="resume") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"resume: {run_file} is damaged ({type(e).__name__}: {e})", field="resume") from None
    mismatch = options.resume_mismatch(cfg, given)
    if mismatch is not None:
        k, old, new = mismatch
        raise UserError(f"resume: the interrupted run used {k}={old!r}, not {new!r}; leave `{k}` out "
                        "(resume takes the saved configuration)", field="resume")
    if given.get("cache") is not None:  # the same cache again (equal by the check above), e.g. an in-memory one
        cfg = dataclasses.replace(cfg, cache=given["cache"])
    if isinstance(cfg.cache, str) and cfg.cache.startswith("<"):
        raise UserError("resume: the interrupted run used an in-memory cache; pass the same cache object",
                        field="resume")
    return out, cfg


def open_run(given: Mapping[str, Any], cls: type = ReproduceConfig, out_prefix: str = "",
             results_file: str = report.RESULTS_FILE, command: str = "reproduce") -> tuple[Path, Any]:
    """(out_dir, configuration ``cls``) of a new run, or of the killed run at ``given["resume"]``
    (``ccpo-jax reproduce`` and ``ccpo-jax sweep``, named by ``command``; a new run's default
    out_dir is ``runs/<out_prefix><setting>-<timestamp>``)."""
    if given.get("resume") is None:
        cfg = cls(**given)
        out = cfg.out_dir if cfg.out_dir is not None else _default_out(out_prefix + cfg.setting)
        workdir.check_new_out(out)
        return out, cfg
    resume, out_dir = Path(given["resume"]), given.get("out_dir")
    if out_dir is not None and Path(out_dir) != resume:
        raise UserError("resume: do not combine with a different out_dir (the run resumes into its own)",
                        field="resume")
    return _resume_config(resume, given, cls, results_file, command)


# -- the cache -------------------------------------------------------------------------

def load_run_cache(setting: Setting, cache: Any) -> ResponseCache:
    """``cache``: None (the setting's SYNTHETIC profile, its n_questions, seed 0), a path
    (either cache format, ``envs.cache.formats.load_cache``) or a ResponseCache."""
    if cache is None:
        c = generate(setting.profile, n_questions=setting.n_questions, seed=0)
        if c.manifest.provenance.get("kind") != "synthetic":  # never let generated data pass as real
            raise RuntimeError("envs.generators.synthetic.generate returned a cache not labelled synthetic")
        return c.with_checksum() if not c.manifest.checksum else c
    if isinstance(cache, ResponseCache):
        return cache.with_checksum() if not cache.manifest.checksum else cache
    return load_cache(cache)


def check_resumed_cache(work: Path, cache: ResponseCache) -> None:
    """A resumed run must see the cache it was started on (the checksum saved in its run.json)."""
    old_sum = json.loads((work / RUN_FILE).read_text()).get("cache_checksum")
    if old_sum and old_sum != cache.manifest.checksum:
        raise UserError(f"resume: the cache changed since the run was interrupted (checksum {old_sum} before, "
                        f"{cache.manifest.checksum} now); restore it or start a new run", field="resume")


def is_setting_profile(setting: Setting, cache: ResponseCache) -> bool:
    """True when ``cache`` is a synthetic cache of the setting's profile (paper numbers are shown then)."""
    prov = cache.manifest.provenance
    if prov.get("kind") != "synthetic":
        return False
    prof = setting.profile
    vals = [str(v) for v in prov.values() if isinstance(v, str)]  # e.g. generator "envs.synthetic/<profile>"
    name = cache.manifest.name
    return any(v == prof or v.endswith("/" + prof) for v in vals) or name == prof or f"-{prof}-" in f"-{name}-"


def describe_cache(cache: ResponseCache) -> str:
    prov = cache.manifest.provenance
    kind = "SYNTHETIC" if prov.get("kind") == "synthetic" else str(prov.get("kind", "?"))
    extra = ", ".join(f"{printable(k)}={printable(v)}" for k, v in prov.items() if k != "kind")
    return f"{kind} cache {cache.manifest.name!r} ({cache.n_questions} questions, T={cache.T}{', ' + extra if extra else ''})"


def as_rows(rows: Mapping[str, Mapping[str, Any]], n_splits: int, source: str) -> dict[str, dict[str, np.ndarray]]:
    """Every row's metrics as float arrays [N seeds, S splits] (rows without seeds: N = 1)."""
    out = {}
    for name, ms in rows.items():
        d = {}
        for m in METRICS:
            if m not in ms:
                raise RuntimeError(f"{source}: row {name!r} lacks metric {m!r}")
            v = np.asarray(ms[m], dtype=np.float64)
            v = v.reshape(1, -1) if v.ndim <= 1 else v.reshape(v.shape[0], -1)  # [seeds, splits]
            if v.shape[1] != n_splits:
                raise RuntimeError(f"{source}: row {name!r} metric {m!r} has {v.shape[1]} values for {n_splits} splits")
            d[m] = v
        out[name] = d
    return out


# -- the pipeline -------------------------------------------------------------------------

def bound_row(params, test_idx, alpha: float) -> dict[str, np.ndarray]:
    """The clairvoyant bound on every test split (``envs.replay.bound``) as a row: cost and coverage;
    length and set size are not defined for it (NaN, written as null)."""
    b = bound_of_params(params, np.asarray(test_idx), alpha)
    nan = np.full_like(b["cost_cents"], np.nan)
    return {"cost_cents": b["cost_cents"], "coverage": b["coverage"], "avg_len": nan, "set_size": nan}


def _announce(say: Callable[[str], Any], st: Setting, cfg: ReproduceConfig, cache: ResponseCache, trains: bool,
              small: str | None, mesh, block: int | None) -> None:
    say(f"reproduce {st.name} ({st.run_title(cache.manifest.name, is_setting_profile(st, cache), cfg.alpha)})")
    say(f"  {describe_cache(cache)}")
    say(f"  protocol {cfg.protocol}, {cfg.n_splits} splits of {'/'.join(map(str, cfg.split_sizes))} "
        f"(train/cal/test), alpha {cfg.alpha:g}, seed {cfg.seed}")
    if trains:
        tc = cfg.train_config()
        dev = deviations(tc)
        say(f"  trainer: preset {cfg.preset}, {cfg.seeds} seed(s), {tc.iterations} iterations, estimator "
            f"{tc.estimator}" + (f"; differs from the paper's setting in {', '.join(sorted(dev))}" if dev else
                                 "; the paper's published setting"))
    if small:
        say(f"  warning: {small}")
    if trains and (mesh is not None or block is not None):
        n_dev = 1 if mesh is None else mesh.devices.size
        say(f"  training sharded over {n_dev} {jax.default_backend()} device(s)"
            + (f", {block} member(s) per block" if block is not None else "")
            + (" (retrain's default: one split's rows x seeds)" if block and cfg.member_block is None else ""))


def _write_outputs(work: Path, st: Setting, cfg: ReproduceConfig, cache: ResponseCache, rows: dict, timing: dict,
                   trains: bool, splits_test: Any = None, pooling: dict | None = None,
                   group_rows: dict | None = None, ltt: dict | None = None,
                   best_obs: dict | None = None) -> tuple[dict, str]:
    """results.json, table.md and the box plots of a finished run, in its work directory (with
    ``--calibration mondrian`` also the per-group coverage and its picture; ``best_obs``: how the
    best observable reference was fitted, ``ccpo_jax.ccpo.observable``)."""
    results = report.build_results(
        setting=st.name, alpha=cfg.alpha, protocol=cfg.protocol, n_splits=cfg.n_splits,
        cache=report.cache_info(cache), rows=rows, timing=timing, seeds=cfg.seeds if trains else 1,
        preset=cfg.preset, train_config=dataclasses.asdict(cfg.train_config()) if trains else None,
    )
    if best_obs is not None and BEST_OBS_ROW in results["policies"]:
        results["policies"][BEST_OBS_ROW].update(describe(best_obs))
        results["timing"]["best_observable_s"] = seconds(best_obs)  # part of eval_s
    compare = is_setting_profile(st, cache)
    left = left_out_rows(cache, splits_test) if splits_test is not None else {}
    results["left_out"] = left
    if pooling is not None:
        results["calibration"] = pooling
        if group_rows:
            report.add_groups(results, group_rows, cfg.alpha)
    if trains:
        add_guarantees(results, rows, cfg.alpha, run_guarantee(cfg), ltt, cfg.split_sizes[2])
        add_group_guarantees(results, group_rows, cfg.alpha, run_guarantee(cfg))
    report.write_results(work, results)
    report.write_table(work, results, st, cfg.split_sizes, compare_paper=compare)
    table = report.format_table(results, st, cfg.split_sizes, compare_paper=compare)
    if results.get("calibration", {}).get("kind") == "mondrian":
        extra = report.format_groups(results)
        with open(work / report.TABLE_FILE, "a", encoding="utf-8") as f:
            f.write(extra)
        table = table.rstrip("\n") + "\n" + extra
        if group_rows:
            report.write_group_plot(work, results)
    if results.get("guarantee"):
        extra = format_guarantees(results)
        with open(work / report.TABLE_FILE, "a", encoding="utf-8") as f:
            f.write(extra)
        table = table.rstrip("\n") + "\n" + extra
    if left:
        extra = "\nRows left out:\n" + "".join(f"- {r}: {why}\n" for r, why in left.items())
        with open(work / report.TABLE_FILE, "a", encoding="utf-8") as f:
            f.write(extra)
        table = table.rstrip("\n") + "\n" + extra
    report.write_boxplots(work, results, st, own_cache=compare)
    return results, table


def _learned(trainer: LearnedRowsFn | None, cfg: ReproduceConfig, cache_obj: ResponseCache, params: Any, splits: Any,
             key: Any, work: Path, mesh: Any, block: int | None, groups: Any, rows: dict, timing: dict,
             notes: list[str], say: Callable[[str], Any]):
    """Train and evaluate the learned rows (step 6 of :func:`reproduce`): add them to ``rows`` and
    their times to ``timing``; refuse a two-risk request no row met; (per-group rows, two-risk outcome).
    No trainer (``train=False``): a note, and (None, None)."""
    if trainer is None:
        notes.append("learned rows (CPO, CPO batch, CPO online, CCPO) not run (train=False)")
        say(f"  note: {notes[-1]}")
        return None, None
    got: LearnedRows = trainer(
        cache=cache_obj, params=params, splits=splits, key=key, config=cfg.train_config(),
        lambdas=cfg.lambdas, protocol=cfg.protocol, seeds=cfg.seeds, ckpt_dir=work / CKPT_DIR,
        tb_dir=work / TB_DIR, progress=cfg.progress, mesh=mesh, member_block=block,
        **({} if groups is None else {"groups": groups}),
        **({} if cfg.guarantee == "marginal" else {"guarantee": run_guarantee(cfg)}),
    )
    check_feasible(getattr(got, "ltt", None), cfg.alpha, run_guarantee(cfg))
    rows.update(as_rows(got.rows, cfg.n_splits, "the trainer"))
    for k in ("compile_s", "train_s", "eval_s"):
        timing[k] += float(got.timing.get(k, 0.0))
    return got.groups, getattr(got, "ltt", None)


def reproduce(
    setting: str | None = None,
    /,
    *,
    echo: Callable[[str], Any] | None = print,
    trainer: LearnedRowsFn | None = None,
    train: bool = True,
    **given: Any,
) -> ReproduceResult:
    """Reproduce one paper table and write its outputs to ``out_dir``.

    ``given``: the options, the fields of :class:`ccpo_jax.ccpo.run_config.ReproduceConfig`
    (``cache``, ``n_splits``, ``split_sizes``, ``out_dir``, ``resume``, ...; None or left out =
    the default; ``setting`` may also come first). With ``resume`` (the out_dir of a killed
    run) the run continues with its saved configuration: the saved options must be left out
    or equal to the saved ones. Python-only arguments:
      echo         where the progress lines go (None: nowhere);
      trainer      the learned rows' trainer (default ``ccpo_jax.ccpo.rows.learned_rows``);
      train        False: the non-learned rows only.
    Raises UserError / CacheError for bad input before anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    if setting is not None:
        given = dict(given, setting=setting)
    unknown = sorted(set(given) - set(options.inputs(ReproduceConfig)))
    if unknown:
        raise TypeError(f"reproduce() got unknown option(s) {', '.join(unknown)}; "
                        f"the options: {', '.join(options.inputs(ReproduceConfig))}")
    # 1. the run configuration: a new one, or the saved one of a killed run
    out, cfg = open_run(given)
    resuming = cfg.resume is not None
    st = get_setting(cfg.setting)
    work = workdir.work_dir(out)
    if jax.process_count() > 1:
        raise UserError(
            f"reproduce runs on one host (this is process {jax.process_index()} of {jax.process_count()}); "
            "for multi-host training run `python -m experiments.multihost` on every host (docs/performance.md)"
        )
    mesh = resolve_mesh(cfg.devices)
    trainer = (trainer or learned.learned_rows) if train else None
    block = cfg.member_block  # None: the protocol's default (rows.default_member_block)
    if block is None and trainer is not None:
        block = learned.default_member_block(cfg.protocol, len(learned.row_variants(cfg.lambdas, cfg.train_config())),
                                             cfg.seeds)

    # 2. the cache
    cache_obj = load_run_cache(st, cfg.cache)
    check_split_sizes(cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits, where=f"the cache {cache_obj.manifest.name!r}")
    if resuming:
        check_resumed_cache(work, cache_obj)
    params = make_env_params(cache_obj)
    check_cost_cap(cfg, question_cost_max(params), f"the cache {cache_obj.manifest.name!r}")
    notes: list[str] = []
    small = calibration_size_warning(cfg.split_sizes[1], cfg.alpha)
    if small:
        notes.append(small)
    created = False
    try:
        if not resuming:
            work.mkdir(parents=True)
            created = True
            atomic_write_text(work / RUN_FILE, json.dumps(dict(options.saved(cfg), command="reproduce",
                                                               cache_checksum=cache_obj.manifest.checksum),
                                                          indent=2) + "\n")
        _announce(say, st, cfg, cache_obj, trainer is not None, small, mesh, block)
        # 3. env params and 4. splits
        k_split, k_base, k_train = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)
        splits = splits_for_protocol(cfg.protocol, k_split, cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits)
        groups = group_spec(cfg, cache_obj)
        pooling = None if groups is None else describe_pooling(groups, splits.cal, say, cfg.group_min)
        # 5. the non-learned rows: all splits in one vmapped call
        t0 = time.perf_counter()
        base = non_learned_rows(cache_obj, params, k_base, splits.cal, splits.test, cfg.alpha)
        rows = as_rows(jax.device_get(base), cfg.n_splits, "baselines.non_learned_rows")
        rows[BOUND_ROW] = bound_row(params, splits.test, cfg.alpha)  # not a policy: what none can beat
        rows[BEST_OBS_ROW], best_obs = best_observable_row(params, splits.test, cfg.alpha)  # nor this: no answers
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": time.perf_counter() - t0}
        # 6. training and evaluation of the learned rows
        group_rows, ltt = _learned(trainer, cfg, cache_obj, params, splits, k_train, work, mesh, block, groups,
                                   rows, timing, notes, say)
        # 7. outputs
        timing["total_s"] = time.perf_counter() - t_start
        results, table = _write_outputs(work, st, cfg, cache_obj, rows, timing, trainer is not None, splits.test,
                                        pooling, group_rows, ltt, best_obs)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
    except KeyboardInterrupt:
        if (work / CKPT_DIR).exists() and not cfg.discard_failed:
            say(f"interrupted; continue with: ccpo-jax reproduce --resume {out}")
        elif work.exists() and (created or cfg.discard_failed):
            shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException as e:
        # A failure after training started (a full disk while writing outputs, a bug in the
        # report) must not cost the training: the checkpoints stay, and the error says how to go on.
        workdir.after_failure(e, work, created=created, discard=cfg.discard_failed, ckpt_dir=CKPT_DIR,
                              resume_hint=f"after fixing the cause, continue with `ccpo-jax reproduce --resume {out}`")
        raise
    say("")
    say(table.rstrip("\n"))
    say("")
    if small:  # again below the table, where a reader of the coverage column looks
        say(f"warning: {small}")
    dirs = [f"{d}/" for d in (TB_DIR, POLICIES_DIR, CKPT_DIR) if (out / d).is_dir()]
    pngs = [report.COST_PNG, report.COVERAGE_PNG] + ([report.GROUP_PNG] if (out / report.GROUP_PNG).is_file() else [])
    say(f"wrote {out}/: {report.RESULTS_FILE}, {report.TABLE_FILE}, {', '.join(pngs)}, "
        + ", ".join([RUN_FILE] + dirs))
    return ReproduceResult(out_dir=out, results=results, table=table, notes=notes)
