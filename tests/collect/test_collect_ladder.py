"""``data collect`` with a base ladder (``--base`` once per round): round t's base call goes to rung t's
model and is priced at rung t's prices, the cache's manifest lists the ladder, and the flags that
cannot apply to a ladder are refused naming the flag. Oracles: the scripted server's request log
(which model each call named), the call log's tokens times the rung's prices, the cache reader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, write_questions
from tests.helpers import run_cli

SCRIPTS = make_scripts(8)
RUNGS = [(BASE_MODEL, "0.1,0.2"), ("mid-base", "1,2"), ("top-base", "3,5")]


@pytest.fixture(scope="module")
def server():
    with FakeChatServer(SCRIPTS, served=[m for m, _ in RUNGS] + [GUIDE_MODEL]) as srv:
        yield srv


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("q") / "questions.jsonl"
    write_questions(p, len(SCRIPTS))
    return p


def _args(server, questions_file, out, rungs=RUNGS, prices=True, *extra):
    a = ["data", "collect", "--round-protocol", "paper", "--questions", str(questions_file), "--rounds", "3", "--guide", f"{server.url},{GUIDE_MODEL}",
         "--guide-price", "2.5,10", "--out", str(out), "--no-progress"]
    for m, p in rungs:
        a += ["--base", f"{server.url},{m}"] + (["--base-price", p] if prices else [])
    return a + list(extra)


@pytest.fixture(scope="module")
def collected(server, questions_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder") / "cache.jsonl"
    r = run_cli(_args(server, questions_file, out))
    assert r.returncode == 0, r.stderr
    return out, r


def test_each_round_calls_its_rung_and_pays_its_price(collected):
    from envs.cache.formats import load_cache

    out, r = collected
    cache = load_cache(out)
    man = cache.manifest
    assert [(m.name, m.price_in, m.price_out) for m in man.base_ladder] == [
        (BASE_MODEL, 0.1, 0.2), ("mid-base", 1.0, 2.0), ("top-base", 3.0, 5.0)]
    assert man.guide.name == GUIDE_MODEL and not man.guide_ladder
    calls = [json.loads(x) for x in Path(str(out) + ".calls").read_text().splitlines()]
    base_calls = [c for c in calls if c.get("call", "").endswith(".base") and "text" in c]
    assert base_calls
    prices = {m: tuple(map(float, p.split(","))) for m, p in RUNGS}
    for c in base_calls:
        t = int(c["call"][1])  # "r<t>.base"
        assert c["model"] == RUNGS[t][0]
        p_in, p_out = prices[RUNGS[t][0]]
        assert c["cost_usd"] == pytest.approx((c["tokens_in"] * p_in + c["tokens_out"] * p_out) / 1e6)
    # the cache's cost of round t is round t's tokens at rung t's prices (plus the guide's)
    a, cost = cache.arrays, cache.round_cost_cents()
    for q in range(cache.n_questions):
        for t in range(cache.T):
            if a["round_mask"][q, t]:
                p_in, p_out = prices[RUNGS[t][0]]
                want = (a["base_tokens_in"][q, t] * p_in + a["base_tokens_out"][q, t] * p_out
                        + a["guide_tokens_in"][q, t] * 2.5 + a["guide_tokens_out"][q, t] * 10.0) / 1e4
                assert cost[q, t] == pytest.approx(want, rel=1e-5)
    # the cost bound printed before the first call names every rung
    assert "base@1 tiny-base" in r.stdout + r.stderr and "base@3 top-base" in r.stdout + r.stderr


def test_data_check_prints_the_collected_ladder(collected):
    out, _ = collected
    r = run_cli(["data", "check", str(out)])
    assert r.returncode == 0, r.stderr
    assert "base model:  a ladder, one model per round:" in r.stdout
    assert "rounds 2: mid-base  ($1 in / $2 out per 1M tokens)" in r.stdout


def test_resume_of_a_finished_ladder_sends_nothing(server, questions_file, collected):
    out, _ = collected
    before = server.requests
    r = run_cli(_args(server, questions_file, out, RUNGS, True, "--resume"))
    assert r.returncode == 0, r.stderr
    assert server.requests == before


@pytest.mark.parametrize("rungs, prices, extra, match", [
    (RUNGS[:2], True, (), "--base: given 2 times; give it once (one base model) or once per round (a ladder of --rounds 3 models)"),
    (RUNGS, False, ("--base-price", "1,1"), "--base-price: given 1 times; give it once per rung of the ladder (3 times) or not at all"),
    (RUNGS, True, ("--exit-baselines", "base"), "--exit-baselines: base: a ladder has one base model per round"),
    (RUNGS, False, (), "no price for the base@1 model 'tiny-base': give --base-price"),
    # issue 48 item 10: a rung price that every cache reader refuses, refused before any call
    ([RUNGS[0], ("mid-base", "1e7,2"), RUNGS[2]], True, (),
     "--base-price '1e7,2': expected a number >= 0 and <= 1e+05 (USD per million tokens), got 10000000.0"),
])
def test_bad_ladder_flags_are_one_error_line(server, questions_file, tmp_path, rungs, prices, extra, match):
    out = tmp_path / "bad.jsonl"
    r = run_cli(_args(server, questions_file, out, rungs, prices, *extra))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert match in r.stderr, r.stderr
    assert not out.exists()


def test_a_pricing_file_price_goes_through_the_cache_price_rule(server, questions_file, tmp_path):
    """Issue 48 item 10: ``--pricing`` (here rung 2's price) checked with the cache's own price rule."""
    pricing = tmp_path / "prices.json"
    pricing.write_text(json.dumps({BASE_MODEL: [0.1, 0.2], "mid-base": {"price_in": 1, "price_out": 2e5},
                                   "top-base": [3, 5]}))
    out, before = tmp_path / "bad.jsonl", server.requests
    r = run_cli(_args(server, questions_file, out, RUNGS, False, "--pricing", str(pricing)))
    assert r.returncode == 2 and not out.exists() and server.requests == before
    assert r.stderr.strip().splitlines() == [
        f"error: --pricing {pricing}: mid-base: expected a number >= 0 and <= 1e+05 (USD per million tokens), got 200000.0"]
    pricing = tmp_path / "prices.yaml"  # issue 48 item 13: PyYAML's message spans lines; one line here
    pricing.write_text("tiny-base: [1, 2\nmid-base: {x: 1}\n")
    r = run_cli(_args(server, questions_file, out, RUNGS, False, "--pricing", str(pricing)))
    assert r.returncode == 2 and not out.exists() and server.requests == before
    assert r.stderr.strip().splitlines() == [
        f"error: --pricing {pricing}: line 2, column 9: not valid YAML (expected ',' or ']', but got ':')"]
