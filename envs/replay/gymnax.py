"""The replay environment through gymnax's API (docs/gym_api.md), so that any gymnax agent
(PureJaxRL's and the rest) can train on a response cache.

``make(CACHE_OR_PATH, ...) -> (env, params)``: ``env`` is a subclass of
``gymnax.environments.environment.Environment`` whose transitions are those of
:class:`envs.replay.env.OrchestrationEnv` (the same ``step``, called, never copied), and
whose ``step`` (gymnax's base class) auto-resets to a fresh question. One episode is one
question (at most T steps).

**Actions: a set, ``Discrete(8)``.** The policy acts with an action *set* C(o_t) of the CCPO
paper (arXiv 2511.11828, Eq. 1), encoded as a bit mask over the raw actions:
``action = base + 2 * guide + 4 * next``. So 0 = {} (no answer: the episode ends uncovered,
unless the question is unsolvable), 1 = {base}, 2 = {guide}, 3 = {base, guide}, 4 = {next},
5 = {base, next}, 6 = {guide, next}, 7 = {base, guide, next}. All 8 ids are valid input (any other id is the empty set); a
member that is unavailable at this round ("next" at the question's last round, "guide" in a
guide-less cascade) is dropped, exactly as :func:`envs.replay.env.evaluate_sets` drops it,
so an episode of sets is the set-valued rollout: it goes on iff "next" is in the set, and
it collects the base / guide answer of every round whose set holds it. The singletons are
the raw env's pointwise actions (1, 2, 4 for base, guide, next).

**Reward** ``-J_t`` (cents), the raw env's: an episode's return is minus the cost of every
round reached. ``info`` (besides gymnax's ``terminated`` / ``truncated`` /
``final_observation``): ``covered`` (1.0 on the final step iff a collected answer is right
or the question is unsolvable, else 0.0: the constraint of Eq. 5), ``cost`` (= J_t),
``round`` (1-based round of the decision), ``question`` (its id in the cache).

**Questions** come uniformly from ``params.questions`` (a split); by default the training
questions of ``reproduce``'s split rule (:func:`training_questions`), so an agent never sees
the calibration and test questions.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

try:
    from gymnax.environments import environment, spaces
except ImportError as e:  # the optional extra: say how to get it, not a bare traceback
    raise ImportError("envs.replay.gymnax needs gymnax: pip install 'ccpo-jax[gymnax]'") from e

from envs.cache.formats import load_cache
from envs.cache.schema import A_BASE, A_GUIDE, A_NEXT, N_ACTIONS, ResponseCache
from envs.replay.env import EnvParams, EnvState, OrchestrationEnv, make_env_params

#: Number of action sets: every subset of {base, guide, next}.
N_SETS = 2 ** N_ACTIONS
#: Bit of each raw action in a set id (``A_BASE`` -> 1, ``A_GUIDE`` -> 2, ``A_NEXT`` -> 4).
SET_BITS = tuple(1 << a for a in range(N_ACTIONS))
_NO_ANSWER = -1  # a raw action id outside {0, 1, 2}: the raw env ends the episode without an answer


@struct.dataclass
class ReplayParams:
    """gymnax params: the replay env's cache arrays and the questions episodes are drawn from."""

    replay: EnvParams
    questions: jax.Array  # [N] i32 ids into the cache
    max_steps_in_episode: int = struct.field(pytree_node=False, default=4)  # = T (gymnax's name)


@struct.dataclass
class ReplayState:
    """The raw env's state and what the set has collected so far."""

    inner: EnvState
    covered: jax.Array  # bool []: a collected answer so far is right
    time: jax.Array  # i32 []: steps taken in this episode (gymnax's name)


def set_members(action: jax.Array) -> jax.Array:
    """[..., 3] bool: which raw actions (base, guide, next) the set id ``action`` holds (an id outside
    [0, 8): none, i.e. the empty set)."""
    a = jnp.asarray(action, jnp.int32)[..., None]
    return ((a & jnp.asarray(SET_BITS, jnp.int32)) > 0) & (a >= 0) & (a < N_SETS)


def set_id(in_set: jax.Array) -> jax.Array:
    """Inverse of :func:`set_members`: [..., 3] bool -> set id in [0, 8)."""
    return jnp.sum(jnp.asarray(in_set, jnp.int32) * jnp.asarray(SET_BITS, jnp.int32), axis=-1)


def training_questions(n_questions: int, n_train: int | None = None, seed: int = 0) -> jax.Array:
    """The training ids of ``reproduce --seed SEED``'s split rule (recalibrate protocol): the first
    ``n_train`` of ``permutation(split(split(PRNGKey(seed), 3)[0])[0], Q)``. Default n_train: Q minus
    a calibration and a test set of 200 questions each from Q = 600 up, else of Q // 5 each
    (1400 -> 1000, 960 -> 560, 500 -> 300: the paper's splits and UALA's). tests/envs/test_gym_api.py checks it against ccpo_jax's splits."""
    if n_train is None:
        n_train = n_questions - 2 * (200 if n_questions >= 600 else n_questions // 5)
    if not 1 <= n_train <= n_questions:
        raise ValueError(f"n_train: {n_train} is not in [1, {n_questions}]")
    k_split = jax.random.split(jax.random.PRNGKey(seed), 3)[0]
    k_train = jax.random.split(k_split)[0]
    return jax.random.permutation(k_train, n_questions).astype(jnp.int32)[:n_train]


class ReplayGymnax(environment.Environment):
    """The replay environment as a gymnax ``Environment`` (module doc); pure and jit/vmap-able."""

    def __init__(self, params: ReplayParams, cache_name: str = ""):
        self._params = params
        self.raw = OrchestrationEnv()  # the one implementation of the transitions
        self.cache_name = cache_name

    @property
    def default_params(self) -> ReplayParams:
        return self._params

    @property
    def name(self) -> str:
        return "Orchestration-sets-v0"

    @property
    def num_actions(self) -> int:
        return N_SETS

    def action_space(self, params: ReplayParams | None = None) -> spaces.Discrete:
        """``Discrete(8)``: set ids ``base + 2 guide + 4 next`` (module doc); all 8 are valid."""
        return spaces.Discrete(N_SETS)

    def observation_space(self, params: ReplayParams | None = None) -> spaces.Box:
        """The raw env's ``[F]`` features (docs/environment.md), each >= 0."""
        p = self._params if params is None else params
        return spaces.Box(0.0, jnp.inf, (p.replay.F,), jnp.float32)

    def reset_env(self, key: jax.Array, params: ReplayParams) -> tuple[jax.Array, ReplayState]:
        """A question drawn uniformly from ``params.questions``, at its first round."""
        i = jax.random.randint(key, (), 0, params.questions.shape[0])
        obs, inner = self.raw.reset(key, params.replay, params.questions[i])
        return obs, ReplayState(inner=inner, covered=jnp.bool_(False), time=jnp.int32(0))

    def step_env(self, key: jax.Array, state: ReplayState, action: Any, params: ReplayParams):
        """The set's decision at the current round: one raw step (go on iff "next" is in the set
        and available, else end with a member answer or none) plus the answers the set collects."""
        p, q, t = params.replay, state.inner.question, state.inner.round
        members = set_members(action) & p.available[q, t]
        raw_action = jnp.where(members[A_NEXT], A_NEXT, jnp.where(
            members[A_BASE], A_BASE, jnp.where(members[A_GUIDE], A_GUIDE, _NO_ANSWER)))
        obs, inner, reward, terminated, _, raw_info = self.raw.step(key, state.inner, raw_action, p)
        hit = (members[A_BASE] & p.base_correct[q, t]) | (members[A_GUIDE] & p.guide_correct[q, t])
        covered = state.covered | hit
        ends = terminated & ~state.inner.done  # the raw env's no-op past the end says nothing either
        info = {
            "covered": (ends & (covered | p.unsolvable[q])).astype(jnp.float32),
            "cost": raw_info["cost_cents"],
            "round": raw_info["round"],
            "question": q,
        }
        return obs, ReplayState(inner=inner, covered=covered, time=state.time + 1), reward, terminated, info

    def is_truncated(self, state: ReplayState, params: ReplayParams) -> jax.Array:
        """Never: an episode ends by the policy's choice, at the latest at its question's last round
        (where "next" is unavailable), so within ``max_steps_in_episode`` = T steps."""
        return jnp.bool_(False)

    def is_terminated(self, state: ReplayState, params: ReplayParams) -> jax.Array:
        return state.inner.done

    def available_sets(self, state: ReplayState, params: ReplayParams) -> jax.Array:
        """[8] bool: the set ids whose members are all available at this round (the rest act as their
        available part; a masked agent may use this, the PPO agent of experiments/ does not)."""
        avail = params.replay.available[state.inner.question, state.inner.round]
        return jnp.all(~set_members(jnp.arange(N_SETS)) | avail, axis=-1)


def replay_params(cache: ResponseCache, questions: Any = None, seed: int = 0) -> ReplayParams:
    """:class:`ReplayParams` of ``cache``; ``questions`` [N] ids (default :func:`training_questions`)."""
    q = training_questions(cache.n_questions, seed=seed) if questions is None else jnp.asarray(questions, jnp.int32)
    if q.ndim != 1 or q.shape[0] < 1 or int(jnp.min(q)) < 0 or int(jnp.max(q)) >= cache.n_questions:
        raise ValueError(f"questions: expected a non-empty [N] array of ids in [0, {cache.n_questions})")
    return ReplayParams(replay=make_env_params(cache), questions=q, max_steps_in_episode=cache.T)


def make(source: ResponseCache | str | os.PathLike, questions: Any = None, seed: int = 0
         ) -> tuple[ReplayGymnax, ReplayParams]:
    """``(env, params)`` on a cache: a :class:`~envs.cache.schema.ResponseCache` (e.g. a SYNTHETIC one,
    ``envs.generators.synthetic.generate("hotpotqa-llama2", 1400, 0)``, the Table 2 setting's) or the
    path of a cache in either format (``load_cache``). ``questions``: the ids episodes are drawn from
    (default: ``reproduce``'s training questions at ``seed``, :func:`training_questions`).

    A setting's name is not accepted: the synthetic generators sit above the replay stage (pyproject's
    layers), so the caller builds the cache."""
    if isinstance(source, ResponseCache):
        cache = source
    elif isinstance(source, (str, os.PathLike)):
        cache = load_cache(source)
    else:
        raise TypeError(f"make: expected a ResponseCache or a cache path, got {type(source).__name__}")
    params = replay_params(cache, questions, seed)
    return ReplayGymnax(params, cache.manifest.name), params
