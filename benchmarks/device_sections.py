"""The ``devices`` section of the benchmark suite (benchmarks/run.py; docs/performance.md): sharded
evaluation and training in subprocesses with N forced host devices, compared with one device."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import Recorder, compile_and_time

RUN = Path(__file__).resolve().with_name("run.py")  # the suite's entry point runs the worker (--device-worker)


def device_worker(n_dev: int, quick: bool, train: bool = True) -> dict:
    """Runs inside a subprocess with N forced devices: sharded evaluation and training, with digests."""
    import jax
    import numpy as np

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.members import train_many
    from ccpo_jax.runtime import sharding
    from ccpo_jax.runtime.execution import Execution
    from envs.replay.env import evaluate_sets, make_env_params
    from envs.generators.synthetic import generate

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
            cmd = [sys.executable, str(RUN), "--device-worker", str(n), "--worker-out", str(out)]
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
