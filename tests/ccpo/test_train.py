"""The CCPO trainer: kill-and-resume equality, learning on a cache with a known optimum,
and the set-valued evaluation of trained policies against a plain-Python oracle."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ccpo_jax.runtime.execution import Execution
from ccpo_jax.ccpo.config import TrainConfig, Variant
from ccpo_jax.ccpo.evaluation import eval_batch_calibrated, policy_tables
from ccpo_jax.ccpo.members import train_many
from ccpo_jax.ccpo.policy_store import load_policy, save_policies
from ccpo_jax.ccpo.train import make_train
from envs.cache.schema import Manifest, ModelInfo, ResponseCache, empty_arrays
from envs.replay.env import make_env_params
from envs.replay.reference import random_cache, reference_evaluate_set

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="module")
def small():
    cache = random_cache(80, T=4, seed=3)
    return cache, make_env_params(cache)


@pytest.fixture(scope="module")
def uninterrupted(mechanics):
    """The uninterrupted 6-iteration run of the mechanics problem (conftest): (state, metrics)."""
    p = mechanics
    state, metrics, _ = train_many(p.config, p.params, p.variants, p.train_idx, p.key, Execution(progress=False))
    return state, metrics


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_killed_run_resumes_to_identical_result(mechanics, uninterrupted, tmp_path):
    p = mechanics
    full_state, full_m = uninterrupted
    ckpt = tmp_path / "ckpt"
    # "kill" after the first chunk, then resume from the checkpoint.
    train_many(p.config, p.params, p.variants, p.train_idx, p.key,
               Execution(ckpt_dir=ckpt, progress=False, stop_after_chunks=1))
    res_state, res_m, _ = train_many(p.config, p.params, p.variants, p.train_idx, p.key,
                                     Execution(ckpt_dir=ckpt, progress=False))
    assert _tree_equal(full_state, res_state)
    assert full_m.keys() == res_m.keys()
    for k in full_m:
        assert full_m[k].shape == (3, 2, 6)
        np.testing.assert_array_equal(full_m[k], res_m[k])


def test_flipped_kernel_byte_in_a_killed_training_run_is_not_resumed(mechanics, uninterrupted, tmp_path):
    """Checkpoints verified before use (issue 15) through the trainer: kill after two chunks, flip
    a byte in the newest checkpoint's array data, resume: step 2 is refused (moved aside to
    orbax.damaged), the run resumes from step 1 and ends with exactly the uninterrupted run's
    result. (The checkpoint files themselves: tests/ccpo/test_checkpoints.py.)"""
    p = mechanics
    full_state, full_m = uninterrupted
    ckpt = tmp_path / "ckpt"
    train_many(p.config, p.params, p.variants, p.train_idx, p.key,
               Execution(ckpt_dir=ckpt, progress=False, stop_after_chunks=2))
    step2 = ckpt / "orbax" / "2"
    data_files = sorted(f for f in step2.rglob("*") if f.is_file() and "/d/" in f.as_posix())
    big = max(data_files, key=lambda f: f.stat().st_size)
    b = bytearray(big.read_bytes())
    b[len(b) // 2] ^= 0x40
    big.write_bytes(bytes(b))
    res_state, res_m, _ = train_many(p.config, p.params, p.variants, p.train_idx, p.key,
                                     Execution(ckpt_dir=ckpt, progress=False))
    assert _tree_equal(full_state, res_state)
    for k in full_m:
        np.testing.assert_array_equal(full_m[k], res_m[k])
    assert (ckpt / "orbax.damaged").is_dir()


def test_another_call_on_the_same_env_reuses_its_programs(mechanics, uninterrupted, monkeypatch):
    """train_many keeps the compiled programs of a call: the same run again builds (traces, lowers,
    compiles) nothing and gives the same result bit for bit. An env with a NumPy leaf, which could
    be changed in place, is never kept."""
    from ccpo_jax.ccpo import members

    built = []
    real = members._cached

    def spy(params, key, build):
        return real(params, key, lambda: built.append(key[0]) or build())

    monkeypatch.setattr(members, "_cached", spy)
    p = mechanics
    state, metrics, _ = train_many(p.config, p.params, p.variants, p.train_idx, p.key, Execution(progress=False))
    assert built == []
    assert _tree_equal(state, uninterrupted[0])
    for k in metrics:
        np.testing.assert_array_equal(metrics[k], uninterrupted[1][k])
    host_env = p.params.replace(obs=np.asarray(p.params.obs))
    assert real(host_env, ("x",), object) is not real(host_env, ("x",), object)
    assert real(p.params, ("x",), object) is real(p.params, ("x",), object)


def test_resume_with_other_config_is_refused(mechanics, tmp_path):
    from ccpo_jax.errors import UserError

    p = mechanics
    cfg = p.config.replace(iterations=2)
    train_many(cfg, p.params, p.variants, p.train_idx, p.key, Execution(ckpt_dir=tmp_path, progress=False))
    with pytest.raises(UserError, match="different configuration"):
        train_many(cfg.replace(iterations=4), p.params, p.variants, p.train_idx, p.key,
                   Execution(ckpt_dir=tmp_path, progress=False))


def _one_right_action_cache(Q: int = 64) -> ResponseCache:
    """Every question: round 1's guide answer is right, the base's is wrong, later rounds wrong.

    The cheapest policy with coverage 1 is obvious by hand: take the guide answer at
    round 1 (cost = one guide call). Going on costs more and finds nothing.
    """
    T = 3
    a = empty_arrays(Q, T)
    a["round_mask"][:] = True
    a["base_answer"][:] = 1
    a["guide_answer"][:, 0] = 0
    a["guide_answer"][:, 1:] = 1
    a["guide_correct"][:, 0] = True
    a["guide_verdict"][:] = False
    a["guide_uncertainty"][:] = 0.2
    a["guide_tokens_in"][:] = 80
    a["guide_tokens_out"][:] = 3
    a["answer_text"][:, 0] = "right"
    a["answer_text"][:, 1] = "wrong"
    a["gold"][:] = "right"
    man = Manifest(
        name="hand-made", task="test", T=T, base=ModelInfo("b"), guide=ModelInfo("g", 2.5, 10.0),
        provenance={"kind": "synthetic", "generator": "tests/ccpo/test_train.py"},
    )
    return ResponseCache(man, a).with_checksum()


SEEDS = 5


@pytest.mark.slow
def test_cpo_and_ccpo_learn_the_obvious_optimum():
    """Hand-derived optimum: take the guide answer at round 1 (coverage 1, one guide call).

    CPO must put most of pi's mass there. CCPO only needs the conformal SET at its
    online kappa to be {guide} at round 1 (pi(guide) >= kappa > the others), so it is
    checked through the set-valued policy's metrics, not through pi's magnitude.
    Every one of 5 seeds (members of one program) must. Measured: at 40, 80 and 150
    iterations the same figures on every seed (CPO pi(guide) 0.90-0.91, batch length 1.0;
    CCPO coverage 1.0, length 1.0, set size 1.0), so 40 iterations.
    """
    cache = _one_right_action_cache()
    params = make_env_params(cache)
    cfg = TrainConfig(iterations=40, chunk=40)  # alpha: the variants' (0.1)
    variants = [Variant("CPO", False), Variant("CCPO (lambda=0)", True)]
    state, metrics, _ = train_many(cfg, params, variants, np.tile(np.arange(64)[None], (SEEDS, 1)),
                                   jax.random.PRNGKey(0), Execution(progress=False))
    _, _, probs_fn = make_train(cfg, params)
    idx = jnp.arange(64)

    for s in range(SEEDS):
        cpo = jax.tree.map(lambda x: x[0, s], state.policy)
        p = np.asarray(probs_fn(cpo, params.obs[:, 0], params.available[:, 0]))  # round 1
        assert p[:, 1].mean() > 0.6, (s, p.mean(0))
        assert metrics["batch_success"][0, s, -10:].mean() > 0.8, s
        assert metrics["batch_len"][0, s, -10:].mean() < 1.3, s

        ccpo = jax.tree.map(lambda x: x[1, s], state.policy)
        probs, kappa_i = policy_tables(ccpo, params)
        # (The online kappa oscillates around pi(guide): online conformal targets 1 - alpha,
        # and here every question is the same, so the final batch calibration decides.)
        m, _ = eval_batch_calibrated(probs, kappa_i, params, idx, idx, 0.1)
        assert float(np.mean(np.asarray(m.covered))) >= 0.9, s
        assert float(np.mean(np.asarray(m.length))) < 1.2, s
        assert float(np.mean(np.asarray(m.set_size))) < 1.2, s


def test_batch_calibrated_evaluation_matches_plain_python(small):
    cache, params = small
    cfg = TrainConfig(iterations=1)
    init, _, probs_fn = make_train(cfg, params)
    pol = init(jax.random.PRNGKey(1)).policy
    probs, kappa_i = policy_tables(pol, params)
    cal, test = jnp.arange(0, 40), jnp.arange(40, 80)
    alpha = 0.2
    m, khat = eval_batch_calibrated(probs, kappa_i, params, cal, test, alpha)

    probs_np = np.asarray(probs)
    avail = np.asarray(params.available)

    def covered(q, kappa):
        in_set = (probs_np[q] >= kappa) & avail[q]
        return reference_evaluate_set(cache, q, in_set)["covered"]

    # Oracle: the smallest-set (largest) kappa on a fine grid whose calibration
    # coverage count reaches ceil((n+1)(1-alpha)).
    n = 40
    need = int(np.ceil((n + 1) * (1 - alpha)))
    grid = np.sort(np.unique(np.concatenate([probs_np.reshape(-1), [0.0]])))[::-1]
    best = None
    for k in grid:
        if sum(covered(q, k) for q in range(40)) >= need:
            best = k
            break
    assert best is not None
    assert float(khat) == pytest.approx(float(best), abs=1e-7)
    cov = np.mean([covered(q, float(khat)) for q in range(40, 80)])
    assert float(np.mean(np.asarray(m.covered))) == pytest.approx(cov)


def test_saved_policy_round_trip(mechanics, uninterrupted, tmp_path):
    cache, cfg, variants = mechanics.cache, mechanics.config, mechanics.variants
    state = jax.tree.map(lambda x: x[:, :, None], uninterrupted[0])  # [V, S_train, N seeds]
    kappas = {"CPO batch": np.array([[0.2, 0.25]]), "CCPO (lambda=0)": np.array([[0.3, 0.35]]),
              "CCPO (lambda=2e-4)": np.array([[0.4, 0.45]])}  # [N, S]
    save_policies(tmp_path, cfg, variants, state, kappas, cache, "recalibrate")
    pol, meta = load_policy(tmp_path / "ccpo-lambda-0")
    assert meta["row"] == "CCPO (lambda=0)" and meta["kappa"] == pytest.approx(0.3)
    assert _tree_equal(pol, jax.tree.map(lambda x: x[1, 0, 0], state.policy))
    assert meta["alpha"] == variants[1].alpha == meta["train_config"]["alpha"]  # the policy's alpha: its variant's
    pol2, meta2 = load_policy(tmp_path / "ccpo-lambda-2e-4")
    assert meta2["kappa"] == pytest.approx(0.4) and _tree_equal(pol2, jax.tree.map(lambda x: x[2, 0, 0], state.policy))


@pytest.mark.parametrize("estimator", ["exact", "jbar"])
def test_the_fisher_step_equals_the_kl_hessian_step(small, estimator):
    """One iteration of the exact and the sampled (J-bar) estimator with H applied as the Fisher product (the default) and
    by differentiating the KL twice: the same step to float32 rounding. A wrong weighting of
    the Fisher (e.g. unnormalised or over masked rounds) scales H and moves the step."""
    _, params = small
    variants = [Variant("CPO", False), Variant("CCPO (lambda=0)", True, lam=1e-3)]
    idx = np.tile(np.arange(60)[None], (2, 1))
    out = {}
    for hvp in ("fisher", "kl-hessian"):
        cfg = TrainConfig(iterations=1, chunk=1, estimator=estimator, hvp=hvp, exact_batch=32)
        state, metrics, _ = train_many(cfg, params, variants, idx, jax.random.PRNGKey(4), Execution(progress=False))
        out[hvp] = (state.policy, metrics["step_accepted"])
    moved = 0
    for a, b in zip(jax.tree.leaves(out["fisher"][0]), jax.tree.leaves(out["kl-hessian"][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    init = jax.vmap(make_train(TrainConfig(), params).init)(jax.random.split(jax.random.PRNGKey(4), 4))  # train_many's
    for a, c in zip(jax.tree.leaves(out["fisher"][0]), jax.tree.leaves(init.policy)):
        c = np.asarray(c).reshape(np.shape(a))
        moved += int(np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-4)
    assert moved > 0  # a real step was compared, not two unchanged policies
    np.testing.assert_array_equal(out["fisher"][1], out["kl-hessian"][1])


def test_the_trainer_reads_the_variants_alpha(small):
    """Variant.alpha (traced, what a sweep sets per member) is the alpha the trainer reads: the
    trainer configuration has none (a run's alpha has one home), 0.25 changes the online kappa, and
    the default is 0.1."""
    _, params = small
    idx = np.tile(np.arange(60)[None], (1, 1))
    cfg = TrainConfig(iterations=3, chunk=3, exact_batch=32)
    assert "alpha" not in {f.name for f in dataclasses.fields(TrainConfig)}
    a, _, _ = train_many(cfg, params, [Variant("CCPO (lambda=0)", True, alpha=0.1)], idx, jax.random.PRNGKey(1),
                         Execution(progress=False))
    b, _, _ = train_many(cfg, params, [Variant("CCPO (lambda=0)", True, alpha=0.25)], idx, jax.random.PRNGKey(1),
                         Execution(progress=False))
    c, _, _ = train_many(cfg, params, [Variant("CCPO (lambda=0)", True)], idx, jax.random.PRNGKey(1),
                         Execution(progress=False))
    assert _tree_equal(a.policy, c.policy) and np.array_equal(np.asarray(a.kappa), np.asarray(c.kappa))
    assert not np.array_equal(np.asarray(a.kappa), np.asarray(b.kappa))  # alpha 0.25 vs 0.1 does change kappa
