"""Time one full CCPO trust-region step (FVP, CG, dual, line search) for the paper's network.

Policy: ccpo_jax.core.networks.policy_net() (3 x 64 tanh, 3 actions). Batch: 10 episodes x 4 rounds,
observation dim 16 (random SYNTHETIC inputs: the timing does not depend on the values).
The step is the one the trainer takes: softmasked conformal policy (kappa fixed), reward
surrogate = mean ratio x advantage, constraint = -coverage surrogate (J-bar), KL on S~.

Measured: jitted step alone, and jax.vmap over 100 independent problems (params + data).
Prints one JSON record per line {"name","value","unit","backend","device","config"} and writes
them to --out (atomic).

    python benchmarks/cpo_step.py [--out runs/benchmarks/cpo_step.json] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ccpo_jax.core import conformal as cf
from ccpo_jax.core import constraint as cs
from ccpo_jax.core import networks
from ccpo_jax.core import trust_region as tr
from envs.cache.atomic import atomic_write_text
from envs.cache.schema import A_BASE, A_NEXT, N_ACTIONS

EPISODES, T, OBS_DIM = 10, 4, 16
KAPPA, ALPHA, DELTA = 0.33, 0.1, 0.01


def make_problem(key):
    """Random params and a batch of 10 x 4 steps (synthetic)."""
    k = jax.random.split(key, 6)
    net = networks.policy_net()
    obs = jax.random.normal(k[0], (EPISODES, T, OBS_DIM))
    params = net.init(k[1], obs)
    avail = jnp.ones((EPISODES, T, N_ACTIONS), bool).at[:, -1, A_NEXT].set(False)
    actions = jax.random.randint(k[2], (EPISODES, T), 0, N_ACTIONS)
    actions = jnp.where(avail[..., A_NEXT] | (actions != A_NEXT), actions, A_BASE)
    mask = jnp.arange(T)[None] < jax.random.randint(k[3], (EPISODES, 1), 1, T + 1)
    adv = jax.random.normal(k[4], (EPISODES, T))
    success = jax.random.bernoulli(k[5], 0.9, (EPISODES,)).astype(jnp.float32)
    unsolvable = jnp.zeros((EPISODES,), bool).at[0].set(True)
    batch = dict(obs=obs, avail=avail, actions=actions, mask=mask, adv=adv, success=success,
                 unsolvable=unsolvable)
    return params, batch


def cpo_step(params, batch):
    net = networks.policy_net()
    avail, mask = batch["avail"], batch["mask"]

    def probs_fn(p):
        return networks.masked_probs(net.apply(p, batch["obs"]), avail)

    def logp_fn(p):
        return cf.soft_conformal_log_policy(probs_fn(p), KAPPA, avail)

    def taken(lp):
        return jnp.take_along_axis(lp, batch["actions"][..., None], -1)[..., 0]

    old = jax.lax.stop_gradient(logp_fn(params))
    behaviour = jax.lax.stop_gradient(taken(jnp.log(jnp.maximum(probs_fn(params), 1e-30))))
    n = jnp.maximum(mask.sum(), 1)

    def objective(p):  # reward surrogate to maximise
        ratio = jnp.exp(taken(logp_fn(p)) - taken(old))
        return jnp.sum(jnp.where(mask, ratio * batch["adv"], 0.0)) / n

    def constraint(p):  # -J-bar surrogate ("<= 0" form)
        return -cs.coverage_surrogate(taken(logp_fn(p)), behaviour, batch["success"], batch["unsolvable"], mask)

    def kl(p):
        return jnp.sum(jnp.where(mask, cf.soft_policy_kl(old, logp_fn(p)), 0.0)) / n

    J = cs.coverage_estimate(jnp.exp(taken(old) - behaviour), batch["success"], batch["unsolvable"], mask)
    c = cs.coverage_constraint_value(J, ALPHA)
    return tr.cpo_update(params, objective, constraint, kl, c, DELTA)


def _time(fn, args, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return compile_s, times[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks/cpo_step.json"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--problems", type=int, default=100)
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    device = str(jax.devices()[0].device_kind)
    config = dict(network="policy_net 3x64 tanh, 3 actions", episodes=EPISODES, rounds=T, obs_dim=OBS_DIM,
                  cg_iters=10, backtrack_steps=15, delta=DELTA, data="synthetic random", repeats=args.repeats)
    params, batch = make_problem(jax.random.PRNGKey(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    config["n_params"] = int(n_params)

    single = jax.jit(cpo_step)
    c1, t1 = _time(single, (params, batch), args.repeats)
    keys = jax.random.split(jax.random.PRNGKey(1), args.problems)
    many = jax.vmap(make_problem)(keys)
    batched = jax.jit(jax.vmap(cpo_step))
    cb, tb = _time(batched, many, args.repeats)
    _, info = batched(*many)

    vcfg = dict(config, problems=args.problems)
    records = [
        dict(name="cpo_step_single", value=t1 * 1e3, unit="ms", backend=backend, device=device, config=config),
        dict(name="cpo_step_single_compile", value=c1, unit="s", backend=backend, device=device, config=config),
        dict(name="cpo_step_vmap", value=tb * 1e3, unit="ms", backend=backend, device=device, config=vcfg),
        dict(name="cpo_step_vmap_per_problem", value=tb * 1e3 / args.problems, unit="ms", backend=backend,
             device=device, config=vcfg),
        dict(name="cpo_step_vmap_compile", value=cb, unit="s", backend=backend, device=device, config=vcfg),
        dict(name="cpo_step_vmap_accepted_fraction", value=float(jnp.mean(info.accepted)), unit="fraction",
             backend=backend, device=device, config=vcfg),
    ]
    for r in records:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
