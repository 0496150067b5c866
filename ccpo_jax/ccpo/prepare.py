"""The preparation ``ccpo-jax reproduce`` and ``ccpo-jax sweep`` share, before anything is written.

:func:`prepare` reads the run configuration (a new one, or the saved one of a killed run:
:func:`open_run`), loads and checks the cache, builds the replay env, draws the splits and the
keys, and builds the one :class:`ccpo_jax.runtime.execution.Execution` of the run (mesh, member
block, checkpoint and TensorBoard directories, progress; the member block's default is decided
here, :func:`default_member_block`, and nowhere else). Both commands then write inside
:func:`ccpo_jax.runtime.workdir.committed`. Errors are :class:`ccpo_jax.errors.UserError` naming
the field at fault.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from ccpo_jax.ccpo import report
from ccpo_jax.ccpo.rows import RunData, row_variants, run_batch
from ccpo_jax.ccpo.run_config import ReproduceConfig, RunConfig, SweepConfig
from ccpo_jax.ccpo.settings import METRICS, Setting, get_setting
from ccpo_jax.ccpo.splits import Splits, check_split_sizes, splits_for_protocol
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options, sharding, workdir
from ccpo_jax.runtime.execution import Execution
from envs.cache.atomic import atomic_write_text
from envs.replay.bound import bound_of_params
from envs.cache.schema import ResponseCache
from envs.cache.formats import load_cache
from envs.replay.env import make_env_params
from envs.generators.synthetic import generate
from envs.cache.values import printable

RUN_FILE = "run.json"
TB_DIR = "tensorboard"
CKPT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run ready to write: its configuration, where it goes, its data and its execution.

    ``data.key`` is the training key; ``k_base`` the key of the non-learned rows' draws."""

    cfg: RunConfig
    out: Path
    setting: Setting
    data: RunData
    k_base: jax.Array
    execution: Execution
    command: str

    @property
    def resuming(self) -> bool:
        return self.cfg.resume is not None

    @property
    def splits(self) -> Splits:
        return self.data.splits

    def committed(self, say=None):
        """The work directory context of this run (:func:`ccpo_jax.runtime.workdir.committed`): a new
        run saves its configuration and the cache checksum in ``run.json`` first."""
        def save(work: Path) -> None:
            atomic_write_text(work / RUN_FILE, json.dumps(dict(options.saved(self.cfg), command=self.command,
                                                               cache_checksum=self.data.cache.manifest.checksum),
                                                          indent=2) + "\n")

        return workdir.committed(self.out, resuming=self.resuming, resume=f"ccpo-jax {self.command} --resume {self.out}",
                                 save=save, discard=self.cfg.discard_failed, say=say, ckpt_dir=CKPT_DIR)


def prepare(given: Mapping[str, Any], cls: type = ReproduceConfig, *, command: str = "reproduce",
            out_prefix: str = "", results_file: str = report.RESULTS_FILE, trains: bool = True) -> Prepared:
    """Everything before the first write: configuration, cache, env, splits, keys, execution."""
    out, cfg = open_run(given, cls, out_prefix, results_file, command)
    st = get_setting(cfg.setting)
    if jax.process_count() > 1:
        raise UserError(
            f"{command} runs on one host (this is process {jax.process_index()} of {jax.process_count()}); "
            "for multi-host training run `ccpo-jax multihost` on every host (docs/performance.md)"
        )
    mesh = resolve_mesh(cfg.devices)
    cache = load_run_cache(st, cfg.cache)
    check_split_sizes(cache.n_questions, *cfg.split_sizes, cfg.n_splits, where=f"the cache {cache.manifest.name!r}")
    work = workdir.work_dir(out)
    if cfg.resume is not None:
        check_resumed_cache(work, cache)
    params = make_env_params(cache)
    k_split, k_base, k_train = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)
    splits = splits_for_protocol(cfg.protocol, k_split, cache.n_questions, *cfg.split_sizes, cfg.n_splits)
    execution = Execution(mesh=mesh, member_block=default_member_block(cfg) if trains else cfg.member_block,
                          ckpt_dir=work / CKPT_DIR, tb_dir=work / TB_DIR, progress=cfg.progress)
    return Prepared(cfg=cfg, out=out, setting=st, data=RunData(cache, params, splits, k_train), k_base=k_base,
                    execution=execution, command=command)


def default_member_block(cfg: RunConfig) -> int | None:
    """The member block of a run (``--member-block``; given: that one), decided here only.

    A ``reproduce`` run under ``recalibrate`` trains its rows x seeds in one plain vmap (None); under
    ``retrain`` its rows x splits x seeds members in blocks of one split's members
    (:func:`ccpo_jax.ccpo.rows.run_batch`). Why: one vmap of all 400 members of ``--protocol retrain
    --seeds 1`` keeps a working set that outgrows the CPU caches (blocks of 4 trained 1.3x the
    member-iterations per second on the 2-core CPU of docs/performance.md), and with ``--devices N``
    every device runs the one-device block program (``sharding.PerDevice``), so a retrain run's
    numbers do not depend on the number of devices. A ``sweep`` (a ``SweepConfig``) computes its
    members in blocks of one reproduce run's batch of its setting under either protocol: XLA picks
    its kernels, and so the last rounding bit that the CPO step amplifies, by the batch size, so every
    member then runs the program of a ``reproduce`` run and a sweep point equals that run bit for bit.
    """
    if cfg.member_block is not None:
        return int(cfg.member_block)
    sweep = isinstance(cfg, SweepConfig)
    if not sweep and cfg.protocol != "retrain":
        return None
    lambdas = get_setting(cfg.setting).lambdas if sweep else cfg.lambdas
    return run_batch(len(row_variants(tuple(lambdas), cfg.train_config())), cfg.seeds)


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
                   results_file: str = report.RESULTS_FILE, command: str = "reproduce") -> tuple[Path, RunConfig]:
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
             results_file: str = report.RESULTS_FILE, command: str = "reproduce") -> tuple[Path, RunConfig]:
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


def check_options(given: Mapping[str, Any], cls: type, command: str) -> None:
    """A Python caller's unknown option: a TypeError listing the options (as for a wrong keyword)."""
    unknown = sorted(set(given) - set(options.inputs(cls)))
    if unknown:
        raise TypeError(f"{command}() got unknown option(s) {', '.join(unknown)}; "
                        f"the options: {', '.join(options.inputs(cls))}")


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


#: The longest provenance text on the run's header line; the whole record is in results.json and run.json.
PROVENANCE_CHARS = 160


def describe_cache(cache: ResponseCache) -> str:
    """One short line: kind, name, size, T, the share of unsolvable questions and the provenance cut to
    :data:`PROVENANCE_CHARS` (an imported cache's record can run to 1,500 characters)."""
    prov = cache.manifest.provenance
    kind = "SYNTHETIC" if prov.get("kind") == "synthetic" else str(prov.get("kind", "?"))
    extra = ", ".join(f"{printable(k)}={printable(v)}" for k, v in prov.items() if k != "kind")
    if len(extra) > PROVENANCE_CHARS:
        extra = extra[:PROVENANCE_CHARS].rstrip(" ,") + "... (in full: results.json cache.provenance)"
    unsolv = f", {100 * float(np.mean(cache.unsolvable)):.1f}% unsolvable" if cache.n_questions else ""
    return (f"{kind} cache {cache.manifest.name!r} ({cache.n_questions} questions, T={cache.T}{unsolv}"
            f"{', ' + extra if extra else ''})")


# -- rows ------------------------------------------------------------------------------

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


def bound_row(params, test_idx, alpha: float) -> dict[str, np.ndarray]:
    """The clairvoyant bound on every test split (``envs.replay.bound``) as a row: cost and coverage;
    length and set size are not defined for it (NaN, written as null)."""
    b = bound_of_params(params, np.asarray(test_idx), alpha)
    nan = np.full_like(b["cost_cents"], np.nan)
    return {"cost_cents": b["cost_cents"], "coverage": b["coverage"], "avg_len": nan, "set_size": nan}
