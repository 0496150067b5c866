"""The typed run configuration of ``ccpo-jax reproduce``: one field per option.

:class:`RunOptions` holds the options every CCPO run command shares (the cache, the
setting, the splits, the trainer preset, the execution options); :class:`ReproduceConfig`
adds reproduce's own. Each field is declared once, with :func:`ccpo_jax.runtime.options.option`,
and from it come the ``ccpo-jax reproduce`` flag, the check and default, the flag name in
error messages, its place in ``run.json``, the ``--resume`` comparison and the option list
of docs/reproduce.md. A configuration is checked when it is built (``__post_init__``):
``ReproduceConfig(n_splits=0)`` raises ``UserError("n_splits: ...", field="n_splits")``.
Every field accepts None for "the default". Nothing here imports jax at module level, so
``ccpo-jax --help`` stays fast.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any, Union

from ccpo_jax.ccpo.calibration import CALIBRATIONS, DELTA, GUARANTEES, Calibration  # the one vocabulary
from ccpo_jax.ccpo.config import TrainConfig
from ccpo_jax.ccpo.presets import apply_overrides, get_preset
from ccpo_jax.ccpo.settings import DEFAULT_SETTING, PROTOCOLS, get_setting
from ccpo_jax.core.guarantee import Guarantee, make_guarantee
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import check_int, option

# -- the checks (each: (field name, value or None, the configuration so far) -> value) ----


def _setting(name: str, v: Any, cfg: RunOptions) -> str:
    return get_setting(DEFAULT_SETTING if v is None else v).name


def _cache(name: str, v: Any, cfg: RunOptions) -> Any:
    """A path becomes absolute (and must exist); a ResponseCache object is kept as it is (and a
    resumed run's record of one, ``<ResponseCache NAME>``, too)."""
    if v is None or not isinstance(v, (str, os.PathLike)) or str(v).startswith("<"):
        return v
    p = Path(v)
    if not p.exists():
        raise UserError(f"cache: {v}: no such file or directory", field="cache")
    return str(p.absolute())


def _cache_json(v: Any) -> str | None:
    """How run.json records the cache: None (built-in), an absolute path, or ``<ResponseCache NAME>``."""
    if v is None or isinstance(v, str):
        return v
    return f"<{type(v).__name__} {getattr(getattr(v, 'manifest', None), 'name', '?')}>"


def _protocol(name: str, v: Any, cfg: RunOptions) -> str:
    if v not in PROTOCOLS:
        raise UserError(f"protocol: unknown protocol {v!r}; valid: {', '.join(PROTOCOLS)}", field="protocol")
    return v


def _split_sizes(name: str, v: Any, cfg: RunOptions) -> tuple[int, int, int]:
    from ccpo_jax.ccpo.splits import parse_split_sizes  # imports jax: not at `ccpo-jax --help`

    if v is None:
        return get_setting(cfg.setting).split_sizes
    if isinstance(v, str):
        return parse_split_sizes(v)
    try:
        sizes = tuple(v)
    except TypeError:
        raise UserError(f"split_sizes: expected n_train,n_cal,n_test, got {v!r}", field="split_sizes") from None
    return parse_split_sizes(",".join(str(x) for x in sizes))


def _preset(name: str, v: Any, cfg: RunOptions) -> str:
    try:
        get_preset(str(v))
    except UserError as e:
        raise UserError(f"preset: {e}", field="preset") from None
    return str(v)


def _overrides(name: str, v: Any, cfg: RunOptions) -> tuple[str, ...]:
    overrides = tuple(str(o) for o in v)
    for item in overrides:
        if item.split("=", 1)[0].strip().replace("-", "_") == "alpha":
            raise UserError(f"overrides: {item}: alpha is set separately (its own argument, or the setting), "
                            "not as a trainer override", field="overrides")
    try:
        apply_overrides(get_preset(cfg.preset), overrides)
    except UserError as e:
        raise UserError(f"overrides: {e}", field="overrides") from None
    return overrides


def _path(name: str, v: Any, cfg: RunOptions) -> Path | None:
    return None if v is None else Path(v)


def _alpha(name: str, v: Any, cfg: ReproduceConfig) -> float:
    if v is None:
        v = get_setting(cfg.setting).alpha
    try:
        a = float(v)
    except (TypeError, ValueError):
        raise UserError(f"alpha: must be a number in (0, 1), got {v!r}", field="alpha") from None
    if not (0.0 < a < 1.0):
        raise UserError(f"alpha: must be in (0, 1) (target coverage 1 - alpha), got {v!r}", field="alpha")
    why = _float32_problem(a, lambda x: 0.0 < x < 1.0, "in (0, 1)")
    if why:
        raise UserError(f"alpha: {why}", field="alpha")
    return a


def _float32_problem(x: float, ok, rule: str) -> str | None:
    """Why ``x`` (which passed ``ok`` in float64) is refused once rounded to the trainer's float32, or None."""
    why = options.float32_problem(x)
    if why is None and not ok(options.as_float32(x)):
        why = f"{x!r} is {options.as_float32(x)!r} in float32, the precision the trainer computes in, which is not {rule}"
    return why


def _setting_lambdas(name: str, v: Any, cfg: ReproduceConfig) -> tuple[float, ...]:
    return tuple(get_setting(cfg.setting).lambdas) if v is None else tuple(float(x) for x in v)


#: Default ``--group-min``: 19 calibration questions are the fewest with a threshold at alpha 0.05
#: (the rank ceil((n+1)(1-alpha)) <= n), so a group of 20 has one at every alpha >= 0.05.
GROUP_MIN = 20


def _calibration(name: str, v: Any, cfg: ReproduceConfig) -> Calibration:
    if v not in CALIBRATIONS:
        raise UserError(f"calibration: unknown calibration {v!r}; valid: {', '.join(CALIBRATIONS)}", field=name)
    return Calibration(v)




def _guarantee(name: str, v: Any, cfg: RunConfig) -> str:
    if v not in GUARANTEES:
        raise UserError(f"guarantee: unknown guarantee {v!r}; valid: {', '.join(GUARANTEES)}", field=name)
    return v


def _delta(name: str, v: Any, cfg: RunConfig) -> float | None:
    """None under ``marginal`` (a --delta there is refused); under ``pac`` a number in (0, 1) for which
    the calibration split has a PAC threshold at every alpha of the run (else the size it needs)."""
    from ccpo_jax.core.guarantee import pac_min_n

    if not GUARANTEES[cfg.guarantee].uses_delta:
        if v is not None:
            raise UserError(f"delta: only with --guarantee pac (this run's guarantee is {cfg.guarantee})", field=name)
        return None
    try:
        d = DELTA if v is None else float(v)
    except (TypeError, ValueError):
        raise UserError(f"delta: must be a number in (0, 1), got {v!r}", field=name) from None
    if not (0.0 < d < 1.0):
        raise UserError(f"delta: must be in (0, 1) (the guarantee holds with probability 1 - delta), got {v!r}",
                        field=name)
    n_cal = cfg.split_sizes[1]
    for a in cfg.run_alphas:
        n_min = pac_min_n(a, d)
        if n_cal < n_min:
            raise UserError(f"delta: {n_cal} calibration questions are too few for a PAC threshold at alpha {a:g}, "
                            f"delta {d:g}: even the lowest score needs (1-alpha)^n <= delta, n >= {n_min}; use at "
                            f"least {n_min} (the middle number of --split-sizes) or a larger delta", field=name)
    return d


def _guarantee_option() -> Any:
    return option("--guarantee", help="marginal: coverage >= 1 - alpha on average over calibration draws; pac: "
                  "every calibrated threshold (and per group) takes the order statistic with P(coverage >= 1 - alpha) "
                  ">= 1 - delta over the calibration draw", choices=GUARANTEES, default="marginal", check=_guarantee,
                  if_missing="marginal")


def _delta_option() -> Any:
    return option("--delta", help="with --guarantee pac: the probability that the guarantee fails", metavar="D",
                  type=float, default_doc=f"{DELTA:g} with --guarantee pac", check=_delta, if_missing=None)


def _cap_context(name: str, what: str, cfg: ReproduceConfig) -> None:
    """A cap on a second risk needs --guarantee pac and one threshold per row (marginal calibration)."""
    if not GUARANTEES[cfg.guarantee].takes_caps:
        raise UserError(f"{what}: a cap on a second risk needs --guarantee pac (Learn then Test holds all the "
                        "risks with probability 1 - delta)", field=name)
    if Calibration.of(cfg) is not Calibration.MARGINAL:
        # Learn then Test per group would test every group's caps on its own few questions, with delta split
        # over groups x risks: not built (docs/calibration.md, "What is not done")
        raise UserError(f"{what}: not with --calibration mondrian: the caps are tested on one threshold per row, "
                        "over all calibration questions; use --calibration marginal with the cap, or drop the cap "
                        "for per-group (Mondrian PAC) thresholds", field=name)


def _guide_cap(name: str, v: Any, cfg: ReproduceConfig) -> float | None:
    """A cap in (0, 1) on the share of questions that call the guide, with --guarantee pac and one
    threshold (marginal calibration); refused when no calibration outcome could pass the tests."""
    if v is None:
        return None
    try:
        r = float(v)
    except (TypeError, ValueError):
        raise UserError(f"guide_cap: must be a number in (0, 1), got {v!r}", field=name) from None
    if not (0.0 < r < 1.0):
        raise UserError(f"guide_cap: must be in (0, 1) (the largest share of questions that call the guide), "
                        f"got {v!r}", field=name)
    _cap_context(name, "guide_cap", cfg)
    n_cal = cfg.split_sizes[1]
    cost = 1.0 if cfg.cost_cap is not None else None  # a third risk: delta split three ways
    for a in cfg.run_alphas:
        g = make_guarantee(cfg.guarantee, cfg.delta, r, cost)
        c_cov, c_guide = g.ltt_counts(n_cal, a)
        for c, what in ((c_cov, f"coverage >= {1 - a:g}"), (c_guide, f"guide-call rate <= {r:g}")):
            if c < 0:
                raise UserError(f"guide_cap: infeasible request (caps: coverage >= {1 - a:g}, guide-call rate <= "
                                f"{r:g}, delta {cfg.delta:g}): with {n_cal} calibration questions no outcome can "
                                f"show {what} at level delta/{g.families}; use more calibration questions or looser "
                                "caps", field=name)
    return r


def _cost_cap(name: str, v: Any, cfg: ReproduceConfig) -> float | None:
    """A budget > 0 on the mean cost per question (cents), with --guarantee pac and one threshold; whether
    the cache can meet it is checked against its prices when the run starts (:func:`check_cost_cap`)."""
    if v is None:
        return None
    try:
        c = float(v)
    except (TypeError, ValueError):
        raise UserError(f"cost_cap: must be a number of cents > 0, got {v!r}", field=name) from None
    if not (c > 0.0 and math.isfinite(c)):
        raise UserError(f"cost_cap: must be a number of cents > 0 (the largest mean cost per question), got {v!r}",
                        field=name)
    _cap_context(name, "cost_cap", cfg)
    return c


def check_cost_cap(cfg: ReproduceConfig, cost_max: float, where: str) -> None:
    """Refuse, before anything is written, a ``--cost-cap`` that caps nothing (at least ``cost_max``, the most
    a question of the cache can cost) or that no calibration outcome could pass (even a mean cost of 0
    fails the Hoeffding-Bentkus test at delta / the number of risks)."""
    cap = cfg.cost_cap
    if cap is None:
        return
    if cap >= cost_max:
        raise UserError(f"cost_cap: {cap:g} cents is at least the most a question of {where} can cost "
                        f"({cost_max:.6g} cents, every round reached), so it caps nothing; give a smaller budget "
                        "or drop --cost-cap", field="cost_cap")
    g = make_guarantee(cfg.guarantee, cfg.delta, cfg.guide_cap, cap)
    if g.cost_critical(cfg.split_sizes[1], cost_max) < 0:
        raise UserError(f"cost_cap: infeasible request (mean cost <= {cap:g} cents a question, delta {cfg.delta:g}): "
                        f"with {cfg.split_sizes[1]} calibration questions and a question costing up to "
                        f"{cost_max:.6g} cents, not even a mean cost of 0 passes the Hoeffding-Bentkus test at "
                        f"level delta/{g.families}; use more calibration questions or a larger budget",
                        field="cost_cap")


def _preset_iterations(cfg: RunOptions) -> int:
    return get_preset(cfg.preset).iterations


# -- the configurations --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The options of every CCPO run command: data, splits, trainer, execution (None = default)."""

    setting: str = option("--setting", help="setting name (see --list-settings)", metavar="NAME", default_doc=DEFAULT_SETTING,
                          check=_setting)
    cache: Any = option("--cache", metavar="PATH", help="response cache: a human-format .jsonl file or a fast-format directory "
                        "(from Python also a ResponseCache)", default_doc="the setting's built-in SYNTHETIC cache",
                        check=_cache, dump=_cache_json)
    n_splits: int = option("--splits", help="number of evaluation splits", metavar="N", type=int, default=100,
                           check=check_int("the number of splits", 1))
    protocol: str = option("--protocol", help="recalibrate: one policy per row, calibration/test redrawn per "
                           "split; retrain: every split trains its own policy", choices=PROTOCOLS,
                           default="recalibrate", check=_protocol)
    iterations: int | None = option("--iterations", help="training iterations", metavar="K", type=int,
                                    default_doc="the preset's: 100 default, 1500 paper",
                                    check=check_int("the number of iterations", 1), unset_means=_preset_iterations)
    split_sizes: tuple[int, int, int] = option(
        "--split-sizes", help="questions per split part, e.g. 60,20,20", metavar="TRAIN,CAL,TEST",
        default_doc="the setting's, 1000,200,200 HotpotQA / 560,200,200 MMLU", check=_split_sizes)
    seed: int = option("--seed", help="PRNG seed of splits, baselines and training", metavar="S", type=int,
                       default=0, check=check_int("the seed", 0))
    seeds: int = option("--seeds", help="training seeds of every learned row, trained in one vmapped program; "
                        "table.md shows the mean over seeds x splits and the spread over seeds", metavar="N",
                        type=int, default=5, check=check_int("the number of seeds", 1), if_missing=1)
    preset: str = option("--preset", help="trainer preset: default (the configuration that learns) or paper "
                         "(the paper's published values: batch 10, 1500 iterations, the J-bar estimator of Eq. 8); "
                         "see --list-presets", metavar="NAME", default="default", check=_preset,
                         if_missing="default")
    overrides: tuple[str, ...] = option(
        "--set", help="set one trainer field on top of the preset, e.g. --set batch_size=100 --set "
        "estimator=vtrace (fields and values: --list-presets)", metavar="FIELD=VALUE", repeat=True, default=(),
        check=_overrides, if_missing=())
    # execution options: not saved; a resumed run may use others
    out_dir: Path | None = option("--out", help="output directory, must not exist", metavar="DIR",
                                  default_doc="runs/<setting>-<timestamp>", saved=False, check=_path)
    resume: Path | None = option("--resume", help="continue the killed run whose --out was DIR, with its saved "
                                 "configuration (options given with it must equal the saved ones)", metavar="DIR",
                                 saved=False, check=_path)
    devices: int | str | None = option("--devices", help="shard the training's members over N devices (all: every "
                                       "device; on a CPU host one per core); on a CPU host N devices are forced "
                                       "with XLA_FLAGS=--xla_force_host_platform_device_count=N", metavar="N|all",
                                       default_doc="1", saved=False)
    member_block: int | None = option("--member-block", help="train members B at a time, one single-device program "
                                      "per device: bit-identical to a one-device run with the same B", metavar="B",
                                      type=int, default_doc="recalibrate: none (one vmap of all members; with "
                                      "--devices one SPMD program); retrain: one split's learned rows x seeds; "
                                      "sweep: one reproduce run's rows x seeds",
                                      saved=False, check=check_int("the member block", 1))
    progress: bool = option("--no-progress", help="no progress bar", switch=False, default=True, saved=False)
    discard_failed: bool = option("--discard-failed", help="when the run fails, remove its work directory and "
                                  "checkpoints too (by default a failed run keeps them for --resume)", switch=True,
                                  default=False, saved=False)

    def __post_init__(self) -> None:
        options.resolve(self)

    def train_config(self) -> TrainConfig:
        """The trainer configuration of this run: the preset, the overrides, the iterations (alpha is
        the run's, on every ``Variant``)."""
        cfg = apply_overrides(get_preset(self.preset), self.overrides)
        return cfg if self.iterations is None else cfg.replace(iterations=int(self.iterations))

    @property
    def run_alphas(self) -> tuple[float, ...]:
        """The alphas this run calibrates at: reproduce's one, a sweep's grid (each command says)."""
        raise NotImplementedError(type(self).__name__)


@dataclasses.dataclass(frozen=True)
class ReproduceConfig(RunOptions):
    """``ccpo-jax reproduce``: one paper table at the setting's (or a given) alpha."""

    alpha: float = option("--alpha", help="miscoverage in (0, 1)", metavar="A", type=float,
                          default_doc="the setting's", check=_alpha)
    lambdas: tuple[float, ...] = option(None, help="the table's nonzero CCPO lambdas (CCPO (lambda=0) always "
                                        "runs)", derived=True, check=_setting_lambdas)
    calibration: Calibration = option("--calibration", help="marginal: one threshold for all questions; mondrian: also "
                              "calibrate every calibrated row per question group (the cache's 'group'), reported as "
                              "'ROW [Mondrian]' beside it, with per-group coverage for both", choices=CALIBRATIONS,
                              default="marginal", check=_calibration, if_missing="marginal")
    group_min: int = option("--group-min", help="with --calibration mondrian: a group needs at least N calibration "
                            "questions for its own threshold; smaller groups are pooled into one 'rest' group",
                            metavar="N", type=int, default=GROUP_MIN, check=check_int("the smallest group", 1),
                            if_missing=GROUP_MIN)
    guarantee: str = _guarantee_option()
    delta: float | None = _delta_option()
    guide_cap: float | None = option("--guide-cap", help="with --guarantee pac: also cap the share of questions "
                                     "that call the guide at R; each calibrated row's threshold is chosen by Learn "
                                     "then Test over a grid, both caps holding with probability 1 - delta",
                                     metavar="R", type=float, check=_guide_cap, if_missing=None)
    cost_cap: float | None = option("--cost-cap", help="with --guarantee pac: also cap the mean cost per question "
                                    "at CENTS (Hoeffding-Bentkus test of a bounded loss); with --guide-cap too, "
                                    "delta is split over three risks", metavar="CENTS", type=float, check=_cost_cap,
                                    if_missing=None)

    @property
    def run_alphas(self) -> tuple[float, ...]:
        return (self.alpha,)

    @functools.cached_property
    def guarantee_of(self) -> Guarantee:
        """The run's guarantee object (``--guarantee``, ``--delta``, the caps), built once: the one lookup every
        calibrated threshold, results.json and the saved policies read. (The field checks, which run while
        the configuration is built, call :func:`make_guarantee` themselves: this caches the finished one.)"""
        return make_guarantee(self.guarantee, self.delta, self.guide_cap, self.cost_cap)


#: reproduce's fields -> its flags (error messages name the flag).
REPRODUCE_FLAGS = options.flag_names(ReproduceConfig)


def _grid(name: str, v: Any, what: str, ok, rule: str) -> tuple[float, ...]:
    """A comma-separated (or sequence) grid of numbers: non-empty, each ``ok``, strictly increasing."""
    items = [x for x in v.split(",")] if isinstance(v, str) else list(v)
    if isinstance(v, str) and not v.strip():
        items = []
    try:
        grid = tuple(float(str(x).strip()) for x in items)
    except ValueError:
        raise UserError(f"{name}: expected numbers separated by commas, e.g. {what}, got {v!r}", field=name) from None
    if not grid:
        raise UserError(f"{name}: the grid is empty; give one or more values, e.g. {what}", field=name)
    bad = [x for x in grid if not ok(x)]
    if bad:
        raise UserError(f"{name}: {bad[0]:g} is not {rule}", field=name)
    for x in grid:
        why = _float32_problem(x, ok, rule)
        if why:
            raise UserError(f"{name}: {why}", field=name)
    g32 = [options.as_float32(x) for x in grid]
    same = [(a, b) for a, b, a32, b32 in zip(grid, grid[1:], g32, g32[1:]) if a < b and a32 >= b32]
    if same:  # distinct in float64, one value for the trainer: two rows (points) that are one
        raise UserError(f"{name}: {same[0][0]!r} and {same[0][1]!r} are one value in float32, the precision the "
                        "trainer computes in; give values that differ in float32", field=name)
    if any(b <= a for a, b in zip(grid, grid[1:])):
        dup = sorted({x for x in grid if grid.count(x) > 1})
        why = f"{dup[0]:g} is given twice" if dup else "the values are not in increasing order"
        raise UserError(f"{name}: {why}; give them increasing, e.g. {','.join(f'{x:g}' for x in sorted(set(grid)))}",
                        field=name)
    return grid


def _alphas(name: str, v: Any, cfg: SweepConfig) -> tuple[float, ...]:
    """The alpha grid; an alpha whose calibration split is too small for a threshold (the conformal
    rank exceeds n_cal, so kappa-hat = 0 and every set holds everything) is refused with the size needed."""
    from ccpo_jax.core.conformal import calibration_size_warning, conformal_rank_f64

    grid = _grid(name, v, "0.05,0.1,0.15,0.2", lambda a: 0.0 < a < 1.0, "in (0, 1) (target coverage 1 - alpha)")
    n_cal = cfg.split_sizes[1]
    for a in grid:
        if conformal_rank_f64(n_cal, a) > n_cal:
            raise UserError(f"{name}: alpha {a:g}: {calibration_size_warning(n_cal, a)}", field=name)
    return grid


def _lambdas(name: str, v: Any, cfg: RunOptions) -> tuple[float, ...]:
    return _grid(name, v, "0,1e-4,2e-4", lambda x: 0.0 <= x < float("inf"), "a finite lambda >= 0")


@dataclasses.dataclass(frozen=True)
class SweepConfig(RunOptions):
    """``ccpo-jax sweep``: the cost-coverage frontier, every learned row x alpha x lambda x seed in one program."""

    out_dir: Path | None = option("--out", help="output directory, must not exist", metavar="DIR",
                                  default_doc="runs/sweep-<setting>-<timestamp>", saved=False, check=_path)
    alphas: tuple[float, ...] = option("--alphas", help="the alpha grid (target coverage 1 - alpha), increasing",
                                       metavar="A1,A2,...", default=(0.05, 0.1, 0.15, 0.2), check=_alphas)
    lambdas: tuple[float, ...] = option("--lambdas", help="the CCPO set-size penalties, increasing; 0 is the row "
                                        "CCPO (lambda=0)", metavar="L1,L2,...", default=(0.0, 1e-4, 2e-4),
                                        check=_lambdas)
    guarantee: str = _guarantee_option()
    delta: float | None = _delta_option()

    @property
    def run_alphas(self) -> tuple[float, ...]:
        return self.alphas

    @functools.cached_property
    def guarantee_of(self) -> Guarantee:
        """The sweep's guarantee object, built once (as :attr:`ReproduceConfig.guarantee_of`; no caps in a sweep)."""
        return make_guarantee(self.guarantee, self.delta)


#: A run command's configuration: what the learned rows, the calibration and ``prepare`` read.
RunConfig = Union[ReproduceConfig, SweepConfig]

SWEEP_FLAGS = options.flag_names(SweepConfig)


# -- ccpo-jax export ------------------------------------------------------------------------

def _required_path(name: str, v: Any, cfg: ExportConfig) -> Path:
    if v is None:
        raise UserError(f"{name}: required", field=name)
    return Path(v)


def _export_guarantee(name: str, v: Any, cfg: ExportConfig) -> str | None:
    if v is not None and v not in GUARANTEES:
        raise UserError(f"guarantee: unknown guarantee {v!r}; valid: {', '.join(GUARANTEES)}", field=name)
    return v


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """``ccpo-jax export``: which row of a run becomes a router artefact, and where it goes
    (:func:`ccpo_jax.ccpo.export.export_router` takes these fields as its arguments)."""

    run_dir: Path = option("RUN_DIR", help="the --out of 'ccpo-jax reproduce' (or one policy folder)",
                           check=_required_path)
    row: str | None = option("--row", help="row name or slug, e.g. 'CPO batch', 'CCPO (lambda=0) [ensemble]' "
                             "(a row's own name exports its kept seed)", metavar="ROW",
                             default_doc="the cheapest calibrated row, by the saved policy's test cost (a kept seed's "
                             "or an ensemble's), whose calibration coverage holds and whose router is not "
                             "degenerate; with --calibration mondrian among the rows with per-group thresholds")
    force: bool = option("--force", help="export a degenerate router anyway (kappa-hat 0, or every action in the set "
                         "for >= 90%% of calibration questions)", switch=True, default=False)
    calibration: Calibration = option("--calibration", help="mondrian: the router carries the row's per-group "
                                      "thresholds (a run of 'reproduce --calibration mondrian') and takes a request's "
                                      "'group'", choices=CALIBRATIONS, default="marginal",
                                      default_doc="marginal, one threshold", check=_calibration)
    guarantee: str | None = option("--guarantee", help="the guarantee the router must carry: the run's thresholds "
                                   "were chosen by 'reproduce --guarantee', so another one is refused",
                                   choices=GUARANTEES, default_doc="the run's; the manifest and every decision "
                                   "state it with alpha and delta", check=_export_guarantee)
    out: Path = option("--out", help="output directory (must not exist)", metavar="ARTIFACT", required=True,
                       check=_required_path)

    def __post_init__(self) -> None:
        options.resolve(self)


EXPORT_FLAGS = options.flag_names(ExportConfig)
