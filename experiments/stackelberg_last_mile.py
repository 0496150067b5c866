"""The Stackelberg learners' last mile (issue 40): the PPO leader against the brute-force best constant
commitment, and the GAIL follower's imitation error against behaviour cloning's, per seed.

    python -m experiments.stackelberg_last_mile --seeds 0,1,2 --out runs/last-mile
    python -m experiments.stackelberg_last_mile --seeds 0,1,2 --set leader.output_margin=0.1 --set gail.policy_lr=3e-5

Each seed runs the whole default pipeline (``run_pipeline``; SYNTHETIC grid) with the ``--set``
overrides (``section.field=value`` of :class:`ccpo_jax.stackelberg.config.StackelbergConfig`) and
reads from its results.json, per controller (scalar, task):

* the learned leader's U_L per session minus the best constant's, in the surrogate (what PPO
  maximises) and on grid replay with repair (``leader_oracle.<kind>.<env>.learned.gap_to_constant``);
* the transfer gap: on replay, the surrogate's best constant minus replay's best constant
  (``leader_oracle.<kind>.replay.surrogate_constant.gap_to_constant``), the replay gap of a leader
  that is exactly the surrogate's best constant;
* the selected GAIL follower's held-out imitation error over the best BC seed's
  (``training.<kind>.imitation_error``).

Prints a markdown table and writes ``--out``/last_mile.json.
The record quoted in docs/: experiments/results/stackelberg_last_mile/defaults.json
(its command: experiments/results/INDEX.md).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time
from pathlib import Path

from ccpo_jax.stackelberg.config import StackelbergConfig
from ccpo_jax.stackelberg.pipeline import run_pipeline


def with_overrides(cfg: StackelbergConfig, sets: list[str]) -> StackelbergConfig:
    for s in sets:
        path, _, text = s.partition("=")
        section, _, field = path.partition(".")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if field:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
        else:
            cfg = dataclasses.replace(cfg, **{section: value})
    return cfg


def read(results: dict) -> dict:
    out = {}
    for kind in ("scalar", "task"):
        lo = results["leader_oracle"][kind]
        im = results["training"][kind]["imitation_error"]
        sel = results["training"][kind].get("follower_seed", 0)
        out[kind] = {
            "surrogate_gap": lo["surrogate"]["learned"]["gap_to_constant"]["mean"],
            "surrogate_gap_se": lo["surrogate"]["learned"]["gap_to_constant"]["se"],
            "replay_gap": lo["replay"]["learned"]["gap_to_constant"]["mean"],
            "replay_gap_se": lo["replay"]["learned"]["gap_to_constant"]["se"],
            "transfer_gap": lo["replay"]["surrogate_constant"]["gap_to_constant"]["mean"],
            "transfer_gap_se": lo["replay"]["surrogate_constant"]["gap_to_constant"]["se"],
            "replay_best_constant": lo["replay"]["constant"]["action"],
            "best_constant": lo["surrogate"]["constant"]["action"],
            "gail_error": im["gail"][sel], "bc_error": min(im["bc"]),
            "gail_over_bc": im["gail"][sel] / min(im["bc"]),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default="runs/last-mile")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for seed in (int(s) for s in a.seeds.split(",")):
        cfg = with_overrides(dataclasses.replace(StackelbergConfig(), seed=seed), a.set)
        t0 = time.perf_counter()
        res = run_pipeline(cfg, out / f"seed_{seed}", progress=False, log=lambda *x, **k: None)
        rows[seed] = {**read(res), "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"seed {seed}: {json.dumps(rows[seed])}", flush=True)
    lines = [f"SYNTHETIC grid; overrides: {', '.join(a.set) or 'none (the defaults)'}", "",
             "| seed | controller | surrogate: PPO - best constant (se) | replay+repair: PPO - best constant (se) "
             "| transfer: surrogate's constant - replay's, on replay (se) | GAIL error / best BC | wall s |",
             "|---|---|---|---|---|---|---|"]
    for seed, r in rows.items():
        for kind in ("scalar", "task"):
            k = r[kind]
            lines.append(f"| {seed} | {kind} | {k['surrogate_gap']:+.4f} ({k['surrogate_gap_se']:.4f}) | "
                         f"{k['replay_gap']:+.4f} ({k['replay_gap_se']:.4f}) | "
                         f"{k['transfer_gap']:+.4f} ({k['transfer_gap_se']:.4f}) | {k['gail_error']:.4f} / "
                         f"{k['bc_error']:.4f} = {k['gail_over_bc']:.2f}x | {r['wall_s']} |")
    print("\n".join(lines))
    (out / "last_mile.json").write_text(json.dumps({"overrides": a.set, "seeds": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
