"""The gateway's drift scenario: fixed vs online kappa when the question mix shifts halfway.

    python -m experiments.gateway_drift ARTIFACT --first PROFILE --then PROFILE [--n N] [--eta ETA]
        [--json OUT.json] [--png OUT.png]

N questions of the synthetic profile ``--first`` (the one the router was trained on, fresh
seed), then N of ``--then`` in which a share ``--hard-share`` of the questions are hard ones
(the guide's first answer wrong; drawn from a larger fresh cache): the question mix shifts, replayed through the gateway's decision code
(:func:`ccpo_jax.gateway.drift.replay`) with ``gold`` feedback after each: once at the
artefact's fixed kappa, once with ``--online-kappa ETA``. Prints and writes long-run coverage,
coverage per half, mean cost and rounds, the alarm's first question; plots the curves.
The record quoted in docs/: experiments/results/gateway_drift/gateway_drift.json
(its command: experiments/results/INDEX.md).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--first", default="hotpotqa-llama3")
    ap.add_argument("--then", default="hotpotqa-llama3")
    ap.add_argument("--hard-share", type=float, default=None,
                    help="share of hard questions in the second half (default: as the profile draws them)")
    ap.add_argument("--n", type=int, default=1500, help="questions per half")
    ap.add_argument("--eta", type=float, default=1.0)
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)

    from ccpo_jax.gateway.drift import replay
    from ccpo_jax.serving import Router
    from envs.cache.jsonl import cache_to_records
    from envs.generators.synthetic import generate

    router = Router.load(a.artifact)
    second = cache_to_records(generate(a.then, 4 * a.n, a.seed + 1))
    hard = [r for r in second if not r["rounds"][0]["guide"]["correct"]]
    easy = [r for r in second if r["rounds"][0]["guide"]["correct"]]
    if a.hard_share is not None:
        k = round(a.hard_share * a.n)
        if k > len(hard) or a.n - k > len(easy):
            raise SystemExit(f"--hard-share {a.hard_share}: not enough questions of a kind in {4 * a.n} drawn")
        mix = hard[:k] + easy[: a.n - k]
        np.random.default_rng(a.seed).shuffle(mix)
    else:
        mix = second[: a.n]
    recs = cache_to_records(generate(a.first, a.n, a.seed)) + mix
    res, wall = {}, {}
    for name, eta in (("fixed", None), ("online", a.eta)):
        t0 = time.perf_counter()
        res[name] = replay(router, recs, eta, a.window)
        wall[name] = time.perf_counter() - t0
    target = 1.0 - router.alpha
    n = a.n
    summary = {"artifact": str(a.artifact), "policy": router.manifest["policy"]["row"], "target": target,
               "first": a.first, "then": a.then, "hard_share": a.hard_share,
               "hard_share_as_drawn": len(hard) / len(second), "n_per_half": n, "eta": a.eta, "window": a.window,
               "seed": a.seed, "kappa_artifact": float(router.kappa)}
    for name, r in res.items():
        alarm = np.flatnonzero(r["alarm"])
        summary[name] = {
            "long_run_coverage": float(r["covered"].mean()),
            "gap_to_target": float(r["covered"].mean() - target),
            "coverage_first_half": float(r["covered"][:n].mean()),
            "coverage_second_half": float(r["covered"][n:].mean()),
            "mean_cost_cents": float(r["cost_cents"].mean()),
            "mean_cost_cents_second_half": float(r["cost_cents"][n:].mean()),
            "mean_rounds": float(r["rounds"].mean()),
            "final_kappa": float(r["kappa"][-1]),
            "first_alarm_question": int(alarm[0]) if alarm.size else None,
            "wall_s": round(wall[name], 2),
            "decisions_per_s": round(float(r["rounds"].sum()) / wall[name], 1),
        }
    print(json.dumps(summary, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    if a.png:
        _plot(res, target, n, a.window, a.png)
    return 0


def _plot(res: dict, target: float, n: int, window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    x = np.arange(1, 2 * n + 1)
    for name, r in res.items():
        c = r["covered"].astype(float)
        ax.plot(x, np.cumsum(c) / x, label=f"{name}: long-run coverage")
        roll = np.convolve(c, np.ones(window) / window, mode="valid")
        ax.plot(x[window - 1:], roll, alpha=0.4, label=f"{name}: last {window}")
        bx.plot(x, r["kappa"], label=f"{name} kappa")
    ax.axhline(target, color="k", lw=0.8, ls="--", label="target 1 - alpha")
    for a in (ax, bx):
        a.axvline(n, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("coverage")
    ax.legend(fontsize=7, loc="lower left")
    bx.set_ylabel("kappa")
    bx.set_xlabel("question (the mix shifts at the dotted line)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
