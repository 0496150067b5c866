"""``ccpo-jax reproduce``: one paper table, end to end.

:func:`reproduce` reads top to bottom: resolve the run configuration (:func:`plan_run`,
or the saved one of a killed run) -> load the cache -> replay env params -> splits ->
the non-learned rows (Random, LLM policies, LLM-EXIT, UALA; ``ccpo_jax.ccpo.baselines``)
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
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo import rows as learned
from ccpo_jax.ccpo.baselines import non_learned_rows
from ccpo_jax.ccpo.config import TrainConfig
from ccpo_jax.ccpo.policy_store import POLICIES_DIR
from ccpo_jax.ccpo.presets import apply_overrides, deviations, get_preset
from ccpo_jax.ccpo.rows import LearnedRows, LearnedRowsFn
from ccpo_jax.ccpo.settings import DEFAULT_SETTING, METRICS, Setting, get_setting
from ccpo_jax.ccpo.splits import PROTOCOLS, check_split_sizes, parse_split_sizes, splits_for_protocol
from ccpo_jax.core.conformal import calibration_size_warning
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import sharding
from envs.atomic import atomic_write_text
from envs.cache import ResponseCache
from envs.formats import load_cache
from envs.orchestration import make_env_params
from envs.synthetic import generate

DEFAULT_SPLITS = 100
DEFAULT_SEEDS = 5
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


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The resolved configuration of a run (saved as ``run.json``; ``--resume`` reads it back)."""

    setting: str
    cache: str | None  # path of --cache (absolute), None = built-in synthetic cache of the setting
    n_splits: int
    protocol: str
    alpha: float
    iterations: int | None  # None = the trainer's default (paper: 1500)
    split_sizes: tuple[int, int, int]
    seed: int
    lambdas: tuple[float, ...]  # nonzero CCPO lambdas; CCPO (lambda=0) always runs
    seeds: int = 1  # training seeds of every learned row (runs saved before seeds existed: 1)
    preset: str = "default"  # trainer preset (ccpo_jax.ccpo.presets)
    overrides: tuple[str, ...] = ()  # trainer fields set with "field=value" on top of the preset

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["split_sizes"] = list(self.split_sizes)
        d["lambdas"] = list(self.lambdas)
        d["overrides"] = list(self.overrides)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunConfig":
        d = dict(d)
        d["split_sizes"] = tuple(d["split_sizes"])
        d["lambdas"] = tuple(d["lambdas"])
        d["overrides"] = tuple(d.get("overrides", ()))
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.name not in optional})

    def train_config(self) -> TrainConfig:
        """The trainer configuration of this run: the preset, the overrides, alpha and iterations."""
        cfg = apply_overrides(get_preset(self.preset), self.overrides).replace(alpha=float(self.alpha))
        return cfg if self.iterations is None else cfg.replace(iterations=int(self.iterations))


# -- validation at the boundary ----------------------------------------------------

def _check_int(field: str, what: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise UserError(f"{field}: {what} must be an integer >= {lo}, got {v!r}", field=field)
    return int(v)


def _check_alpha(alpha: Any) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise UserError(f"alpha: must be a number in (0, 1), got {alpha!r}", field="alpha") from None
    if not (0.0 < a < 1.0):
        raise UserError(f"alpha: must be in (0, 1) (target coverage 1 - alpha), got {alpha!r}", field="alpha")
    return a


def _work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _check_out(out: Path) -> None:
    """``out_dir`` must not exist yet (nor an interrupted run of it), and its folder must be creatable."""
    if out.exists() or out.is_symlink():
        raise UserError(f"out_dir: {out} already exists; choose a new directory (results are never overwritten)",
                        field="out_dir")
    anc = out.parent
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise UserError(f"out_dir: cannot create {out}: {anc} is not a directory", field="out_dir")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"out_dir: cannot create {out}: {anc} is not writable", field="out_dir")
    work = _work_dir(out)
    if work.exists():
        raise UserError(f"out_dir: an interrupted run for {out} exists ({work}); resume that run, "
                        f"or delete {work}", field="out_dir")


def _default_out(setting: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{setting}-{stamp}"


def _resolve_split_sizes(v: Any, setting: Setting) -> tuple[int, int, int]:
    if v is None:
        return setting.split_sizes
    if isinstance(v, str):
        return parse_split_sizes(v)
    try:
        sizes = tuple(v)
    except TypeError:
        raise UserError(f"split_sizes: expected n_train,n_cal,n_test, got {v!r}", field="split_sizes") from None
    return parse_split_sizes(",".join(str(x) for x in sizes))


def _resolve_trainer(seeds: int | None, preset: str | None, overrides: Any) -> tuple[int, str, tuple[str, ...]]:
    """Validate the seeds, the preset and the ``field=value`` overrides of the trainer configuration."""
    seeds = _check_int("seeds", "the number of seeds", DEFAULT_SEEDS if seeds is None else seeds, 1)
    preset = "default" if preset is None else str(preset)
    overrides = tuple(str(o) for o in ((overrides,) if isinstance(overrides, str) else (overrides or ())))
    try:
        base = get_preset(preset)
    except UserError as e:
        raise UserError(f"preset: {e}", field="preset") from None
    for item in overrides:
        if item.split("=", 1)[0].strip().replace("-", "_") == "alpha":
            raise UserError(f"overrides: {item}: alpha is set separately (its own argument, or the setting), not as a trainer override",
                            field="overrides")
    try:
        apply_overrides(base, overrides)
    except UserError as e:
        raise UserError(f"overrides: {e}", field="overrides") from None
    return seeds, preset, overrides


def _cache_spec(cache: Any) -> str | None:
    """How run.json records the cache: None (built-in), an absolute path, or ``<ResponseCache NAME>``."""
    if cache is None:
        return None
    if not isinstance(cache, (str, os.PathLike)):
        return f"<{type(cache).__name__} {getattr(getattr(cache, 'manifest', None), 'name', '?')}>"
    p = Path(cache)
    if not p.exists():
        raise UserError(f"cache: {cache}: no such file or directory", field="cache")
    return str(p.absolute())


def plan_run(setting: str | None = None, *, cache: Any = None, n_splits: int | None = None,
             protocol: str | None = None, alpha: float | None = None, iterations: int | None = None,
             split_sizes: Any = None, seed: int | None = None, seeds: int | None = None, preset: str | None = None,
             overrides: Any = None) -> RunConfig:
    """The validated :class:`RunConfig` of a new run (None = the default of each argument)."""
    st = get_setting(setting if setting is not None else DEFAULT_SETTING)
    protocol = "recalibrate" if protocol is None else protocol
    if protocol not in PROTOCOLS:
        raise UserError(f"protocol: unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}", field="protocol")
    seeds, preset, overrides = _resolve_trainer(seeds, preset, overrides)
    return RunConfig(
        setting=st.name, cache=_cache_spec(cache),
        n_splits=_check_int("n_splits", "the number of splits", DEFAULT_SPLITS if n_splits is None else n_splits, 1),
        protocol=protocol, alpha=_check_alpha(st.alpha if alpha is None else alpha),
        iterations=None if iterations is None else _check_int("iterations", "the number of iterations", iterations, 1),
        split_sizes=_resolve_split_sizes(split_sizes, st),
        seed=_check_int("seed", "the seed", 0 if seed is None else seed, 0),
        lambdas=tuple(st.lambdas), seeds=seeds, preset=preset, overrides=overrides,
    )


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


def _resume_config(resume: Path, given: Mapping[str, Any]) -> tuple[Path, RunConfig]:
    """Find the work dir of a killed run at ``resume`` (its out_dir) and read its run.json.

    ``given`` holds the arguments of this call; each must be None or equal to the saved value.
    """
    resume = Path(resume)
    if resume.name.startswith(".") and resume.name.endswith(".partial"):
        out = resume.parent / resume.name[1:-len(".partial")]
    else:
        out = resume
    work = _work_dir(out)
    if (out / report.RESULTS_FILE).is_file():
        raise UserError(f"resume: {out} holds a finished run (results.json exists); nothing to resume", field="resume")
    if not (work / RUN_FILE).is_file():
        raise UserError(f"resume: no interrupted run for {out} (expected {work / RUN_FILE})", field="resume")
    try:
        cfg = RunConfig.from_dict(json.loads((work / RUN_FILE).read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"resume: {work / RUN_FILE} is damaged ({e})", field="resume") from None
    for k, v in given.items():
        if v is None:
            continue
        old, new = getattr(cfg, k), v
        if k == "split_sizes":
            new = _resolve_split_sizes(v, get_setting(cfg.setting))
        if k == "cache" and isinstance(v, (str, os.PathLike)):
            new = str(Path(v).absolute())
        if k == "iterations" and old is None:  # saved as "the preset's default": an explicit default matches
            old = get_preset(cfg.preset).iterations
        if k == "overrides":
            new = tuple([v] if isinstance(v, str) else v)
        if new != old:
            raise UserError(f"resume: the interrupted run used {k}={old!r}, not {new!r}; leave `{k}` out "
                            "(resume takes the saved configuration)", field="resume")
    return out, cfg


def _open_run(given: dict[str, Any], out_dir, resume) -> tuple[Path, RunConfig, Any]:
    """(out_dir, configuration, cache argument) of a new run, or of the killed run at ``resume``."""
    if resume is None:
        cfg = plan_run(**given)
        out = Path(out_dir) if out_dir is not None else _default_out(cfg.setting)
        _check_out(out)
        return out, cfg, given["cache"]
    if out_dir is not None and Path(out_dir) != Path(resume):
        raise UserError("resume: do not combine with a different out_dir (the run resumes into its own)",
                        field="resume")
    out, cfg = _resume_config(Path(resume), given)
    cache_arg = cfg.cache if given["cache"] is None else given["cache"]
    if cache_arg is not None and str(cache_arg).startswith("<"):
        raise UserError("resume: the interrupted run used an in-memory cache; pass the same cache object",
                        field="resume")
    return out, cfg, cache_arg


# -- the cache -------------------------------------------------------------------------

def load_run_cache(setting: Setting, cache: Any) -> ResponseCache:
    """``cache``: None (the setting's SYNTHETIC profile, its n_questions, seed 0), a path
    (either cache format, ``envs.formats.load_cache``) or a ResponseCache."""
    if cache is None:
        c = generate(setting.profile, n_questions=setting.n_questions, seed=0)
        if c.manifest.provenance.get("kind") != "synthetic":  # never let generated data pass as real
            raise RuntimeError("envs.synthetic.generate returned a cache not labelled synthetic")
        return c.with_checksum() if not c.manifest.checksum else c
    if isinstance(cache, ResponseCache):
        return cache.with_checksum() if not cache.manifest.checksum else cache
    return load_cache(cache)


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
    extra = ", ".join(f"{k}={v}" for k, v in prov.items() if k != "kind")
    return f"{kind} cache '{cache.manifest.name}' ({cache.n_questions} questions, T={cache.T}{', ' + extra if extra else ''})"


def _as_rows(rows: Mapping[str, Mapping[str, Any]], n_splits: int, source: str) -> dict[str, dict[str, np.ndarray]]:
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

def _announce(say: Callable[[str], Any], st: Setting, cfg: RunConfig, cache: ResponseCache, trains: bool,
              small: str | None, mesh, member_block: int | None) -> None:
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
    if mesh is not None or member_block is not None:
        n_dev = 1 if mesh is None else mesh.devices.size
        say(f"  training sharded over {n_dev} {jax.default_backend()} device(s)"
            + (f", {member_block} member(s) per block" if member_block is not None else ""))


def _write_outputs(work: Path, st: Setting, cfg: RunConfig, cache: ResponseCache, rows: dict, timing: dict,
                   trains: bool) -> tuple[dict, str]:
    """results.json, table.md and the box plots of a finished run, in its work directory."""
    results = report.build_results(
        setting=st.name, alpha=cfg.alpha, protocol=cfg.protocol, n_splits=cfg.n_splits,
        cache=report.cache_info(cache), rows=rows, timing=timing, seeds=cfg.seeds if trains else 1,
        preset=cfg.preset, train_config=dataclasses.asdict(cfg.train_config()) if trains else None,
    )
    compare = is_setting_profile(st, cache)
    report.write_results(work, results)
    report.write_table(work, results, st, cfg.split_sizes, compare_paper=compare)
    report.write_boxplots(work, results, st, own_cache=compare)
    return results, report.format_table(results, st, cfg.split_sizes, compare_paper=compare)


def reproduce(
    setting: str | None = None,
    *,
    cache: str | os.PathLike | ResponseCache | None = None,
    n_splits: int | None = None,
    protocol: str | None = None,
    alpha: float | None = None,
    iterations: int | None = None,
    split_sizes: str | Sequence[int] | None = None,
    out_dir: str | os.PathLike | None = None,
    seed: int | None = None,
    resume: str | os.PathLike | None = None,
    progress: bool = True,
    echo: Callable[[str], Any] | None = print,
    trainer: LearnedRowsFn | None = None,
    train: bool = True,
    devices: int | str | None = None,
    member_block: int | None = None,
    seeds: int | None = None,
    preset: str | None = None,
    overrides: str | Sequence[str] | None = None,
) -> ReproduceResult:
    """Reproduce one paper table and write its outputs to ``out_dir``.

    Arguments (None = the default):
      setting      name in ``ccpo_jax.ccpo.settings.SETTINGS`` (default Table 2's);
      cache        path of a cache (either format), a ResponseCache, or None for
                   the setting's SYNTHETIC profile with its n_questions and seed 0;
      n_splits     evaluation splits (default 100);
      protocol     ``recalibrate`` (default) or ``retrain`` (``ccpo_jax.ccpo.splits``);
      alpha        miscoverage in (0, 1) (default: the setting's);
      iterations   training iterations (default: the preset's);
      split_sizes  (n_train, n_cal, n_test) or "a,b,c" (default: the setting's);
      out_dir      final directory, must not exist (default runs/<setting>-<timestamp>);
      seed         PRNG seed of splits, baselines and training (default 0);
      resume       out_dir of a killed run: continue it with its saved configuration
                   (other arguments must be None or equal to the saved ones);
      trainer      the learned rows' trainer (default ``ccpo_jax.ccpo.rows.learned_rows``);
      train        False: the non-learned rows only;
      devices      shard the training's members over this many devices (an int or
                   "all"; default 1). Execution option: not saved, a resumed run may differ;
      member_block train the members this many at a time, one single-device program per
                   device: bit-identical to a one-device run with the same block
                   (docs/performance.md); default None: one SPMD program;
      seeds        training seeds of every learned row (default 5);
      preset       trainer preset, ``default`` or ``paper`` (``ccpo_jax.ccpo.presets``);
      overrides    trainer fields ``["field=value", ...]`` on top of the preset.
    Raises UserError / CacheError for bad input before anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    # 1. the run configuration: a new one, or the saved one of a killed run
    given = dict(setting=setting, cache=cache, n_splits=n_splits, protocol=protocol, alpha=alpha,
                 iterations=iterations, split_sizes=split_sizes, seed=seed, seeds=seeds, preset=preset,
                 overrides=overrides)
    out, cfg, cache_arg = _open_run(given, out_dir, resume)
    resuming = resume is not None
    if member_block is not None:
        member_block = _check_int("member_block", "the member block", member_block, 1)
    st = get_setting(cfg.setting)
    work = _work_dir(out)
    if jax.process_count() > 1:
        raise UserError(
            f"reproduce runs on one host (this is process {jax.process_index()} of {jax.process_count()}); "
            "for multi-host training run `python -m experiments.multihost` on every host (docs/performance.md)"
        )
    mesh = resolve_mesh(devices)
    trainer = (trainer or learned.learned_rows) if train else None

    # 2. the cache
    cache_obj = load_run_cache(st, cache_arg)
    check_split_sizes(cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits, where=f"the cache '{cache_obj.manifest.name}'")
    if resuming:
        old_sum = json.loads((work / RUN_FILE).read_text()).get("cache_checksum")
        if old_sum and old_sum != cache_obj.manifest.checksum:
            raise UserError(f"resume: the cache changed since the run was interrupted (checksum {old_sum} before, "
                            f"{cache_obj.manifest.checksum} now); restore it or start a new run", field="resume")
    notes: list[str] = []
    small = calibration_size_warning(cfg.split_sizes[1], cfg.alpha)
    if small:
        notes.append(small)
    created = False
    try:
        if not resuming:
            work.mkdir(parents=True)
            created = True
            atomic_write_text(work / RUN_FILE,
                              json.dumps(dict(cfg.to_dict(), cache_checksum=cache_obj.manifest.checksum), indent=2) + "\n")
        _announce(say, st, cfg, cache_obj, trainer is not None, small, mesh, member_block)
        # 3. env params and 4. splits
        k_split, k_base, k_train = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)
        splits = splits_for_protocol(cfg.protocol, k_split, cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits)
        params = make_env_params(cache_obj)
        # 5. the non-learned rows: all splits in one vmapped call
        t0 = time.perf_counter()
        base = non_learned_rows(cache_obj, params, k_base, splits.cal, splits.test, cfg.alpha)
        rows = _as_rows(jax.device_get(base), cfg.n_splits, "baselines.non_learned_rows")
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": time.perf_counter() - t0}
        # 6. training and evaluation of the learned rows
        if trainer is not None:
            got: LearnedRows = trainer(
                cache=cache_obj, params=params, splits=splits, key=k_train, config=cfg.train_config(),
                lambdas=cfg.lambdas, protocol=cfg.protocol, seeds=cfg.seeds, ckpt_dir=work / CKPT_DIR,
                tb_dir=work / TB_DIR, progress=progress, mesh=mesh, member_block=member_block,
            )
            rows.update(_as_rows(got.rows, cfg.n_splits, "the trainer"))
            for k in ("compile_s", "train_s", "eval_s"):
                timing[k] += float(got.timing.get(k, 0.0))
        else:
            notes.append("learned rows (CPO, CPO batch, CPO online, CCPO) not run (train=False)")
            say(f"  note: {notes[-1]}")
        # 7. outputs
        timing["total_s"] = time.perf_counter() - t_start
        results, table = _write_outputs(work, st, cfg, cache_obj, rows, timing, trainer is not None)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
    except KeyboardInterrupt:
        if (work / CKPT_DIR).exists():
            say(f"interrupted; continue with: ccpo-jax reproduce --resume {out}")
        elif work.exists() and created:
            shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException:
        if created or not (work / CKPT_DIR).exists():
            shutil.rmtree(work, ignore_errors=True)
        raise
    say("")
    say(table.rstrip("\n"))
    say("")
    if small:  # again below the table, where a reader of the coverage column looks
        say(f"warning: {small}")
    dirs = [f"{d}/" for d in (TB_DIR, POLICIES_DIR, CKPT_DIR) if (out / d).is_dir()]
    say(f"wrote {out}/: {report.RESULTS_FILE}, {report.TABLE_FILE}, {report.COST_PNG}, {report.COVERAGE_PNG}, "
        + ", ".join([RUN_FILE] + dirs))
    return ReproduceResult(out_dir=out, results=results, table=table, notes=notes)
