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
             plain-Python reference env ``envs.replay.reference.ReferenceEnv``;
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

The cache is SYNTHETIC (``envs.generators.synthetic.generate('hotpotqa-llama2', 1400, 0)``).

    python benchmarks/run.py [--quick] [--out FILE.json] [--only env,eval,train,reproduce,devices,sweep]

Writes a JSON list of records {"name","value","unit","backend","device","config"}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from device_sections import device_worker, section_devices  # noqa: E402
from env_sections import section_env, section_eval  # noqa: E402
from envs.cache.atomic import atomic_write_json  # noqa: E402
from timing import Recorder, device_desc  # noqa: E402

SECTIONS = ("env", "eval", "train", "reproduce", "devices", "sweep")


# -- sections ----------------------------------------------------------------------


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
    from envs.replay.env import make_env_params
    from envs.generators.synthetic import generate

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
