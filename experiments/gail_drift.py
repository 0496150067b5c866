"""How BC-initialised GAIL moves away from its start (issue 40, item 4): the follower phase of the default
Stackelberg pipeline, with GAIL's held-out imitation error, the discriminator's batch accuracy and the
policy's action spread read every 25 iterations.

    python -m experiments.gail_drift --seeds 0,1,2 --out runs/gail-drift [--set disc_steps=5 ...]

Per seed and controller (scalar, task), exactly as ``training._train_follower`` draws them: the
demonstrations, the held-out expert states, the BC seeds and the GAIL seeds started from them. Every 25
GAIL iterations it reads, per GAIL seed,

* the held-out mean absolute error of the mean action against the noise-free expert action (what the
  pipeline selects the follower by), split into coordinates whose expert action is on the box's edge
  (0 or 1) and interior ones;
* the policy's action spread, mean |sample - mean action|, beside the expert's, mean |action - clean|;
* the discriminator's accuracy on the iteration's own batch, after its steps (mean over the 25).

``--set FIELD=VALUE`` overrides a :class:`ccpo_jax.stackelberg.config.GAILConfig` field. SYNTHETIC grid.
Prints one block per (seed, controller) and writes ``--out``/gail_drift.json.
The record quoted in docs/: experiments/results/gail_drift/defaults.json
(its command: experiments/results/INDEX.md).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

STEP = 25


def follower_drift(cfg, params, seed: int, kind: str) -> dict:
    from ccpo_jax.stackelberg.gail import make_bc, make_gail
    from ccpo_jax.stackelberg.training import follower_data
    from envs.governance.session import SessionEnv

    env = SessionEnv(dataclasses.replace(cfg.session, state=kind, mode="surrogate"), n_models=int(params.grid_tokens.shape[1]))
    # the pipeline's keys: run key -> fold_in(controller index) -> train_controller's first split (the follower's)
    k_fol = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), ("scalar", "task").index(kind)), 3)[0]
    demos, held, k_bc, k_gail = follower_data(env, cfg, params, k_fol)
    policy, bc_init, bc_run = make_bc(env.obs_dim + 2, 3, cfg.gail)
    bc = jax.jit(jax.vmap(bc_init))(jax.random.split(k_bc, cfg.seeds))
    bc, _ = jax.jit(jax.vmap(bc_run, in_axes=(0, None, None)), static_argnums=2)(bc, demos, cfg.gail.bc_steps)
    _, _, g_init, g_run = make_gail(env.obs_dim + 2, 3, cfg.gail)
    st = jax.jit(jax.vmap(lambda k, a: g_init(k).replace(actor=a)))(jax.random.split(k_gail, cfg.seeds), bc[0])
    run = jax.jit(jax.vmap(g_run, in_axes=(0, None, None)), static_argnums=2)
    edge = (held.clean_action <= 1e-6) | (held.clean_action >= 1 - 1e-6)

    @jax.jit
    @jax.vmap
    def read(p):
        e = jnp.abs(policy.mean(p, held.obs) - held.clean_action)
        s = policy.sample(p, held.obs, jax.random.PRNGKey(0))
        on_edge = lambda m: jnp.sum(e * m) / jnp.sum(m)  # noqa: E731 (a mean over a mask, jit-safe)
        return e.mean(), on_edge(edge), on_edge(~edge), jnp.abs(s - policy.mean(p, held.obs)).mean()

    err, err_edge, err_inner, spread, acc = [], [], [], [], []
    iters = [*range(0, cfg.gail.iterations, STEP), cfg.gail.iterations]  # every 25 and the last
    for i, it in enumerate(iters):
        r = [np.asarray(x).tolist() for x in read(st.actor)]
        for lst, v in zip((err, err_edge, err_inner, spread), r):
            lst.append(v)
        if i + 1 < len(iters):
            st, m = run(st, demos, iters[i + 1] - it)
            acc.append(np.asarray(m["disc_acc"]).mean(1).tolist())
    bc_err = np.asarray(err[0])  # GAIL starts at BC: its first reading is BC's imitation error
    return {"iterations": iters, "gail_error": err, "gail_error_edge": err_edge, "gail_error_interior": err_inner,
            "policy_spread": spread, "disc_acc": acc, "bc_error": err[0],
            "expert_spread": float(jnp.abs(held.action - held.clean_action).mean()),
            "edge_share": float(edge.mean()),
            "selected_over_best_bc": float(np.min(err[-1]) / bc_err.min())}


def main(argv=None) -> None:
    from ccpo_jax.stackelberg.config import StackelbergConfig
    from ccpo_jax.stackelberg.pipeline import load_or_generate_grid
    from ccpo_jax.stackelberg.surrogate import fit_surrogate
    from envs.governance.session import make_session_params

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a GAILConfig field")
    a = ap.parse_args(argv)
    cfg = StackelbergConfig()
    for s in a.set:
        field, _, text = s.partition("=")
        if field not in {f.name for f in dataclasses.fields(cfg.gail)}:
            ap.error(f"--set {s}: GAILConfig has no field {field!r}")
        cfg = dataclasses.replace(cfg, gail=dataclasses.replace(cfg.gail, **{field: ast.literal_eval(text)}))
    grid = load_or_generate_grid(cfg)
    params = make_session_params(grid, fit_surrogate(grid, cfg.surrogate).weights)
    out = {"note": "SYNTHETIC grid; default Stackelberg pipeline's follower phase", "gail": dataclasses.asdict(cfg.gail),
           "runs": {}}
    for seed in (int(s) for s in a.seeds.split(",")):
        for kind in ("scalar", "task"):
            r = follower_drift(cfg, params, seed, kind)
            out["runs"][f"{seed}/{kind}"] = r
            mean = lambda v: np.round(np.mean(v, axis=-1), 4).tolist()  # noqa: E731 (over GAIL seeds)
            print(f"seed {seed} {kind}: BC {np.round(r['bc_error'], 4).tolist()}, GAIL selected / best BC "
                  f"{r['selected_over_best_bc']:.2f}x\n  error {mean(r['gail_error'])}\n  spread {mean(r['policy_spread'])} "
                  f"(expert {r['expert_spread']:.4f})\n  disc acc {mean(r['disc_acc'])}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gail_drift.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
