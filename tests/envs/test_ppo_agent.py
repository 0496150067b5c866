"""The PPO-Lagrangian agent of experiments/ppo_agent.py (issue 53, item 2): a PureJaxRL-style
``make_train`` that runs unchanged on gymnax's CartPole-v1 and on the replay env's gymnax API;
its GAE against rlax's, its multiplier's dual steps recomputed from its own metrics, and the set
scores of experiments/ppo_lagrangian.py against a brute-force sum over the sets.

gymnax is an optional extra: these skip without it locally; under CI=true its absence fails."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import IN_CI

if IN_CI:
    import gymnax  # noqa: F401  CI installs '.[gymnax]': its absence must fail, not skip
gymnax = pytest.importorskip("gymnax")

from envs.replay.gymnax import make  # noqa: E402
from envs.replay.reference import random_cache  # noqa: E402
from experiments.ppo_agent import PPOConfig, gae, make_train, policy_probs  # noqa: E402

TINY = dict(num_envs=8, num_steps=8, total_timesteps=8 * 8 * 6, update_epochs=2, num_minibatches=2)


def test_gae_equals_rlax():
    rlax = pytest.importorskip("rlax")
    rng = np.random.default_rng(0)
    S, E = 11, 3
    values, rewards = rng.normal(size=(S, E)).astype(np.float32), rng.normal(size=(S, E)).astype(np.float32)
    dones = (rng.random((S, E)) < 0.3).astype(np.float32)
    last = rng.normal(size=E).astype(np.float32)
    adv, ret = gae(jnp.asarray(values), jnp.asarray(rewards), jnp.asarray(dones), jnp.asarray(last), 0.97, 0.9)
    for e in range(E):
        want = rlax.truncated_generalized_advantage_estimation(
            rewards[:, e], 0.97 * (1.0 - dones[:, e]), 0.9, np.concatenate([values[:, e], last[e:e + 1]]))
        np.testing.assert_allclose(np.asarray(adv[:, e]), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), np.asarray(adv) + values, rtol=1e-6)


def test_the_same_train_runs_on_cartpole_and_on_the_replay_env():
    """PureJaxRL's shape: make_train(config, env, params) -> jit(vmap(train)) over seeds, on a
    gymnax classic and on the replay env, unchanged."""
    cart, cart_params = gymnax.make("CartPole-v1")
    params, m = jax.jit(jax.vmap(make_train(PPOConfig(**TINY), cart, cart_params)))(
        jax.random.split(jax.random.PRNGKey(0), 2))
    assert np.asarray(m["episode_return"]).shape == (2, 6)
    assert np.all(np.asarray(m["lagrange"]) == 0.0)  # unconstrained: plain PPO

    env, p = make(random_cache(60, 4, seed=5), questions=np.arange(40))
    cfg = PPOConfig(**TINY, constraint_key="covered", target=1.0, lagrange_lr=0.3, lagrange_init=0.1)
    policy, m = jax.jit(make_train(cfg, env, p))(jax.random.PRNGKey(1))
    lam, con = np.asarray(m["lagrange"], np.float64), np.asarray(m["episode_constraint"], np.float64)
    assert np.isfinite(con).all() and (con <= 1.0).all()
    # the projected dual step, recomputed from the metrics: lam_k = max(0, lam_{k-1} + lr (target - c_k))
    want, prev = [], 0.1
    for c in con:
        prev = max(0.0, prev + 0.3 * (1.0 - c))
        want.append(prev)
    np.testing.assert_allclose(lam, want, rtol=1e-5)
    probs = policy_probs(cfg, 8, policy, p.replay.obs)
    assert probs.shape == (60, 4, 8)
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, rtol=1e-5)


def test_set_scores_are_the_probability_that_the_set_holds_the_action():
    from experiments.ppo_lagrangian import set_scores

    env, p = make(random_cache(30, 4, seed=6), questions=np.arange(30))
    cfg = PPOConfig(**TINY)
    policy = jax.jit(make_train(cfg, env, p))(jax.random.PRNGKey(2))[0]
    scores = np.asarray(set_scores(cfg, policy, p.replay.obs))
    probs = np.asarray(policy_probs(cfg, 8, policy, p.replay.obs), np.float64)
    for a, bit in enumerate((1, 2, 4)):  # base, guide, next: the ids whose bit is set
        np.testing.assert_allclose(scores[..., a], sum(probs[..., s] for s in range(8) if s & bit), rtol=1e-5)
