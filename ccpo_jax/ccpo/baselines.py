"""The non-learned baselines of the paper's tables (arXiv 2511.11828 §5): Random, LLM policy, LLM-EXIT, UALA.

Each ``*_rows`` function returns per-question :class:`envs.replay.env.SetMetrics`
for one split and is pure, so it jits and vmaps over splits.
:func:`non_learned_rows` evaluates every row the cache supports for S splits
in one compiled call. Rows whose data the cache lacks are absent, not faked.

Readings where the paper is silent ([ours]):

* **Random** picks uniformly among the *available* actions: (base, guide,
  next) w.p. 1/3 each, and (base, guide) w.p. 1/2 each at a question's last
  round, where "next" does not exist. In a guide-less cascade "guide" is never
  available, so Random picks among base and next.
* **<model> EXIT** replays the cached LLM-EXIT runs: cost = cached cost,
  covered = correct or unsolvable (the paper's "matched coverage", footnote of
  1.12; taken as an OR so a question that is both is counted once),
  length = rounds. Set size = rounds as well: the paper's EXIT rows report
  Set Size equal to Avg. Len. in every table (e.g. 2.39 / 2.39), so an EXIT
  run is counted as keeping one answer per round. The row is present only if
  every test question of every split has a run of that model.
* **LLM policy (<model>)** replays the cached per-round actions as a
  pointwise policy (singleton sets); a missing action (-1) at a reached round
  ends the episode with no answer.
* **UALA** (GPT-4o-guided; "fixed thresholds on uncertainty"): at every
  reached round collect the guide's answer; stop when the guide uncertainty
  is <= theta, else go to the next round; the last round always stops. So
  the set is {guide} ∪ ({next} if u_t > theta), the length is the stopping
  round and the set size is the number of distinct guide answers collected
  (the paper's UALA rows have Set Size = Avg. Len., consistent with this).
  A NaN uncertainty counts as "uncertain" (continue). theta is chosen on the
  calibration split: among the candidate thresholds {every calibration
  uncertainty} ∪ {-inf} (between two candidates the behaviour is constant,
  so this search is exact), the cheapest one whose empirical calibration
  coverage is >= 1 - alpha (ties: the largest theta); if none reaches it,
  theta = -inf (always go to the last round, the highest coverage). Absent
  when the cache has no uncertainty, and in a guide-less cascade (no guide
  answer to collect; ``left_out`` says so).

A guide-less cascade (``models.guide: null``) keeps Random, the EXIT rows (runs of
other systems, priced in the cache) and the LLM-policy rows (the cache refuses an
action 1 there, envs.cache.values).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ccpo_jax.ccpo.ladder_rows import LADDER
from ccpo_jax.ccpo.registry import BASELINES, Baseline, register_baseline
from ccpo_jax.ccpo.rowid import RANDOM, UALA, Family, RowId, exit_row, llm_policy_row
from ccpo_jax.runtime import executables
from envs.cache.schema import A_NEXT, ResponseCache
from envs.replay.env import EnvParams, SetMetrics, evaluate_actions, evaluate_sets, summarise

#: Tolerance of the float comparison coverage >= 1 - alpha.
COVERAGE_EPS = 1e-6


@struct.dataclass
class BaselineData:
    """Cached baseline outcomes on device: M EXIT models, M2 LLM-policy models."""

    exit_correct: jax.Array  # [Q, M] bool
    exit_rounds: jax.Array  # [Q, M] i32
    exit_cost_cents: jax.Array  # [Q, M] f32
    exit_mask: jax.Array  # [Q, M] bool
    llm_policy_actions: jax.Array  # [Q, M2, T] i32, -1 = none


def make_baseline_data(cache: ResponseCache) -> BaselineData:
    a = cache.arrays
    return BaselineData(
        exit_correct=jnp.asarray(a["exit_correct"], bool),
        exit_rounds=jnp.asarray(a["exit_rounds"], jnp.int32),
        exit_cost_cents=jnp.asarray(a["exit_cost_cents"], jnp.float32),
        exit_mask=jnp.asarray(a["exit_mask"], bool),
        llm_policy_actions=jnp.asarray(a["llm_policy_actions"], jnp.int32),
    )


# -- Random ---------------------------------------------------------------------


def random_actions(key: jax.Array, params: EnvParams, idx: jax.Array) -> jax.Array:
    """[N, T] i32: an action drawn uniformly among the available ones, independently per round."""
    avail = params.available[idx]
    logits = jnp.where(avail, 0.0, -1e9)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def random_rows(key: jax.Array, params: EnvParams, idx: jax.Array) -> SetMetrics:
    """The Random row (arXiv 2511.11828 §5): uniform over the available actions at every round."""
    return evaluate_actions(random_actions(key, params, idx), params, idx)


# -- cached LLM runs --------------------------------------------------------------


def exit_rows(data: BaselineData, params: EnvParams, idx: jax.Array, model: int) -> SetMetrics:
    """The "<model> EXIT" row from cached LLM-EXIT runs (matched coverage: arXiv 2511.11828, footnote on exit policies)."""
    rounds = data.exit_rounds[idx, model]
    ok = data.exit_mask[idx, model]
    return SetMetrics(
        cost_cents=jnp.where(ok, data.exit_cost_cents[idx, model], 0.0),
        covered=(ok & data.exit_correct[idx, model]) | params.unsolvable[idx],
        length=jnp.where(ok, rounds, 0),
        set_size=jnp.where(ok, rounds, 0),
        unsolvable=params.unsolvable[idx],
    )


def llm_policy_rows(data: BaselineData, params: EnvParams, idx: jax.Array, model: int) -> SetMetrics:
    """The "LLM policy (<model>)" row: the cached per-round actions replayed as a pointwise policy."""
    return evaluate_actions(data.llm_policy_actions[idx, model], params, idx)


# -- UALA -------------------------------------------------------------------------


def uala_sets(theta: jax.Array, params: EnvParams, idx: jax.Array) -> jax.Array:
    """[N, T, 3] UALA action sets for threshold ``theta``: guide always, next iff u_t > theta."""
    u = params.guide_uncertainty[idx]
    u = jnp.where(jnp.isnan(u), jnp.inf, u)
    go_on = u > theta
    zeros = jnp.zeros_like(go_on)
    return jnp.stack([zeros, jnp.ones_like(go_on), go_on], axis=-1)  # order: base, guide, next


def uala_threshold(params: EnvParams, cal_idx: jax.Array, alpha: Any) -> jax.Array:
    """f32 theta: the cheapest candidate threshold with calibration coverage >= 1 - alpha (module doc)."""
    u = params.guide_uncertainty[cal_idx]
    cand = jnp.where(jnp.isfinite(u) & params.round_mask[cal_idx], u, -jnp.inf).reshape(-1)
    cand = jnp.concatenate([cand, jnp.full((1,), -jnp.inf, cand.dtype)])  # [K]

    cost_t = params.cost[cal_idx]  # [n, T]
    hit_t = params.guide_correct[cal_idx]
    unsolvable = params.unsolvable[cal_idx]
    avail_next = params.available[cal_idx][..., A_NEXT]

    def metrics(theta):
        # only cost and coverage are needed here: a light version of evaluate_sets for guide-only sets
        go_on = (uala_sets(theta, params, cal_idx)[..., A_NEXT] & avail_next).astype(jnp.int32)
        reached = jnp.concatenate([jnp.ones_like(go_on[:, :1]), jnp.cumprod(go_on[:, :-1], axis=-1)], -1) > 0
        covered = jnp.any(reached & hit_t, axis=-1) | unsolvable
        return jnp.sum(jnp.where(reached, cost_t, 0.0)), jnp.mean(covered.astype(jnp.float32))

    cost, cov = jax.vmap(metrics)(cand)  # [K]
    feasible = cov >= 1.0 - alpha - COVERAGE_EPS
    score = jnp.where(feasible, cost, jnp.inf)
    best = jnp.min(score)
    theta = jnp.max(jnp.where(feasible & (score <= best), cand, -jnp.inf))
    return theta


def uala(params: EnvParams, cal_idx: jax.Array, test_idx: jax.Array, alpha: Any) -> SetMetrics:
    """The UALA row: threshold fitted on ``cal_idx``, metrics on ``test_idx``."""
    theta = uala_threshold(params, cal_idx, alpha)
    return evaluate_sets(uala_sets(theta, params, test_idx), params, test_idx)


# -- every non-learned row for S splits -------------------------------------------------


def has_uncertainty(cache: ResponseCache) -> bool:
    """A guide uncertainty on some round (never in a guide-less cascade: no guide)."""
    a = cache.arrays
    return cache.manifest.has_guide and bool(np.isfinite(a["guide_uncertainty"][a["round_mask"]]).any())


@functools.lru_cache(maxsize=32)
def _rows_program(plan: tuple):
    """The jitted, split-vmapped program for one choice of rows (cached: repeated calls do not recompile).
    ``plan``: ((baseline, ((row name, static), ...)), ...) in registration order; ONE program for all."""

    def one(params, data, k, cal, test, alpha):
        rows = {}
        for b, named in plan:
            for name, static in named:
                rows[name] = summarise(b.metrics(params, data, k, cal, test, alpha, static))
        return rows

    return jax.jit(jax.vmap(one, in_axes=(None, None, 0, 0, 0, None)))


def _plan_key(plan: tuple) -> Any:
    """What :func:`_rows_program`'s program closes over, for its key on disk
    (:func:`ccpo_jax.runtime.executables.compile`): each baseline's family, its ``metrics`` function (module,
    name, line: the source hash covers its code) and rows. A ``metrics`` outside this library's code, or with a
    closure, has no such key: an ``object()``, which no key encodes, so that program is traced as before."""
    out = []
    for b, named in plan:
        fn = b.metrics
        if not fn.__module__.startswith(("ccpo_jax.", "envs.")) or getattr(fn, "__closure__", None) or not hasattr(
                fn, "__code__"):
            return object()
        out.append((b.family, fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno, named))
    return tuple(out)


def non_learned_rows(
    cache: ResponseCache,
    params: EnvParams,
    key: jax.Array,
    cal_idx: Any,
    test_idx: Any,
    alpha: float,
    train_idx: Any = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Every non-learned row for S splits: the traced baselines in one jitted, vmapped call.

    ``cal_idx``, ``test_idx``: int [S, n]. Returns
    ``{row name: {"cost_cents", "coverage", "avg_len", "set_size": np.ndarray [S]}}``
    with the paper's row names ("<model> EXIT", "Random", "LLM policy (<model>)",
    "UALA"), in the paper's order, then the ladder rows (``ccpo_jax.ccpo.ladder_rows``: "Always
    rung k" on a base ladder; the threshold cascade, fitted on ``train_idx`` [S, n_train], when
    given), then any other registered baseline's (``ccpo_jax.ccpo.registry``), each in registration
    order; rows the cache cannot support are absent.
    """
    cal_idx = np.asarray(cal_idx, np.int32)
    test_idx = np.asarray(test_idx, np.int32)
    used = np.unique(test_idx)
    plan = tuple((b, tuple((r.name, static) for r, static in b.rows(cache, used)))
                 for b in BASELINES if b.metrics is not None)
    data = make_baseline_data(cache)
    keys = jax.random.split(key, test_idx.shape[0])
    # params and data are arguments (not closed over) so they are not baked into the program as constants
    args = (params, data, keys, cal_idx, test_idx, jnp.float32(alpha))
    out = executables.compile("non-learned-rows", _rows_program(plan), args, _plan_key(plan))(*args)
    rows: dict[str, dict[str, np.ndarray]] = {}
    for b, named in plan:
        rows.update({r: {k: np.asarray(v) for k, v in out[r].items()} for r, _ in named})
    for b in BASELINES:
        if b.host is not None:
            rows.update(b.host(cache, params, train_idx, test_idx, alpha))
    return rows


def left_out_rows(cache: ResponseCache, test_idx: Any) -> dict[str, str]:
    """{row name: why} of every non-learned row the cache lists or could have that
    :func:`non_learned_rows` leaves out (each baseline's ``left_out``, in registration order)."""
    used = np.unique(np.asarray(test_idx, np.int32))
    out: dict[str, str] = {}
    for b in BASELINES:
        out.update(b.left_out(cache, used))
    return out


# -- the registrations: what each baseline supports and why it is absent ---------------------------------------


def _exit_supported(cache: ResponseCache, used: np.ndarray) -> list[tuple[RowId, int]]:
    mask = cache.arrays["exit_mask"]
    return [(exit_row(m), i) for i, m in enumerate(cache.manifest.exit_models) if mask[used, i].all()]


def _exit_left_out(cache: ResponseCache, used: np.ndarray) -> dict[str, str]:
    mask = cache.arrays["exit_mask"]
    return {exit_row(m).name: f"{int((~mask[used, i]).sum())} of the {used.size} test questions have no cached "
            f"EXIT run of {m}" for i, m in enumerate(cache.manifest.exit_models) if not mask[used, i].all()}


def _llm_supported(cache: ResponseCache, used: np.ndarray) -> list[tuple[RowId, int]]:
    acts = cache.arrays["llm_policy_actions"]
    return [(llm_policy_row(m), i) for i, m in enumerate(cache.manifest.llm_policy_models) if (acts[used, i] >= 0).any()]


def _llm_left_out(cache: ResponseCache, used: np.ndarray) -> dict[str, str]:
    acts = cache.arrays["llm_policy_actions"]
    return {llm_policy_row(m).name: f"no test question has readable actions of {m} (every reply unreadable or none "
            "cached)" for i, m in enumerate(cache.manifest.llm_policy_models) if not (acts[used, i] >= 0).any()}


def _uala_left_out(cache: ResponseCache, used: np.ndarray) -> dict[str, str]:
    if not cache.manifest.has_guide:
        return {UALA.name: "a guide-less cascade (models.guide: null): UALA collects the guide's answers"}
    if not has_uncertainty(cache):
        return {UALA.name: "no round of the cache has a guide uncertainty (UALA thresholds it)"}
    return {}


register_baseline(Baseline(
    Family.EXIT, _exit_left_out, _exit_supported,
    lambda params, data, k, cal, test, alpha, i: exit_rows(data, params, test, i)))
register_baseline(Baseline(
    Family.RANDOM, lambda cache, used: {}, lambda cache, used: [(RANDOM, None)],
    lambda params, data, k, cal, test, alpha, _: random_rows(k, params, test)))
register_baseline(Baseline(
    Family.LLM_POLICY, _llm_left_out, _llm_supported,
    lambda params, data, k, cal, test, alpha, i: llm_policy_rows(data, params, test, i)))
register_baseline(Baseline(
    Family.UALA, _uala_left_out, lambda cache, used: [(UALA, None)] if has_uncertainty(cache) else [],
    lambda params, data, k, cal, test, alpha, _: uala(params, cal, test, alpha)))
register_baseline(LADDER)
