"""Sharding over a device mesh (docs/performance.md): results on 4 forced CPU devices equal one device's.

The checks run in ONE subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
set before jax is imported (the test process's own jax is already initialised
with one device). The oracle each time is the same computation unsharded on
one device, plus, for the set evaluation, the plain-Python recursive
evaluator ``envs.replay.reference.reference_evaluate_set``.

Tolerance: the sharded programs run each device's block of members/episodes
with the same per-member code and no collectives. The set evaluation and the
env rollout are required BITWISE equal. For train_many, the discrete state
(kappa, PRNG keys, counters) and the rollout metrics (kappa, CPO case, step
accepted, batch cost/success/length) are required bitwise equal; the float
parameters, optimiser moments, losses and KL to |x8 - x1| <= 1e-6 + 1e-5 |x1|
(observed max abs diff ~6e-7 in the policy head): XLA:CPU compiles a
different dot kernel for a block of two members per device than for six
members on one device, and the CPO step's conjugate-gradient solve turns that
last-bit rounding into ~1e-7-level parameter differences.

With ``member_block`` set, every device runs its own single-device program
(``sharding.PerDevice``) of the same block program, and runs of 9 members on 1
and on 2 devices (one padding member) are required BITWISE equal over 12
iterations (state and every metric), as is a run killed after its first chunk
on 2 devices and resumed from the checkpoint on one. The tolerance above is for the SPMD path (no block): XLA compiles a
multi-partition program through another pass pipeline than a one-partition
one, which changes the last bit of rounding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests.helpers import FAST_COMPILE_XLA_FLAGS, REPO

pytestmark = pytest.mark.slow  # one subprocess with 4 devices, 9 trainer compiles

WORKER = textwrap.dedent(
    r'''
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.runtime.execution import Execution
    from ccpo_jax.runtime import sharding
    from envs.replay.env import OrchestrationEnv, evaluate_sets, make_env_params, summarise
    from envs.replay.reference import reference_evaluate_set
    from envs.generators.synthetic import generate

    out = {}
    cache = generate("hotpotqa-llama2", 300, 0)
    params = make_env_params(cache)
    mesh = sharding.make_mesh()
    rng = np.random.default_rng(0)

    # (a) set evaluation over splits: S=13 (not a multiple of 4: padded), n=40.
    S, n = 13, 40
    idx = np.stack([rng.permutation(cache.n_questions)[:n] for _ in range(S)]).astype(np.int32)
    sets = rng.random((S, n, cache.T, 3)) < 0.5
    ev = jax.vmap(lambda s, i: evaluate_sets(s, params, i))
    one = jax.device_get(jax.jit(ev)(sets, idx))
    (s_sh, i_sh), n0 = sharding.shard_leading((sets, idx), mesh)
    sh_out = jax.jit(sharding.member_map(ev, mesh))(s_sh, i_sh)
    out["a_n_shards"] = len(sh_out.cost_cents.addressable_shards)
    sh = sharding.unpad(sharding.to_host(sh_out), n0)
    out["a_equal"] = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(sh)))
    # also the same metrics via the SPMD partitioner (NamedSharding inputs, plain jit)
    auto = jax.device_get(jax.jit(ev)(s_sh, i_sh))
    out["a_equal_auto"] = all(np.array_equal(np.asarray(x)[:S], np.asarray(y)) for x, y in zip(jax.tree.leaves(auto), jax.tree.leaves(one)))
    ref_ok = True
    for s in range(0, S, 6):
        for j in range(0, n, 13):
            r = reference_evaluate_set(cache, int(idx[s, j]), sets[s, j].tolist())
            ref_ok &= abs(r["cost_cents"] - float(sh.cost_cents[s, j])) < 1e-4 and bool(r["covered"]) == bool(sh.covered[s, j])
    out["a_reference_ok"] = bool(ref_ok)

    # (c) env rollout with the episode axis sharded (N=1000 episodes, 6 steps of pre-drawn actions).
    env = OrchestrationEnv()
    N, steps = 1000, 6
    qs = rng.integers(0, cache.n_questions, N).astype(np.int32)
    acts = rng.integers(0, 3, (steps, N)).astype(np.int32)

    def rollout(q, a):  # q [N], a [N, steps] -> (reward sum [N], cost [N], done [N])
        _, st = jax.vmap(lambda qq: env.reset(jax.random.PRNGKey(0), params, qq))(q)
        def body(st, a_t):
            _, st, r, d, _, info = jax.vmap(env.step, in_axes=(None, 0, 0, None))(jax.random.PRNGKey(0), st, a_t, params)
            return st, (r, info["constraint"])
        st, (r, c) = jax.lax.scan(body, st, a.T)
        return r.sum(0), c.sum(0), st.cost_cents, st.done
    base = jax.device_get(jax.jit(rollout)(qs, acts.T))
    emesh = sharding.make_mesh(axis=sharding.EPISODE_AXIS)
    (q_sh, a_sh), n_ep = sharding.shard_leading((qs, acts.T), emesh)
    got = sharding.unpad(sharding.to_host(jax.jit(sharding.member_map(rollout, emesh))(q_sh, a_sh)), n_ep)
    got_auto = sharding.unpad(jax.device_get(jax.jit(rollout)(q_sh, a_sh)), n_ep)
    out["c_equal"] = all(np.array_equal(x, y) for x, y in zip(base, got))
    out["c_equal_auto"] = all(np.array_equal(x, y) for x, y in zip(base, got_auto))
    out["c_nonzero"] = float(np.abs(base[0]).sum())

    # (b) train_many, 2 variants x 3 splits = 6 members (padded to 8), 2 iterations in 2 chunks.
    # The sampled V-trace estimator: its rollout metrics are discrete, so they must match bitwise
    # (the exact estimator's are float means, equal only up to rounding under SPMD).
    cfg = TrainConfig(iterations=2, chunk=1, batch_size=8, cg_iters=3, backtrack_steps=4, critic_steps=2,
                      estimator="vtrace")
    variants = [Variant("CPO", conformal=False), Variant("CCPO (lambda=0)", conformal=True, lam=0.0)]
    train_idx = np.stack([rng.permutation(cache.n_questions)[:100] for _ in range(3)]).astype(np.int32)
    key = jax.random.PRNGKey(7)
    st1, m1, _ = train_many(cfg, params, variants, train_idx, key, Execution(progress=False))
    st8, m8, _ = train_many(cfg, params, variants, train_idx, key, Execution(progress=False, mesh=mesh))
    l1 = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(st1))]
    l8 = [np.asarray(x) for x in jax.tree.leaves(sharding.to_host(st8))]
    out["b_shapes_equal"] = [x.shape for x in l1] == [x.shape for x in l8]
    def compare(xs, ys):  # (all discrete leaves bitwise equal, max |x - y| - rtol |x| of float leaves)
        exact, excess = True, -1.0
        for x, y in zip(xs, ys):
            if np.issubdtype(x.dtype, np.floating):
                excess = max(excess, float(np.max(np.abs(x - y) - 1e-5 * np.abs(x))))
            else:
                exact &= bool(np.array_equal(x, y))
        return exact, excess
    out["b_state_discrete_equal"], out["b_state_excess"] = compare(l1, l8)
    out["b_state_bitwise"] = all(np.array_equal(x, y) for x, y in zip(l1, l8))
    out["b_state_maxabs"] = max(float(np.max(np.abs(x - y))) for x, y in zip(l1, l8) if x.dtype.kind == "f")
    exact_m = ("kappa", "cpo_case", "step_accepted", "batch_cost_cents", "batch_success", "batch_len", "coverage_err_online")
    out["b_metrics_exact_equal"] = all(np.array_equal(m1[k], m8[k]) for k in exact_m)
    _, out["b_metrics_excess"] = compare([m1[k] for k in sorted(m1)], [m8[k] for k in sorted(m8)])
    out["b_metric_shape"] = list(m8["kappa"].shape)
    out["b_policy_moved"] = float(np.max(np.abs(l1[0])))

    # (d) member_block=1: 3 variants x 3 splits = 9 members, 12 iterations (3 chunks), on ONE device
    # (no mesh) and on 2 devices (5 members each, one of them padding): BITWISE equal, state and
    # every metric (sharding.PerDevice: one single-device program per device). Then killed after
    # 1 of 3 chunks on the 2 devices and resumed from its checkpoint on ONE device: equal to the
    # uninterrupted one-device run. (Three compilations: the one-device program and the two
    # per-device ones, which the killed run reuses through the compilation cache.)
    cfg_d = cfg.replace(iterations=12, chunk=4)
    variants_d = variants + [Variant("CCPO (lambda=2e-4)", conformal=True, lam=2e-4)]
    runs = {}
    for n_dev in (1, 2):
        mesh_d = None if n_dev == 1 else sharding.make_mesh(n_dev)
        st, m, _ = train_many(cfg_d, params, variants_d, train_idx, key,
                              Execution(progress=False, mesh=mesh_d, member_block=1))
        runs[n_dev] = ([np.asarray(x) for x in jax.tree.leaves(jax.device_get(st))], m)
    (l_one, m_one) = runs[1]
    out["d_state_bitwise"] = all(np.array_equal(x, y) for x, y in zip(l_one, runs[2][0]))
    out["d_metrics_bitwise"] = sorted(m_one) == sorted(runs[2][1]) and all(np.array_equal(m_one[k], runs[2][1][k]) for k in m_one)
    out["d_metric_shape"] = list(runs[2][1]["kappa"].shape)
    out["d_param_change"] = float(np.max(np.abs(l_one[0][:2] - l1[0])))  # the same two rows, trained further than (b)
    import tempfile
    with tempfile.TemporaryDirectory() as ck:
        train_many(cfg_d, params, variants_d, train_idx, key,
                   Execution(progress=False, mesh=sharding.make_mesh(2), member_block=1, ckpt_dir=ck, stop_after_chunks=1))
        st_r, m_r, _ = train_many(cfg_d, params, variants_d, train_idx, key,
                                  Execution(progress=False, member_block=1, ckpt_dir=ck))
    l_r = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(st_r))]
    out["d_resumed_bitwise"] = all(np.array_equal(x, y) for x, y in zip(l_one, l_r)) and all(
        np.array_equal(m_one[k], m_r[k]) for k in m_one)
    print("RESULT " + json.dumps(out))
    '''
)


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{FAST_COMPILE_XLA_FLAGS} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_set_evaluation_sharded_over_splits_equals_one_device(result):
    assert result["a_n_shards"] == 4
    assert result["a_equal"], "shard_map evaluation differs from one device"
    assert result["a_equal_auto"], "NamedSharding (SPMD-partitioned) evaluation differs from one device"
    assert result["a_reference_ok"], "sharded evaluation disagrees with the plain-Python reference evaluator"


def test_train_many_with_mesh_equals_one_device(result):
    assert result["b_shapes_equal"]
    assert result["b_metric_shape"] == [2, 3, 2]
    # Discrete state (kappa, keys, counters) and the rollout metrics: bitwise equal.
    assert result["b_state_discrete_equal"]
    assert result["b_metrics_exact_equal"]
    # Float parameters, optimiser moments and losses: |x8 - x1| <= 1e-6 + 1e-5 |x1|.
    assert result["b_state_excess"] <= 1e-6, result
    assert result["b_metrics_excess"] <= 1e-6, result
    print("train_many on 4 devices: bitwise", result["b_state_bitwise"], "max abs diff", result["b_state_maxabs"])


def test_train_many_member_block_on_2_devices_equals_one_device_bitwise(result):
    assert result["d_metric_shape"] == [3, 3, 12]
    assert result["d_param_change"] > 0  # the 12-iteration runs did train
    assert result["d_state_bitwise"], "member_block=1 on 2 devices: state differs from one device"
    assert result["d_metrics_bitwise"], "member_block=1 on 2 devices: metrics differ from one device"


def test_train_killed_on_2_devices_resumes_on_one_device_bitwise(result):
    assert result["d_resumed_bitwise"], "2-device checkpoint resumed on 1 device differs from an uninterrupted 1-device run"


def test_env_rollout_episode_axis_sharded_equals_unsharded(result):
    assert result["c_nonzero"] > 0  # the rollout did something
    assert result["c_equal"], "shard_map rollout differs"
    assert result["c_equal_auto"], "NamedSharding rollout differs"
