"""The OpenAI-compatible gateway (docs/gateway.md), end to end against the scripted upstream.

The test client is the official ``openai`` package. Oracles: the scripted server's own
replies and usage (ccpo_jax/testing/chat_server.py), ``Router.decide`` on the journaled rounds (the
exported router, called directly), the cache reader (``data check``), the closed-form
recursion of Eq. 9 and an exact binomial tail summed by hand.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, token_logprob  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact, post  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint, RetryPolicy  # noqa: E402

FAST = RetryPolicy(retries=2, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=5.0, timeout_s=0.5,
                   attempt_timeout_s=2.0)
SCRIPTS = make_scripts(12)
QS = list(SCRIPTS)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return build_artefact(tmp_path_factory.mktemp("gw"))


def _gateway(art, up, journal=None, **kw):
    kw.setdefault("max_batch", 4)  # (compiled at start: 3 batch sizes)
    cfg = GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=FAST,
                        journal=None if journal is None else str(journal), **kw)
    return GatewayThread(load_gateway(art, cfg))


@pytest.fixture(scope="module")
def live(art, tmp_path_factory):
    """(upstream, gateway thread, openai client, journal path): logprobs on, the openai flavour."""
    journal = tmp_path_factory.mktemp("gwj") / "journal.jsonl"
    with FakeChatServer(SCRIPTS, timeout_sleep_s=1.0) as up, _gateway(art, up, journal) as g:
        yield up, g, openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30), journal


def _ask(client, q, **extra):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}],
                                          extra_body=extra or None)


def _journal(path: Path) -> dict[str, dict]:
    """The last line of each id (what the reader takes)."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return {x["id"]: x for x in lines[1:]}


def test_openai_client_reply_usage_and_decisions(live):
    up, g, client, journal = live
    router = g.gw.router
    for q in QS[:6]:
        n0 = up.requests
        r = _ask(client, q)
        ccpo = r.model_extra["ccpo"]
        rec = _journal(journal)[r.id]
        # the decisions equal the exported router's on the journaled rounds, round by round
        for t, d in enumerate(ccpo["decisions"]):
            last = t == len(ccpo["decisions"]) - 1
            want = router.decide(rec["rounds"][: t + 1], can_continue=t + 1 < router.T)
            # screened decisions: the same set, the probabilities within 1e-5 (tests/serving/test_router_screen.py)
            assert d["action_set"] == want["action_set"] and d["probs"] == pytest.approx(want["probs"], abs=1e-5)
            assert d["kappa"] == pytest.approx(float(router.kappa)) and d["kappa_source"] == "marginal"
            assert "next" in d["action_set"] if not last else (ccpo["stopped_by"] != "router" or
                                                               "next" not in d["action_set"])
        # two upstream calls a round, nothing more
        assert up.requests - n0 == 2 * ccpo["rounds"] == 2 * len(rec["rounds"])
        # the content is the answer collected last (the guide's when the set holds both)
        assert r.choices[0].message.content == ccpo["answer_set"][-1]["answer"]
        if len(ccpo["answer_set"]) > 1 and ccpo["answer_set"][-1]["round"] == ccpo["answer_set"][-2]["round"]:
            assert ccpo["answer_set"][-1]["role"] == "guide"
        # usage: the scripted server's usage (words + 4 per message in, words out), summed
        tin = sum(rd[role]["tokens_in"] for rd in rec["rounds"] for role in ("base", "guide"))
        tout = sum(rd[role]["tokens_out"] for rd in rec["rounds"] for role in ("base", "guide"))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (tin, tout, tin + tout)
        prices = router.manifest["models"]
        want_cents = sum((rd[role]["tokens_in"] * prices[role]["price_in"] + rd[role]["tokens_out"] *
                          prices[role]["price_out"]) / 1e4 for rd in rec["rounds"] for role in ("base", "guide"))
        assert ccpo["cost_cents"] == pytest.approx(want_cents, rel=1e-9)
        assert ccpo["tokens"]["guide"]["model"] == GUIDE_MODEL and ccpo["coverage_target"] == pytest.approx(0.9)
        assert "correct" not in rec["rounds"][0]["base"] and "gold" not in rec


def test_round_one_values_are_data_collects(live):
    """The journaled round equals what data collect's reading of the same replies gives."""
    from ccpo_jax.llm import paper as P

    up, g, client, journal = live
    q = QS[1]
    r = _ask(client, q)
    rnd = _journal(journal)[r.id]["rounds"][0]
    b_text = up.reply(BASE_MODEL, P.base_messages(q, []))
    br = P.read_base(b_text, [(t, token_logprob(t)) for t in re.findall(r"\s*\S+", b_text)])
    assert rnd["base"]["answer"] == br.answer == "wrong 1"
    assert rnd["base"]["confidence"] == br.confidence
    assert rnd["guide"] == {**rnd["guide"], "verdict": False, "answer": "answer 1"}


def test_streaming_equals_non_streaming(live):
    up, g, client, journal = live
    q = QS[2]
    plain = _ask(client, q)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}],
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].model_extra["ccpo"]["answer_set"] == plain.model_extra["ccpo"]["answer_set"]
    assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_caps_max_rounds_and_cost(live):
    up, g, client, journal = live
    q = QS[4]  # the random router continues on this one when allowed (its set holds "next" at round 1)
    r = _ask(client, q, max_rounds=1)
    assert r.model_extra["ccpo"]["rounds"] == 1
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, q, max_cost_cents=1e-6)
    assert e.value.body["code"] == "cost_cap_too_small" and e.value.body["param"] == "max_cost_cents"
    n0 = up.requests
    with pytest.raises(openai.BadRequestError):
        _ask(client, q, max_rounds=0)
    assert up.requests == n0  # nothing was sent


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL_ID, "messages": []}, 400, "messages"),
    ({"model": MODEL_ID, "messages": [{"role": "system", "content": "x"}]}, 400, "messages"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}], "n": 2}, 400, "n"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}], "tools": [{}]}, 400, "tools"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}], "max_cost_cents": -1}, 400, "max_cost_cents"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}], "group": 3}, 400, "group"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}], "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_get_openai_errors(live, body, status, param):
    up, g, client, journal = live
    n0 = up.requests
    st, err = post(g.url, "/chat/completions", body)
    assert st == status and set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    assert up.requests == n0


def test_oversized_body_is_413(live):
    up, g, client, journal = live
    st, err = post(g.url, "/chat/completions", b"{" + b" " * (g.gw.cfg.max_body_bytes + 1) + b"}")
    assert st == 413 and err["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("kind,status,code", [("500", 502, "upstream_status"), ("malformed", 502, "upstream_malformed"),
                                              ("timeout", 504, "upstream_timeout")])
def test_upstream_failing_for_good_is_a_5xx_and_no_journal_line(live, kind, status, code):
    up, g, client, journal = live
    q = QS[5]
    before = journal.read_text()
    up.fault(q, kind, times=3)  # every attempt (1 + 2 retries) of the first call fails
    st, err = post(g.url, "/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": q}]})
    assert st == status and err["error"]["code"] == code and err["error"]["type"] == "upstream_error"
    assert BASE_MODEL in err["error"]["message"]
    assert journal.read_text() == before


def test_upstream_transient_faults_are_retried(live):
    up, g, client, journal = live
    q = QS[6]
    clean = _ask(client, q)
    up.fault(q, "429", times=1, retry_after="0")
    up.fault(q, "malformed", times=1)
    again = _ask(client, q)
    assert again.choices[0].message.content == clean.choices[0].message.content
    assert again.model_extra["ccpo"]["decisions"] == clean.model_extra["ccpo"]["decisions"]


def test_feedback_labels_the_journal_and_data_check_reads_it(live, tmp_path):
    up, g, client, journal = live
    ids = {}
    for q in QS[:3]:
        ids[q] = _ask(client, q).id
    # before feedback: the journal is a valid cache with requests awaiting feedback
    res = run_cli(["data", "check", str(journal)])
    assert res.returncode == 0 and "await feedback" in res.stdout, res.stderr
    for q, cid in ids.items():
        st, fb = post(g.url, "/feedback", {"id": cid, "gold": SCRIPTS[q].gold})
        assert st == 200 and fb["labelled"] is True
    st, err = post(g.url, "/feedback", {"id": ids[QS[0]], "gold": "x"})
    assert st == 409
    assert post(g.url, "/feedback", {"id": "chatcmpl-nope", "correct": True})[0] == 404
    assert post(g.url, "/feedback", {"id": ids[QS[0]], "correct": True, "gold": "x"})[0] == 400
    assert post(g.url, "/feedback", {"id": ids[QS[0]], "correct": "yes"})[0] == 400
    _ask(client, QS[3])  # one more, left without feedback
    res = run_cli(["data", "check", str(journal)])
    assert res.returncode == 0, res.stderr
    from envs.cache.jsonl import awaiting_feedback, read_jsonl

    waiting = awaiting_feedback(journal)
    assert waiting >= 1 and f"{waiting} gateway request line(s) await feedback" in res.stdout

    cache = read_jsonl(journal)
    assert cache.n_questions >= 3
    recs = _journal(journal)
    for q, cid in ids.items():
        rec = recs[cid]
        for rd in rec["rounds"]:
            for role in ("base", "guide"):
                assert rd[role]["correct"] == (rd[role]["answer"] == SCRIPTS[q].gold)
    m = httpx.get(g.url.replace("/v1", "/metrics")).text
    assert 'ccpo_gateway_feedback_total{outcome="covered"}' in m and "ccpo_gateway_rolling_coverage" in m


def test_journal_torn_tail_is_dropped_on_reopen(live, tmp_path):
    from ccpo_jax.gateway.journal import Journal
    from envs.cache.jsonl import read_jsonl

    up, g, client, journal = live
    _ask(client, QS[0])
    copy = tmp_path / "j.jsonl"
    text = journal.read_text()
    copy.write_text(text + text.splitlines()[-1][:40])  # a line cut by a kill
    assert run_cli(["data", "check", str(copy)]).returncode == 0  # a journal stays readable
    man = json.loads(text.splitlines()[0])["manifest"]
    j = Journal(copy, man)
    j.close()
    assert copy.read_text() == text
    assert run_cli(["data", "check", str(copy)]).returncode == 0
    # the unlabelled-line rule is a journal's only: in another cache a missing `correct` is still an error
    lines = text.splitlines()
    man["provenance"].pop("journal")
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join([json.dumps({"manifest": man})] + lines[1:]) + "\n")
    with pytest.raises(Exception, match=r"plain.jsonl:2: rounds\[0\]\.base\.correct: missing required field"):
        read_jsonl(plain)
    plain.write_text(json.dumps({"manifest": man}) + "\n" + lines[1][:40])  # and a cut line is an error
    with pytest.raises(Exception, match=r"plain.jsonl:2: not valid JSON"):
        read_jsonl(plain)


def test_no_logprobs_uses_the_missing_value(art):
    """An upstream without log-probs: confidence/uncertainty are absent (the features' missing value),
    the decisions are the router's on those rounds, and /metrics counts the missing signals."""
    with FakeChatServer(SCRIPTS, logprobs=False) as up, _gateway(art, up) as g:
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
        r = _ask(client, QS[0])
        ccpo = r.model_extra["ccpo"]
        assert ccpo["rounds"] >= 2  # this router continues without the confidence
        m = httpx.get(g.url.replace("/v1", "/metrics")).text
        assert f'ccpo_gateway_missing_signal_total{{signal="confidence"}} {float(ccpo["rounds"])}' in m


def test_client_disconnect_cancels_the_upstream_calls(art, tmp_path):
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS, delay_s=0.4) as up, _gateway(art, up, journal) as g:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(g.url + "/chat/completions", json={"model": MODEL_ID, "messages": [
                {"role": "user", "content": QS[0]}]}, timeout=0.2)
        time.sleep(1.5)
        assert up.requests == 1  # the base call in flight; no guide call after the hang-up
        assert len(journal.read_text().splitlines()) == 1  # the manifest only
        m = httpx.get(g.url.replace("/v1", "/metrics")).text
        assert 'ccpo_gateway_requests_total{outcome="client_disconnected"} 1.0' in m


def test_mondrian_group_is_taken_from_the_request(art, tmp_path):
    """A Mondrian router's per-group threshold comes from the request's `group` field."""
    with FakeChatServer(SCRIPTS) as up:
        th = _gateway(art, up)
        r = th.gw.router
        r.group_kappas, r.rest_kappa = {"easy": np.float32(0.05)}, np.float32(0.9)
        with th as g:
            client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
            a = _ask(client, QS[0], group="easy").model_extra["ccpo"]
            b = _ask(client, QS[0]).model_extra["ccpo"]
        assert a["decisions"][0]["kappa"] == pytest.approx(0.05) and a["decisions"][0]["kappa_source"] == "group 'easy'"
        assert b["decisions"][0]["kappa"] == pytest.approx(0.9)
        assert b["decisions"][0]["kappa_source"] == "pooled: the request gives no group"
        assert set(a["decisions"][0]["action_set"]) == set(a["decisions"][0]["available"])  # every pi >= 0.05


def test_online_kappa_follows_eq9_and_the_alarm_is_a_binomial_test():
    from ccpo_jax.gateway.online import XI, CoverageState

    rng = np.random.default_rng(0)
    outcomes = rng.random(300) < 0.7  # coverage 0.7 against a target of 0.9: drift
    st = CoverageState(alpha=0.1, kappa=0.4, eta0=0.5, window=100, alarm_p=0.01)
    k = 0.4
    for i, c in enumerate(outcomes, start=1):
        st.record(bool(c))
        k = min(1.0, max(0.0, k + 0.5 * i ** -(0.5 + XI) * (0.1 - (not c))))
        assert st.kappa == pytest.approx(k, abs=1e-5)
    recent = outcomes[-100:]
    s, n = int(recent.sum()), 100
    p = sum(math.comb(n, j) * 0.9 ** j * 0.1 ** (n - j) for j in range(s + 1))
    assert st.p_value == pytest.approx(p, rel=1e-6) and st.alarm == (p < 0.01) and st.alarm


@pytest.mark.parametrize("extra,msg", [
    (["--base", "nocomma"], "error: --base 'nocomma': expected URL,MODEL"),
    (["--online-kappa", "-1"], "error: --online-kappa: expected a step > 0, got -1.0"),
    (["--journal", "j.txt"], "--journal"),
    (["--port", "70000"], "error: --port: expected 0..65535, got 70000"),
])
def test_gateway_flag_errors(art, tmp_path, extra, msg):
    args = ["gateway", str(art), "--base", "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g"]
    res = run_cli(args + extra, cwd=tmp_path)
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_gateway_missing_artefact_in_a_subprocess(tmp_path):
    res = run_cli(["gateway", str(tmp_path / "nope"), "--base", "http://127.0.0.1:9/v1,b", "--guide",
                   "http://127.0.0.1:9/v1,g"], in_subprocess=True)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "no such artefact" in res.stderr


def test_drift_replay_equals_the_replay_environment(art, tmp_path):
    """At the fixed kappa, the gateway's decision loop over cached rounds gives, question by question,
    the covered flag, rounds and cost of the replay environment's set-valued rollout (evaluate_sets)."""
    import jax.numpy as jnp

    from ccpo_jax.gateway.drift import replay
    from ccpo_jax.serving import Router
    from envs.cache.jsonl import cache_to_records
    from envs.replay.env import evaluate_sets, make_env_params
    from envs.generators.synthetic import generate

    from envs.cache.jsonl import read_jsonl

    router = Router.load(art)
    full = generate("hotpotqa-llama2", 40, 11)
    recs = cache_to_records(full)
    for rec in recs[::2]:  # half without log-prob signals: this router then runs more rounds
        for rd in rec["rounds"]:
            rd["base"].pop("confidence", None)
            rd["guide"].pop("uncertainty", None)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in [{"manifest": full.manifest.to_dict()}] + recs))
    cache = read_jsonl(src)
    env = make_env_params(cache)
    obs, avail = np.asarray(env.obs), np.asarray(env.available)
    N, T = obs.shape[:2]
    in_set = router.action_set(obs.reshape(N * T, -1), avail.reshape(N * T, -1) | ~avail.reshape(N * T, -1).any(1,
                               keepdims=True)).reshape(N, T, 3) & avail
    want = evaluate_sets(jnp.asarray(in_set), env, jnp.arange(N))
    got = replay(router, cache_to_records(cache), eta=None)
    assert np.array_equal(got["covered"], np.asarray(want.covered))
    assert np.array_equal(got["rounds"], np.asarray(want.length))
    np.testing.assert_allclose(got["cost_cents"], np.asarray(want.cost_cents), rtol=1e-5)
    assert len(np.unique(got["rounds"])) >= 2


def test_live_eval_table_against_the_replay_prediction(art, tmp_path):
    """live-eval's numbers recomputed from its journal; the Clopper-Pearson interval from beta quantiles."""
    from scipy.stats import beta

    from ccpo_jax.testing.chat_server import write_questions
    from envs.cache.jsonl import read_jsonl

    qfile = tmp_path / "q.jsonl"
    write_questions(qfile, 10)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"policies": {"CCPO (lambda=0)": {
        "coverage": {"mean": 0.9}, "avg_len": {"mean": 1.5}, "cost_cents": {"mean": 2.0}}}}))
    (tmp_path / "run.json").write_text(json.dumps({"split_sizes": [10, 10, 200]}))
    journal = tmp_path / "live.jsonl"
    with FakeChatServer(make_scripts(10)) as up:
        res = run_cli(["live-eval", str(art), "--questions", str(qfile), "--journal", str(journal), "--base",
                       f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}", "--results", str(results), "--max-batch", "4"])
    assert res.returncode == 0, res.stderr
    cache = read_jsonl(journal)
    assert cache.n_questions == 10
    recs = list(_journal(journal).values())
    from ccpo_jax.llm.paper import is_correct

    k = sum(any(is_correct(a["answer"], [r["gold"]]) for a in r["gateway"]["answer_set"]) for r in recs)
    lo, hi = beta.ppf(0.025, k, 10 - k + 1) if k else 0.0, beta.ppf(0.975, k + 1, 10 - k) if k < 10 else 1.0
    # (no cache found for this artefact, so no router's own prediction: its columns say n/a)
    assert f"| coverage: set (CP 95%) | {k / 10:.4g} [{lo:.3f}, {hi:.3f}] | n/a | n/a | 0.9 |" in res.stdout
    cost = np.mean([r["gateway"]["cost_cents"] for r in recs])
    assert f"| cost per question (cents) | {cost:.4g} | n/a | n/a | 0.01 |" in res.stdout
    assert "the router's own replay prediction skipped: no run.json of the training run found (pass --cache)" \
        in res.stdout
    assert "inside" in res.stdout
    assert "drift alarm (gold feedback after each question): never on; at the end off" in res.stdout


def test_live_eval_reports_when_the_drift_alarm_turned_on():
    """summarise's drift-alarm entry: the first outcome (in recording order, not question order) after
    which the alarm was on, and the state after the last one; absent for rows without alarm records."""
    from ccpo_jax.gateway.liveeval import summarise

    def row(after, on, rolling):
        return {"cost_cents": 1.0, "rounds": 1, "covered": True, "none_seen": False, "empty_set": False,
                "reply_correct": {"guide": True, "base": True, "abstain": True},
                "alarm": {"after": after, "on": on, "rolling": rolling}}

    rows = [row(3, True, 0.5), row(1, False, 1.0), row(4, False, 0.75), row(2, True, 0.5)]
    got = summarise(rows, None, 4, 0.9)["drift_alarm"]
    assert got == {"on_at_end": False, "first_on_after": 2, "rolling_coverage_at_end": 0.75}
    rows = [row(i + 1, False, 1.0) for i in range(3)]
    assert summarise(rows, None, 3, 0.9)["drift_alarm"]["first_on_after"] is None
    for r in rows:
        del r["alarm"]
    assert "drift_alarm" not in summarise(rows, None, 3, 0.9)


def test_live_eval_budget_stops_before_crossing(art, tmp_path):
    from ccpo_jax.testing.chat_server import write_questions

    qfile = tmp_path / "q.jsonl"
    write_questions(qfile, 10)
    journal = tmp_path / "live.jsonl"
    with FakeChatServer(make_scripts(10)) as up:
        res = run_cli(["live-eval", str(art), "--questions", str(qfile), "--journal", str(journal), "--base",
                       f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}", "--budget-cents", "1.3",
                       "--concurrency", "1", "--max-batch", "1"])
    assert res.returncode == 0, res.stderr
    recs = list(_journal(journal).values())
    assert 0 < len(recs) < 10 and "not started (--budget-cents)" in res.stdout
    # each question reserves its worst case (about 1.27 cents here, realised cost ~0.01-0.03): with 1.3 cents
    # the first questions start, and one whose reservation would cross the budget does not
    assert sum(r["gateway"]["cost_cents"] for r in recs) <= 1.3


def test_concurrent_decisions_are_batched_and_equal_router_decide(art):
    """32 requests at once, no HTTP: the batcher makes fewer router calls than decisions, and every
    decision equals Router.decide on that request's rounds."""
    import asyncio

    from ccpo_jax.gateway.engine import Batcher, Caps, Decider, ProtocolConfig, run_protocol
    from ccpo_jax.gateway.online import CoverageState
    from ccpo_jax.llm.wire import parse_completion
    from ccpo_jax.serving import Router

    router = Router.load(art)
    up = FakeChatServer(SCRIPTS, logprobs=False)  # (its replies only; not started): several rounds each
    batcher = Batcher(Decider(router, CoverageState(router.alpha, float(router.kappa))))

    async def call(role, t, body):
        body["model"] = BASE_MODEL if role == "base" else GUIDE_MODEL
        await asyncio.sleep(0.001)
        return parse_completion(up.completion(body))

    async def main():
        return await asyncio.gather(*(run_protocol(QS[i % len(QS)], None, Caps(), decider=batcher, call=call,
                                                   cfg=ProtocolConfig(), prices={"base": (0, 0), "guide": (1, 1)})
                                      for i in range(32)))

    outs = asyncio.run(main())
    n = sum(len(o.decisions) for o in outs)
    assert batcher.batches < n
    for o in outs:
        for t, d in enumerate(o.decisions):
            want = router.decide(o.rounds[: t + 1], can_continue=t + 1 < router.T)
            # screened decisions: the same set, the probabilities within 1e-5 (tests/serving/test_router_screen.py)
            assert d["action_set"] == want["action_set"] and d["probs"] == pytest.approx(want["probs"], abs=1e-5)
    # one Decides protocol (issue 52): a request alone (Immediate) runs the same protocol as a batched one
    from ccpo_jax.gateway.engine import Decides, Immediate

    alone = Immediate(batcher.decider)
    assert isinstance(batcher, Decides) and isinstance(alone, Decides) and alone.router is batcher.router is router
    for i, o in enumerate(outs[:4]):
        again = asyncio.run(run_protocol(QS[i % len(QS)], None, Caps(), decider=alone, call=call,
                                         cfg=ProtocolConfig(), prices={"base": (0, 0), "guide": (1, 1)}))
        assert again.rounds == o.rounds and [d["action_set"] for d in again.decisions] == \
            [d["action_set"] for d in o.decisions]


def test_upstream_down_is_502_connection(art):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    dead = Endpoint(f"http://127.0.0.1:{port}/v1", BASE_MODEL)
    with GatewayThread(load_gateway(art, GatewayConfig(base=dead, guide=dead, retry=FAST, max_batch=1))) as g:
        st, err = post(g.url, "/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "q"}]})
        assert st == 502 and err["error"]["code"] == "upstream_connection"
        assert "gave up after 3 attempts" in err["error"]["message"]


def test_gateway_port_taken_is_one_error_line(art, tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        res = run_cli(["gateway", str(art), "--max-batch", "1", "--port", str(s.getsockname()[1]), "--base",
                       "http://127.0.0.1:9/v1,b",
                       "--guide", "http://127.0.0.1:9/v1,g"])
    finally:
        s.close()
    assert res.returncode == 2 and res.stderr.startswith("error: --port: cannot listen on 127.0.0.1:")
    assert "Traceback" not in res.stderr


def test_missing_key_variable_is_an_error_at_start(art, monkeypatch):
    monkeypatch.delenv("CCPO_TEST_NO_SUCH_KEY", raising=False)
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,b", "--guide", "http://127.0.0.1:9/v1,g",
                   "--guide-key-env", "CCPO_TEST_NO_SUCH_KEY"])
    assert res.returncode == 2 and "CCPO_TEST_NO_SUCH_KEY" in res.stderr and "Traceback" not in res.stderr


def test_restarted_journal_takes_feedback_for_earlier_requests(live, tmp_path):
    from ccpo_jax.gateway.journal import Journal
    from envs.cache.jsonl import awaiting_feedback

    up, g, client, journal = live
    cid = _ask(client, QS[8]).id
    copy = tmp_path / "j.jsonl"
    copy.write_text(journal.read_text())
    man = json.loads(copy.read_text().splitlines()[0])["manifest"]
    j = Journal(copy, man)  # an existing journal of this router: its manifest is kept, the waiting requests reloaded
    try:
        assert cid in j.pending
        before = awaiting_feedback(copy)
        out, cov = j.feedback({"id": cid, "gold": SCRIPTS[QS[8]].gold})
    finally:
        j.close()
    assert out["gold"] == SCRIPTS[QS[8]].gold and cov is not None
    assert awaiting_feedback(copy) == before - 1


def test_correct_feedback_labels_only_what_it_determines():
    from ccpo_jax.gateway.journal import covered, label

    def rec(answers, chosen, in_set):
        rounds = [{"base": {"answer": b, "tokens_in": 1, "tokens_out": 1},
                   "guide": {"verdict": b == g, "answer": g, "tokens_in": 1, "tokens_out": 1}} for b, g in answers]
        return {"id": "x", "rounds": rounds, "gateway": {"answer": chosen, "answer_set": [{"answer": a} for a in in_set]}}

    same = rec([("Paris", "paris")], "paris", ["Paris", "paris"])  # one normalised answer: determined
    out = label(same, None, True)
    assert out["rounds"][0]["base"]["correct"] is True and out["rounds"][0]["guide"]["correct"] is True
    assert covered(same, None, True) is True and covered(same, None, False) is False
    two = rec([("Lyon", "Paris")], "Paris", ["Lyon", "Paris"])  # the other answer's outcome is unknown
    out = label(two, None, False)
    assert "correct" not in out["rounds"][0]["base"] and out["feedback"] == {"correct": False}
    assert covered(two, None, False) is None and covered(two, None, True) is True
    out = label(two, "lyon", None, ["Lyons"])  # gold labels every answer
    assert out["rounds"][0]["base"]["correct"] is True and out["rounds"][0]["guide"]["correct"] is False
    assert covered(two, "lyon", None) is True and covered(two, "Nice", None) is False


def test_online_kappa_needs_a_marginal_router(art):
    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.service import Gateway
    from ccpo_jax.serving import Router

    r = Router.load(art)
    r.group_kappas, r.rest_kappa = {"a": np.float32(0.2)}, np.float32(0.3)
    ep = Endpoint("http://127.0.0.1:9/v1", "m")
    with pytest.raises(UserError, match="online_eta: a Mondrian router"):
        Gateway(r, GatewayConfig(base=ep, guide=ep, online_eta=1.0))


def test_live_eval_upstream_failure_is_one_error_line_and_a_valid_journal(art, tmp_path):
    from ccpo_jax.testing.chat_server import write_questions
    from envs.cache.jsonl import read_jsonl

    qfile = tmp_path / "q.jsonl"
    write_questions(qfile, 6)
    journal = tmp_path / "live.jsonl"
    with FakeChatServer(make_scripts(6)) as up:
        up.fault(list(make_scripts(6))[5], "500", times=100)
        res = run_cli(["live-eval", str(art), "--questions", str(qfile), "--journal", str(journal), "--base",
                       f"{up.url},{BASE_MODEL}", "--guide", f"{up.url},{GUIDE_MODEL}", "--concurrency", "1",
                       "--retries", "0", "--max-batch", "1"])
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "HTTP 500" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert read_jsonl(journal).n_questions == 5


def test_an_ensemble_router_behind_the_gateway(tmp_path):
    """An exported ensemble (three policies, ``ROW [ensemble]``) behind the gateway, asked by the openai client,
    streamed and not: every decision equals the router's own on the journaled rounds (its float64 screen
    averages the members as the module does)."""
    art = build_artefact(tmp_path, members=3)
    journal = tmp_path / "journal.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal) as g:
        router = g.gw.router
        assert router.manifest["policy"]["network"]["ensemble"] == 3 and router.manifest["seed"] is None
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
        for q in QS[:4]:
            r = _ask(client, q)
            ccpo = r.model_extra["ccpo"]
            rec = _journal(journal)[r.id]
            for t, d in enumerate(ccpo["decisions"]):
                want = router.decide(rec["rounds"][: t + 1], can_continue=t + 1 < router.T)
                assert d["action_set"] == want["action_set"] and d["probs"] == pytest.approx(want["probs"], abs=1e-5)
            chunks = list(client.chat.completions.create(model=MODEL_ID, stream=True,
                                                         messages=[{"role": "user", "content": q}]))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == r.choices[0].message.content


def test_feedback_outcome_counts_a_question_no_round_saw_as_covered():
    """journal.outcome against the replay's definition, case by case by hand: covered when the set holds
    the gold or no round run answered it (possibly unsolvable, Eq. 8); missed only when a round run had it."""
    from ccpo_jax.gateway.journal import apply_feedback, none_seen, outcome

    def rec(answers, in_set):
        rounds = [{"base": {"answer": b, "tokens_in": 1, "tokens_out": 1},
                   "guide": {"verdict": b == g, "answer": g, "tokens_in": 1, "tokens_out": 1}} for b, g in answers]
        return {"id": "x", "rounds": rounds,
                "gateway": {"answer": in_set[0] if in_set else None, "answer_set": [{"answer": a} for a in in_set]}}

    r = rec([("Lyon", "Lyon"), ("Nice", "Nice")], ["Nice"])
    assert outcome(r, "nice", None) is True  # in the set
    assert outcome(r, "Lyon", None) is False and not none_seen(r, "Lyon")  # round 1 had it, the set does not
    assert none_seen(r, "Paris") and outcome(r, "Paris", None) is True  # no round run saw it
    assert outcome(rec([("Lyon", "Lyon")], []), "Paris", None) is True  # empty set, nothing seen
    assert outcome(rec([("Lyon", "Paris")], []), "Paris", None) is False  # the guide had it, the set is empty
    assert outcome(r, "Lyons", None, ["lyon"]) is False  # an alias counts as seen
    assert outcome(r, None, False) is False and outcome(r, None, True) is True  # `correct` alone: as before
    out, cov = apply_feedback(r, "x", "Paris", None, [])
    assert cov is True and out["feedback"]["covered"] is False  # the journal keeps the plain fact


def test_unsolvable_questions_do_not_set_off_the_drift_alarm(art, tmp_path):
    """30 outcomes whose gold no round saw: covered for the alarm (before: 30 misses, alarm on at p ~ 1e-30),
    counted as none_seen in the reply and the metrics."""
    journal = tmp_path / "j.jsonl"
    with FakeChatServer(SCRIPTS) as up, _gateway(art, up, journal, window=30) as g:
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
        replies = []
        for i in range(30):
            cid = _ask(client, QS[i % len(QS)]).id
            st, fb = post(g.url, "/feedback", {"id": cid, "gold": "an answer no round gave"})
            assert st == 200
            replies.append(fb)
        m = httpx.get(g.url.replace("/v1", "/metrics")).text
    assert all(fb["covered"] is False and fb["counted_as"] == "none_seen" for fb in replies)
    assert replies[-1]["rolling_coverage"] == 1.0 and replies[-1]["drift_alarm"] is False
    assert 'ccpo_gateway_feedback_total{outcome="none_seen"} 30.0' in m
    assert "ccpo_gateway_drift_alarm 0.0" in m
