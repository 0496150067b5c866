"""The ``env`` and ``eval`` sections of the benchmark suite (benchmarks/run.py; docs/performance.md):
the replay env and the set evaluation, jitted, against a NumPy implementation written for the
benchmark (:class:`NumpyEnv`) and the plain-Python reference (``envs.replay.reference``)."""
from __future__ import annotations

import time

from timing import Recorder, compile_and_time, n_steps_for


# -- a NumPy implementation of the env and the set evaluation (written for the benchmark) ----


class NumpyEnv:
    """The replay env vectorised over N episodes with NumPy (same semantics as envs.replay.env)."""

    def __init__(self, cache):
        import numpy as np

        a = cache.arrays
        rm = a["round_mask"].astype(bool)
        self.cost = cache.round_cost_cents().astype(np.float32)
        self.n_rounds = rm.sum(1).astype(np.int32)
        self.avail = np.stack([rm, rm, np.zeros_like(rm)], -1)
        self.avail[..., 2] = np.arange(cache.T)[None, :] < (self.n_rounds[:, None] - 1)
        self.base_correct, self.guide_correct = a["base_correct"] & rm, a["guide_correct"] & rm
        self.unsolvable = cache.unsolvable.astype(bool)
        self.Q = cache.n_questions

    def rollout(self, rng, n_envs: int, n_steps: int) -> float:
        """Uniform random policy over the available actions, auto-reset; returns the total reward."""
        import numpy as np

        q = rng.integers(0, self.Q, n_envs)
        t = np.zeros(n_envs, np.int64)
        ret = 0.0
        for _ in range(n_steps):
            av = self.avail[q, t]  # [N,3]
            k = av.sum(1)
            pick = (rng.random(n_envs) * k).astype(np.int64)  # index among available actions
            action = np.argmax(np.cumsum(av, 1) > pick[:, None], axis=1)
            ret -= float(self.cost[q, t].sum())
            go = action == 2
            t = np.where(go, t + 1, 0)
            q = np.where(go, q, rng.integers(0, self.Q, n_envs))
        return ret

    def evaluate_sets(self, in_set, idx):
        """[N,T,3] sets for questions idx [N] -> (cost [N], covered [N], length [N]) (docs/environment.md)."""
        import numpy as np

        av = self.avail[idx]
        s = in_set & av
        nxt = s[..., 2].astype(np.int32)
        reached = np.concatenate([np.ones(idx.shape + (1,), bool), np.cumprod(nxt[..., :-1], -1).astype(bool)], -1)
        hit = (reached & s[..., 0] & self.base_correct[idx]) | (reached & s[..., 1] & self.guide_correct[idx])
        cost = np.where(reached, self.cost[idx], 0.0).sum(-1)
        return cost, hit.any(-1) | self.unsolvable[idx], reached.sum(-1)


def make_env_rollout(env, n_envs: int, n_steps: int, hidden=None):
    """fn(key, params, pol) -> total reward: n_steps of n_envs episodes with auto-reset.

    ``hidden`` None: uniformly random policy over the available actions; else the
    policy MLP (``policy_net(hidden)``, params ``pol``) picks every action.
    Keys: one split per step (the action draw and the fresh questions of the
    auto-reset), not one key per episode (``env.step`` ignores its key; the
    per-episode keys of ``env_throughput.make_rollout`` cost more than the env).
    """
    import jax
    import jax.numpy as jnp

    from ccpo_jax.core.networks import masked_probs, policy_net

    net = policy_net(hidden) if hidden is not None else None
    Q_axis = 0

    def run(key, params, pol):
        k0, key = jax.random.split(key)
        Q = params.round_mask.shape[Q_axis]
        reset = jax.vmap(env.reset, in_axes=(None, None, 0))
        _, state = reset(k0, params, jax.random.randint(k0, (n_envs,), 0, Q))

        def body(carry, _):
            state, key, ret = carry
            key, ka, kr = jax.random.split(key, 3)
            avail = jax.vmap(env.available, in_axes=(0, None))(state, params)  # [N,3]
            if net is None:
                logits = jnp.where(avail, 0.0, -1e9)
            else:
                obs = jax.vmap(env.get_obs, in_axes=(0, None))(state, params)  # [N,F]
                logits = jnp.log(jnp.maximum(masked_probs(net.apply(pol, obs), avail), 1e-30))
            action = jax.random.categorical(ka, logits, axis=-1)
            _, state, r, done, _, _ = jax.vmap(env.step, in_axes=(None, 0, 0, None))(ka, state, action, params)
            _, fresh = reset(kr, params, jax.random.randint(kr, (n_envs,), 0, Q))
            state = jax.tree.map(lambda f, s: jnp.where(done, f, s), fresh, state)
            return (state, key, ret + r.sum()), None

        (_, _, ret), _ = jax.lax.scan(body, (state, key, jnp.float32(0.0)), None, length=n_steps)
        return ret

    return run


def make_forward_only(n_steps: int, hidden):
    """fn(obs [N,F], pol) -> scalar: n_steps MLP forward passes + masked softmax on the batch."""
    import jax
    import jax.numpy as jnp

    from ccpo_jax.core.networks import masked_probs, policy_net

    net = policy_net(hidden)

    def run(obs, avail, pol):
        def body(c, _):
            # the carry enters the input so XLA cannot hoist the pass out of the loop
            p = masked_probs(net.apply(pol, obs + c), avail)
            return 1e-6 * jnp.mean(p[:, 0]), None

        c, _ = jax.lax.scan(body, jnp.float32(0.0), None, length=n_steps)
        return c

    return run


def section_env(rec: Recorder, ctx, quick: bool):
    import jax
    import numpy as np

    from env_throughput import make_rollout, reference_steps
    from envs.replay.env import OrchestrationEnv
    from ccpo_jax.core.networks import policy_net

    cache, params, base = ctx["cache"], ctx["params"], ctx["base_cfg"]
    env = OrchestrationEnv()
    hidden = (64, 64, 64)
    pol = policy_net(hidden).init(jax.random.PRNGKey(1), np.zeros((params.F,), np.float32))
    sizes = ctx["env_sizes"]
    work = 2**17 if quick else 2**21
    out = {}
    for n in sizes:
        steps = n_steps_for(n, work, lo=10 if quick else 20, hi=500 if quick else 2000)
        c_r, t_r = compile_and_time(make_env_rollout(env, n, steps), jax.random.PRNGKey(0), params, pol)
        c_p, t_p = compile_and_time(make_env_rollout(env, n, steps, hidden), jax.random.PRNGKey(0), params, pol)
        rng = np.random.default_rng(n)
        qs = rng.integers(0, cache.n_questions, n)
        obs = np.asarray(params.obs)[qs, 0]
        avail = np.asarray(params.available)[qs, 0]
        c_f, t_f = compile_and_time(make_forward_only(steps, hidden), obs, avail, pol)
        cfg = {**base, "parallel_envs": n, "scan_steps": steps, "auto_reset": True}
        r1 = rec.add("env_steps_per_s_random_policy", n * steps / t_r, "steps/s", **cfg,
                     policy="uniform over available actions", compile_s=round(c_r, 3), impl="jax jit+vmap, lax.scan")
        r2 = rec.add("env_steps_per_s_mlp_policy", n * steps / t_p, "steps/s", **cfg,
                     policy=f"policy MLP {hidden} tanh + masked softmax + categorical", compile_s=round(c_p, 3),
                     impl="jax jit+vmap, lax.scan")
        r3 = rec.add("mlp_forward_rows_per_s", n * steps / t_f, "rows/s", **cfg, hidden=list(hidden),
                     compile_s=round(c_f, 3), impl="jax jit, lax.scan of forward passes on one [N,F] batch")
        out[n] = (r1["value"], r2["value"], r3["value"])
        rec.add("env_with_policy_over_mlp_forward", r2["value"] / r3["value"], "ratio", parallel_envs=n,
                note="env-with-policy steps/s / MLP-forward-only rows/s, same batch, same run")

    if 4096 in sizes:  # benchmarks/env_throughput.py's rollout: one PRNG key per episode and step
        steps = n_steps_for(4096, work, lo=10 if quick else 20, hi=500 if quick else 2000)
        c_g, t_g = compile_and_time(make_rollout(env, 4096, steps), jax.random.PRNGKey(0), params)
        rec.add("env_steps_per_s_random_policy_per_episode_keys", 4096 * steps / t_g, "steps/s", **base,
                parallel_envs=4096, scan_steps=steps, compile_s=round(c_g, 3),
                impl="benchmarks/env_throughput.make_rollout (gymnax-style key per episode per step)")
    # NumPy (vectorised, written for the benchmark) and plain-Python reference, same run.
    npenv = NumpyEnv(cache)
    np_sizes = [n for n in sizes if n <= 65536]
    for n in np_sizes:
        steps = n_steps_for(n, 2**15 if quick else 2**18, lo=5, hi=2000)
        rng = np.random.default_rng(0)
        npenv.rollout(rng, n, 2)
        t0 = time.perf_counter()
        npenv.rollout(rng, n, steps)
        dt = time.perf_counter() - t0
        v = rec.add("numpy_env_steps_per_s_random_policy", n * steps / dt, "steps/s", **base, parallel_envs=n,
                    scan_steps=steps, impl="NumPy, vectorised over episodes (benchmarks/env_sections.py NumpyEnv)")
        if n in out:
            rec.add("jax_over_numpy_env_speedup", out[n][0] / v["value"], "ratio", parallel_envs=n,
                    note="jitted env steps/s / NumPy env steps/s, random policy, same run")
    ref_steps = 5_000 if quick else 50_000
    t_ref = reference_steps(cache, ref_steps)
    ref = rec.add("reference_env_steps_per_s", ref_steps / t_ref, "steps/s", **base, steps=ref_steps,
                  impl="plain Python envs.replay.reference.ReferenceEnv, one episode at a time")
    for n in sizes:
        rec.add("jax_over_reference_env_speedup", out[n][0] / ref["value"], "ratio", parallel_envs=n,
                note="jitted env steps/s (random policy) / plain-Python reference steps/s, same run")


def section_eval(rec: Recorder, ctx, quick: bool):
    import jax
    import numpy as np

    from envs.replay.env import evaluate_sets, summarise
    from envs.replay.reference import reference_evaluate_set

    cache, params, base = ctx["cache"], ctx["params"], ctx["base_cfg"]
    n = 200
    ev = jax.vmap(lambda s, i, p: summarise(evaluate_sets(s, p, i)), in_axes=(0, 0, None))
    times = {}
    for S in (1, 10, 100, 1000):
        rng = np.random.default_rng(S)
        idx = np.stack([rng.permutation(cache.n_questions)[:n] for _ in range(S)]).astype(np.int32)
        sets = rng.random((S, n, cache.T, 3)) < 0.5
        c, t = compile_and_time(ev, sets, idx, params)
        times[S] = t
        rec.add("evaluate_sets_wall_s", t, "s", **base, splits=S, questions_per_split=n, compile_s=round(c, 3),
                impl="jax jit, vmap over splits")
        rec.add("evaluate_sets_questions_per_s", S * n / t, "questions/s", **base, splits=S, questions_per_split=n)
    rec.add("eval_wall_ratio_100_over_1_split", times[100] / times[1], "ratio",
            note="wall time of 100 splits / 1 split, one jitted call each, same run")
    rec.add("eval_wall_ratio_1000_over_1_split", times[1000] / times[1], "ratio")
    # NumPy-vectorised evaluator and plain-Python recursive evaluator.
    npenv = NumpyEnv(cache)
    rng = np.random.default_rng(0)
    S = 100
    idx = np.stack([rng.permutation(cache.n_questions)[:n] for _ in range(S)]).astype(np.int32)
    sets = rng.random((S, n, cache.T, 3)) < 0.5
    t0 = time.perf_counter()
    np_cost, np_cov, _ = npenv.evaluate_sets(sets.reshape(-1, cache.T, 3), idx.reshape(-1))
    dt = time.perf_counter() - t0
    rec.add("numpy_evaluate_sets_questions_per_s", S * n / dt, "questions/s", **base, splits=S,
            impl="NumPy, vectorised over questions (benchmarks/env_sections.py NumpyEnv)")
    jm = jax.device_get(jax.jit(jax.vmap(lambda s, i: evaluate_sets(s, params, i)))(sets, idx))
    assert np.allclose(np_cost, np.asarray(jm.cost_cents).reshape(-1), atol=1e-5), "NumPy evaluator disagrees"
    assert np.array_equal(np_cov, np.asarray(jm.covered).reshape(-1)), "NumPy evaluator disagrees"
    nq = 1000 if quick else 10_000
    fs, fi = sets.reshape(-1, cache.T, 3), idx.reshape(-1)
    t0 = time.perf_counter()
    for i in range(nq):
        reference_evaluate_set(cache, int(fi[i]), fs[i].tolist())
    dt = time.perf_counter() - t0
    ref = rec.add("reference_evaluate_set_questions_per_s", nq / dt, "questions/s", **base, questions=nq,
                  impl="plain Python recursive envs.replay.reference.reference_evaluate_set")
    rec.add("jax_over_reference_eval_speedup_100_splits", S * n / times[100] / ref["value"], "ratio")
