"""The Stackelberg learners against the brute-force oracles on the default SYNTHETIC grid, on every seed of 3
(issue 28): the PPO leader within one standard error of the best constant commitment and within 0.005 U_L per
session of it (surrogate, where PPO trains), and the follower (BC-initialised GAIL) within 1.3x of behaviour cloning's held-out action error (issue 40's
goal; 1.5x until the discriminator took 5 steps an iteration); under the
SYNTHETIC 'state-feedback' leader profile, whose best policy depends on the task, the task-aware PPO leader within one
standard error of the brute-force best (task, model) table, which beats the best constant by many."""
from __future__ import annotations

import jax
import pytest

from ccpo_jax.runtime.scalars import ScalarWriter
from ccpo_jax.stackelberg import pipeline as P
from ccpo_jax.stackelberg.config import StackelbergConfig
from ccpo_jax.stackelberg.leader_oracles import leader_oracles


@pytest.fixture(scope="module")
def setup():
    cfg = StackelbergConfig()
    grid = P.load_or_generate_grid(cfg)
    params = P.make_session_params(grid, P.fit_surrogate(grid, cfg.surrogate).weights)
    return cfg, params, P.fit_u_need(grid, cfg.repair)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leader_reaches_best_constant_and_gail_imitates_like_bc(tmp_path, setup, seed):
    cfg, params, u_head = setup
    key = jax.random.PRNGKey(seed)
    w = ScalarWriter(tmp_path / "tb", ".t")
    ctrl = P.train_controller("scalar", cfg, params, jax.random.fold_in(key, 0), tmp_path / "ck", w, False)
    w.close()
    o = leader_oracles(cfg, params, {"scalar": ctrl}, u_head, key)["scalar"]["surrogate"]
    best, learned = o["constant"], o["learned"]
    print(f"seed {seed}: best constant {best['u_leader']:.4f} (se {best['u_leader_se']:.4f}) {best['action']}, "
          f"learned {learned['u_leader']:.4f}, untrained {o['untrained']['u_leader']:.4f}; imitation {ctrl.report['imitation_error']}")
    assert learned["u_leader"] >= best["u_leader"] - best["u_leader_se"]
    assert learned["gap_to_constant"]["mean"] >= -0.005  # issue 40's goal (measured -0.0039 / -0.0023 / -0.0020)
    assert learned["u_leader"] > o["untrained"]["u_leader"] + 2 * o["untrained"]["gap_to_constant"]["se"]
    err = ctrl.report["imitation_error"]
    assert min(err["gail"]) <= 1.3 * min(err["bc"])
    assert min(err["bc"]) < 0.5 * err["constant_mean_action"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_task_aware_leader_reaches_the_best_table_when_feedback_matters(tmp_path, setup, seed):
    """The task controller exactly as the pipeline trains it (key fold 1) under the SYNTHETIC 'state-feedback'
    profile (the follower is the default one: the profile changes only the leader's utility)."""
    _, params, u_head = setup
    cfg = StackelbergConfig().with_leader_profile("state-feedback")
    key = jax.random.PRNGKey(seed)
    w = ScalarWriter(tmp_path / "tb", ".t")
    ctrl = P.train_controller("task", cfg, params, jax.random.fold_in(key, 1), tmp_path / "ck", w, False)
    w.close()
    o = leader_oracles(cfg, params, {"task": ctrl}, u_head, key, modes=("surrogate",))["task"]["surrogate"]
    const, table, learned = o["constant"], o["table"], o["learned"]
    gain = o["table"]["gap_to_constant"]
    print(f"seed {seed}: constant {const['u_leader']:.4f} {const['action']}, table {table['u_leader']:.4f} "
          f"(se {table['u_leader_se']:.4f}; +{gain['mean']:.4f} se {gain['se']:.4f}), learned {learned['u_leader']:.4f} "
          f"({learned['gap_to_table']}), untrained {o['untrained']['u_leader']:.4f}")
    assert gain["mean"] >= 0.1 and gain["mean"] > 10 * gain["se"]  # feedback matters, by the derived margin
    assert learned["u_leader"] >= table["u_leader"] - table["u_leader_se"]
    assert learned["gap_to_constant"]["mean"] > 0.8 * gain["mean"]
