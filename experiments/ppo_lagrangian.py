"""A PPO-Lagrangian agent that knows nothing of CCPO, on the replay env through gymnax's API,
reported beside CCPO and the best observable reference (issue 53, item 2; docs/gym_api.md).

    python -m experiments.ppo_lagrangian --out DIR [--cases table2,uala-ladder] [--seeds 5]
        [--splits 100] [--timesteps 1000000] [--uala ../shared/data/uala]

Per case (``table2``: the built-in SYNTHETIC Table 2 cache, 1000/200/200 at alpha 0.1;
``uala-ladder``: UALA's real HotpotQA runs as a three-rung guide-less ladder, 300/100/100):

1. ``ccpo-jax reproduce`` with the same seed, splits and seeds (a subprocess; reused when
   DIR/CASE/reproduce/results.json exists) gives CCPO, CPO batch, UALA, the best observable
   reference and the clairvoyant bound on every split;
2. :mod:`experiments.ppo_agent`'s ``make_train`` trains the agent on ``envs.replay.gymnax.make``'s env
   (``reproduce``'s training questions; action sets ``Discrete(8)``; reward -J_t; constraint
   ``info["covered"] >= 1 - alpha``), one compiled ``train`` per seed (:func:`train_seeds`);
3. its set scores are calibrated like any row: the score of raw action a at o_t is the policy's
   probability that the set it samples holds a, s_a(o_t) = sum_{S ∋ a} pi(S | o_t), and
   C(o_t) = {a : s_a(o_t) >= kappa-hat} with kappa-hat the exact split-conformal threshold on each
   split's calibration questions (``ccpo_jax.ccpo.evaluation.eval_batch_calibrated``, as the CCPO
   rows), evaluated on its test questions. The agent's own sampled sets (not calibrated) are
   reported too.

Writes DIR/ppo_lagrangian.json and DIR/ppo_lagrangian.md and prints the table.
The record quoted in docs/: experiments/results/ppo_lagrangian/ppo_lagrangian.json
(its command: experiments/results/INDEX.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ccpo_jax.ccpo.evaluation import eval_batch_calibrated
from ccpo_jax.ccpo.splits import make_recalibrate_splits
from ccpo_jax.core import conformal
from envs.replay.env import evaluate_sets, summarise
from envs.replay.gymnax import N_SETS, make, set_members
from experiments.ppo_agent import PPOConfig, make_train, policy_probs

CASES = {  # label: (split sizes, alpha, reproduce's cache option or None for the setting's SYNTHETIC cache)
    "table2": ((1000, 200, 200), 0.1, None),
    "uala-ladder": ((300, 100, 100), 0.1, "uala-ladder"),
}
PPO_ROW = "PPO-Lagrangian (calibrated sets)"
SAMPLED_ROW = "PPO-Lagrangian (its sampled sets, not calibrated)"
REFERENCE_ROWS = ("CCPO (lambda=0)", "CCPO (lambda=2e-4)", "CPO batch", "UALA", "Best observable", "Clairvoyant bound")


def agent_config(params, alpha: float, timesteps: int, overrides: dict | None = None) -> PPOConfig:
    """The agent's configuration: PPO's usual defaults, the constraint at 1 - alpha, and rewards scaled so
    that a round's mean cost on the training questions is 1 (any RL user's reward scaling; no CCPO);
    ``overrides``: fields set on top (``--set``)."""
    cost = np.asarray(params.replay.cost)[np.asarray(params.questions)]
    cfg = PPOConfig(constraint_key="covered", target=1.0 - alpha, total_timesteps=timesteps,
                    reward_scale=float(1.0 / cost[cost > 0].mean()))
    return dataclasses.replace(cfg, **(overrides or {}))


def parse_sets(items: list[str]) -> dict:
    """``["lagrange_lr=0.5", ...]`` -> typed PPOConfig overrides."""
    types = {f.name: f.type for f in dataclasses.fields(PPOConfig)}
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        if k not in types:
            raise SystemExit(f"--set: unknown PPOConfig field {k!r}; valid: {', '.join(types)}")
        out[k] = v == "true" if types[k] == "bool" else (int(v) if types[k] == "int" else float(v))
    return out


def set_scores(config: PPOConfig, policy, obs) -> jax.Array:
    """[..., 3] s_a(o) = P(a in the sampled set | o) from the policy's [..., 8] set probabilities."""
    probs = policy_probs(config, N_SETS, policy, obs)
    return probs @ set_members(jnp.arange(N_SETS)).astype(jnp.float32)


def evaluate(config: PPOConfig, policies, p, splits, alpha: float, key) -> dict[str, dict[str, np.ndarray]]:
    """Both PPO rows on every seed and split: ``{row: {metric: [N seeds, S splits]}}``."""
    def one_seed(policy, k):
        scores = set_scores(config, policy, p.obs)  # [Q, T, 3]
        kappa_i = jax.vmap(conformal.largest_covering_kappa)(scores, p.base_correct, p.guide_correct, p.round_mask,
                                                              p.unsolvable)
        set_logits = jnp.log(jnp.maximum(policy_probs(config, N_SETS, policy, p.obs), 1e-30))

        def one_split(cal, test, ks):
            m, _ = eval_batch_calibrated(scores, kappa_i, p, cal, test, alpha)
            sampled = set_members(jax.random.categorical(ks, set_logits[test]))
            return summarise(m), summarise(evaluate_sets(sampled, p, test))

        return jax.vmap(one_split)(splits.cal, splits.test, jax.random.split(k, splits.cal.shape[0]))

    n = jax.tree.leaves(policies)[0].shape[0]
    cal, sampled = jax.jit(jax.vmap(one_seed))(policies, jax.random.split(key, n))
    as_np = lambda d: {k: np.asarray(v) for k, v in d.items()}  # noqa: E731
    return {PPO_ROW: as_np(cal), SAMPLED_ROW: as_np(sampled)}


def train_seeds(cfg: PPOConfig, env, params, keys):
    """One compiled ``train`` called per seed, the results stacked [N, ...]. Not ``jit(vmap(train))``:
    with 5 seeds vmapped on this 2-core CPU (jax 0.10.2), the run hung after compiling, every XLA thread
    idle, reproducibly (docs/gym_api.md); one seed at a time ran every time."""
    train = jax.jit(make_train(cfg, env, params))
    outs = [jax.block_until_ready(train(k)) for k in keys]
    return jax.tree.map(lambda *x: jnp.stack(x), *outs)


def reproduce(case: str, out: Path, seeds: int, n_splits: int, cache_path: Path | None) -> dict:
    """CCPO and the references on the same splits: ``ccpo-jax reproduce``'s results.json."""
    res = out / "results.json"
    if not res.exists():
        sizes, alpha, _ = CASES[case]
        cmd = [sys.executable, "-m", "ccpo_jax.cli", "reproduce", "--out", str(out), "--seeds", str(seeds),
               "--splits", str(n_splits), "--alpha", str(alpha), "--split-sizes", ",".join(map(str, sizes)),
               "--no-progress"] + (["--cache", str(cache_path)] if cache_path else [])
        subprocess.run(cmd, check=True)
    return json.loads(res.read_text())


def case_cache(case: str, uala: Path, work: Path):
    """The case's cache and, for a real one, its path for ``reproduce``."""
    if CASES[case][2] is None:
        from envs.generators.synthetic import generate

        return generate("hotpotqa-llama2", 1400, 0), None
    from envs.cache.formats import save_cache
    from envs.importers import import_cache

    cache = import_cache(CASES[case][2], uala)
    path = work / f"{case}.jsonl"
    if not path.exists():
        save_cache(cache, path)
    return cache, path


def run_case(case: str, a: argparse.Namespace) -> dict:
    sizes, alpha, _ = CASES[case]
    work = Path(a.out) / case
    work.mkdir(parents=True, exist_ok=True)
    cache, path = case_cache(case, Path(a.uala), work)
    t0 = time.perf_counter()
    ref = reproduce(case, work / "reproduce", a.seeds, a.splits, path)
    t_ref = time.perf_counter() - t0
    env, params = make(cache, seed=0)  # reproduce --seed 0's training questions (tests/envs/test_gym_api.py)
    assert int(params.questions.shape[0]) == sizes[0]
    cfg = agent_config(params, alpha, a.timesteps, parse_sets(a.set))
    t0 = time.perf_counter()
    policies, metrics = train_seeds(cfg, env, params, jax.random.split(jax.random.PRNGKey(a.agent_seed), a.seeds))
    t_train = time.perf_counter() - t0
    k_split = jax.random.split(jax.random.PRNGKey(0), 3)[0]  # ccpo_jax/ccpo/prepare.py's split key at --seed 0
    splits = make_recalibrate_splits(k_split, cache.n_questions, *sizes, a.splits)
    rows = evaluate(cfg, policies, params.replay, splits, alpha, jax.random.PRNGKey(1))
    bound = np.asarray(ref["policies"]["Clairvoyant bound"]["per_split"]["cost_cents"], np.float64)
    from envs.replay.bound import bound_of_params

    mine = bound_of_params(params.replay, np.asarray(splits.test), alpha)["cost_cents"]
    if not np.allclose(mine, bound, rtol=1e-5):  # the same test questions as reproduce's, split for split
        raise RuntimeError(f"{case}: the splits differ from reproduce's (bound per split)")
    last = {k: np.asarray(v)[:, -max(1, cfg.num_updates // 10):] for k, v in metrics.items()}
    return {"case": case, "alpha": alpha, "split_sizes": sizes, "splits": a.splits, "seeds": a.seeds,
            "cache": ref["cache"], "agent": dataclasses.asdict(cfg), "num_updates": cfg.num_updates,
            "timing_s": {"reproduce": t_ref, "ppo_train": t_train},
            "training_end": {k: np.nanmean(v, axis=1).tolist() for k, v in last.items()},
            "rows": table_rows(rows, ref)}


def _stats(per_seed_cost, per_seed_cov, best_obs: float) -> dict:
    c = np.asarray(per_seed_cost, np.float64)
    return {"cost_cents": float(c.mean()), "cost_seed_sd": float(c.std(ddof=1)) if c.size > 1 else 0.0,
            "coverage": float(np.mean(per_seed_cov)), "per_seed_cost": c.tolist(),
            "cost_over_best_observable": float(c.mean() / best_obs),
            "ratio_seed_sd": float((c / best_obs).std(ddof=1)) if c.size > 1 else 0.0}


def table_rows(rows: dict, ref: dict) -> dict:
    """Per row: mean cost and coverage over seeds x splits, the spread over seeds, cost / best observable."""
    pol = ref["policies"]
    best = pol["Best observable"]["cost_cents"]["mean"]
    out = {}
    for name, m in rows.items():
        out[name] = _stats(m["cost_cents"].mean(axis=1), m["coverage"].mean(axis=1), best)
        out[name]["set_size"] = float(m["set_size"].mean())
        out[name]["avg_len"] = float(m["avg_len"].mean())
    for name in REFERENCE_ROWS:
        if name in pol:
            r = pol[name]
            ps = r.get("per_seed", {}).get("cost_cents") or [r["cost_cents"]["mean"]]
            out[name] = _stats(ps, [r["coverage"]["mean"]], best)
            for m in ("set_size", "avg_len"):  # the bound has no set
                out[name][m] = float("nan") if (r.get(m) or {}).get("mean") is None else r[m]["mean"]
    return out


def markdown(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines += [f"**{r['case']}** ({r['cache']['name']}, {r['cache']['provenance'].get('kind', '?')}; "
                  f"{'/'.join(map(str, r['split_sizes']))}, alpha {r['alpha']}, {r['seeds']} seeds x {r['splits']} splits)",
                  "", "| row | cost (cents) | coverage | cost / best obs. | set size | avg len | per-seed cost |",
                  "|---|---|---|---|---|---|---|"]
        for name, s in r["rows"].items():
            per = " ".join(f"{x:.2f}" for x in s["per_seed_cost"]) if len(s["per_seed_cost"]) > 1 else ""
            lines.append(f"| {name} | {s['cost_cents']:.3f} ±{s['cost_seed_sd']:.3f} | {s['coverage']:.3f} | "
                         f"{s['cost_over_best_observable']:.2f}x ±{s['ratio_seed_sd']:.2f} | {s['set_size']:.2f} | "
                         f"{s['avg_len']:.2f} | {per} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--splits", type=int, default=100)
    ap.add_argument("--timesteps", type=int, default=1_000_000)
    ap.add_argument("--agent-seed", type=int, default=0)
    ap.add_argument("--uala", default="../shared/data/uala")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a PPOConfig field")
    a = ap.parse_args(argv)
    results = []
    for case in a.cases.split(","):
        if case not in CASES:
            ap.error(f"--cases: unknown case {case!r}; valid: {', '.join(CASES)}")
        results.append(run_case(case, a))
        out = Path(a.out)
        (out / "ppo_lagrangian.json").write_text(json.dumps(results, indent=1))
        (out / "ppo_lagrangian.md").write_text(markdown(results))
        print(markdown(results[-1:]), flush=True)


if __name__ == "__main__":
    main()
