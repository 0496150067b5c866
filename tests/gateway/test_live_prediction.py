"""The deployed router's own replay prediction (``ccpo_jax.gateway.prediction``; issue 49, live-eval).

Oracles: ``ccpo-jax route --every-round`` (the CLI path, unscreened decisions of every round, not the
function under test) walked by a brute-force loop, costs summed by hand from the cache's tokens and
the manifest's prices; and, end to end, what ``live-eval`` realises against the scripted server that
the cache itself was collected from (the same replies, so the same rounds, decisions and costs).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, write_questions
from ccpo_jax.testing.gateway_harness import build_artefact
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """(cache path, artefact) of a SYNTHETIC cache, half its questions without log-prob signals (so this
    random sharp router stops at round 1 on some and runs to the last round on others), a third made
    unsolvable, two groups."""
    from envs.cache.jsonl import cache_to_records, read_jsonl
    from envs.generators.synthetic import generate

    root = tmp_path_factory.mktemp("pred")
    full = generate("hotpotqa-llama2", 40, 11)
    recs = cache_to_records(full)
    for rec in recs[::2]:
        for rd in rec["rounds"]:
            rd["base"].pop("confidence", None)
            rd["guide"].pop("uncertainty", None)
    for rec in recs[1::3]:  # unsolvable: no answer of any round correct (a gold none of them gives)
        rec["gold"] = "no model says this"
        for rd in rec["rounds"]:
            rd["base"]["correct"] = rd["guide"]["correct"] = False
    for i, rec in enumerate(recs):  # groups (used by a Mondrian router only)
        rec["group"] = "a" if i % 4 < 2 else "b"
    src = root / "c.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in [{"manifest": full.manifest.to_dict()}] + recs))
    return src, build_artefact(root, kappa=0.4, cache=read_jsonl(src))


def _oracle(art: Path, cache: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """Per question from ``route --every-round``: walk each line's decisions in round order, collect the
    set's answers, stop at the first decision without "next"; cost by hand (tokens x USD per M / 1e4)."""
    out = tmp_path / "dec.jsonl"
    res = run_cli(["route", str(art), "--input", str(cache), "--every-round", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    decs: dict[int, list[dict]] = {}
    for line in out.read_text().splitlines():
        d = json.loads(line)
        decs.setdefault(d["line"], []).append(d)
    lines = cache.read_text().splitlines()
    m = json.loads((art / "manifest.json").read_text())["models"]
    got = {k: [] for k in ("rounds", "cost", "set", "unsolvable", "empty", "all_rounds_cost")}
    for ln, ds in sorted(decs.items()):
        rounds = json.loads(lines[ln - 1])["rounds"]
        price = lambda rd: sum(rd[r]["tokens_in"] * m[r]["price_in"] / 1e4 + rd[r]["tokens_out"] * m[r]["price_out"]  # noqa: E731
                               / 1e4 for r in ("base", "guide"))
        flags, n = [], 0
        for d in ds:
            n += 1
            flags += [rounds[d["round"] - 1][a]["correct"] for a in ("base", "guide") if a in d["action_set"]]
            if "next" not in d["action_set"]:
                break
        got["rounds"].append(n)
        got["cost"].append(sum(price(rd) for rd in rounds[:n]))
        got["all_rounds_cost"].append(sum(price(rd) for rd in rounds))
        got["set"].append(any(flags))
        got["empty"].append(not flags)
        got["unsolvable"].append(not any(rd[a]["correct"] for rd in rounds for a in ("base", "guide")))
    return {k: np.asarray(v) for k, v in got.items()}


def test_router_replay_equals_a_brute_force_walk_of_route_every_round(crafted, tmp_path):
    from ccpo_jax.gateway.prediction import router_replay
    from ccpo_jax.serving import Router

    cache, art = crafted
    router = Router.load(art)
    o = _oracle(art, cache, tmp_path)
    T = router.T
    # the case mix that tells a wrong implementation apart: questions that stop before T and questions
    # that run to the last round (ignoring "continue", or stopping after round 1, would differ); rounds
    # not run have a cost (charging them would differ); unsolvable questions whose set misses (counted
    # as missed, matched coverage would differ); empty sets
    assert 1 in o["rounds"] and T in o["rounds"] and (o["all_rounds_cost"] > o["cost"] + 1e-9).any()
    assert (o["unsolvable"] & ~o["set"]).any() and (o["set"] & ~o["unsolvable"]).any() and o["empty"].any()
    got = router_replay(router, cache)
    n = len(o["rounds"])
    assert got["questions"] == n == 40
    assert got["rounds_mean"] == pytest.approx(o["rounds"].mean(), abs=1e-12)
    assert got["cost_cents_per_question"] == pytest.approx(o["cost"].mean(), rel=1e-9)
    k = int((o["set"] | o["unsolvable"]).sum())
    assert got["coverage"] == pytest.approx(k / n, abs=1e-12)
    assert got["coverage_set"] == pytest.approx(o["set"].mean(), abs=1e-12)
    assert got["empty_set_share"] == pytest.approx(o["empty"].mean(), abs=1e-12)
    assert got["unsolvable_share"] == pytest.approx(o["unsolvable"].mean(), abs=1e-12)
    from scipy.stats import beta

    lo = beta.ppf(0.025, k, n - k + 1) if k else 0.0
    hi = beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    assert got["coverage_ci95"] == pytest.approx((lo, hi), abs=1e-9)
    # the prices are the gateway's: twice the prices, twice the cost
    m = router.manifest["models"]
    dbl = {r: (2 * m[r]["price_in"], 2 * m[r]["price_out"]) for r in ("base", "guide")}
    assert router_replay(router, cache, dbl)["cost_cents_per_question"] == pytest.approx(2 * o["cost"].mean(), rel=1e-9)


def test_a_mondrian_router_replays_each_question_at_its_groups_threshold(crafted):
    """Per-group thresholds: the replay equals a one-question-at-a-time walk of Router.decide (unscreened,
    unbatched) with each question's group, and differs from the walk without groups (the pooled one)."""
    from ccpo_jax.gateway.prediction import router_replay
    from ccpo_jax.serving import Router

    cache, art = crafted
    router = Router.load(art)
    router.group_kappas, router.rest_kappa = {"a": np.float32(0.05)}, np.float32(0.4)
    recs = [json.loads(x) for x in cache.read_text().splitlines()[1:]]

    def walk(with_group: bool) -> tuple[float, float]:
        rounds_run, covered = [], []
        for rec in recs:
            rs, flags = rec["rounds"], []
            for t in range(len(rs)):
                d = router.decide(rs[: t + 1], t + 1 < len(rs), rec["group"] if with_group else None)
                flags += [rs[t][a]["correct"] for a in ("base", "guide") if a in d["action_set"]]
                if not d["continue"]:
                    break
            rounds_run.append(t + 1)
            covered.append(any(flags) or not any(r[a]["correct"] for r in rs for a in ("base", "guide")))
        return float(np.mean(rounds_run)), float(np.mean(covered))

    got = router_replay(router, cache)
    assert (got["rounds_mean"], got["coverage"]) == pytest.approx(walk(True), abs=1e-12)
    assert walk(True) != walk(False)


def test_a_mismatched_cache_is_one_line_naming_the_flag(crafted, tmp_path):
    from envs.cache.jsonl import write_jsonl
    from envs.generators.synthetic import generate

    _, art = crafted
    other = tmp_path / "other.jsonl"
    write_jsonl(generate("hotpotqa-llama2", 20, 4), other)
    qfile = tmp_path / "q.jsonl"
    write_questions(qfile, 2)
    for cache, msg in ((other, "not the cache the router was trained on"), (tmp_path / "nope.jsonl", "cannot read")):
        journal = tmp_path / "live.jsonl"
        res = run_cli(["live-eval", str(art), "--questions", str(qfile), "--journal", str(journal), "--base",
                       "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g", "--cache", str(cache)])
        assert res.returncode == 2 and msg in res.stderr and "--cache" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and not journal.exists()


def test_live_eval_reports_the_routers_own_prediction_equal_to_live_on_its_cache(tmp_path):
    """The cache collected from the scripted server, a router exported on it, live-eval on the same
    questions against the same server: every round the gateway runs is a cached round, so the router's
    own replay predicts the realised cost, rounds and both coverage counts exactly."""
    from envs.cache.formats import load_cache

    qfile = tmp_path / "q.jsonl"
    write_questions(qfile, 10)
    cache = tmp_path / "cache.jsonl"
    with FakeChatServer(make_scripts(10)) as up:
        res = run_cli(["data", "collect", "--round-protocol", "paper", "--questions", str(qfile), "--base",
                       f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}", "--out", str(cache),
                       "--rounds", "3", "--base-price", "0.5,1.5", "--guide-price", "2.5,10", "--no-progress"])
        assert res.returncode == 0, res.stderr
        art = build_artefact(tmp_path, seed=7, kappa=0.4, cache=load_cache(cache))
        report = tmp_path / "report.json"
        res = run_cli(["live-eval", str(art), "--questions", str(qfile), "--journal", str(tmp_path / "live.jsonl"),
                       "--base", f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}", "--cache", str(cache),
                       "--report", str(report), "--max-batch", "4"])
    assert res.returncode == 0, res.stderr
    r = json.loads(report.read_text())
    o = r["prediction_router"]
    assert o["questions"] == 10 and r["prediction_router_note"] == f"--cache {cache}"
    assert r["prediction"] is None and "prediction_inside" not in r  # no results.json: the row mean is absent
    # not a trivial agreement: questions stop at rounds 1, 2 and 3 (mean 1.4), and some sets are empty
    assert 1 < r["rounds_mean"] < 2 and 0 < r["empty_sets"] < 10
    assert o["cost_cents_per_question"] == pytest.approx(r["cost_cents_per_question"], rel=1e-6)
    assert r["cost_diff_cents_router"] == pytest.approx(0.0, abs=1e-9) and r["rounds_diff_router"] == 0.0
    assert o["rounds_mean"] == r["rounds_mean"] and o["empty_set_share"] == r["empty_set_share"]
    assert [o["coverage_set"], o["coverage_set_or_none_seen"]] == [r["coverage_set"], r["coverage_set_or_none_seen"]]
    assert r["coverage_diff_router"] == [0.0, 0.0] and r["prediction_router_inside"] is True
    assert "| cost per question (cents) |" in res.stdout and "this router over the cache (10 questions)" in res.stdout
    assert "prediction of this router (its replay over the cache" in res.stdout


def test_the_cache_is_found_through_the_training_runs_run_json(crafted, tmp_path):
    """Not given: the cache run.json names (beside the artefact's policy directory) is used when it is the
    training cache; a missing or another cache skips the router's own prediction with the reason."""
    from ccpo_jax.gateway.prediction import find_cache
    from ccpo_jax.serving import Router
    from envs.cache.jsonl import write_jsonl
    from envs.generators.synthetic import generate

    cache, art = crafted
    router = Router.load(art)
    run = Path(router.manifest["source"]["policy_dir"]).parent.parent / "run.json"
    assert find_cache(router, None) == (None, "the router's own replay prediction skipped: no run.json of the "
                                              "training run found (pass --cache)")
    other = tmp_path / "other.jsonl"
    write_jsonl(generate("hotpotqa-llama2", 20, 4), other)
    try:
        run.write_text(json.dumps({"cache": str(cache)}))
        c, note = find_cache(router, None)
        assert c.n_questions == 40 and note == f"{cache} (from {run})"
        for path, why in ((tmp_path / "gone.jsonl", "no such file"), (other, "not the cache the router was trained on")):
            run.write_text(json.dumps({"cache": str(path)}))
            c, note = find_cache(router, None)
            assert c is None and note.startswith("the router's own replay prediction skipped: ") and why in note
            assert note.endswith("pass --cache")
    finally:
        run.unlink()


def test_the_picture_draws_the_routers_own_prediction_and_the_row_mean(tmp_path):
    """experiments.real_llms plot: an x at the router's own prediction (coverage and cost) when the report
    has it, a + at the row's mean; a report from before (no prediction_router) still draws."""
    from experiments.real_llms import plot

    r = json.loads((Path(__file__).parents[2] / "experiments/results/real_llms/live-p10-live.json").read_text())
    r.pop("prediction_router", None)  # a report from before the router's own prediction
    old = tmp_path / "old.json"
    old.write_text(json.dumps(r))
    r["prediction_router"] = {"coverage": 0.987, "coverage_ci95": [0.97, 0.995], "cost_cents_per_question": 0.0611}
    new = tmp_path / "new.json"
    new.write_text(json.dumps(r))
    fig = plot([old, new], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    cov, cost = fig.axes

    def marks(ax, m):
        return sorted((round(float(x), 6), round(float(y), 2)) for ln in ax.get_lines() if ln.get_marker() == m
                      for x, y in zip(ln.get_xdata(), ln.get_ydata()))

    row = r["prediction"]
    assert marks(cov, "x") == [(0.987, 0.85)] and marks(cost, "x") == [(0.0611, 0.85)]
    assert marks(cov, "+") == [(round(row["coverage"], 6), 0.15), (round(row["coverage"], 6), 1.15)]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("predicted: this router over its cache") for t in labels), labels
