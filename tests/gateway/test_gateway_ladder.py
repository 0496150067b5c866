"""The gateway on a model ladder and on a guide-less cascade (docs/gateway.md "Ladders and cascades").

Each rung is its own scripted upstream (ccpo_jax/testing/chat_server.py), which records every request's model and
messages. Oracles: those request logs (which rung's upstream and model each round called), the exported
router called directly (``Router.decide`` on the journaled rounds), costs summed by hand from this file's
own price table, the cache reader (``data check``, ``load_cache``) on the journal.
"""
from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from ccpo_jax.testing.chat_server import GUIDE_MODEL, FakeChatServer, make_scripts  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact, post  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint, RetryPolicy  # noqa: E402
from envs.cache.schema import ModelInfo  # noqa: E402

FAST = RetryPolicy(retries=1, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=5.0, timeout_s=2.0,
                   attempt_timeout_s=5.0)
SCRIPTS = make_scripts(12)
QS = list(SCRIPTS)
#: (model, USD per M in, per M out) of rounds 1..4; the guide is the SYNTHETIC cache's gpt-4o at $2.5/$10.
RUNGS = [("tiny-base", 0.1, 0.2), ("mid-base", 1.0, 2.0), ("big-base", 3.0, 5.0), ("top-base", 8.0, 16.0)]
GUIDE_PRICE = (2.5, 10.0)


def _ladder_cache(cascade: bool):
    from envs.cache.schema import ResponseCache
    from envs.generators.cascade import as_cascade
    from envs.generators.synthetic import generate

    c = generate("hotpotqa-llama2", 60, 3)
    rungs = tuple(ModelInfo(m, p_in, p_out) for m, p_in, p_out in RUNGS[: c.T])
    if cascade:
        return as_cascade(c, rungs)
    return ResponseCache(dataclasses.replace(c.manifest, base_ladder=rungs), c.arrays).with_checksum()


@pytest.fixture(scope="module")
def ladder_art(tmp_path_factory):
    # (seed 0: this random policy, over the 20 features of a ladder, goes on to the top rung on most questions and stops earlier on one)
    return build_artefact(tmp_path_factory.mktemp("gwl"), seed=0, cache=_ladder_cache(False))


@pytest.fixture(scope="module")
def cascade_art(tmp_path_factory):
    # a smooth policy at a low threshold: "next" stays in the set, so requests reach the last round
    return build_artefact(tmp_path_factory.mktemp("gwc"), scale=1.0, kappa=0.02, cache=_ladder_cache(True))


@pytest.fixture(scope="module")
def upstreams():
    """One scripted server per rung (serving that rung's model) and one for the guide."""
    with ExitStack() as st:
        rungs = [st.enter_context(FakeChatServer(SCRIPTS, served=[m], log_requests=True)) for m, _, _ in RUNGS]
        guide = st.enter_context(FakeChatServer(SCRIPTS, served=[GUIDE_MODEL], log_requests=True))
        yield rungs, guide


def _cfg(rungs, guide, journal, **kw):
    return GatewayConfig(base=tuple(Endpoint(s.url, m) for s, (m, _, _) in zip(rungs, RUNGS)),
                         guide=None if guide is None else Endpoint(guide.url, GUIDE_MODEL), retry=FAST,
                         journal=str(journal), max_batch=2, **kw)


def _journal(path: Path) -> dict[str, dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return {x["id"]: x for x in lines[1:]}


def _hand_cost(rounds: list[dict]) -> float:
    """Cents of the journaled rounds: round t's base tokens at rung t's prices, the guide's at its own."""
    usd = 0.0
    for t, rd in enumerate(rounds):
        usd += rd["base"]["tokens_in"] * RUNGS[t][1] + rd["base"]["tokens_out"] * RUNGS[t][2]
        if "guide" in rd:
            usd += rd["guide"]["tokens_in"] * GUIDE_PRICE[0] + rd["guide"]["tokens_out"] * GUIDE_PRICE[1]
    return usd / 1e6 * 100


def _check_decisions(router, ccpo, rounds):
    assert len(ccpo["decisions"]) == len(rounds) == ccpo["rounds"]
    for t, d in enumerate(ccpo["decisions"]):
        want = router.decide(rounds[: t + 1], can_continue=t + 1 < router.T)
        # screened decisions: the same set, the probabilities within 1e-5 (tests/serving/test_router_screen.py)
        assert d["action_set"] == want["action_set"] and d["probs"] == pytest.approx(want["probs"], abs=1e-5)


def test_ladder_rounds_call_their_rung_at_its_prices(ladder_art, upstreams, tmp_path):
    rungs, guide = upstreams
    journal = tmp_path / "journal.jsonl"
    with GatewayThread(load_gateway(ladder_art, _cfg(rungs, guide, journal))) as g:
        router = g.gw.router
        client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
        lengths = []
        for q in QS:
            before = [len(s.asked) for s in rungs + [guide]]
            r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}])
            ccpo = r.model_extra["ccpo"]
            rounds = _journal(journal)[r.id]["rounds"]
            n = len(rounds)
            lengths.append(n)
            # round t's base call went to rung t's upstream, naming rung t's model; one guide call a round
            new = [s.asked[b:] for s, b in zip(rungs + [guide], before)]
            for k, (m, _, _) in enumerate(RUNGS):
                assert [c["model"] for c in new[k]] == ([m] if k < n else [])
                if k < n:  # rung k saw the earlier rounds' exchange (k assistant messages), as data collect's
                    assert sum(x["role"] == "assistant" for x in new[k][0]["messages"]) == k
            assert [c["model"] for c in new[-1]] == [GUIDE_MODEL] * n
            _check_decisions(router, ccpo, rounds)
            assert ccpo["cost_cents"] == pytest.approx(_hand_cost(rounds), rel=1e-9)
            assert ccpo["tokens"]["base"]["model"] == [m for m, _, _ in RUNGS[:n]]
            assert ccpo["tokens"]["guide"]["model"] == GUIDE_MODEL
            tin = sum(rd[x]["tokens_in"] for rd in rounds for x in ("base", "guide"))
            assert r.usage.prompt_tokens == tin
            assert r.choices[0].message.content == (ccpo["answer_set"][-1]["answer"] if ccpo["answer_set"] else "")
            st, fb = post(g.url, "/feedback", {"id": r.id, "gold": SCRIPTS[q].gold})
            assert st == 200 and fb["labelled"], fb
    # every rung was called, and the router also stopped before the top rung
    assert max(lengths) == len(RUNGS) and min(lengths) < len(RUNGS), lengths
    _check_journal(journal, ladder=True)


def _check_journal(journal: Path, ladder: bool):
    """The journal is a cache of the artefact's models: data check passes and prints the ladder; each
    labelled question costs what the gateway reported."""
    from envs.cache.formats import load_cache

    r = run_cli(["data", "check", str(journal)])
    assert r.returncode == 0, r.stderr
    assert "a ladder, one model per round" in r.stdout and "top-base" in r.stdout
    if not ladder:
        assert "guide model: none" in r.stdout
    cache = load_cache(journal)
    assert [(m.name, m.price_in, m.price_out) for m in cache.manifest.base_ladder] == RUNGS
    assert (cache.manifest.guide is None) == (not ladder)
    recs = _journal(journal)
    got = cache.round_cost_cents().sum(axis=1)
    assert cache.n_questions == len(QS)
    for i, qid in enumerate(cache.arrays["question_ids"]):
        assert float(got[i]) == pytest.approx(recs[str(qid)]["gateway"]["cost_cents"], rel=1e-5)


def test_cascade_makes_no_guide_call_and_answers_the_last_base_answer(cascade_art, upstreams, tmp_path):
    rungs, guide = upstreams
    journal = tmp_path / "journal.jsonl"
    with GatewayThread(load_gateway(cascade_art, _cfg(rungs, None, journal))) as g:
        router = g.gw.router
        assert not router.has_guide
        g0 = len(guide.asked)
        last_round = 0
        for q in QS:
            before = [len(s.asked) for s in rungs]
            st, body = post(g.url, "/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": q}]})
            assert st == 200, body
            ccpo = body["ccpo"]
            rounds = _journal(journal)[body["id"]]["rounds"]
            n = len(rounds)
            assert all(set(rd) == {"base"} for rd in rounds)
            for k, s in enumerate(rungs):
                new = s.asked[before[k]:]
                assert [c["model"] for c in new] == ([RUNGS[k][0]] if k < n else [])
                if new:  # a cascade's base is asked afresh: no earlier exchange, no guide reply to show,
                    # at round 1's temperature on every rung (as `data collect --guide none` collects it)
                    assert len(new[0]["messages"]) == 1 and new[0]["temperature"] == 0
            _check_decisions(router, ccpo, rounds)
            assert all("guide" not in d["action_set"] and "guide" not in d["available"] for d in ccpo["decisions"])
            assert ccpo["cost_cents"] == pytest.approx(_hand_cost(rounds), rel=1e-9)
            assert set(ccpo["tokens"]) == {"base"}
            if n == router.T:  # the last round: only "base" is available, so it is the set and the answer
                last_round += 1
                assert ccpo["decisions"][-1]["action_set"] == ["base"]
                assert body["choices"][0]["message"]["content"] == rounds[-1]["base"]["answer"]
            st, fb = post(g.url, "/feedback", {"id": body["id"], "gold": SCRIPTS[q].gold})
            assert st == 200 and fb["labelled"], fb
        assert len(guide.asked) == g0  # no guide call at all
    assert last_round >= 3
    _check_journal(journal, ladder=False)


@pytest.mark.parametrize("which, extra, match", [
    ("ladder", ["--base", "{u},tiny-base", "--guide", "{u},big-guide"],
     "error: --base: given 1 time(s); the artefact's router is a ladder of T = 4 base models (tiny-base, mid-base, "
     "big-base, top-base): give it once per round, in round order"),
    ("ladder", ["--base", "{u},a", "--base", "{u},b", "--base", "{u},c", "--base", "{u},d"],
     "error: --guide: required; the artefact's router has one guide model (gpt-4o): give its endpoint once"),
    ("cascade", ["--base", "{u},a", "--base", "{u},b", "--base", "{u},c", "--base", "{u},d", "--guide", "{u},g"],
     "error: --guide: the artefact's router is a guide-less cascade (models.guide: null): it makes no guide call, "
     "so give no guide endpoint"),
    ("cascade", ["--base", "{u},a", "--guide-key-env", "KEY"],
     "error: --guide-key-env: given without --guide (a guide-less cascade calls no guide)"),
])
def test_wrong_endpoints_for_the_artefact_are_one_error_line(ladder_art, cascade_art, tmp_path, which, extra, match):
    art = ladder_art if which == "ladder" else cascade_art
    u = "http://127.0.0.1:9/v1"
    journal = tmp_path / "j.jsonl"
    r = run_cli(["gateway", str(art), "--journal", str(journal), *[x.format(u=u) for x in extra]])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == match
    assert not journal.exists()


def test_one_model_artefact_refuses_a_ladder_of_endpoints(tmp_path):
    from ccpo_jax.errors import UserError
    from ccpo_jax.gateway.service import endpoint_rungs

    one = {"name": "b", "price_in": 1, "price_out": 2}
    e = Endpoint("http://127.0.0.1:9/v1", "b")
    assert endpoint_rungs(e, one, 3, "base") == (e, e, e)
    with pytest.raises(UserError, match=r"^base: given 2 times; the artefact's router has one base model \(b\)"):
        endpoint_rungs((e, e), one, 3, "base")
    assert endpoint_rungs(None, None, 3, "guide") is None


def test_reservation_is_round_ts_at_its_prices():
    """``max_cost_cents`` and live-eval reserve round t at rung t's prices; a cascade's round is the base
    call alone. Rungs 1 and 2 have proportional prices (x10), so their base reservations are x10."""
    from ccpo_jax.gateway.engine import ProtocolConfig, per_round, round_reserve

    cfg, q = ProtocolConfig(), QS[0]
    base = tuple((p_in, p_out) for _, p_in, p_out in RUNGS)
    cascade = per_round({"base": base, "guide": None}, 4)
    ladder = per_round({"base": base, "guide": GUIDE_PRICE}, 4)
    assert round_reserve(q, [], cfg, cascade, 1) == pytest.approx(10 * round_reserve(q, [], cfg, cascade, 0), rel=1e-12)
    guide_part = [round_reserve(q, [], cfg, ladder, t) - round_reserve(q, [], cfg, cascade, t) for t in range(4)]
    assert guide_part[0] > 0 and guide_part == pytest.approx([guide_part[0]] * 4, rel=1e-9)
    with pytest.raises(ValueError, match="T = 4"):
        per_round({"base": base[:2], "guide": None}, 4)


def test_live_eval_on_a_cascade(cascade_art, upstreams, tmp_path):
    """live-eval with one --base per rung and no --guide: every question answered, the journal a cascade cache,
    the table's cost the journal's mean."""
    from ccpo_jax.testing.chat_server import write_questions

    rungs, _ = upstreams
    qfile, journal = tmp_path / "q.jsonl", tmp_path / "live.jsonl"
    write_questions(qfile, 6)
    flags = [x for s, (m, _, _) in zip(rungs, RUNGS) for x in ("--base", f"{s.url},{m}")]
    res = run_cli(["live-eval", str(cascade_art), "--questions", str(qfile), "--journal", str(journal), *flags,
                   "--budget-cents", "100", "--max-batch", "2"])
    assert res.returncode == 0, res.stderr
    recs = list(_journal(journal).values())
    assert len(recs) == 6 and all("gold" in r and set(r["rounds"][0]) == {"base"} for r in recs)
    cost = sum(r["gateway"]["cost_cents"] for r in recs) / 6
    assert f"| cost per question (cents) | {cost:.4g} |" in res.stdout
    r = run_cli(["data", "check", str(journal)])
    assert r.returncode == 0 and "guide model: none" in r.stdout, r.stderr
