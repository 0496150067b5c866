"""Steps per second through gymnax's API, in the field's units (issue 53, item 4; docs/gym_api.md).

A uniformly random policy (``env.action_space(params).sample``) steps N parallel environments with
gymnax's auto-reset, ``lax.scan`` over steps inside ``jit(vmap)``; compile excluded, the best of
repeated calls timed round-robin (:func:`interleaved_best`). At each N (1, 64, 1,024, 4,096 by
default), back to back in one process:

  * ``gymnax_replay_steps_per_s``: the replay env (``envs.replay.gymnax.make``, the SYNTHETIC Table 2
    cache, training questions), random action sets (``Discrete(8)``);
  * ``gymnax_cartpole_steps_per_s``: gymnax's own ``CartPole-v1``, the reference, and
    ``replay_over_cartpole`` = the ratio of the two;
  * ``gymnax_replay_singleton_steps_per_s`` and ``raw_replay_steps_per_s``: the same random
    pointwise actions (base / guide / next) through the wrapper (as singleton sets) and through
    ``envs.replay.env.OrchestrationEnv`` with the same auto-reset written out (reset every step,
    select), so both run the same transitions; ``wrapper_cost`` = raw / wrapper (1 = no cost).

Records ``{"name","value","unit","backend","device","config"}`` (benchmarks/timing.py), printed as
a table and written with ``--out``. Needs the ``gymnax`` extra.

    python benchmarks/gymnax_throughput.py [--quick] [--out FILE.json] [--envs 1,64,1024,4096]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import gymnax

from envs.cache.atomic import atomic_write_json
from envs.generators.synthetic import generate
from envs.replay.env import OrchestrationEnv
from envs.replay.gymnax import make
from timing import Recorder, device_desc, n_steps_for


def gymnax_rollout(env, params, n_envs: int, n_steps: int, action_fn=None):
    """fn(key) -> summed reward of ``n_steps`` of ``n_envs`` environments through gymnax's ``step``
    (auto-reset); actions from ``action_fn(key)`` (default: ``action_space.sample``)."""
    sample = action_fn or env.action_space(params).sample

    def run(key):
        k0, key = jax.random.split(key)
        obs, state = jax.vmap(env.reset, (0, None))(jax.random.split(k0, n_envs), params)

        def body(carry, key):
            state, ret = carry
            ka, ks = jax.random.split(key)
            a = jax.vmap(sample)(jax.random.split(ka, n_envs))
            _, state, r, _, _, _ = jax.vmap(env.step, (0, 0, 0, None))(jax.random.split(ks, n_envs), state, a, params)
            return (state, ret + r.sum()), None

        (_, ret), _ = jax.lax.scan(body, (state, jnp.float32(0.0)), jax.random.split(key, n_steps))
        return ret

    return run


def raw_rollout(params, n_envs: int, n_steps: int):
    """The raw env with gymnax's auto-reset written out (split key, step, reset, select), random
    pointwise actions, questions drawn from the same split as the wrapper's."""
    env, p, qs = OrchestrationEnv(), params.replay, params.questions

    def reset(key):
        return env.reset(key, p, qs[jax.random.randint(key, (), 0, qs.shape[0])])

    def step(key, state, a):
        k_step, k_reset = jax.random.split(key)
        _, st, r, term, _, _ = env.step(k_step, state, a, p)
        _, fresh = reset(k_reset)
        return jax.tree.map(lambda x, y: jax.lax.select(term, x, y), fresh, st), r

    def run(key):
        k0, key = jax.random.split(key)
        _, state = jax.vmap(reset)(jax.random.split(k0, n_envs))

        def body(carry, key):
            state, ret = carry
            ka, ks = jax.random.split(key)
            a = jax.vmap(raw_action)(jax.random.split(ka, n_envs))  # drawn as the wrapper's, key by key
            state, r = jax.vmap(step)(jax.random.split(ks, n_envs), state, a)
            return (state, ret + r.sum()), None

        (_, ret), _ = jax.lax.scan(body, (state, jnp.float32(0.0)), jax.random.split(key, n_steps))
        return ret

    return run


def raw_action(key):
    """A uniformly random raw pointwise action: base 0, guide 1, next 2."""
    return jax.random.randint(key, (), 0, 3)


def singleton_action(key):
    """The same draw as :func:`raw_action` (same key, same action) as its singleton set id: base 1,
    guide 2, next 4."""
    return jnp.left_shift(1, raw_action(key))


def interleaved_best(fns: dict, key, rounds: int) -> dict[str, float]:
    """Best seconds per call of each compiled function, timed round-robin (one call of each per
    round, ``rounds`` rounds): on a shared machine a burst of load hits every function alike, and
    the best of many interleaved calls is what each costs when the machine lets it run."""
    comp = {k: jax.jit(f).lower(key).compile() for k, f in fns.items()}
    for f in comp.values():
        jax.block_until_ready(f(key))
    best = {k: float("inf") for k in comp}
    for r in range(rounds):
        k = jax.random.fold_in(key, r)
        for name, f in comp.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(k))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measure(rec: Recorder, counts: list[int], work: int, rounds: int) -> None:
    env, params = make(generate("hotpotqa-llama2", 1400, 0))
    cart, cart_params = gymnax.make("CartPole-v1")
    key = jax.random.PRNGKey(0)
    for n in counts:
        steps = n_steps_for(n, work, lo=100, hi=2000)
        cfg = {"n_envs": n, "n_steps": steps, "policy": "uniform random", "rounds": rounds,
               "cache": "synthetic hotpotqa-llama2 Q=1400"}
        sec = interleaved_best({"cartpole": gymnax_rollout(cart, cart_params, n, steps),
                                "replay": gymnax_rollout(env, params, n, steps),
                                "singleton": gymnax_rollout(env, params, n, steps, singleton_action),
                                "raw": raw_rollout(params, n, steps)}, key, rounds)
        rate = {k: n * steps / v for k, v in sec.items()}
        rec.add("gymnax_cartpole_steps_per_s", rate["cartpole"], "steps/s", **cfg, env="CartPole-v1")
        rec.add("gymnax_replay_steps_per_s", rate["replay"], "steps/s", **cfg, env=env.name, actions="Discrete(8)")
        rec.add("replay_over_cartpole", rate["replay"] / rate["cartpole"], "ratio", **cfg)
        rec.add("gymnax_replay_singleton_steps_per_s", rate["singleton"], "steps/s", **cfg, actions="singletons")
        rec.add("raw_replay_steps_per_s", rate["raw"], "steps/s", **cfg, actions="raw 0/1/2")
        rec.add("wrapper_cost", rate["raw"] / rate["singleton"], "ratio", **cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the steps, 3 rounds")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (best of them)")
    ap.add_argument("--envs", default="1,64,1024,4096")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    backend, device = device_desc()
    rec = Recorder(backend, device)
    if a.out:
        rec.on_add = lambda: atomic_write_json(Path(a.out), rec.records)
    t0 = time.perf_counter()
    measure(rec, [int(x) for x in a.envs.split(",")], 40_000 if a.quick else 400_000, 3 if a.quick else a.rounds)
    rec.add("gymnax_throughput_wall_s", time.perf_counter() - t0, "s", quick=a.quick)
    print(json.dumps({r["name"] + "@" + str(r["config"].get("n_envs", "")): round(r["value"], 3)
                      for r in rec.records if r["unit"] == "ratio"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
