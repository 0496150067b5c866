"""The Stackelberg learners against the brute-force oracles on the default SYNTHETIC grid, on every seed of 3
(issue 28): the PPO leader within one standard error of the best constant commitment (surrogate, where PPO
trains), and the follower (BC-initialised GAIL) within 1.5x of behaviour cloning's held-out action error."""
from __future__ import annotations

import jax
import pytest

from ccpo_jax.runtime.scalars import ScalarWriter
from ccpo_jax.stackelberg import pipeline as P
from ccpo_jax.stackelberg.config import StackelbergConfig


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
    o = P.leader_oracles(cfg, params, {"scalar": ctrl}, u_head, key)["scalar"]["surrogate"]
    best, learned = o["constant"], o["learned"]
    print(f"seed {seed}: best constant {best['u_leader']:.4f} (se {best['u_leader_se']:.4f}) {best['action']}, "
          f"learned {learned['u_leader']:.4f}, untrained {o['untrained']['u_leader']:.4f}; imitation {ctrl.report['imitation_error']}")
    assert learned["u_leader"] >= best["u_leader"] - best["u_leader_se"]
    assert learned["u_leader"] > o["untrained"]["u_leader"] + 2 * o["untrained"]["gap_to_constant"]["se"]
    err = ctrl.report["imitation_error"]
    assert min(err["gail"]) <= 1.5 * min(err["bc"])
    assert min(err["bc"]) < 0.5 * err["constant_mean_action"]
