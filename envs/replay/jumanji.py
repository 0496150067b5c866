"""The replay environment through Jumanji's API (docs/gym_api.md "Jumanji"), so that agents built on
Jumanji's ``TimeStep`` and specs (Stoix's among them) load it.

``make_jumanji(CACHE_OR_PATH, ...) -> env``: a ``jumanji.env.Environment`` around
:class:`envs.replay.gymnax.ReplayGymnax` (its ``reset_env`` / ``step_env``, hence the raw env's
transitions; nothing copied). Jumanji's conventions: the params live in the env, ``reset(key)``
and ``step(state, action)`` return ``(state, TimeStep)``, no auto-reset (Jumanji's
``AutoResetWrapper`` adds it), the observation is a named tuple ``Observation(agent_view,
action_mask, step_count)`` as Stoix reads it, ``discount`` is 0 on the last step. Actions are the
gymnax env's set ids (``DiscreteArray(8)``); ``action_mask`` marks the ids whose members are all
available. ``extras`` holds ``covered``, ``cost`` and ``round`` as the gymnax ``info``.
"""
from __future__ import annotations

import os
from functools import cached_property
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

try:
    from jumanji import specs
    from jumanji.env import Environment
    from jumanji.types import StepType, TimeStep, restart
except ImportError as e:  # the optional extra
    raise ImportError("envs.replay.jumanji needs jumanji: pip install 'ccpo-jax[gymnax]'") from e

from envs.cache.schema import ResponseCache
from envs.replay.gymnax import N_SETS, ReplayState, make

_EXTRAS = ("covered", "cost", "round")


class Observation(NamedTuple):
    agent_view: jax.Array  # [F] f32: the raw env's features
    action_mask: jax.Array  # [8] bool: set ids whose members are all available
    step_count: jax.Array  # i32 []: steps taken in the episode


@struct.dataclass
class State:
    inner: ReplayState
    key: jax.Array  # Jumanji's StateProtocol: the state carries its key


class ReplayJumanji(Environment):
    """The replay env as a Jumanji ``Environment`` (module doc)."""

    def __init__(self, source: ResponseCache | str | os.PathLike, questions: Any = None, seed: int = 0):
        self.gymnax, self.params = make(source, questions, seed)
        super().__init__()

    def __repr__(self) -> str:
        return f"ReplayJumanji({self.gymnax.cache_name!r}, {int(self.params.questions.shape[0])} questions)"

    def _observation(self, obs, state: ReplayState) -> Observation:
        return Observation(obs, self.gymnax.available_sets(state, self.params), state.time)

    def reset(self, key: jax.Array) -> tuple[State, TimeStep]:
        k_reset, k_state = jax.random.split(key)
        obs, inner = self.gymnax.reset_env(k_reset, self.params)
        extras = {k: jnp.zeros((), jnp.int32 if k == "round" else jnp.float32) for k in _EXTRAS}
        return State(inner, k_state), restart(self._observation(obs, inner), extras)

    def step(self, state: State, action: jax.Array) -> tuple[State, TimeStep]:
        key, k_step = jax.random.split(state.key)
        obs, inner, reward, term, info = self.gymnax.step_env(k_step, state.inner, action, self.params)
        ts = TimeStep(step_type=jnp.where(term, StepType.LAST, StepType.MID), reward=reward.astype(float),
                      discount=jnp.where(term, 0.0, 1.0).astype(float), observation=self._observation(obs, inner),
                      extras={k: info[k] for k in _EXTRAS})
        return State(inner, key), ts

    @cached_property
    def observation_spec(self) -> specs.Spec[Observation]:
        F = self.params.replay.F
        return specs.Spec(
            Observation, "ObservationSpec",
            agent_view=specs.BoundedArray((F,), jnp.float32, 0.0, jnp.inf, "agent_view"),
            action_mask=specs.BoundedArray((N_SETS,), bool, False, True, "action_mask"),
            step_count=specs.DiscreteArray(self.params.max_steps_in_episode + 1, jnp.int32, "step_count"))

    @cached_property
    def action_spec(self) -> specs.DiscreteArray:
        return specs.DiscreteArray(N_SETS, name="action")


def make_jumanji(source: ResponseCache | str | os.PathLike, questions: Any = None, seed: int = 0) -> ReplayJumanji:
    """The Jumanji env on a cache or a cache path; ``questions`` as :func:`envs.replay.gymnax.make`."""
    return ReplayJumanji(source, questions, seed)
