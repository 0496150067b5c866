"""Replay-env throughput: the jitted, vmapped env vs the plain-Python reference, in one run.

Measures (compile excluded, ``block_until_ready``):
  * ``env_steps_per_s``: env steps per second, N parallel episodes (default
    4096) under a uniformly random policy over the available actions, with
    auto-reset to a new random question, ``lax.scan`` over steps inside jit;
  * ``reference_env_steps_per_s``: the same policy on ``envs.replay.reference.ReferenceEnv``;
  * ``evaluate_sets_questions_per_s``: set-valued evaluation (docs/environment.md), S
    splits x n questions in one jitted vmapped call, vs
  * ``reference_evaluate_set_questions_per_s``: the plain-Python recursive evaluator.

Prints a table and writes JSON records {"name","value","unit","backend","device","config"}.
The cache is SYNTHETIC (``envs.generators.synthetic.generate('hotpotqa-llama2', 1400, 0)``).

    python benchmarks/env_throughput.py [--quick] [--out FILE] [--envs 4096] [--steps 1000]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from envs.cache.atomic import atomic_write_json
from envs.replay.env import OrchestrationEnv, evaluate_sets, make_env_params, summarise
from envs.replay.reference import ReferenceEnv, random_cache, reference_evaluate_set


def load_cache():
    try:
        from envs.generators.synthetic import generate

        return generate("hotpotqa-llama2", 1400, 0), "synthetic hotpotqa-llama2 Q=1400 seed=0"
    except ImportError:  # before envs.generators.synthetic existed
        return random_cache(1400, 4, 0), "random_cache Q=1400 T=4 seed=0 (synthetic)"


def make_rollout(env: OrchestrationEnv, n_envs: int, n_steps: int):
    """jit(fn(key, params) -> total reward): n_steps of n_envs episodes with auto-reset."""

    def policy(key, state, params):
        avail = jax.vmap(env.available, in_axes=(0, None))(state, params)
        return jax.random.categorical(key, jnp.where(avail, 0.0, -1e9), axis=-1)

    def run(key, params):
        k0, key = jax.random.split(key)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k0, n_envs), params)

        def body(carry, _):
            state, key, ret = carry
            key, ka, ks, kr = jax.random.split(key, 4)
            action = policy(ka, state, params)
            _, state, r, done, _, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(ks, n_envs), state, action, params
            )
            _, fresh = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(kr, n_envs), params)
            state = jax.tree.map(lambda f, s: jnp.where(done, f, s), fresh, state)
            return (state, key, ret + r.sum()), None

        (_, _, ret), _ = jax.lax.scan(body, (state, key, jnp.float32(0.0)), None, length=n_steps)
        return ret

    return jax.jit(run)


def timed(fn, *args, repeats: int = 3) -> float:
    """Best wall time of ``repeats`` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def reference_steps(cache, n_steps: int, seed: int = 0) -> float:
    env = ReferenceEnv(cache)  # featurisation happens here, outside the timing
    rng = np.random.default_rng(seed)
    nr = cache.n_rounds
    t0 = time.perf_counter()
    env.reset(int(rng.integers(cache.n_questions)))
    for _ in range(n_steps):
        k = 2 if env.t < nr[env.q] - 1 else 1
        _, _, done, _, _ = env.step(int(rng.integers(k + 1)))
        if done:
            env.reset(int(rng.integers(cache.n_questions)))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--envs", type=int, default=4096, help="parallel episodes")
    ap.add_argument("--steps", type=int, default=None, help="scan steps per call (default 1000, quick 100)")
    ap.add_argument("--out", default=None, help="write the JSON records here (a list)")
    args = ap.parse_args(argv)
    n_steps = args.steps or (100 if args.quick else 1000)
    ref_steps = 5_000 if args.quick else 50_000
    S, n = (10, 200) if args.quick else (100, 200)
    ref_q = 500 if args.quick else 5_000

    cache, cache_desc = load_cache()
    params = make_env_params(cache)
    env = OrchestrationEnv()
    backend, device = jax.default_backend(), str(jax.devices()[0].device_kind)
    base_cfg = {"cache": cache_desc, "T": cache.T, "synthetic": cache.manifest.is_synthetic}

    rollout = make_rollout(env, args.envs, n_steps)
    t_jax = timed(rollout, jax.random.PRNGKey(0), params)
    t_ref = reference_steps(cache, ref_steps)

    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(cache.n_questions)[:n] for _ in range(S)]).astype(np.int32)
    sets = rng.random((S, n, cache.T, 3)) < 0.5
    ev = jax.jit(jax.vmap(lambda s, i, p: summarise(evaluate_sets(s, p, i)), in_axes=(0, 0, None)))
    t_ev = timed(ev, sets, idx, params)
    flat_sets, flat_idx = sets.reshape(-1, cache.T, 3), idx.reshape(-1)
    t0 = time.perf_counter()
    for i in range(ref_q):
        reference_evaluate_set(cache, int(flat_idx[i]), flat_sets[i].tolist())
    t_ref_ev = time.perf_counter() - t0

    records = [
        {"name": "env_steps_per_s", "value": args.envs * n_steps / t_jax, "unit": "steps/s",
         "config": {**base_cfg, "impl": "jax jit+vmap, lax.scan", "parallel_envs": args.envs, "scan_steps": n_steps,
                    "policy": "uniform over available actions", "auto_reset": True}},
        {"name": "reference_env_steps_per_s", "value": ref_steps / t_ref, "unit": "steps/s",
         "config": {**base_cfg, "impl": "plain Python envs.replay.reference.ReferenceEnv", "steps": ref_steps,
                    "policy": "uniform over available actions", "auto_reset": True}},
        {"name": "evaluate_sets_questions_per_s", "value": S * n / t_ev, "unit": "questions/s",
         "config": {**base_cfg, "impl": "jax jit+vmap over splits", "splits": S, "questions_per_split": n}},
        {"name": "reference_evaluate_set_questions_per_s", "value": ref_q / t_ref_ev, "unit": "questions/s",
         "config": {**base_cfg, "impl": "plain Python recursive envs.replay.reference.reference_evaluate_set",
                    "questions": ref_q}},
    ]
    for r in records:
        r["backend"], r["device"] = backend, device
    speed = records[0]["value"] / records[1]["value"]
    print(f"replay-env throughput on {backend} ({device}); cache: {cache_desc}  [SYNTHETIC data]")
    print(f"{'measure':42s} {'value':>14s}  unit")
    for r in records:
        print(f"{r['name']:42s} {r['value']:14,.0f}  {r['unit']}")
    print(f"jax env / reference env speed-up: {speed:,.0f}x")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, records, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
