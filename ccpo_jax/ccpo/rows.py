"""The learned rows of the paper's tables: CPO, CPO batch, CPO online and the CCPO rows.

:func:`learned_rows` is what ``ccpo-jax reproduce`` calls (:mod:`ccpo_jax.ccpo.reproduce`):
it trains the row variants (:func:`row_variants`) for several seeds in one program
(:func:`train_seeds` -> :func:`ccpo_jax.ccpo.members.train_many`), evaluates them on every
split (:func:`ccpo_jax.ccpo.evaluation.evaluate_trained`), adds each calibrated row's kept-seed twin
(:func:`kept_seeds`: the seed a user would deploy, chosen on its own training questions) and saves
the kept seeds' policies (:mod:`ccpo_jax.ccpo.policy_store`). Rows follow arXiv 2511.11828 section 5: ``CPO`` is the
pointwise policy, ``CPO batch`` / ``CPO online`` its sets with a calibrated / the online
kappa (Eq. 10), ``CCPO (lambda=l)`` the conformally trained policy's calibrated sets.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.ccpo.evaluation import (GroupSpec, MemberEval, calibrated_rows, calibration_diagnostics,
                                      evaluate_members, variant_group_rows, variant_ltt, variant_rows)
from ccpo_jax.ccpo.members import train_many
from ccpo_jax.ccpo.policy_store import POLICIES_DIR, policy_row, save_policies
from ccpo_jax.ccpo.rowid import CPO, CPO_BATCH, CPO_ONLINE, Twin, lambda_row
from ccpo_jax.ccpo.splits import Splits
from ccpo_jax.ccpo.calibration import group_spec
from ccpo_jax.core.guarantee import Guarantee, Marginal
from ccpo_jax.errors import UserError
from ccpo_jax.runtime.execution import Execution
from envs.cache.schema import ResponseCache
from envs.replay.env import EnvParams

@dataclasses.dataclass
class LearnedRows:
    """What a trainer returns to the pipeline.

    rows:   row name -> metric (``ccpo_jax.ccpo.settings.METRICS``) -> np.ndarray [N seeds, S splits]
            (or [S] for one seed);
    timing: ``compile_s``, ``train_s``, ``eval_s`` in seconds (missing keys count 0).
    """

    rows: dict[str, dict[str, np.ndarray]]
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    groups: dict[str, Any] | None = None
    """With a group-conditional calibration (``groups=`` given): ``{"names": [G], "n_cal": [S, G],
    "n_test": [S, G], "group_min": int, "rows": {row: {"coverage", "cost_cents", "kappa", "own":
    [N, S, G]}}}`` for every calibrated row and its Mondrian twin (``rows`` holds the twins' metrics)."""
    ltt: dict[str, Any] | None = None
    """With a cap (``--guide-cap``, ``--cost-cap``): ``{row: {"feasible", "guide_rate", "cal_guide_rate", ...: [N, S]}}``
    for every calibrated row (:func:`ccpo_jax.ccpo.evaluation.variant_ltt`)."""
    kept: dict[str, dict[str, Any]] | None = None
    """With several seeds: ``{row [kept seed]: {"seed": [S_train], "train_cost_cents": [S_train][N]}}``, how
    each kept-seed twin chose its seed on each training split (:func:`kept_seeds`)."""


@dataclasses.dataclass(frozen=True)
class RunData:
    """What the learned rows train and evaluate on: the cache, its replay env, the splits and the
    training key (``ccpo_jax.ccpo.prepare.prepare`` makes it for ``reproduce`` and ``sweep``)."""

    cache: ResponseCache
    params: EnvParams
    splits: Splits
    key: jax.Array


class RunSpec(Protocol):
    """What the learned rows read of a run configuration (``ReproduceConfig``, ``SweepConfig``, :class:`RowsRun`)."""

    @property
    def lambdas(self) -> tuple[float, ...]: ...
    @property
    def seeds(self) -> int: ...
    @property
    def protocol(self) -> str: ...
    @property
    def run_alphas(self) -> tuple[float, ...]: ...
    @property
    def guarantee_of(self) -> Guarantee: ...
    def train_config(self) -> TrainConfig: ...


class TableSpec(RunSpec, Protocol):
    """A run of one table (``ReproduceConfig``, :class:`RowsRun`): its alpha and calibration as well."""

    @property
    def alpha(self) -> float: ...
    @property
    def calibration(self) -> str: ...
    @property
    def group_min(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class RowsRun:
    """The run configuration the learned rows read, for a caller without a command's configuration
    (experiments, tests): the trainer configuration, the table's lambdas, seeds, protocol (and, for
    :func:`train_sweep`, the alphas), the calibration and its guarantee. A run of ``reproduce`` passes its
    ``ReproduceConfig`` instead."""

    config: TrainConfig
    lambdas: tuple[float, ...] = ()
    seeds: int = 1
    protocol: str = "recalibrate"
    alpha: float = 0.1
    alphas: tuple[float, ...] = ()
    calibration: str = "marginal"
    group_min: int = 20
    guarantee_of: Guarantee = Marginal()

    def train_config(self) -> TrainConfig:
        return self.config

    @property
    def run_alphas(self) -> tuple[float, ...]:
        return self.alphas or (self.alpha,)


class LearnedRowsFn(Protocol):
    """The trainer the pipeline calls (:func:`learned_rows`, or a stand-in in tests): the run
    configuration (``ccpo_jax.ccpo.run_config.ReproduceConfig``), the data and the execution."""

    def __call__(self, run: TableSpec, data: RunData, execution: Execution) -> LearnedRows: ...


def twin_name(row: str, kind: Twin) -> str:
    """The name of ``row``'s ``kind`` twin (:attr:`ccpo_jax.ccpo.rowid.RowId.name`'s rule, for a row this module
    knows by its variant's row name): ``CCPO (lambda=0) [kept seed]``."""
    return row + kind.value


#: Name of the CPO variant that serves the calibrated CPO rows when the margins differ.
CPO_CALIBRATED = "CPO (calibrated)"


def row_variants(lambdas: tuple[float, ...], config: TrainConfig | None = None, alpha: float = 0.1) -> list[Variant]:
    """CPO (gives rows CPO, CPO batch, CPO online), CCPO (lambda=0) and CCPO (lambda=l) for each l,
    all at the run's ``alpha`` (``Variant.alpha``, what the trainer reads).

    When ``config.pointwise_z`` differs from ``config.constraint_z`` (the default preset), CPO
    trains twice: ``CPO`` at the pointwise margin serves the row CPO, ``CPO (calibrated)`` at the
    calibrated rows' margin serves CPO batch and CPO online."""
    a = float(alpha)
    if config is None or config.pointwise_z == config.constraint_z:
        out = [Variant(CPO.name, conformal=False, lam=0.0, alpha=a)]
    else:
        out = [Variant(CPO.name, conformal=False, lam=0.0, rows=(CPO.name,), alpha=a),
               Variant(CPO_CALIBRATED, conformal=False, lam=0.0, z=config.constraint_z,
                       rows=(CPO_BATCH.name, CPO_ONLINE.name),
                       alpha=a)]
    out += [Variant(lambda_row(0.0).name, conformal=True, lam=0.0, alpha=a)]
    out += [Variant(lambda_row(lam).name, conformal=True, lam=float(lam), alpha=a) for lam in lambdas if lam != 0.0]
    return out


def run_batch(n_variants: int, seeds: int) -> int:
    """The vmapped batch every member of a ``reproduce`` run is computed in: its learned rows x seeds
    (the members of one training split). XLA picks its kernels, and so the last bit of rounding that
    the CPO step amplifies, by the batch shape (``ccpo_jax.runtime.sharding.blocked_vmap``): a member
    computed in a batch of this size, alone or in blocks, runs the program of a reproduce run."""
    return int(n_variants) * int(seeds)


@dataclasses.dataclass
class TrainedRows:
    """What :func:`train_seeds` returns.

    rows:    row name -> metric -> np.ndarray [N seeds, S splits]
    kappas:  row name -> calibrated (or online) kappa [N, S]
    state:   the trained TrainState, leaves [V, S_train, N, ...]
    curves:  variant name -> metric -> np.ndarray [S_train * N, iterations]
    timing:  compile_s, train_s, eval_s
    groups:  with ``groups=``: row -> per-group arrays (:func:`ccpo_jax.ccpo.evaluation.variant_group_rows`)
    ev:      the :class:`ccpo_jax.ccpo.evaluation.MemberEval` the rows come from
    """

    rows: dict
    kappas: dict
    state: Any
    variants: list
    curves: dict
    timing: dict
    groups: dict = dataclasses.field(default_factory=dict)
    ev: Any = None
    ltt: dict = dataclasses.field(default_factory=dict)
    kept: dict = dataclasses.field(default_factory=dict)
    """calibrated row -> its kept seed on every training split [S_train] and the in-sample costs [N, S_train]
    (:func:`kept_seeds`; empty for one seed)."""


def member_keys(key: jax.Array, names: list[str], n: int) -> jax.Array:
    """One PRNG key per (variant, member) [V, n, 2]: variant ``names[v]``'s n keys split from
    ``fold_in(key, crc32(name))``. A row's policies therefore depend on its name, the seed and the
    data, not on which other rows train beside it: a sweep's point equals the ``reproduce`` run at
    the same alpha and seed (:mod:`ccpo_jax.ccpo.sweep`), and adding a lambda changes no other row."""
    return jax.numpy.stack([jax.random.split(jax.random.fold_in(key, zlib.crc32(nm.encode())), n) for nm in names])


def kept_seeds(run: RunSpec, data: RunData, variants: list[Variant], state, train_idx: np.ndarray
               ) -> list[dict[str, np.ndarray]]:
    """Of each variant's N seeds, the one a user would deploy, per training split: the seed whose calibrated
    sets cost least on the training questions it was trained on, its threshold fitted on those same
    questions (in-sample, under the run's guarantee). No calibration or test question is looked at, so
    the kept seed's test figures are as honest as any seed's.

    ``state`` leaves are [V, S_train, N, ...], ``train_idx`` [S_train, n_train]. Returns per variant
    ``{"seed": int [S_train], "train_cost_cents": [N, S_train]}`` (ties: the lowest seed; under a cap a
    seed without a feasible threshold never wins unless none has one, then seed 0). Measured over 25
    training-split draws of five SYNTHETIC Table 2-5 settings, the kept seed cost less on the test splits
    than the seeds' mean on 21 (``experiments/learnable_gap_splits.py --select-train``; docs/results.md)."""
    ev = evaluate_members(run.train_config(), data.params, variants, state, train_idx, train_idx,
                          jax.random.PRNGKey(0), retrain=True, guarantee=run.guarantee_of)
    out = []
    for v in range(len(variants)):
        cost = np.asarray(ev.batch["cost_cents"][v], np.float64)  # [N, S_train]
        if ev.ltt is not None:
            cost = np.where(np.asarray(ev.ltt["feasible"][v], bool), cost, np.inf)
        seed = np.where(np.isfinite(cost).any(axis=0), np.argmin(cost, axis=0), 0)
        out.append({"seed": seed.astype(np.int64), "train_cost_cents": cost})
    return out


def kept_seed_rows(var: Variant, rows: dict[str, dict[str, np.ndarray]], kept: dict[str, np.ndarray],
                   retrain: bool) -> dict[str, dict[str, np.ndarray]]:
    """The kept-seed twin of each calibrated row of ``var`` (``rows``: its rows, ``{row: {metric: [N, S]}}``;
    ``kept``: its entry of :func:`kept_seeds`): ``{row [kept seed]: {metric: [1, S]}}``, on split s the kept seed
    of the policy evaluated there (its own training split's under ``retrain``; the one under
    ``recalibrate``)."""
    return {twin_name(row, Twin.KEPT_SEED): {m: kept_seed_values(x, kept, retrain) for m, x in rows[row].items()}
            for row in calibrated_rows(var) if row in rows}


def kept_seed_values(x, kept: dict[str, np.ndarray], retrain: bool) -> np.ndarray:
    """``x`` [N, S] at the kept seed of every split: [1, S] (one seed)."""
    x = np.asarray(x)
    seed = kept["seed"] if retrain else np.broadcast_to(kept["seed"][:1], (x.shape[1],))
    return x[seed, np.arange(x.shape[1])][None]


def twin_variants(variants: list[Variant]) -> list[int]:
    """The indices of the variants whose rows get seed twins: those with calibrated rows (not the pointwise-only
    CPO variant of the default preset)."""
    return [v for v, var in enumerate(variants) if calibrated_rows(var)]


def ensemble_rows(var: Variant, ev: MemberEval, v: int) -> tuple[dict[str, dict[str, np.ndarray]], dict, dict]:
    """The ensemble twin of each calibrated row of ``var`` from ``ev``, the evaluation of every variant's seeds
    as one policy (``evaluate_members(..., ensemble=True)``): ``{row [ensemble]: {metric: [1, S]}}``, its
    calibrated kappas ``{row [ensemble]: [1, S]}`` and under a cap its Learn-then-Test outcome."""
    rows, kappas = variant_rows(var, ev, v)
    ltt = variant_ltt(var, ev, v)
    keep = calibrated_rows(var)
    ens = {r: twin_name(r, Twin.ENSEMBLE) for r in keep}
    return ({ens[r]: rows[r] for r in keep}, {ens[r]: kappas[r] for r in keep},
            {ens[r]: ltt[r] for r in keep if r in ltt})


def _train_and_evaluate(run: RunSpec, variants: list[Variant], data: RunData, execution: Execution,
                        key_names: list[str], groups: GroupSpec | None = None):
    """Train ``variants`` x training splits x ``run.seeds`` in one program and evaluate every member on
    every split: (state [V, S_train, N, ...], :class:`MemberEval`, curves, timing, the kept seeds of every
    variant with calibrated rows (``{v: kept_seeds entry}``; {} for one seed), the seeds as one ensemble
    policy (a :class:`MemberEval` of those variants, one member each, and ``{v: its index there}``; None for
    one seed))."""
    config, splits = run.train_config(), data.splits
    N = int(run.seeds)
    if N < 1:
        raise UserError(f"seeds={run.seeds}: must be >= 1")
    retrain = run.protocol == "retrain"
    train_idx = np.asarray(splits.train) if retrain else np.asarray(splits.train)[:1]
    S_t = train_idx.shape[0]
    k_train, k_eval = jax.random.split(data.key)
    state, metrics, timing = train_many(config, data.params, variants, np.repeat(train_idx, N, axis=0),
                                        member_keys(k_train, key_names, S_t * N), execution)
    # the trained state on the host from here: its reshapes and the twins' and diagnostics' slices are exact
    # copies either way, and as NumPy operations they compile nothing (on jax arrays each was an eager XLA
    # program, about 60 per default reproduce; docs/performance.md)
    state = jax.tree.map(lambda x: np.asarray(x).reshape((x.shape[0], S_t, N) + x.shape[2:]), jax.device_get(state))
    t0 = time.perf_counter()
    execution.status(f"evaluating {len(variants)} learned variant(s) x {N} seed(s) on {np.shape(splits.test)[0]} "
                     "splits (calibrating each threshold, then the test split) ...")
    ev = evaluate_members(config, data.params, variants, state, np.asarray(splits.cal), np.asarray(splits.test), k_eval,
                          retrain, groups, run.guarantee_of)
    kept, ens = {}, None
    twin_v = twin_variants(variants)
    if N > 1 and twin_v:
        execution.status("choosing each calibrated row's kept seed and evaluating its seeds as one ensemble ...")
        sub, sub_state = [variants[v] for v in twin_v], jax.tree.map(lambda x: x[np.asarray(twin_v)], state)
        kept = dict(zip(twin_v, kept_seeds(run, data, sub, sub_state, train_idx)))
        ens = (evaluate_members(config, data.params, sub, sub_state, np.asarray(splits.cal), np.asarray(splits.test),
                                k_eval, retrain, None, run.guarantee_of, ensemble=True),
               {v: j for j, v in enumerate(twin_v)})
    timing = dict(timing, eval_s=time.perf_counter() - t0)
    curves = {var.name: {k: v[i] for k, v in metrics.items()} for i, var in enumerate(variants)}
    return state, ev, curves, timing, kept, ens


def train_seeds(run: TableSpec, data: RunData, execution: Execution) -> TrainedRows:
    """Train the learned rows (:func:`row_variants`) for ``run.seeds`` seeds and evaluate them on every split.

    ``run``: the run configuration (``ReproduceConfig``: ``train_config()``, ``lambdas``, ``seeds``,
    ``protocol``, ``calibration``, the guarantee). All variants x training splits x seeds are members
    of one vmapped program; seed n of every member starts from its own key (:func:`member_keys`).
    Under ``recalibrate`` each seed trains once on ``splits.train[0]`` and is recalibrated on every
    split; under ``retrain`` every (split, seed) pair trains its own policy. With ``--calibration
    mondrian`` every calibrated row also gets its group-conditional (Mondrian) twin, ``ROW [Mondrian]``,
    from the same trained policies. The guarantee (default marginal) chooses the order statistic
    every calibrated threshold takes (:mod:`ccpo_jax.core.guarantee`).
    """
    variants = row_variants(tuple(run.lambdas), run.train_config(), run.alpha)
    groups = group_spec(run, data.cache)
    state, ev, curves, timing, kept, ens = _train_and_evaluate(run, variants, data, execution,
                                                               [v.name for v in variants], groups)
    rows: dict = {}
    kappas: dict = {}
    per_group: dict = {}
    ltt: dict = {}
    chosen: dict = {}
    for v, var in enumerate(variants):
        ltt.update(variant_ltt(var, ev, v))
        r, k = variant_rows(var, ev, v)
        rows.update(r)
        kappas.update(k)
        if v in kept:
            retrain = run.protocol == "retrain"
            rows.update(kept_seed_rows(var, r, kept[v], retrain))
            chosen.update({row: kept[v] for row in calibrated_rows(var)})
            ltt.update({twin_name(row, Twin.KEPT_SEED): {k: kept_seed_values(x, kept[v], retrain)
                                                         for k, x in ltt[row].items()}
                        for row in calibrated_rows(var) if row in ltt})
        if ens is not None and v in ens[1]:
            r_e, k_e, l_e = ensemble_rows(var, ens[0], ens[1][v])
            rows.update(r_e)
            kappas.update(k_e)
            ltt.update(l_e)
        twins, g = variant_group_rows(var, ev, v)
        rows.update(twins)
        per_group.update(g)
    return TrainedRows(rows=rows, kappas=kappas, state=state, variants=variants, curves=curves, timing=timing,
                       groups=per_group, ev=ev, ltt=ltt, kept=chosen)


def alpha_name(name: str, alpha: float) -> str:
    """A sweep variant's name: the row variant's at one alpha, e.g. ``CCPO (lambda=0) @ alpha=0.05``."""
    return f"{name} @ alpha={alpha:g}"


def train_sweep(run: RunSpec, data: RunData, execution: Execution
                ) -> tuple[dict[float, dict[str, dict[str, np.ndarray]]], dict[str, float]]:
    """Every learned row x alpha x seed (x training split under ``retrain``) as members of ONE
    vmapped program (alpha is traced data, ``Variant.alpha``), each member calibrated and
    evaluated at its own alpha on every split. ``run``: the sweep's configuration (``SweepConfig``:
    ``alphas``, ``lambdas``, ``seeds``, ``protocol``, the guarantee). The row variant at alpha a has
    the keys of the same row in ``train_seeds`` (:func:`member_keys`), so it equals a ``reproduce``
    run at alpha a.

    Returns ``{alpha: {row: {metric: [N seeds, S splits]}}}`` and the timing."""
    lambdas, config = run.lambdas, run.train_config()
    base = row_variants(tuple(lam for lam in lambdas if lam != 0.0), config)
    if 0.0 not in [float(x) for x in lambdas]:  # CCPO (lambda=0) only when asked for
        base = [v for v in base if not (v.conformal and v.lam == 0.0)]
    variants = [dataclasses.replace(v, name=alpha_name(v.name, a), alpha=float(a), rows=v.table_rows())
                for a in run.run_alphas for v in base]
    state, ev, _, timing, kept, ens = _train_and_evaluate(run, variants, data, execution,
                                                          [v.name for a in run.run_alphas for v in base])
    out: dict[float, dict[str, dict[str, np.ndarray]]] = {}
    for v, var in enumerate(variants):
        rows = variant_rows(var, ev, v)[0]
        if v in kept:
            rows.update(kept_seed_rows(var, rows, kept[v], run.protocol == "retrain"))
        if ens is not None and v in ens[1]:
            rows.update(ensemble_rows(var, ens[0], ens[1][v])[0])
        out.setdefault(float(var.alpha), {}).update(rows)
    return out, timing


def learned_rows(run: TableSpec, data: RunData, execution: Execution) -> LearnedRows:
    """Train and evaluate the learned rows; save each row's split-0 policy of its kept seed
    (:func:`saved_seed`) beside ``execution.ckpt_dir``.

    ``run`` is the run configuration (:func:`train_seeds`), its ``lambdas`` the table's nonzero
    lambdas (CCPO (lambda=0) always trains); ``data.splits.train`` is [S, n_train],
    ``cal``/``test`` [S, n]. Checkpoints go to ``execution.ckpt_dir`` (a run killed there resumes
    from them), live training curves to ``execution.tb_dir``, the policies to
    ``ckpt_dir/../policies``. Rows hold [N seeds, S splits] arrays. With ``--calibration
    mondrian`` every calibrated row gets its Mondrian twin and the per-group outcome
    (:attr:`LearnedRows.groups`); the saved policies carry their per-group thresholds (saved seed,
    split 0) for ``ccpo-jax export``. The run's guarantee chooses every calibrated threshold's
    order statistic and is saved with the policies.
    """
    trained = train_seeds(run, data, execution)
    config, params, splits, cache, protocol = run.train_config(), data.params, data.splits, data.cache, run.protocol
    groups, guarantee, ckpt_dir = group_spec(run, cache), run.guarantee_of, execution.ckpt_dir
    diagnostics, seeds = {}, {}
    for v, var in enumerate(trained.variants):
        row = policy_row(var)
        if row is None:
            continue
        seed = saved_seed(trained, row)
        if row in trained.kept:
            seeds[row] = seed
        kept_row, ens_row = twin_name(row, Twin.KEPT_SEED), twin_name(row, Twin.ENSEMBLE)
        served = kept_row if kept_row in trained.rows else row  # the saved seed's own figures
        pol = jax.tree.map(lambda x: x[v, 0, seed], trained.state.policy)
        d = calibration_diagnostics(pol, params, float(np.asarray(trained.kappas[row])[seed, 0]),
                                    np.asarray(splits.cal)[0], var.alpha, config.hidden)
        d["test_cost_cents_mean"] = _finite_mean(trained.rows[served]["cost_cents"])
        d["test_coverage_mean"] = _finite_mean(trained.rows[served]["coverage"])
        if row in trained.ltt:  # the saved threshold (split 0) passed both tests, or not
            d["ltt_feasible"] = bool(trained.ltt[row]["feasible"][seed, 0])
        diagnostics[row] = d
        if ens_row in trained.rows:  # every seed of split 0 as one policy
            members = jax.tree.map(lambda x: x[v, 0], trained.state.policy)
            d = calibration_diagnostics(members, params, float(np.asarray(trained.kappas[ens_row])[0, 0]),
                                        np.asarray(splits.cal)[0], var.alpha, config.hidden, ensemble=True)
            d["test_cost_cents_mean"] = _finite_mean(trained.rows[ens_row]["cost_cents"])
            d["test_coverage_mean"] = _finite_mean(trained.rows[ens_row]["coverage"])
            if ens_row in trained.ltt:
                d["ltt_feasible"] = bool(trained.ltt[ens_row]["feasible"][0, 0])
            diagnostics[ens_row] = d
    mondrian = None if groups is None else mondrian_thresholds(trained, groups)
    save_policies(Path(ckpt_dir).parent / POLICIES_DIR, config, trained.variants, trained.state, trained.kappas,
                  cache, protocol, diagnostics, mondrian, guarantee, seeds, ensembles=True)
    group_out = None
    if groups is not None:
        group_out = {"names": list(groups.names), "group_min": groups.group_min, "n_cal": trained.ev.groups.n_cal,
                     "n_test": trained.ev.groups.n_test, "rows": trained.groups}
    return LearnedRows(rows=trained.rows, timing=trained.timing, groups=group_out, ltt=trained.ltt or None,
                       kept=kept_json(trained.kept) or None)


def kept_json(kept: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, list]]:
    """results.json's ``kept_seed`` of every twin: ``{row [kept seed]: {"seed": [S_train], "train_cost_cents":
    [S_train][N]}}``, plain numbers; a seed without a feasible threshold under a cap (cost inf) is null."""
    return {twin_name(row, Twin.KEPT_SEED): {"seed": [int(s) for s in k["seed"]],
                              "train_cost_cents": [[float(c) if np.isfinite(c) else None for c in per]
                                                   for per in np.asarray(k["train_cost_cents"]).T]}
            for row, k in kept.items()}


def saved_seed(trained: TrainedRows, row: str) -> int:
    """The seed whose split-0 policy of ``row`` ``ccpo-jax export`` serves: the kept seed of the first training
    split (:func:`kept_seeds`), seed 0 when there is one seed."""
    return int(trained.kept[row]["seed"][0]) if row in trained.kept else 0


def _finite_mean(x) -> float:
    """The mean over the finite entries (a guide cap leaves NaN on the splits without a threshold)."""
    x = np.asarray(x, np.float64)
    ok = np.isfinite(x)
    return float(np.mean(x[ok])) if ok.any() else float("nan")


def mondrian_thresholds(trained: TrainedRows, groups: GroupSpec) -> dict[str, dict]:
    """Each calibrated row's group-conditional thresholds of its saved seed (:func:`saved_seed`) on split 0,
    as saved with its policy: ``{row: {"group_min", "kappas": {group: kappa} (own groups), "rest_kappa",
    "rest_groups": [...] (pooled), "n_cal": {group: n}}}``."""
    ge = trained.ev.groups
    out = {}
    for v, var in enumerate(trained.variants):
        row = policy_row(var)
        if row is None:
            continue
        seed = saved_seed(trained, row)
        kap, own, n_cal = np.asarray(ge.kappa[v, seed, 0]), np.asarray(ge.own[v, seed, 0]), ge.n_cal[0]
        names = groups.names
        out[row] = {"group_min": groups.group_min,
                    "kappas": {names[g]: float(kap[g]) for g in range(len(names)) if own[g]},
                    "rest_kappa": float(kap[len(names)]),
                    "rest_groups": [names[g] for g in range(len(names)) if not own[g]],
                    "n_cal": {names[g]: int(n_cal[g]) for g in range(len(names))}}
    return out
