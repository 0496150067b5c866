"""``ccpo-jax reproduce``: one paper table, end to end (DESIGN 5-6; BRIEF 1.11-1.14).

:func:`reproduce` validates its inputs, loads (or generates) the response
cache, draws the splits, evaluates the non-learned rows (Random, LLM
policies, LLM-EXIT, UALA) for all splits in one vmapped call
(``ccpo_jax.baselines.non_learned_rows``), trains and evaluates the learned
rows (CPO, CPO batch, CPO online, CCPO) through
``ccpo_jax.train.learned_rows`` (call site: :func:`_call_learned_rows`), and
writes ``results.json``, ``table.md``, the box-plot PNGs, TensorBoard scalars
and ``run.json`` (the run's configuration).

Output is built in a hidden work directory beside ``--out``
(``<parent>/.<name>.partial``) and renamed to ``--out`` only when complete, so
``--out`` never holds a half-written run. A run killed during training leaves
the work directory (with the trainer's checkpoints) behind; ``--resume OUT``
continues it with the configuration saved in its ``run.json``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ccpo_jax.errors import UserError
from ccpo_jax.settings import DEFAULT_SETTING, METRICS, Setting, get_setting

DEFAULT_SPLITS = 100
DEFAULT_SEEDS = 5
RUN_FILE = "run.json"
TB_DIR = "tensorboard"
CKPT_DIR = "checkpoints"


@dataclasses.dataclass
class LearnedRows:
    """What ``ccpo_jax.train.learned_rows`` returns to the pipeline.

    rows:   row name (DESIGN 6: ``CPO``, ``CPO batch``, ``CPO online``,
            ``CCPO (lambda=0)``, ``CCPO (lambda=<value>)``) -> metric in
            ``METRICS`` -> np.ndarray [S] (one value per split).
    curves: TensorBoard tag prefix (e.g. the variant name) -> curve name ->
            np.ndarray [iterations] or [S, iterations] (per-split curves are
            written as their mean over splits).
    timing: ``compile_s``, ``train_s``, ``eval_s`` in seconds (missing keys count 0).
    """

    rows: dict[str, dict[str, np.ndarray]]
    curves: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)


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
    preset: str = "default"  # trainer preset (ccpo_jax.presets)
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

    def train_config(self):
        """The trainer configuration of this run: the preset, the overrides, alpha and iterations."""
        from ccpo_jax.presets import apply_overrides, get_preset

        cfg = apply_overrides(get_preset(self.preset), self.overrides).replace(alpha=float(self.alpha))
        return cfg if self.iterations is None else cfg.replace(iterations=int(self.iterations))


# -- validation at the boundary ----------------------------------------------------

def _check_int(name: str, flag: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise UserError(f"{flag}: {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _check_alpha(alpha: Any) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise UserError(f"--alpha: must be a number in (0, 1), got {alpha!r}") from None
    if not (0.0 < a < 1.0):
        raise UserError(f"--alpha: must be in (0, 1) (target coverage 1 - alpha), got {alpha!r}")
    return a


def _work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _check_out(out: Path) -> None:
    """--out must not exist yet and its folder must be creatable and writable."""
    if out.exists() or out.is_symlink():
        raise UserError(f"--out: {out} already exists; choose a new directory (results are never overwritten)")
    anc = out.parent
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise UserError(f"--out: cannot create {out}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"--out: cannot create {out}: {anc} is not writable")


def _default_out(setting: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{setting}-{stamp}"


def _resolve_split_sizes(v: Any, setting: Setting) -> tuple[int, int, int]:
    from ccpo_jax.splits import parse_split_sizes

    if v is None:
        return setting.split_sizes
    if isinstance(v, str):
        return parse_split_sizes(v)
    try:
        sizes = tuple(v)
    except TypeError:
        raise UserError(f"--split-sizes: expected n_train,n_cal,n_test, got {v!r}") from None
    return parse_split_sizes(",".join(str(x) for x in sizes))


# -- cache --------------------------------------------------------------------------

def load_run_cache(setting: Setting, cache: Any):
    """``cache``: None (the setting's SYNTHETIC profile, its n_questions, seed 0), a path
    (either cache format, ``envs.cache.load_cache``) or a ResponseCache."""
    from envs.cache import ResponseCache, load_cache

    if cache is None:
        from envs.synthetic import generate

        c = generate(setting.profile, n_questions=setting.n_questions, seed=0)
        if c.manifest.provenance.get("kind") != "synthetic":  # never let generated data pass as real
            raise RuntimeError("envs.synthetic.generate returned a cache not labelled synthetic")
        return c.with_checksum() if not c.manifest.checksum else c
    if isinstance(cache, ResponseCache):
        return cache.with_checksum() if not cache.manifest.checksum else cache
    return load_cache(cache)


def is_setting_profile(setting: Setting, cache) -> bool:
    """True when ``cache`` is a synthetic cache of the setting's profile (paper numbers are shown then)."""
    prov = cache.manifest.provenance
    if prov.get("kind") != "synthetic":
        return False
    prof = setting.profile
    vals = [str(v) for v in prov.values() if isinstance(v, str)]  # e.g. generator "envs.synthetic/<profile>"
    name = cache.manifest.name
    return any(v == prof or v.endswith("/" + prof) for v in vals) or name == prof or f"-{prof}-" in f"-{name}-"


def describe_cache(cache) -> str:
    prov = cache.manifest.provenance
    kind = "SYNTHETIC" if prov.get("kind") == "synthetic" else str(prov.get("kind", "?"))
    extra = ", ".join(f"{k}={v}" for k, v in prov.items() if k != "kind")
    return f"{kind} cache '{cache.manifest.name}' ({cache.n_questions} questions, T={cache.T}{', ' + extra if extra else ''})"


# -- the learned-rows call site ---------------------------------------------------------

def _find_learned_rows() -> Callable | None:
    """``ccpo_jax.train.learned_rows`` if the trainer provides it (import errors propagate)."""
    if importlib.util.find_spec("ccpo_jax.train") is None:
        return None
    mod = importlib.import_module("ccpo_jax.train")
    return getattr(mod, "learned_rows", None)


def _coerce_learned(out: Any) -> LearnedRows:
    if isinstance(out, LearnedRows):
        return out
    if isinstance(out, tuple):
        return LearnedRows(*out)
    if isinstance(out, Mapping):
        return LearnedRows(rows=dict(out))
    if all(hasattr(out, a) for a in ("rows",)):
        return LearnedRows(rows=out.rows, curves=getattr(out, "curves", {}), timing=getattr(out, "timing", {}))
    raise TypeError(f"learned_rows returned {type(out).__name__}; expected LearnedRows")


def _call_learned_rows(fn: Callable, *, cache, params, splits, key, cfg: RunConfig, work: Path, resume: bool, progress: bool,
                       mesh=None, member_block: int | None = None) -> LearnedRows:
    """THE call site of the trainer. ``fn`` is ``ccpo_jax.train.learned_rows`` with signature::

        learned_rows(*, cache: ResponseCache, params: EnvParams, splits: Splits, key: jax.Array,
                     alpha: float, lambdas: tuple[float, ...], protocol: str,
                     iterations: int | None, ckpt_dir: Path, tb_dir: Path, resume: bool, progress: bool)
            -> LearnedRows  (or a (rows, curves, timing) tuple, or just the rows dict)

    ``splits.train`` is [S, n_train] (all rows equal under ``recalibrate``: train
    once on ``splits.train[0]``), ``splits.cal``/``splits.test`` [S, n]; ``lambdas``
    are the table's nonzero lambdas (CCPO (lambda=0) is always trained);
    ``iterations`` None = the trainer's default. ``ckpt_dir`` lives in the work
    directory; ``resume`` says whether checkpoints from a killed run may be there.
    ``tb_dir`` (passed only if ``fn`` accepts it) is the run's TensorBoard folder:
    the pipeline writes the returned ``curves`` there at the end; a trainer that
    logs live scalars there itself returns no curves. Every returned row must hold all of METRICS as arrays [S].
    ``mesh`` / ``member_block`` (execution options, passed only when set) shard the training.
    """
    kwargs = dict(
        cache=cache,
        params=params,
        splits=splits,
        key=key,
        alpha=cfg.alpha,
        lambdas=cfg.lambdas,
        protocol=cfg.protocol,
        iterations=cfg.iterations,
        ckpt_dir=work / CKPT_DIR,
        tb_dir=work / TB_DIR,
        resume=resume,
        progress=progress,
    )
    if not _accepts(fn, "tb_dir"):  # tb_dir is optional for the trainer
        kwargs.pop("tb_dir")
    # The trainer configuration and the seeds (optional for stand-in trainers in tests).
    for name, value in (("config", cfg.train_config()), ("seeds", cfg.seeds)):
        if _accepts(fn, name):
            kwargs[name] = value
    for name, value in (("mesh", mesh), ("member_block", member_block)):
        if value is None:
            continue
        if not _accepts(fn, name):
            raise UserError(f"the trainer {getattr(fn, '__qualname__', fn)} does not support {name} (--devices/--member-block)")
        kwargs[name] = value
    return _coerce_learned(fn(**kwargs))


def _accepts(fn: Callable, name: str) -> bool:
    import inspect

    try:
        ps = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in ps or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps.values())


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

def _resolve_trainer(seeds, preset, overrides) -> tuple[int, str, tuple[str, ...]]:
    """Validate --seeds, --preset and --set FIELD=VALUE (the trainer configuration)."""
    from ccpo_jax.presets import apply_overrides, get_preset

    seeds = _check_int("the number of seeds", "--seeds", DEFAULT_SEEDS if seeds is None else seeds, 1)
    preset = "default" if preset is None else str(preset)
    if isinstance(overrides, str):
        overrides = (overrides,)
    overrides = tuple(str(o) for o in (overrides or ()))
    try:
        base = get_preset(preset)
    except UserError as e:
        raise UserError(f"--preset: {e}") from None
    for item in overrides:
        if item.split("=", 1)[0].strip().replace("-", "_") == "alpha":
            raise UserError(f"--set {item}: alpha is set with --alpha (or the setting)")
    try:
        apply_overrides(base, overrides)
    except UserError as e:
        raise UserError(f"--set: {e}") from None
    return seeds, preset, overrides


def _resolve(
    setting, cache, n_splits, protocol, alpha, iterations, split_sizes, seed, seeds=None, preset=None, overrides=None
) -> tuple[Setting, RunConfig, Any]:
    from ccpo_jax.splits import PROTOCOLS

    st = get_setting(setting if setting is not None else DEFAULT_SETTING)
    n_splits = _check_int("the number of splits", "--splits", DEFAULT_SPLITS if n_splits is None else n_splits, 1)
    protocol = "recalibrate" if protocol is None else protocol
    if protocol not in PROTOCOLS:
        raise UserError(f"--protocol: unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    alpha = _check_alpha(st.alpha if alpha is None else alpha)
    if iterations is not None:
        iterations = _check_int("the number of iterations", "--iterations", iterations, 1)
    sizes = _resolve_split_sizes(split_sizes, st)
    seed = _check_int("the seed", "--seed", 0 if seed is None else seed, 0)
    cache_spec = None
    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        cache_spec = f"<{type(cache).__name__} {getattr(getattr(cache, 'manifest', None), 'name', '?')}>"
    elif cache is not None:
        p = Path(cache)
        if not p.exists():
            raise UserError(f"--cache: {cache}: no such file or directory")
        cache_spec = str(p.absolute())
    cfg = RunConfig(
        setting=st.name, cache=cache_spec, n_splits=n_splits, protocol=protocol, alpha=alpha,
        iterations=iterations, split_sizes=sizes, seed=seed, lambdas=tuple(st.lambdas),
        **dict(zip(("seeds", "preset", "overrides"), _resolve_trainer(seeds, preset, overrides))),
    )
    return st, cfg, cache


def _resolve_mesh(devices: int | str | None):
    """``--devices``: None/1 -> no mesh; N or "all" -> a 1-D mesh over the first N devices."""
    if devices is None:
        return None
    import jax

    available = jax.devices()
    if isinstance(devices, str) and devices.strip().lower() == "all":
        n = len(available)
    else:
        try:
            n = int(devices)
        except (TypeError, ValueError):
            raise UserError(f"--devices: an integer >= 1 or 'all', got {devices!r}") from None
        if isinstance(devices, float) and devices != n:
            raise UserError(f"--devices: an integer >= 1 or 'all', got {devices!r}")
    if n < 1:
        raise UserError(f"--devices: an integer >= 1 or 'all', got {devices!r}")
    if n > len(available):
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (f"; on a CPU the ccpo-jax command forces N host devices itself; from Python, set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
        raise UserError(f"--devices {n}: only {len(available)} {jax.default_backend()} device(s) available{hint}")
    if n == 1:
        return None
    from ccpo_jax import sharding

    return sharding.make_mesh(n)


def _resume_config(resume: Path, given: Mapping[str, Any]) -> tuple[Path, RunConfig]:
    """Find the work dir of a killed run at ``resume`` (its --out) and read its run.json."""
    resume = Path(resume)
    if resume.name.startswith(".") and resume.name.endswith(".partial"):
        out = resume.parent / resume.name[1:-len(".partial")]
    else:
        out = resume
    work = _work_dir(out)
    if (out / "results.json").is_file():
        raise UserError(f"--resume: {out} holds a finished run (results.json exists); nothing to resume")
    if not (work / RUN_FILE).is_file():
        raise UserError(f"--resume: no interrupted run for {out} (expected {work / RUN_FILE})")
    try:
        cfg = RunConfig.from_dict(json.loads((work / RUN_FILE).read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume: {work / RUN_FILE} is damaged ({e})") from None
    for k, v in given.items():
        if v is None:
            continue
        old = getattr(cfg, k)
        new = v
        if k == "split_sizes":
            new = _resolve_split_sizes(v, get_setting(cfg.setting))
        if k == "cache" and isinstance(v, (str, os.PathLike)):
            new = str(Path(v).absolute())
        if k == "iterations" and old is None:  # saved as "the preset's default": an explicit default matches
            from ccpo_jax.presets import get_preset

            old = get_preset(cfg.preset).iterations
        if k == "overrides":
            new = tuple([v] if isinstance(v, str) else v)
        if new != old:
            raise UserError(
                f"--resume: the interrupted run used {k}={old!r}, not {new!r}; drop the flag (resume takes the saved configuration)"
            )
    return out, cfg


def reproduce(
    setting: str | None = None,
    *,
    cache: Any = None,
    n_splits: int | None = None,
    protocol: str | None = None,
    alpha: float | None = None,
    iterations: int | None = None,
    split_sizes: Any = None,
    out_dir: str | os.PathLike | None = None,
    seed: int | None = None,
    resume: str | os.PathLike | None = None,
    progress: bool = True,
    echo: Callable[[str], Any] | None = print,
    learned_rows: Callable | bool | None = None,
    devices: int | str | None = None,
    member_block: int | None = None,
    seeds: int | None = None,
    preset: str | None = None,
    overrides: Any = None,
) -> ReproduceResult:
    """Reproduce one paper table (DESIGN 6) and write its outputs to ``out_dir``.

    Arguments (None = the default):
      setting      name in ``ccpo_jax.settings.SETTINGS`` (default Table 2's);
      cache        path of a cache (either format), a ResponseCache, or None for
                   the setting's SYNTHETIC profile with its n_questions and seed 0;
      n_splits     evaluation splits (default 100);
      protocol     ``recalibrate`` (default) or ``retrain`` (``ccpo_jax.splits``);
      alpha        miscoverage in (0, 1) (default: the setting's);
      iterations   training iterations (default: the preset's);
      seeds        training seeds of every learned row, trained in one vmapped
                   program (default 5); results report the spread over seeds;
      preset       trainer preset, ``default`` or ``paper`` (``ccpo_jax.presets``);
      overrides    trainer fields ``["field=value", ...]`` on top of the preset;
      split_sizes  (n_train, n_cal, n_test) or "a,b,c" (default: the setting's);
      out_dir      final directory, must not exist (default runs/<setting>-<timestamp>);
      seed         PRNG seed of splits, baselines and training (default 0);
      resume       --out of a killed run: continue it with its saved configuration
                   (other arguments must be None or equal to the saved ones);
      learned_rows the trainer entry point (None: ``ccpo_jax.train.learned_rows``
                   when it exists; False: skip the learned rows);
      devices      shard the training's variant x split members over this many
                   devices (an int or "all"; default 1: no mesh). Execution
                   option: not saved in run.json, a resumed run may use another;
      member_block train the members this many at a time
                   (``ccpo_jax.sharding.blocked_vmap``), one single-device program
                   per device (``sharding.PerDevice``): bit-identical to a
                   one-device run with the same block (docs/performance.md);
                   default None: one SPMD program, a vmap per device.
    Raises UserError / CacheError for bad input before anything is written.
    """
    t_start = time.perf_counter()
    say = echo if echo is not None else (lambda s: None)
    if member_block is not None:
        member_block = _check_int("member block", "--member-block", member_block, 1)
    given = dict(setting=setting, cache=cache, n_splits=n_splits, protocol=protocol, alpha=alpha,
                 iterations=iterations, split_sizes=split_sizes, seed=seed, seeds=seeds, preset=preset,
                 overrides=overrides)
    if resume is not None:
        if out_dir is not None and Path(out_dir) != Path(resume):
            raise UserError("--resume: do not combine with a different --out (the run resumes into its own --out)")
        out, cfg = _resume_config(Path(resume), given)
        st = get_setting(cfg.setting)
        cache_arg = cfg.cache if cache is None else cache
        if cache_arg is not None and str(cache_arg).startswith("<"):
            raise UserError("--resume: the interrupted run used an in-memory cache; pass the same cache object")
        resuming = True
    else:
        st, cfg, cache_arg = _resolve(setting, cache, n_splits, protocol, alpha, iterations, split_sizes, seed,
                                      seeds, preset, overrides)
        out = Path(out_dir) if out_dir is not None else _default_out(st.name)
        _check_out(out)
        work = _work_dir(out)
        if work.exists():
            raise UserError(
                f"--out: an interrupted run for {out} exists ({work}); continue it with --resume {out} "
                f"or delete {work}"
            )
        resuming = False
    work = _work_dir(out)

    # everything below reads data; errors here still leave nothing behind
    import jax

    if jax.process_count() > 1:
        raise UserError(
            f"reproduce runs on one host (this is process {jax.process_index()} of {jax.process_count()}); "
            "for multi-host training run `python -m experiments.multihost` on every host (docs/performance.md)"
        )

    from ccpo_jax import report
    from ccpo_jax.splits import check_split_sizes, splits_for_protocol
    from envs.orchestration import make_env_params

    mesh = _resolve_mesh(devices)
    cache_obj = load_run_cache(st, cache_arg)
    check_split_sizes(cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits, where=f"the cache '{cache_obj.manifest.name}'")
    fn = learned_rows
    if fn is None:
        fn = _find_learned_rows()
    notes: list[str] = []

    if resuming:
        old_sum = json.loads((work / RUN_FILE).read_text()).get("cache_checksum")
        if old_sum and old_sum != cache_obj.manifest.checksum:
            raise UserError(
                f"--resume: the cache changed since the run was interrupted (checksum {old_sum} before, "
                f"{cache_obj.manifest.checksum} now); restore it or start a new run"
            )
    created = False
    try:
        if not resuming:
            work.mkdir(parents=True)
            created = True
            saved = dict(cfg.to_dict(), cache_checksum=cache_obj.manifest.checksum)
            report.atomic_write_text(work / RUN_FILE, json.dumps(saved, indent=2) + "\n")
        own_cache = is_setting_profile(st, cache_obj)
        say(f"reproduce {st.name} ({st.run_title(cache_obj.manifest.name, own_cache, cfg.alpha)})")
        say(f"  {describe_cache(cache_obj)}")
        say(f"  protocol {cfg.protocol}, {cfg.n_splits} splits of {'/'.join(map(str, cfg.split_sizes))} "
            f"(train/cal/test), alpha {cfg.alpha:g}, seed {cfg.seed}")
        if fn:
            from ccpo_jax.presets import deviations

            tc = cfg.train_config()
            dev = deviations(tc)
            say(f"  trainer: preset {cfg.preset}, {cfg.seeds} seed(s), {tc.iterations} iterations, estimator "
                f"{tc.estimator}" + (f"; differs from the paper's setting in {', '.join(sorted(dev))}" if dev else
                                     "; the paper's published setting"))
        from ccpo_jax.conformal import calibration_size_warning

        small = calibration_size_warning(cfg.split_sizes[1], cfg.alpha)
        if small:
            notes.append(small)
            say(f"  warning: {small}")
        if mesh is not None or member_block is not None:
            n_dev = 1 if mesh is None else mesh.devices.size
            say(f"  training sharded over {n_dev} {jax.default_backend()} device(s)"
                + (f", {member_block} member(s) per block" if member_block is not None else ""))

        key = jax.random.PRNGKey(cfg.seed)
        k_split, k_base, k_train = jax.random.split(key, 3)
        splits = splits_for_protocol(cfg.protocol, k_split, cache_obj.n_questions, *cfg.split_sizes, cfg.n_splits)
        params = make_env_params(cache_obj)

        # non-learned rows: all splits in one vmapped call
        from ccpo_jax.baselines import non_learned_rows

        t0 = time.perf_counter()
        base_rows = non_learned_rows(cache_obj, params, k_base, splits.cal, splits.test, cfg.alpha)
        base_rows = _as_rows(jax.device_get(base_rows), cfg.n_splits, "baselines.non_learned_rows")
        base_eval_s = time.perf_counter() - t0

        rows = dict(base_rows)
        timing = {"compile_s": 0.0, "train_s": 0.0, "eval_s": base_eval_s}
        if fn:
            learned = _call_learned_rows(
                fn, cache=cache_obj, params=params, splits=splits, key=k_train, cfg=cfg, work=work,
                resume=resuming, progress=progress, mesh=mesh, member_block=member_block,
            )
            rows.update(_as_rows(learned.rows, cfg.n_splits, "train.learned_rows"))
            for k in ("compile_s", "train_s", "eval_s"):
                timing[k] += float(learned.timing.get(k, 0.0))
            for prefix, curves in learned.curves.items():
                report.write_scalars(work / TB_DIR, prefix, curves)
        else:
            notes.append("learned rows (CPO, CPO batch, CPO online, CCPO) not run: the trainer "
                         "(ccpo_jax.train.learned_rows) is not available")
            say(f"  note: {notes[-1]}")

        timing["total_s"] = time.perf_counter() - t_start
        results = report.build_results(
            setting=st.name, alpha=cfg.alpha, protocol=cfg.protocol, n_splits=cfg.n_splits,
            cache=report.cache_info(cache_obj), rows=rows, timing=timing,
            seeds=cfg.seeds if fn else 1, preset=cfg.preset,
            train_config=dataclasses.asdict(cfg.train_config()) if fn else None,
        )
        compare = is_setting_profile(st, cache_obj)
        report.write_results(work, results)
        report.write_table(work, results, st, cfg.split_sizes, compare_paper=compare)
        report.write_boxplots(work, results, st, own_cache=compare)
        table = report.format_table(results, st, cfg.split_sizes, compare_paper=compare)
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
    dirs = [f"{d}/" for d in (TB_DIR, "policies", CKPT_DIR) if (out / d).is_dir()]  # policies/: train.POLICIES_DIR
    say(f"wrote {out}/: {report.RESULTS_FILE}, {report.TABLE_FILE}, {report.COST_PNG}, {report.COVERAGE_PNG}, "
        + ", ".join([RUN_FILE] + dirs))
    return ReproduceResult(out_dir=out, results=results, table=table, notes=notes)
