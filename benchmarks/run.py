"""The ccpo-jax benchmark suite: one run, one JSON file, one table (docs/performance.md; issue 7).

Every figure is measured in the same process (or, for device scaling, in
subprocesses started by it), compile time excluded from throughput
(``lower().compile()`` or one warm-up call first, then ``block_until_ready``):

  env        replay-env steps/s, N parallel episodes (1 .. 65,536), ``lax.scan``
             over steps with auto-reset, (a) uniformly random policy over the
             available actions (``benchmarks/env_throughput.make_rollout``),
             (b) the policy MLP (3 x 64, ``ccpo_jax.core.networks.policy_net``) in the
             loop, (c) the MLP forward pass alone on the same [N, F] batch (the
             bound (b) can approach), (d) a NumPy implementation of the same env
             written for this benchmark (vectorised over episodes), (e) the
             plain-Python reference env ``envs.reference.ReferenceEnv``;
  eval       set-policy evaluation (``evaluate_sets`` vmapped over splits) with
             1, 10, 100, 1,000 splits of 200 questions, vs a NumPy-vectorised
             evaluator and the plain-Python recursive one;
  train      CCPO training iterations/s (``train_many``, the default rows CPO +
             CCPO(lambda=0) + CCPO(lambda), one split) and retrain-protocol
             training with 1, 10, 100 splits at reduced iterations;
  reproduce  the default ``ccpo-jax reproduce`` (100 splits), compile separated;
  sweep      the trainer's member-iterations/s at 20, 200 and 2,000 members (one program,
             compile time apart), and at the retrain protocol's 400 members as one vmap and
             in its default blocks; ``ccpo-jax sweep`` over 4 alphas x 5 seeds against 4
             separate ``ccpo-jax reproduce --alpha A`` runs (subprocesses, the same rows,
             seeds and splits; the ratio of wall times), the sweep with the default lambda
             grid, and ``reproduce --protocol retrain --seeds 1`` (every split trains its own
             policies) on one device and with ``--devices all``;
  devices    the same sharded evaluation and training in subprocesses with
             ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, N = 1, 2, 4, 8
             (on a CPU these are forced host devices sharing the same cores:
             the point is the mechanism and equality of results, not speed-up).

The cache is SYNTHETIC (``envs.synthetic.generate('hotpotqa-llama2', 1400, 0)``).

    python benchmarks/run.py [--quick] [--out FILE.json] [--only env,eval,train,reproduce,devices,sweep]

Writes a JSON list of records {"name","value","unit","backend","device","config"}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from envs.atomic import atomic_write_json  # noqa: E402

SECTIONS = ("env", "eval", "train", "reproduce", "devices", "sweep")


# -- helpers -------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_desc() -> tuple[str, str]:
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return "cpu", f"{n}-core CPU ({cpu_name()})"
    return jax.default_backend(), f"{len(jax.devices())} x {d.device_kind}"


def compile_and_time(fn, *args, repeats: int = 3, min_time: float = 0.2):
    """(compile_s, best seconds per call): AOT-compile ``jax.jit(fn)``, then time calls until ``min_time``."""
    import jax

    t0 = time.perf_counter()
    comp = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(comp(*args))  # first run (allocations)
    best, total, n = float("inf"), 0.0, 0
    while n < repeats or (total < min_time and n < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(comp(*args))
        dt = time.perf_counter() - t0
        best, total, n = min(best, dt), total + dt, n + 1
    return compile_s, best


def n_steps_for(n_envs: int, work: int, lo: int = 10, hi: int = 2000) -> int:
    return int(min(hi, max(lo, work // n_envs)))


class Recorder:
    def __init__(self, backend: str, device: str):
        self.records: list[dict] = []
        self.backend, self.device = backend, device
        self.on_add = None  # called after every record (saves the JSON so far)

    def add(self, name: str, value: float, unit: str, **config) -> dict:
        r = {"name": name, "value": float(value), "unit": unit, "backend": self.backend,
             "device": self.device, "config": config}
        self.records.append(r)
        if self.on_add is not None:
            self.on_add()
        cfg = ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("cache", "synthetic", "impl"))
        print(f"  {name:44s} {value:16,.2f}  {unit:14s} {cfg[:90]}", flush=True)
        return r


# -- a NumPy implementation of the env and the set evaluation (written for the benchmark) ----


class NumpyEnv:
    """The replay env vectorised over N episodes with NumPy (same semantics as envs.orchestration)."""

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


# -- sections ----------------------------------------------------------------------


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
    from envs.orchestration import OrchestrationEnv
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
                    scan_steps=steps, impl="NumPy, vectorised over episodes (benchmarks/run.py NumpyEnv)")
        if n in out:
            rec.add("jax_over_numpy_env_speedup", out[n][0] / v["value"], "ratio", parallel_envs=n,
                    note="jitted env steps/s / NumPy env steps/s, random policy, same run")
    ref_steps = 5_000 if quick else 50_000
    t_ref = reference_steps(cache, ref_steps)
    ref = rec.add("reference_env_steps_per_s", ref_steps / t_ref, "steps/s", **base, steps=ref_steps,
                  impl="plain Python envs.reference.ReferenceEnv, one episode at a time")
    for n in sizes:
        rec.add("jax_over_reference_env_speedup", out[n][0] / ref["value"], "ratio", parallel_envs=n,
                note="jitted env steps/s (random policy) / plain-Python reference steps/s, same run")


def section_eval(rec: Recorder, ctx, quick: bool):
    import jax
    import numpy as np

    from envs.orchestration import evaluate_sets, summarise
    from envs.reference import reference_evaluate_set

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
            impl="NumPy, vectorised over questions (benchmarks/run.py NumpyEnv)")
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
                  impl="plain Python recursive envs.reference.reference_evaluate_set")
    rec.add("jax_over_reference_eval_speedup_100_splits", S * n / times[100] / ref["value"], "ratio")


def _train_setup(ctx, S: int, n_train: int = 1000, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(ctx["cache"].n_questions)[:n_train] for _ in range(S)]).astype(np.int32)


def section_train(rec: Recorder, ctx, quick: bool):
    import jax

    from ccpo_jax.ccpo.config import TrainConfig
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.runtime.execution import Execution
    from ccpo_jax.ccpo.rows import row_variants

    params, base = ctx["params"], ctx["base_cfg"]
    variants = row_variants((2e-4,))
    iters, chunk = (100, 20) if quick else (300, 100)
    it_r = 5 if quick else 100  # retrain runs with 10 and 100 splits
    per_it = {}
    for S in ctx["train_splits"]:
        n_it, n_chunk = (iters, chunk) if S == 1 else (it_r, it_r)
        cfg = TrainConfig(iterations=n_it, chunk=n_chunk)
        _, _, tm = train_many(cfg, params, variants, _train_setup(ctx, S, seed=S), jax.random.PRNGKey(S),
                              Execution(progress=False))
        per_it[S] = tm["train_s"] / n_it
        common = dict(splits=S, variants=len(variants), members=S * len(variants), iterations=n_it, chunk=n_chunk,
                      batch_size=cfg.batch_size, compile_s=round(tm["compile_s"], 3), train_s=round(tm["train_s"], 3))
        if S == 1:
            rec.add("train_iterations_per_s", n_it / tm["train_s"], "it/s", **base, **common,
                    variant_names=[v.name for v in variants],
                    note="one vmapped program over the variants; compile excluded; host work between chunks included")
        else:
            rec.add("retrain_train_wall_s", tm["train_s"], "s", **base, **common,
                    note="retrain protocol: every split trains its own policies, one vmapped program")
        rec.add("train_member_iterations_per_s", S * len(variants) * n_it / tm["train_s"], "member-it/s", **common)
    for S in per_it:
        if S != 1 and 1 in per_it:
            rec.add(f"retrain_wall_ratio_{S}_over_1_split", per_it[S] / per_it[1], "ratio",
                    note="train wall time per iteration (compile excluded), S splits / 1 split, same run")


def section_reproduce(rec: Recorder, ctx, quick: bool):
    from ccpo_jax.ccpo.reproduce import reproduce

    stubbed = _ensure_tensorboardx()
    iters = 100 if quick else None
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = reproduce(n_splits=100, iterations=iters, out_dir=Path(tmp) / "run", progress=False, echo=None)
        wall = time.perf_counter() - t0
    tm = res.results["timing"]
    cfg = {"setting": res.results.get("setting"), "splits": 100, "protocol": res.results.get("protocol"),
           "iterations": iters or "default (1500)", "cache": "built-in SYNTHETIC cache of the setting",
           "synthetic": True, "tensorboard": "skipped (tensorboardX not installed)" if stubbed else "written"}
    rec.add("reproduce_total_s", tm.get("total_s", wall), "s", **cfg)
    for k in ("compile_s", "train_s", "eval_s"):
        if k in tm:
            rec.add(f"reproduce_{k}", tm[k], "s", **cfg)


def _cli_wall(args: list[str]) -> float:
    """Wall seconds of ``python -m ccpo_jax.cli ARGS`` in a fresh process (import, compile and all)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ccpo_jax.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"ccpo-jax {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return wall


def section_sweep(rec: Recorder, ctx, quick: bool):
    import jax

    from ccpo_jax.ccpo.members import clear_program_cache, train_many

    from ccpo_jax.runtime.execution import Execution
    from ccpo_jax.ccpo.presets import DEFAULT
    from ccpo_jax.ccpo.rows import row_variants, run_batch
    from ccpo_jax.cli.main import usable_cores

    params = ctx["params"]
    variants = row_variants((2e-4,), DEFAULT)  # the default table's 4 trained variants
    n_it = 3 if quick else 10
    cfg = DEFAULT.replace(iterations=n_it, chunk=n_it)
    for members in (20, 200) if quick else (20, 200, 2000):
        S = members // len(variants)
        clear_program_cache()
        _, _, tm = train_many(cfg, params, variants, _train_setup(ctx, S, seed=S), jax.random.PRNGKey(S),
                              Execution(progress=False))
        common = dict(members=members, variants=len(variants), iterations=n_it, estimator=cfg.estimator,
                      hvp=cfg.hvp, compile_s=round(tm["compile_s"], 3), train_s=round(tm["train_s"], 3))
        rec.add("sweep_trainer_member_iterations_per_s", members * n_it / tm["train_s"], "member-it/s", **common,
                note="default preset, one vmapped program, compile excluded")
        rec.add("sweep_trainer_compile_s", tm["compile_s"], "s", **common)
    # The retrain protocol's layout (100 splits x the 4 rows, 1 seed = 400 members): one vmap of every
    # member (its layout until 2026-12-03) against its default, blocks of one split's rows x seeds;
    # alternated twice and the better of each kept, as a short measurement on a shared CPU swings.
    S = 20 if quick else 100
    block = run_batch(len(variants), 1)  # retrain's default block (ccpo.prepare.default_member_block)
    rates: dict = {None: [], block: []}
    for b in (None, block) * 2:
        clear_program_cache()
        _, _, tm = train_many(cfg, params, variants, _train_setup(ctx, S, seed=S), jax.random.PRNGKey(S),
                              Execution(progress=False, member_block=b))
        rates[b].append(S * len(variants) * n_it / tm["train_s"])
    for b, r in rates.items():
        rec.add("retrain_trainer_member_iterations_per_s", max(r), "member-it/s", members=S * len(variants),
                member_block=b, iterations=n_it, runs=[round(x, 1) for x in r],
                note=("one vmap of every member" if b is None else "retrain's default: blocks of one split's rows x "
                      "seeds") + "; the better of two alternated runs, compile excluded")
    rec.add("retrain_blocked_over_one_vmap_member_it", max(rates[block]) / max(rates[None]), "ratio",
            members=S * len(variants), member_block=block, note="same run, better of two each")
    alphas = (0.05, 0.1, 0.15, 0.2)
    small = ["--splits", "20", "--iterations", "20"] if quick else []
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(alphas=list(alphas), seeds=5, setting="hotpotqa-llama2-a0.1", cache="built-in SYNTHETIC",
                      splits=20 if quick else 100, iterations=20 if quick else "default (100)")
        runs = [_cli_wall(["reproduce", "--alpha", str(a), "--seeds", "5", "--no-progress", *small, "--out",
                           f"{tmp}/r{a}"]) for a in alphas]
        sw = _cli_wall(["sweep", "--alphas", ",".join(map(str, alphas)), "--lambdas", "0,2e-4", "--seeds", "5",
                        "--no-progress", *small, "--out", f"{tmp}/sweep"])
        rec.add("sweep_4_alphas_wall_s", sw, "s", **common, lambdas=[0, 2e-4],
                note="the rows of 4 reproduce runs: CPO, CPO (calibrated), CCPO (lambda=0), CCPO (lambda=2e-4)")
        rec.add("reproduce_4_runs_wall_s", sum(runs), "s", **common, per_run=[round(x, 2) for x in runs])
        rec.add("sweep_over_4_reproduce_runs_wall", sw / sum(runs), "ratio", **common,
                note="one process, one compile, shared evaluation vs 4 processes; target <= 0.5")
        multi_core = jax.default_backend() == "cpu" and usable_cores() > 1  # --devices all: one per core
        sw_all = None if not multi_core else _cli_wall(
            ["sweep", "--alphas", ",".join(map(str, alphas)), "--lambdas", "0,2e-4", "--seeds", "5", "--no-progress",
             "--devices", "all", *small, "--out", f"{tmp}/sweep_all"])
        if sw_all is not None:
            rows = [json.loads((Path(tmp) / d / "frontier.json").read_text())["rows"] for d in ("sweep", "sweep_all")]
            rec.add("sweep_4_alphas_devices_all_wall_s", sw_all, "s", **common, lambdas=[0, 2e-4],
                    devices=usable_cores(), equal_to_one_device=rows[0] == rows[1],
                    note="--devices all: each device runs the one-device block program (frontier.json rows compared)")
        sw3 = _cli_wall(["sweep", "--seeds", "5", "--no-progress", *small, "--out", f"{tmp}/sweep3"])
        rec.add("sweep_default_grid_wall_s", sw3, "s", **common, lambdas=[0, 1e-4, 2e-4])
        retrain = ["--splits", "10", "--iterations", "20"] if quick else []
        rt = _cli_wall(["reproduce", "--protocol", "retrain", "--seeds", "1", "--no-progress", *retrain, "--out",
                        f"{tmp}/retrain"])
        res = json.loads((Path(tmp) / "retrain" / "results.json").read_text())
        rec.add("reproduce_retrain_1_seed_wall_s", rt, "s", splits=res["splits"], seeds=1,
                iterations=res["train_config"]["iterations"], timing={k: round(v, 2) for k, v in res["timing"].items()},
                note="every split trains its own policies (4 variants x splits members); target < 300 s")
        if not multi_core:
            return
        rt_all = _cli_wall(["reproduce", "--protocol", "retrain", "--seeds", "1", "--no-progress", "--devices", "all",
                            *retrain, "--out", f"{tmp}/retrain_all"])
        res_all = json.loads((Path(tmp) / "retrain_all" / "results.json").read_text())
        same = all(res["policies"][r]["per_split"] == res_all["policies"][r]["per_split"] for r in res["policies"])
        rec.add("reproduce_retrain_1_seed_devices_all_wall_s", rt_all, "s", splits=res_all["splits"], seeds=1,
                devices=len(res_all["environment"]["devices"]), equal_to_one_device=same,
                timing={k: round(v, 2) for k, v in res_all["timing"].items()},
                note="--devices all: on a CPU one forced host device per core, each running the one-device block "
                     "program (results.json compared split for split with the one-device run)")
        rec.add("reproduce_retrain_devices_all_over_one_device_wall", rt_all / rt, "ratio",
                devices=len(res_all["environment"]["devices"]))


def _ensure_tensorboardx() -> bool:
    """If tensorboardX is missing (e.g. a GPU image without it), install a no-op stand-in; return True then."""
    try:
        import tensorboardX  # noqa: F401

        return False
    except ImportError:
        import types

        class SummaryWriter:  # noqa: D401 - no-op stand-in, recorded in the JSON config
            def __init__(self, *a, **k):
                pass

            def add_scalar(self, *a, **k):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def close(self):
                pass

        sys.modules["tensorboardX"] = types.SimpleNamespace(SummaryWriter=SummaryWriter)
        return True


# -- device scaling: subprocesses with forced host devices --------------------------


def device_worker(n_dev: int, quick: bool, train: bool = True) -> dict:
    """Runs inside a subprocess with N forced devices: sharded evaluation and training, with digests."""
    import jax
    import numpy as np

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.runtime.execution import Execution
    from ccpo_jax.runtime import sharding
    from envs.orchestration import evaluate_sets, make_env_params
    from envs.synthetic import generate

    assert len(jax.devices()) >= n_dev
    cache = generate("hotpotqa-llama2", 1400, 0)
    params = make_env_params(cache)
    mesh = sharding.make_mesh(n_dev)
    rng = np.random.default_rng(0)
    S, n = 1000, 200
    idx = np.stack([rng.permutation(cache.n_questions)[:n] for _ in range(S)]).astype(np.int32)
    sets = rng.random((S, n, cache.T, 3)) < 0.5
    ev = sharding.member_map(jax.vmap(lambda s, i: evaluate_sets(s, params, i)), mesh)
    (s_sh, i_sh), n0 = sharding.shard_leading((sets, idx), mesh)
    c_e, t_e = compile_and_time(ev, s_sh, i_sh)
    m = sharding.unpad(sharding.to_host(jax.jit(ev)(s_sh, i_sh)), n0)
    ev_digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(m))).hexdigest()[:16]
    res = {"devices": n_dev, "eval_s": t_e, "eval_compile_s": c_e, "eval_digest": ev_digest, "eval_splits": S}
    if not train:
        return res
    iters = 10 if quick else 50
    cfg = TrainConfig(iterations=iters, chunk=iters)
    variants = [Variant("CPO", False), Variant("CCPO (lambda=0)", True, 0.0)]
    S_tr = 8
    tidx = np.stack([rng.permutation(cache.n_questions)[:1000] for _ in range(S_tr)]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), len(variants) * S_tr).reshape(len(variants), S_tr, -1)
    train_mesh = None if n_dev == 1 else mesh
    st, met, tm = train_many(cfg, params, variants, tidx, keys, Execution(progress=False, mesh=train_mesh))
    leaves = [np.asarray(x) for x in jax.tree.leaves(sharding.to_host(st))]
    # The same training computed one member at a time (member_block=1): with a mesh,
    # one single-device program per device (sharding.PerDevice), as on one device.
    st_b, met_b, tm_b = train_many(cfg, params, variants, tidx, keys,
                                   Execution(progress=False, mesh=train_mesh, member_block=1))
    leaves_b = [np.asarray(x) for x in jax.tree.leaves(sharding.to_host(st_b))]
    blocked_digest = hashlib.sha256(
        b"".join(np.ascontiguousarray(x).tobytes() for x in leaves_b + [np.asarray(met_b[k]) for k in sorted(met_b)])
    ).hexdigest()[:16]
    return {
        **res, "train_s": tm["train_s"], "train_compile_s": tm["compile_s"], "train_iterations": iters,
        "train_members": S_tr * len(variants),
        "kappa": np.asarray(st.kappa).tolist(),
        "state_float": np.concatenate([x.ravel().astype(np.float64) for x in leaves if x.dtype.kind == "f"]).tolist(),
        "metrics_kappa": np.asarray(met["kappa"]).tolist(),
        "blocked_train_s": tm_b["train_s"], "blocked_compile_s": tm_b["compile_s"], "blocked_digest": blocked_digest,
        "blocked_state_float": np.concatenate([x.ravel().astype(np.float64) for x in leaves_b if x.dtype.kind == "f"]).tolist(),
    }


def section_devices(rec: Recorder, ctx, quick: bool):
    import numpy as np

    res = {}
    for n in ctx["device_counts"]:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
        env["JAX_PLATFORMS"] = "cpu"
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "w.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--device-worker", str(n), "--worker-out", str(out)]
            if quick:
                cmd.append("--quick")
                if n not in (1, 2, max(ctx["device_counts"])):
                    cmd.append("--worker-no-train")  # quick: training on 1, 2 and 8 devices only (compile time)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                raise RuntimeError(f"device worker N={n} failed")
            res[n] = json.loads(out.read_text())
    ref = res[min(res)]
    for n, r in sorted(res.items()):
        same_eval = r["eval_digest"] == ref["eval_digest"]
        cfg = {"forced_cpu_devices": n, "devices_note": "forced host devices share the machine's cores"}
        rec.add("sharded_eval_questions_per_s", r["eval_splits"] * 200 / r["eval_s"], "questions/s", **cfg,
                splits=r["eval_splits"], compile_s=round(r["eval_compile_s"], 3), digest=r["eval_digest"])
        rec.add("sharded_eval_equal_1_device", float(same_eval), "bool", **cfg,
                note="set evaluation over 1000 splits, bitwise (sha256 of all outputs)")
        if "train_s" not in r:
            continue
        f0, f1 = np.asarray(ref["state_float"]), np.asarray(r["state_float"])
        maxdiff = float(np.max(np.abs(f0 - f1))) if f0.shape == f1.shape else float("inf")
        same_kappa = r["metrics_kappa"] == ref["metrics_kappa"]
        rec.add("sharded_train_member_iterations_per_s", r["train_members"] * r["train_iterations"] / r["train_s"],
                "member-it/s", **cfg, members=r["train_members"], iterations=r["train_iterations"],
                compile_s=round(r["train_compile_s"], 3))
        rec.add("sharded_train_equal_1_device_all_members", float(same_kappa and maxdiff == 0.0), "bool", **cfg,
                kappa_curves_bitwise=bool(same_kappa), max_abs_param_diff=maxdiff, iterations=r["train_iterations"],
                note="16 members, one vmap per device, vs the 1-device run: XLA:CPU rounds the member-batched "
                     "matmuls differently for another per-device batch, and CPO iterations amplify last-bit "
                     "differences through discrete steps (kappa comparisons, line search)")
        rec.add("sharded_train_blocked_member_iterations_per_s",
                r["train_members"] * r["train_iterations"] / r["blocked_train_s"], "member-it/s", **cfg,
                members=r["train_members"], iterations=r["train_iterations"], member_block=1,
                compile_s=round(r["blocked_compile_s"], 3))
    blocked = {n: r for n, r in res.items() if "blocked_digest" in r}
    if 1 in blocked:
        for n, r in sorted(blocked.items()):
            if n == 1:
                continue
            f0, f1 = np.asarray(blocked[1]["blocked_state_float"]), np.asarray(r["blocked_state_float"])
            rec.add("sharded_train_blocked_equal_1_device", float(r["blocked_digest"] == blocked[1]["blocked_digest"]),
                    "bool", forced_cpu_devices=n, member_block=1, digest=r["blocked_digest"],
                    iterations=r["train_iterations"], max_abs_param_diff=float(np.max(np.abs(f0 - f1))),
                    note="member_block=1 (one single-device program per device, sharding.PerDevice): state and "
                         "every metric bitwise (sha256) vs the same training on one device")


# -- main --------------------------------------------------------------------------


def print_summary(records: list[dict]):
    by = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)

    def get(name, **match):
        for r in by.get(name, []):
            if all(r["config"].get(k) == v for k, v in match.items()):
                return r["value"]
        return None

    lines = []
    v = get("jax_over_reference_env_speedup", parallel_envs=4096)
    if v is not None:
        lines.append(f"jitted env / plain-Python reference env, 4,096 episodes: {v:,.0f}x")
    v = get("jax_over_numpy_env_speedup", parallel_envs=4096)
    if v is not None:
        lines.append(f"jitted env / NumPy-vectorised env, 4,096 episodes:      {v:,.1f}x")
    v = get("env_with_policy_over_mlp_forward", parallel_envs=4096)
    if v is not None:
        lines.append(f"env-with-policy steps/s / MLP-forward rows/s, 4,096:    {v:.2f}")
    v = get("eval_wall_ratio_100_over_1_split")
    if v is not None:
        lines.append(f"evaluation wall time, 100 splits / 1 split:              {v:.2f}")
    v = get("retrain_wall_ratio_100_over_1_split")
    if v is not None:
        lines.append(f"training wall time per iteration, 100 splits / 1 split:  {v:.2f}")
    v = get("sweep_over_4_reproduce_runs_wall")
    if v is not None:
        lines.append(f"sweep of 4 alphas x 5 seeds / 4 reproduce runs, wall:     {v:.2f}")
    v, w = get("sweep_4_alphas_wall_s"), get("sweep_4_alphas_devices_all_wall_s")
    if v is not None and w is not None:
        lines.append(f"  that sweep with --devices all / on one device, wall:   {w / v:.2f}")
    for r in by.get("sweep_trainer_member_iterations_per_s", []):
        lines.append(f"trainer member-it/s at {r['config']['members']:>5,} members:              {r['value']:,.0f}"
                     f" (compile {r['config']['compile_s']:.1f} s)")
    v = get("retrain_blocked_over_one_vmap_member_it")
    if v is not None:
        lines.append(f"retrain layout, blocked / one vmap, member-it/s:          {v:.2f}")
    v = get("reproduce_retrain_1_seed_wall_s")
    if v is not None:
        lines.append(f"reproduce --protocol retrain --seeds 1, wall:            {v:.0f} s")
    v = get("reproduce_retrain_1_seed_devices_all_wall_s")
    if v is not None:
        lines.append(f"  the same with --devices all, wall:                     {v:.0f} s")
    v = get("train_iterations_per_s")
    if v is not None:
        lines.append(f"CCPO training iterations/s (3 rows, 1 split):            {v:.1f}")
    for name, text in (("sharded_eval_equal_1_device", "sharded evaluation == 1 device (bitwise):"),
                       ("sharded_train_equal_1_device_all_members", "sharded training == 1 device (one vmap/device):"),
                       ("sharded_train_blocked_equal_1_device", "member_block=1 training == 1 device (bitwise):")):
        eq = by.get(name)
        if eq:
            lines.append(f"{text:56s}" + ", ".join(
                f"N={r['config']['forced_cpu_devices']}: {'yes' if r['value'] else 'no'}" for r in eq))
    tr = {r["config"]["forced_cpu_devices"]: r["value"] for r in by.get("sharded_train_member_iterations_per_s", [])}
    if 1 in tr and len(tr) > 1:
        lines.append("training member-it/s vs 1 device (forced CPU devices): " + ", ".join(
            f"N={n}: {v / tr[1]:.2f}x" for n, v in sorted(tr.items()) if n != 1))
    if lines:
        print("\nsummary")
        for ln in lines:
            print("  " + ln)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (under 5 minutes on 2 CPU cores)")
    ap.add_argument("--out", default=None, help="write the JSON records here (a list)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--env-sizes", default=None, help="parallel episodes, e.g. 1,64,4096,65536")
    ap.add_argument("--device-counts", default="1,2,4,8",
                    help="forced CPU device counts of the devices section (must include 1), e.g. 1,2")
    ap.add_argument("--device-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-no-train", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.device_worker is not None:
        r = device_worker(args.device_worker, args.quick, train=not args.worker_no_train)
        Path(args.worker_out).write_text(json.dumps(r))
        return 0

    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")

    import jax

    from ccpo_jax.runtime.sharding import init_distributed
    from envs.orchestration import make_env_params
    from envs.synthetic import generate

    init_distributed()
    t_all = time.perf_counter()
    backend, device = device_desc()
    cache = generate("hotpotqa-llama2", 1400, 0)
    params = make_env_params(cache)
    if args.env_sizes:
        env_sizes = [int(x) for x in args.env_sizes.split(",")]
    else:
        env_sizes = [1, 64, 4096, 65536] if args.quick else [1, 16, 256, 4096, 16384, 65536]
    try:
        device_counts = tuple(sorted({int(x) for x in args.device_counts.split(",")}))
    except ValueError:
        ap.error(f"--device-counts: comma-separated integers, got {args.device_counts!r}")
    if 1 not in device_counts or min(device_counts) < 1:
        ap.error(f"--device-counts: must include 1 (the reference) and be >= 1, got {args.device_counts!r}")
    ctx = {
        "cache": cache,
        "params": params,
        "base_cfg": {"cache": "synthetic hotpotqa-llama2 Q=1400 seed=0", "synthetic": True, "T": cache.T},
        "env_sizes": env_sizes,
        "train_splits": (1, 10, 100),
        "device_counts": device_counts,
    }
    rec = Recorder(backend, device)
    print(f"ccpo-jax benchmarks on {backend}: {device}; jax {jax.__version__}; "
          f"{'quick' if args.quick else 'full'} mode; cache: SYNTHETIC hotpotqa-llama2 (1,400 questions)")
    fns = {"env": section_env, "eval": section_eval, "train": section_train, "reproduce": section_reproduce,
           "devices": section_devices, "sweep": section_sweep}
    def save():  # after every section, atomically, so a run stopped by a timeout keeps what it measured
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out, rec.records, indent=2)

    rec.on_add = save
    for s in only:
        t0 = time.perf_counter()
        print(f"\n[{s}]", flush=True)
        fns[s](rec, ctx, args.quick)
        rec.add(f"section_wall_s_{s}", time.perf_counter() - t0, "s")
        save()
    rec.add("suite_wall_s", time.perf_counter() - t_all, "s", quick=args.quick, sections=only)
    print_summary(rec.records)
    save()
    if args.out:
        print(f"\nwrote {len(rec.records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
