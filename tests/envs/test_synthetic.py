"""Synthetic caches (envs/generators/synthetic.py): calibration to the paper's marginals, determinism,
schema validity, internal consistency, and the `ccpo-jax data synth` command.

The marginals are recomputed here from the raw arrays with independent code (the
uniform random policy by brute-force enumeration of its action sequences, the
LLM-policy rows by walking each question's actions) and compared with the
targets and tolerances stored in each Profile."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import rankdata

from envs.generators import synthetic
from envs.cache.fast import load_fast
from envs.cache.schema import CacheError, check_arrays

N = 1400
PROFILE_NAMES = list(synthetic.PROFILES)


@pytest.fixture(scope="module")
def caches():
    return {name: synthetic.generate(name, N, seed=0) for name in PROFILE_NAMES}


def _random_policy_coverage(a, unsolvable) -> float:
    """Brute force over the uniform random policy's draws.

    Think of the policy as drawing an action at every round, uniformly over the
    available ones (3, or 2 at the last round where "next" is unavailable); only
    the first non-"next" draw matters. Sum coverage over all 3^(T-1) * 2 draw
    sequences, each with probability (1/3)^(T-1) * 1/2.
    """
    Q, T = a["base_correct"].shape
    total = np.zeros(Q)
    for seq in itertools.product(*([range(3)] * (T - 1) + [range(2)])):
        prob = (1.0 / 3.0) ** (T - 1) * 0.5
        t = next(i for i, act in enumerate(seq) if act != 2)
        covered = a["base_correct"][:, t] if seq[t] == 0 else a["guide_correct"][:, t]
        total += prob * covered
    return float(np.where(unsolvable, 1.0, total).mean())


def _independent_marginals(cache) -> dict[str, float]:
    a, man = cache.arrays, cache.manifest
    unsolv = ~(a["base_correct"] | a["guide_correct"]).any(axis=1)
    out = {
        "unsolvable": unsolv.mean(),
        "guide_round1_coverage": (a["guide_correct"][:, 0] | unsolv).mean(),
        "random_coverage": _random_policy_coverage(a, unsolv),
        # USD per million tokens -> cents: x 100 / 1e6
        "cents_per_guide_call": (
            (a["guide_tokens_in"] * man.guide.price_in + a["guide_tokens_out"] * man.guide.price_out) * 1e-4
        ).mean(),
        "guide_verdict_accuracy": (a["guide_verdict"] == a["base_correct"]).mean(),
    }
    for j, model in enumerate(man.exit_models):
        key = "gpt4o" if model == "gpt-4o" else "base"
        out[f"{key}_exit_coverage"] = (a["exit_correct"][:, j] | unsolv).mean()
        out[f"{key}_exit_len"] = a["exit_rounds"][:, j].mean()
        out[f"{key}_exit_cost_per_200"] = a["exit_cost_cents"][:, j].astype(float).sum() * 200 / len(unsolv)
    for j, model in enumerate(man.llm_policy_models):
        key = "gpt4o" if model == "gpt-4o" else "base"
        cov, length = [], []
        for q in range(len(unsolv)):
            for t, act in enumerate(a["llm_policy_actions"][q, j]):
                if act in (0, 1):
                    ok = a["base_correct"][q, t] if act == 0 else a["guide_correct"][q, t]
                    cov.append(ok or unsolv[q])
                    length.append(t + 1)
                    break
        out[f"{key}_policy_coverage"] = np.mean(cov)
        out[f"{key}_policy_len"] = np.mean(length)
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_marginals_match_paper_targets(caches, name):
    prof = synthetic.PROFILES[name]
    got = _independent_marginals(caches[name])
    assert set(prof.targets) <= set(got)
    off = {
        k: (round(got[k], 4), tgt.value, round(tgt.tol(N), 4))
        for k, tgt in prof.targets.items()
        if abs(got[k] - tgt.value) > tgt.tol(N)
    }
    assert not off, f"{name}: marginals outside tolerance (measured, target, tol): {off}"
    # The module's own measure() (used for the docs table) agrees with the independent code.
    mine = synthetic.measure(caches[name])
    for k, v in got.items():
        assert mine[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_tolerances_are_sampling_error_plus_margin():
    for prof in synthetic.PROFILES.values():
        for k, tgt in prof.targets.items():
            assert tgt.sd >= 0 and tgt.margin > 0, (prof.name, k)
            assert tgt.tol(N) == pytest.approx(3 * tgt.sd / np.sqrt(N) + tgt.margin)
            assert tgt.source, (prof.name, k)


def test_deterministic_per_seed_and_different_across_seeds():
    a = synthetic.generate("hotpotqa-llama2", 300, seed=5)
    b = synthetic.generate("hotpotqa-llama2", 300, seed=5)
    c = synthetic.generate("hotpotqa-llama2", 300, seed=6)
    assert a.manifest.checksum == b.manifest.checksum == a.checksum()
    for k in a.arrays:
        np.testing.assert_array_equal(a.arrays[k], b.arrays[k])
    assert c.manifest.checksum != a.manifest.checksum
    assert (c.arrays["base_correct"] != a.arrays["base_correct"]).any()
    assert (c.arrays["guide_uncertainty"] != a.arrays["guide_uncertainty"]).any()


# The checksums every profile drew (257 questions, seed 7) before envs/ was split by stage and
# _simulate into its parts (issue 39): the arrays alone, and the whole cache (arrays + manifest,
# whose provenance label must not change either). A refactor of the generator must keep them.
DRAWN_BEFORE_THE_SPLIT = {
    "hotpotqa-llama2": ("5733c931a3e0f21bcc05a9256c07c48b62733592acac459ca87ab2bfbb90c2db",
                        "f27fbe764e26e16c3ff19b4f07413b92bfd92d8871098af9aefacae2151d72b1"),
    "hotpotqa-llama3": ("b5666c53dfa7465b037be98ec03458b17828c79f5247fd2e6af0760794a77573",
                        "9fdf68132d5ea7f61d103578add38f15a7dacf2c933f7a49845c36ecf713871c"),
    "mmlu-llama2": ("6abb4c45674903fad1685ae6c9d5de81d09c4a59566c97a0f28f831c226896f0",
                    "2a6daf84b508c028028f6e8c9dd475675eeeebf18e9e91c20d7ad6c2b5f0c1be"),
    "mmlu-llama3": ("7ccc0a788066617f867632b87209b5979e4f6c18649b7123ba6cd89591720048",
                    "c80a291a124b6cc873b734e84a2dd799041e2e36b3728701c5d2eb7271272f07"),
}


def test_every_profile_draws_the_same_numbers_as_before_the_split():
    assert set(DRAWN_BEFORE_THE_SPLIT) == set(synthetic.PROFILES)
    for name, (arrays_sum, cache_sum) in DRAWN_BEFORE_THE_SPLIT.items():
        man = synthetic.generate(name, 257, 7).manifest
        assert (man.arrays_checksum, man.checksum) == ("sha256:" + arrays_sum, "sha256:" + cache_sum), name


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_schema_manifest_and_consistency(caches, name):
    cache, prof = caches[name], synthetic.PROFILES[name]
    a, man = cache.arrays, cache.manifest
    check_arrays(man, a, name)
    assert man.is_synthetic and man.provenance["kind"] == "synthetic"
    assert man.provenance["generator"] == f"envs.synthetic/{name}"
    assert man.provenance["seed"] == 0
    assert man.provenance["calibrated_to"] == f"arXiv 2511.11828 {prof.table}"
    assert man.name == f"synthetic-{name}-s0" and man.T == 4 and man.task == name.split("-")[0]
    assert (man.base.price_in, man.base.price_out) == (0.0, 0.0)
    assert (man.guide.name, man.guide.price_in, man.guide.price_out) == ("gpt-4o", 2.5, 10.0)
    assert man.exit_models == man.llm_policy_models == ("gpt-4o", prof.base_model)
    assert cache.checksum() == man.checksum
    assert a["round_mask"].all()
    # correctness flags agree with answer ids and the gold text
    rows = np.arange(N)[:, None]
    for who in ("base", "guide"):
        text = a["answer_text"][rows, a[f"{who}_answer"]]
        assert (text != "").all()
        assert (a[f"{who}_correct"] == (text == a["gold"][:, None])).all()
    assert all(g.startswith("synthetic answer ") for g in a["gold"])
    # ids are numbered in order of first appearance (base r1, guide r1, base r2, ...), as envs.cache.jsonl does
    seq = np.stack([a["base_answer"], a["guide_answer"]], axis=2).reshape(N, -1)
    running_max = np.maximum.accumulate(seq, axis=1)
    assert (seq[:, 0] == 0).all() and (seq[:, 1:] <= running_max[:, :-1] + 1).all()
    assert all(len(set(r)) == len(set(t[t != ""])) for r, t in zip(seq, a["answer_text"]))
    # "Yes" means the guide's answer is the base's; "No [answer]" gives a different answer
    assert (a["guide_answer"] == a["base_answer"])[a["guide_verdict"]].all()
    assert (a["guide_answer"] != a["base_answer"])[~a["guide_verdict"]].all()
    # distinct wrong answers and repeats both happen
    n_distinct = np.array([len(set(r) | set(s)) for r, s in zip(a["base_answer"], a["guide_answer"])])
    assert (n_distinct >= 3).mean() > 0.1
    assert (a["base_answer"][:, 1:] == a["base_answer"][:, :-1]).mean() > 0.3
    # unsolvable questions exist but are a minority; not every question is easy
    assert 0.02 < cache.unsolvable.mean() < 0.2
    # cached baselines: EXIT rounds in 1..T, base EXIT free, GPT-4o EXIT paid
    assert a["exit_mask"].all()
    assert ((a["exit_rounds"] >= 1) & (a["exit_rounds"] <= 4)).all()
    assert (a["exit_cost_cents"][:, 1] == 0).all() and (a["exit_cost_cents"][:, 0] > 0).all()
    # LLM-policy actions: a run of "next", one answer, then -1; never "next" at the last round
    for j in range(2):
        acts = a["llm_policy_actions"][:, j]
        assert (acts[:, -1] != 2).all()
        stopped = np.zeros(len(acts), bool)
        for t in range(4):
            assert (acts[stopped, t] == -1).all()
            assert np.isin(acts[~stopped, t], (0, 1, 2)).all()
            stopped |= np.isin(acts[:, t], (0, 1))
        assert stopped.all()


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_guide_uncertainty_ranks_guide_errors_higher(caches, name):
    """AUC (Mann-Whitney, via ranks) of uncertainty for guide errors vs successes > 0.6."""
    a = caches[name].arrays
    u, err = a["guide_uncertainty"].ravel().astype(float), ~a["guide_correct"].ravel()
    assert ((u >= 0) & (u <= 1)).all()
    r = rankdata(u)
    n1, n0 = err.sum(), (~err).sum()
    auc = (r[err].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)
    assert auc > 0.6, auc
    # base confidence: in [0, 1] and (weakly) higher on correct base answers
    conf = a["base_confidence"]
    assert ((conf >= 0) & (conf <= 1)).all()
    assert conf[a["base_correct"]].mean() > conf[~a["base_correct"]].mean()


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_base_accuracy_rises_over_rounds(caches, name):
    acc = caches[name].arrays["base_correct"].mean(axis=0)
    assert (np.diff(acc) > 0).all(), acc
    np.testing.assert_allclose(synthetic.base_accuracy_by_round(caches[name]), acc)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_token_sizes_and_prices(caches, name):
    a = caches[name].arrays
    g_in = a["guide_tokens_in"]
    lo, hi = np.percentile(g_in, [5, 95])
    if name.startswith("hotpotqa"):
        assert 55 <= lo and hi <= 120, (lo, hi)
    else:
        assert lo > 80 and hi < 250, (lo, hi)
    assert (a["guide_tokens_out"] >= 1).all() and (a["guide_tokens_out"][a["guide_verdict"]] == 1).all()
    assert (a["base_tokens_in"][:, 1:] > a["base_tokens_in"][:, :-1]).all()  # context grows
    assert (a["base_tokens_out"] > 0).all()


def test_unknown_profile_and_bad_sizes():
    with pytest.raises(CacheError) as e:
        synthetic.generate("hotpotqa-gpt5")
    for name in PROFILE_NAMES:
        assert name in str(e.value)
    with pytest.raises(CacheError, match="the number of questions must be an integer >= 1, got 0"):
        synthetic.generate("mmlu-llama2", 0)
    with pytest.raises(CacheError, match="the seed must be an integer >= 0, got -1"):
        synthetic.generate("mmlu-llama2", 10, seed=-1)
    assert synthetic.DEFAULT_PROFILE in synthetic.PROFILES and synthetic.DEFAULT_QUESTIONS == 1400
    for prof in synthetic.PROFILES.values():
        assert "SYNTHETIC" in prof.description


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_cli_synth_writes_a_loadable_cache(tmp_path, name, capsys):
    from ccpo_jax.cli.main import main

    out = tmp_path / f"{name}-cache"
    rc = main(["data", "synth", "--profile", name, "--questions", "200", "--seed", "1", "--out", str(out)])
    assert rc == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    loaded = load_fast(out)
    direct = synthetic.generate(name, 200, seed=1)
    assert loaded.manifest.checksum == direct.manifest.checksum
    assert loaded.manifest.provenance["kind"] == "synthetic" and loaded.n_questions == 200


def test_cli_synth_unknown_profile_exits_2(tmp_path, capsys):
    from ccpo_jax.cli.main import main

    out = tmp_path / "x"
    assert main(["data", "synth", "--profile", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hotpotqa-llama2" in err and "Traceback" not in err
    assert not out.exists()
