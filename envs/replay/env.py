"""The replay environment of the base/guide orchestration POMDP (CCPO paper, arXiv 2511.11828:
the orchestration protocol, Eqs. 4-5; docs/environment.md).

Every LLM response is in the response cache, so an episode is a replay of one
question's fixed chain of rounds. gymnax-1.0 style: static :class:`EnvParams`
holding the cache on device, a :class:`EnvState` dataclass, and pure
``reset``/``step`` functions that jit and vmap over thousands of episodes.

Semantics (the paper's orchestration protocol; choices where the paper is silent are marked [ours]):

* At round t the base has answered and the guide has judged; the guide call's
  cost ``J_t`` (cents) is paid. The observation is ``obs[q, t]``
  (:mod:`envs.replay.features`). Then the policy acts:
  0 = take the base answer (end), 1 = take the guide answer (end),
  2 = next round.
* Reward of the step taken at round t is ``-J_t`` (paper Eq. 4 with
  lambda = 0): the first observation's cost ``J_1`` is charged on the first
  step, so an episode's return is minus the cost of all rounds reached.
* [ours] An unavailable action ("next" at the question's last round, "guide"
  in a guide-less cascade (``models.guide: null``: round t's cost is the base
  call alone), or any action id outside {0, 1, 2}) ends the episode with *no answer*: correct is
  False and the constraint is 1 only if the question is unsolvable. This
  matches :func:`evaluate_sets` on an empty set. Policies mask "next" there
  (``params.available``), so a masked policy never hits this case.
* ``info``: ``correct`` (the chosen answer is correct), ``constraint`` =
  1[correct or unsolvable] on the final step (0 before; paper Eq. 5 with a
  pointwise answer), ``cost_cents`` (= ``J_t``), ``round`` (1-based round at
  which the action was taken), ``answer`` (chosen answer id, -1 = none).
* [ours] No auto-reset: episodes last at most T steps. Stepping a finished
  episode is a no-op (reward 0, terminated True, info zeros).
* ``truncated`` is always False (episodes end by the policy's choice; the
  last round offers no "next").

Set-valued policies (arXiv 2511.11828, Eq. 1; docs/environment.md): :func:`evaluate_sets` evaluates a
conformal action set per round for every question at once with array ops.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.cache.schema import A_BASE, A_GUIDE, A_NEXT, N_ACTIONS, ResponseCache
from envs.replay.features import available_actions, build_features, ladder_raw, ladder_roles, n_features


@struct.dataclass
class EnvParams:
    """The cache on device. Shapes: Q questions, T rounds, F features."""

    obs: jax.Array  # [Q, T, F] f32
    available: jax.Array  # [Q, T, 3] bool
    cost: jax.Array  # [Q, T] f32, cents (0 on padding rounds)
    base_answer: jax.Array  # [Q, T] i32
    guide_answer: jax.Array  # [Q, T] i32
    base_correct: jax.Array  # [Q, T] bool
    guide_correct: jax.Array  # [Q, T] bool
    round_mask: jax.Array  # [Q, T] bool
    n_rounds: jax.Array  # [Q] i32
    unsolvable: jax.Array  # [Q] bool
    guide_uncertainty: jax.Array  # [Q, T] f32, NaN = not given (for UALA)
    T: int = struct.field(pytree_node=False, default=4)
    F: int = struct.field(pytree_node=False, default=19)

    @property
    def n_questions(self) -> int:
        return int(self.round_mask.shape[-2])


def raw_rounds(cache: ResponseCache) -> dict[str, np.ndarray]:
    """The raw per-round fields that :func:`envs.replay.features.build_features` reads, as NumPy [Q, T]."""
    raw = {k: cache.arrays[k] for k in (
        "round_mask", "guide_verdict", "guide_uncertainty", "base_confidence", "base_answer",
        "guide_answer", "guide_tokens_in", "guide_tokens_out", "base_tokens_in", "base_tokens_out")}
    raw["round_cost_cents"] = cache.round_cost_cents()
    # a ladder's rung prices, [Q, T] like the rest; nothing on one model
    raw.update({k: np.broadcast_to(v, raw["round_mask"].shape).copy() for k, v in ladder_raw(*cache_models(cache)).items()})
    return raw


def cache_models(cache: ResponseCache) -> tuple:
    """(base, guide) of the cache: a ModelInfo, a ladder's tuple, or None (a cascade's guide)."""
    m = cache.manifest
    return m.models_of("base"), m.models_of("guide")


_build_features_jit = jax.jit(build_features, static_argnums=(1, 2))  # one compile per shape, not one per op


def make_env_params(cache: ResponseCache) -> EnvParams:
    """Featurise a cache and move it to the default device."""
    a, T = cache.arrays, cache.T
    raw = raw_rounds(cache)
    ladder = ladder_roles(*cache_models(cache))
    return EnvParams(
        obs=_build_features_jit(raw, T, ladder),
        available=available_actions(a["round_mask"], cache.manifest.has_guide),
        cost=jnp.asarray(raw["round_cost_cents"], jnp.float32),
        base_answer=jnp.asarray(a["base_answer"], jnp.int32),
        guide_answer=jnp.asarray(a["guide_answer"], jnp.int32),
        base_correct=jnp.asarray(a["base_correct"] & a["round_mask"]),
        guide_correct=jnp.asarray(a["guide_correct"] & a["round_mask"]),
        round_mask=jnp.asarray(a["round_mask"]),
        n_rounds=jnp.asarray(cache.n_rounds, jnp.int32),
        unsolvable=jnp.asarray(cache.unsolvable),
        guide_uncertainty=jnp.asarray(a["guide_uncertainty"], jnp.float32),
        T=T,
        F=n_features(T, ladder),
    )


# -- the step-by-step environment ---------------------------------------------


@struct.dataclass
class EnvState:
    question: jax.Array  # i32 []
    round: jax.Array  # i32 [], 0-based current round
    cost_cents: jax.Array  # f32 [], cost paid so far (rounds stepped through)
    done: jax.Array  # bool []


class OrchestrationEnv:
    """gymnax-1.0 style replay env; all methods are pure and jit/vmap-able."""

    name = "Orchestration-v0"
    num_actions = N_ACTIONS

    def reset(self, key: jax.Array, params: EnvParams, question: Any = None) -> tuple[jax.Array, EnvState]:
        """Start an episode on ``question`` (index into the cache), or a uniformly random one."""
        if question is None:
            question = jax.random.randint(key, (), 0, params.round_mask.shape[0])
        q = jnp.asarray(question, jnp.int32)
        state = EnvState(question=q, round=jnp.int32(0), cost_cents=jnp.float32(0.0), done=jnp.bool_(False))
        return self.get_obs(state, params), state

    def get_obs(self, state: EnvState, params: EnvParams) -> jax.Array:
        """[F] features of the current round."""
        return params.obs[state.question, state.round]

    def available(self, state: EnvState, params: EnvParams) -> jax.Array:
        """[3] bool action mask of the current round."""
        return params.available[state.question, state.round]

    def step(
        self, key: jax.Array, state: EnvState, action: Any, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        """One decision (see module doc). ``key`` is unused (the replay is deterministic)."""
        del key
        q, t = state.question, state.round
        action = jnp.asarray(action, jnp.int32)
        live = ~state.done
        avail = params.available[q, t]
        valid = (action >= 0) & (action < N_ACTIONS) & avail[jnp.clip(action, 0, N_ACTIONS - 1)]
        go_on = live & valid & (action == A_NEXT)
        ends = live & ~go_on
        take_base = live & valid & (action == A_BASE)
        take_guide = live & valid & (action == A_GUIDE)
        correct = (take_base & params.base_correct[q, t]) | (take_guide & params.guide_correct[q, t])
        answer = jnp.where(take_base, params.base_answer[q, t], jnp.where(take_guide, params.guide_answer[q, t], -1))
        j_t = jnp.where(live, params.cost[q, t], 0.0)
        new_state = EnvState(
            question=q,
            round=jnp.where(go_on, t + 1, t),
            cost_cents=state.cost_cents + j_t,
            done=state.done | ends,
        )
        info = {
            "correct": correct,
            "constraint": (ends & (correct | params.unsolvable[q])).astype(jnp.float32),
            "cost_cents": j_t,
            "round": t + 1,
            "answer": answer,
        }
        obs = self.get_obs(new_state, params)
        return obs, new_state, -j_t, new_state.done, jnp.bool_(False), info


# -- whole-table evaluation of pointwise and set-valued policies ---------------


@struct.dataclass
class SetMetrics:
    """Per-question outcome of a (set-valued) policy; every field is ``[N]`` (the paper's table metrics, §5)."""

    cost_cents: jax.Array  # f32: sum of J_t over the rounds reached
    covered: jax.Array  # bool: a collected answer is correct, or the question is unsolvable
    length: jax.Array  # i32: deepest round reached (1-based)
    set_size: jax.Array  # i32: distinct answer ids collected
    unsolvable: jax.Array  # bool


def _gather(params: EnvParams, idx: jax.Array) -> dict[str, jax.Array]:
    return {
        "cost": params.cost[idx],
        "available": params.available[idx],
        "base_answer": params.base_answer[idx],
        "guide_answer": params.guide_answer[idx],
        "base_correct": params.base_correct[idx],
        "guide_correct": params.guide_correct[idx],
        "unsolvable": params.unsolvable[idx],
    }


def reached_rounds(in_set: jax.Array, available: jax.Array) -> jax.Array:
    """[N, T] bool: round t is reached iff "next" is (available and) in the set at every earlier round."""
    nxt = (in_set[..., A_NEXT] & available[..., A_NEXT]).astype(jnp.int32)
    prefix = jnp.cumprod(nxt[..., :-1], axis=-1).astype(bool)
    return jnp.concatenate([jnp.ones(nxt.shape[:-1] + (1,), bool), prefix], axis=-1)  # T = 1 safe


def evaluate_sets(in_set: jax.Array, params: EnvParams, idx: jax.Array) -> SetMetrics:
    """Set-valued rollout of every question ``idx`` [N] at once (arXiv 2511.11828, Eq. 1; docs/environment.md).

    ``in_set`` [N, T, 3] bool: the action set C(o_t) of question idx[n] at
    round t. The rollout continues past round t iff "next" is in the set there
    (and round t+1 exists); it collects the base/guide answer of every
    reached round where that action is in the set. Entries of padding rounds
    and an unavailable "next" are ignored.
    cost = sum of J_t up to the deepest round reached (branches share their
    prefix; our choice, the paper leaves set costs open); length = that round (1-based); set_size = distinct
    answer ids collected; covered = a collected answer is correct, or the
    question is unsolvable (Y* not in Y(Q)). An empty set at round 1 gives no
    answer, length 1, cost J_1.
    """
    g = _gather(params, idx)
    s = jnp.asarray(in_set, bool) & g["available"]
    reached = reached_rounds(s, g["available"])
    take_b = reached & s[..., A_BASE]
    take_g = reached & s[..., A_GUIDE]
    N, T = reached.shape[-2:]
    ids = jnp.stack([g["base_answer"], g["guide_answer"]], -1).reshape(reached.shape[:-1] + (2 * T,))
    took = jnp.stack([take_b, take_g], -1).reshape(ids.shape)
    same = (ids[..., :, None] == ids[..., None, :]) & took[..., None, :]
    earlier = jnp.tril(jnp.ones((2 * T, 2 * T), bool), k=-1)
    new = took & ~jnp.any(same & earlier, axis=-1)
    hit = (take_b & g["base_correct"]) | (take_g & g["guide_correct"])
    return SetMetrics(
        cost_cents=jnp.sum(jnp.where(reached, g["cost"], 0.0), axis=-1),
        covered=jnp.any(hit, axis=-1) | g["unsolvable"],
        length=jnp.sum(reached, axis=-1, dtype=jnp.int32),
        set_size=jnp.sum(new, axis=-1, dtype=jnp.int32),
        unsolvable=g["unsolvable"],
    )


def actions_to_sets(actions: jax.Array) -> jax.Array:
    """[N, T] int actions -> [N, T, 3] singleton sets (ids outside {0,1,2}, e.g. -1, -> empty set)."""
    return jnp.asarray(actions)[..., None] == jnp.arange(N_ACTIONS)


def evaluate_actions(actions: jax.Array, params: EnvParams, idx: jax.Array) -> SetMetrics:
    """A pointwise policy's outcome: ``actions`` [N, T] = the action it takes at each round.

    Equals stepping :class:`OrchestrationEnv` with these actions: an
    unavailable action (or -1) ends the episode with no answer.
    """
    return evaluate_sets(actions_to_sets(actions), params, idx)


def summarise(m: SetMetrics) -> dict[str, jax.Array]:
    """Table metrics over the last axis (questions; arXiv 2511.11828 §5): total cost, coverage, avg length, set size."""
    return {
        "cost_cents": jnp.sum(m.cost_cents, axis=-1),
        "coverage": jnp.mean(m.covered.astype(jnp.float32), axis=-1),
        "avg_len": jnp.mean(m.length.astype(jnp.float32), axis=-1),
        "set_size": jnp.mean(m.set_size.astype(jnp.float32), axis=-1),
    }


# -- a pointwise policy's trajectories, all steps at once -----------------------


@struct.dataclass
class Trajectory:
    """Pointwise episodes as ``[N, T]`` step arrays (step t = the decision at round t+1).

    ``valid`` marks the steps that happened; after the final step everything is 0.
    Equals stepping :class:`OrchestrationEnv` with the same actions.
    """

    obs: jax.Array  # [N, T, F]
    available: jax.Array  # [N, T, 3]
    action: jax.Array  # [N, T] i32
    reward: jax.Array  # [N, T] f32 = -J_t on valid steps
    constraint: jax.Array  # [N, T] f32: 1[correct or unsolvable] on the final step
    correct: jax.Array  # [N, T] bool: the final step's chosen answer is correct
    done: jax.Array  # [N, T] bool: this step ends the episode
    valid: jax.Array  # [N, T] bool


def trajectories(actions: jax.Array, params: EnvParams, idx: jax.Array) -> Trajectory:
    """Roll out actions [N, T] (the action a policy would take at each round) for questions ``idx`` [N]."""
    g = _gather(params, idx)
    actions = jnp.asarray(actions, jnp.int32)
    valid_action = jnp.take_along_axis(
        g["available"], jnp.clip(actions, 0, N_ACTIONS - 1)[..., None], axis=-1
    )[..., 0] & (actions >= 0) & (actions < N_ACTIONS)
    go_on = valid_action & (actions == A_NEXT)
    reached = jnp.concatenate(
        [jnp.ones_like(go_on[..., :1]), jnp.cumprod(go_on[..., :-1].astype(jnp.int32), -1).astype(bool)], -1
    )
    done = reached & ~go_on
    correct = done & valid_action & (
        ((actions == A_BASE) & g["base_correct"]) | ((actions == A_GUIDE) & g["guide_correct"])
    )
    return Trajectory(
        obs=params.obs[idx],
        available=g["available"],
        action=actions,
        reward=jnp.where(reached, -g["cost"], 0.0),
        constraint=(done & (correct | g["unsolvable"][..., None])).astype(jnp.float32),
        correct=correct,
        done=done,
        valid=reached,
    )
