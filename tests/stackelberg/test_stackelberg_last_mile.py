"""The Stackelberg learners' last mile (issue 40, docs/stackelberg.md "The learners' last mile"): the
transfer gap of the leader oracles against a brute-force rollout of every constant, the linear
step anneals of the PPO leader and the GAIL follower, and experiments/gail_drift.py against the pipeline's
own follower phase."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.stackelberg.acting import Controller, RolloutParams
from ccpo_jax.stackelberg.config import LeaderPPOConfig, SurrogateConfig
from ccpo_jax.stackelberg.nets import BoxPolicy
from ccpo_jax.stackelberg.ppo import make_ppo
from ccpo_jax.stackelberg.surrogate import fit_surrogate
from envs.governance.session import SessionConfig, SessionEnv, make_session_params
from envs.governance.synthetic import generate_grid


@pytest.fixture(scope="module")
def session_params():
    grid = generate_grid(seed=3, levels=(0.0, 0.5, 1.0), turns=2, trials=2)
    return make_session_params(grid, fit_surrogate(grid, SurrogateConfig()).weights)


def test_transfer_gap_is_the_surrogate_constant_on_replay(session_params):
    """results.json's ``leader_oracle.<kind>.replay.surrogate_constant``: on replay's fresh sessions, the
    constant chosen in the surrogate minus the constant chosen on replay. Oracle: every constant rolled out
    by hand (the test's own act) on both environments, arg max on the selection sessions, the paired mean on
    the scoring ones. The seed is one where the two environments choose different constants (else the gap
    is 0 whatever is scored)."""
    import dataclasses

    from ccpo_jax.stackelberg.acting import make_follower
    from ccpo_jax.stackelberg.config import StackelbergConfig
    from ccpo_jax.stackelberg.evaluate import rollout_episodes
    from ccpo_jax.stackelberg.leader_oracles import leader_oracles
    from ccpo_jax.stackelberg.oracle import leader_candidates
    from ccpo_jax.stackelberg.repair import UNeedHead

    cfg = StackelbergConfig()
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, turns=2),
                              oracle=dataclasses.replace(cfg.oracle, levels=3, select_sessions=40, score_sessions=40))
    M = int(session_params.grid_tokens.shape[1])
    env0 = SessionEnv(SessionConfig(state="scalar"), M)
    leader = BoxPolicy(2, cfg.leader.hidden, cfg.leader.policy)
    lp = leader.init(jax.random.PRNGKey(1), env0.obs_dim)
    # a follower whose action is linear in the commitment, clip(W [1, q, alpha]); this W makes the surrogate
    # choose (1, 1) and replay (0, 0) (the untrained network's response is clipped away by repair: ties)
    class Linear:
        def mean(self, w, obs):
            return jnp.clip(w @ jnp.stack([1.0, obs[-2], obs[-1]]), 0.0, 1.0)

    w = jnp.array([[0.97, 0.53, 0.48], [0.53, 0.08, -0.3], [0.58, 0.29, -0.03]])
    ctrl = Controller(env0, Linear(), leader, leader_params=lp, follower_params=w, leader_init_params=lp)
    u_head = UNeedHead(jnp.linspace(0.0, 0.4, 6 + M), M)
    key = jax.random.PRNGKey(0)
    got = leader_oracles(cfg, session_params, {"scalar": ctrl}, u_head, key)["scalar"]
    k_sel, k_score = jax.random.split(jax.random.fold_in(key, cfg.oracle.seed))
    sel, sco = jax.random.split(k_sel, 40), jax.random.split(k_score, 40)
    cand = leader_candidates(3)
    u = {}
    for mode, fmode, horizon in (("surrogate", "raw", cfg.session.horizon), ("replay", "repair", 2)):
        env = SessionEnv(dataclasses.replace(cfg.session, state="scalar", mode=mode, horizon=horizon), M)
        follower = make_follower(ctrl.policy, cfg, u_head, fmode)

        def act(pp, x, st, env=env, follower=follower):
            ell = env.commit(st, pp.table)
            a_raw, a = follower(pp, jnp.concatenate([x, ell]), st)
            return ell, a_raw, a

        run = jax.jit(jax.vmap(lambda c, keys: rollout_episodes(env, act, keys, session_params,
                                                                 RolloutParams(fol=ctrl.follower_params, table=c))["u_leader"].sum(-1),
                               in_axes=(0, None)))
        u[mode] = (np.asarray(run(jnp.asarray(cand), sel)), np.asarray(run(jnp.asarray(cand), sco)))
    c_s, c_r = int(np.argmax(u["surrogate"][0].mean(1))), int(np.argmax(u["replay"][0].mean(1)))
    assert c_s != c_r
    want = u["replay"][1][c_s] - u["replay"][1][c_r]
    assert abs(want.mean()) > 1e-3
    sc = got["replay"]["surrogate_constant"]
    assert sc["action"] == cand[c_s].tolist() and got["surrogate"]["constant"]["action"] == cand[c_s].tolist()
    np.testing.assert_allclose(sc["gap_to_constant"]["mean"], want.mean(), atol=1e-5)
    np.testing.assert_allclose(sc["gap_to_constant"]["se"], want.std(ddof=1) / np.sqrt(40), atol=1e-5)
    np.testing.assert_allclose(sc["u_leader"], u["replay"][1][c_s].mean(), atol=1e-5)


def test_leader_lr_anneals_linearly_to_zero_per_iteration():
    """``leader.anneal_lr``: Adam's step is lr (1 - i / I) in iteration i, constant over its epochs x
    minibatches updates, and 0 from iteration I on; so with I = 1 a second iteration moves no parameter,
    while the constant step (the default until 2026-12-04) does."""
    from ccpo_jax.stackelberg.ppo import leader_lr

    cfg = LeaderPPOConfig(iterations=4, lr=2e-3, epochs=2, minibatches=3, anneal_lr=True)
    sched = leader_lr(cfg)
    counts = np.array([0, 5, 6, 11, 12, 18, 23, 24, 40])
    want = 2e-3 * np.maximum(1 - (counts // 6) / 4, 0)
    np.testing.assert_allclose([float(sched(jnp.int32(c))) for c in counts], want, rtol=1e-6)
    assert leader_lr(LeaderPPOConfig(lr=2e-3, anneal_lr=False)) == 2e-3

    def reset(key, p):
        return jnp.zeros((2,)), jnp.int32(0)

    def step(key, s, a, p):
        return jnp.zeros((2,)), s, -jnp.sum((a - 0.3) ** 2), jnp.bool_(True), {}

    for anneal in (True, False):
        c = LeaderPPOConfig(iterations=1, n_envs=16, epochs=1, minibatches=2, anneal_lr=anneal)
        _, init, run = make_ppo(reset, step, 2, 2, 1, c, "squashed")
        f = jax.jit(run, static_argnums=2)
        one, _ = f(init(jax.random.PRNGKey(0)), None, 1)
        two, _ = f(one, None, 1)
        same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), (one.actor, one.critic), (two.actor, two.critic)))
        assert all(same) == anneal


def test_gail_policy_step_anneals_to_zero():
    """``gail.anneal_lr``: with one iteration annealed, a second GAIL iteration moves neither the policy nor
    its critic (the discriminator keeps its own constant step); without it, both move."""
    from ccpo_jax.stackelberg.config import GAILConfig
    from ccpo_jax.stackelberg.gail import Demos, make_gail

    rng = np.random.default_rng(0)
    demos = Demos(obs=jnp.asarray(rng.uniform(size=(64, 5)), jnp.float32), action=jnp.asarray(rng.uniform(size=(64, 3)), jnp.float32),
                  t_ratio=jnp.ones(64), task=jnp.zeros(64, jnp.int32), clean_action=jnp.zeros((64, 3)))
    for anneal in (True, False):
        _, _, init, run = make_gail(5, 3, GAILConfig(iterations=1, batch=32, hidden=(8,), anneal_lr=anneal))
        f = jax.jit(run, static_argnums=2)
        one, _ = f(init(jax.random.PRNGKey(0)), demos, 1)
        two, _ = f(one, demos, 1)
        same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), (one.actor, one.critic), (two.actor, two.critic)))
        assert all(same) == anneal
        assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), one.disc, two.disc)))


def test_gail_drift_experiment_replays_the_pipelines_follower_phase(tmp_path, session_params):
    """experiments/gail_drift.py reads GAIL every 25 iterations; its last reading must be the follower phase
    of the pipeline itself (``training._train_follower`` with the key ``train_controller`` gives it): the same
    BC errors, and the same GAIL errors after all iterations (31: a short last chunk), per seed."""
    import dataclasses

    from ccpo_jax.runtime.scalars import ScalarWriter
    from ccpo_jax.stackelberg.config import StackelbergConfig
    from ccpo_jax.stackelberg.training import _train_follower
    from experiments.gail_drift import follower_drift

    cfg = StackelbergConfig()
    cfg = dataclasses.replace(cfg, seeds=2, expert=dataclasses.replace(cfg.expert, n_demos=256),
                              gail=dataclasses.replace(cfg.gail, iterations=31, batch=64, bc_steps=40, hidden=(16,)))
    seed, kind = 3, "task"
    drift = follower_drift(cfg, session_params, seed, kind)
    assert drift["iterations"] == [0, 25, 31]
    env = SessionEnv(dataclasses.replace(cfg.session, state=kind, mode="surrogate"), int(session_params.grid_tokens.shape[1]))
    key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), 1), 3)[0]  # train_controller's follower key
    w = ScalarWriter(tmp_path / "tb", ".t")
    fol = _train_follower(kind, env, cfg, session_params, key, tmp_path / "ck", w, False, {})
    w.close()
    im = fol.report["imitation_error"]
    np.testing.assert_allclose(drift["bc_error"], im["bc"], rtol=1e-5)  # its first reading: GAIL starts at BC
    np.testing.assert_allclose(drift["gail_error"][-1], im["gail"], rtol=1e-4)
    assert len(drift["disc_acc"]) == 2 and all(0.0 <= a <= 1.0 for row in drift["disc_acc"] for a in row)
