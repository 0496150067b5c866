"""The ``json`` round protocol (issue 49): option labels, reading structured replies and their measures
(hand-derived values), ``data collect``'s default and the gateway's protocol and ``--on-empty``.

The real replies of ``tests/fixtures/real_llms/replies.json`` (SmolLM2-135M-Instruct under llama.cpp's
``llama-server``, recorded by ``tests/end_to_end/real_llm_loop.py record``) are read here too, in the default tier.
"""
from __future__ import annotations

import dataclasses
import json
import math

import openai
import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts, token_logprob
from ccpo_jax.cli.main import main
from ccpo_jax.gateway.engine import ProtocolConfig, fallback_answer
from ccpo_jax.llm import protocols
from ccpo_jax.llm import structured as S
from ccpo_jax.llm.wire import Endpoint, RetryPolicy
from tests.helpers import REPO

MC = "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22"
JSON = protocols.get("json")
REPLIES = REPO / "tests" / "fixtures" / "real_llms" / "replies.json"


@pytest.mark.parametrize("question, labels", [
    (MC, ("A", "B", "C", "D")),
    ("Pick one:\n(A) yes\n(B) no", ("A", "B")),
    ("Pick one:\nA) yes\nB) no\nC) maybe", ("A", "B", "C")),
    ("What is the capital of France?", None),
    ("Only one option\nA. x", None),                   # one line is no list
    ("Skipping\nA. x\nC. y", None),                    # not consecutive from A
    ("Grade A. students and B. students", None),       # not at the start of a line
])
def test_option_labels(question, labels):
    assert S.option_labels(question) == labels


def test_schema_constrains_multiple_choice_answers_to_the_labels():
    fmt = JSON.base_format(MC)
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["schema"]["properties"]["answer"] == {"type": "string", "enum": ["A", "B", "C", "D"]}
    free = JSON.base_format("What is the capital of France?")["json_schema"]["schema"]["properties"]["answer"]
    assert free["type"] == "string" and "enum" not in free
    g = JSON.guide_format(MC)["json_schema"]["schema"]
    assert list(g["properties"]) == ["verdict", "answer"] and g["properties"]["verdict"]["enum"] == ["yes", "no"]
    assert protocols.get("paper").base_format(MC) is None


def test_base_reply_answer_and_confidence_hand_derived():
    text = '{"answer": "B"}'
    toks = [('{"', -0.1), ("answer", -0.01), ('":', 0.0), (' "', -0.1), ("B", -0.5), ('"}', -0.01)]
    r = JSON.read_base(MC, text, toks)
    assert (r.answer, r.parsed, r.shown) == ("B", True, "B")
    assert r.confidence == pytest.approx(math.exp(-0.5), abs=1e-6)  # the one token inside the value
    two = '{"answer": "New York"}'
    toks2 = [('{"answer": "', -0.2), ("New", -0.4), (" York", -0.2), ('"}', -0.3)]
    r2 = JSON.read_base("Which city?", two, toks2)
    assert r2.answer == "New York" and r2.confidence == pytest.approx(math.exp(-0.3), abs=1e-6)  # mean(-0.4, -0.2)


@pytest.mark.parametrize("text, answer, parsed", [
    ('```json\n{"answer": "(b)"}\n```', "B", True),   # code fence; an option written (b) is its label
    ('Sure! {"answer": "B. 4"}', "B", True),
    ("Let me think.\nAnswer: C", "C", True),          # a server that ignored the schema: the paper's line
    ('{"answer": ""}', "", False),
    ("I am not sure.", "", False),
])
def test_base_reply_variants(text, answer, parsed):
    r = JSON.read_base(MC, text, None)
    assert (r.answer, r.parsed) == (answer, parsed)
    assert r.shown == (answer if parsed else text.strip())
    assert r.confidence is None  # no log-probs


def test_guide_reply_verdict_and_uncertainty_hand_derived():
    text = '{"verdict": "no", "answer": "C"}'
    toks = [('{"verdict": "', -0.1), ("no", -0.3), ('", "answer": "', -0.01), ("C", -0.2), ('"}', 0.0)]
    g = JSON.read_guide(MC, text, toks, "B")
    assert (g.verdict, g.correction, g.answer) == (False, "C", "C")
    assert g.uncertainty == pytest.approx(1 - math.exp(-0.3), abs=1e-6)
    y = JSON.read_guide(MC, '{"verdict": "yes", "answer": "D"}', None, "B")
    assert (y.verdict, y.answer, y.uncertainty) == (True, "B", None)  # on yes the base answer is the guide's
    assert JSON.read_guide(MC, "No [C]", None, "B").answer == "C"  # the paper's format still read
    bad = JSON.read_guide(MC, '{"verdict": "maybe"}', None, "B")
    assert bad.verdict is None and bad.answer == ""
    # tokens that do not spell out the text: not measurable, never invented
    assert JSON.read_guide(MC, text, toks[:-1], "B").uncertainty is None


def test_protocol_resolution_from_provenance_and_flag():
    assert ProtocolConfig().resolved({}).round_protocol == "paper"  # caches that record none
    r = ProtocolConfig().resolved({"round_protocol": "json"})
    assert (r.round_protocol, r.base_max_tokens, r.guide_max_tokens) == ("json", 48, 48)
    assert ProtocolConfig(round_protocol="paper", base_max_tokens=7).resolved({"round_protocol": "json"}) == \
        dataclasses.replace(ProtocolConfig(), round_protocol="paper", base_max_tokens=7, guide_max_tokens=32)
    with pytest.raises(Exception, match="round_protocol 'xml'"):
        protocols.of_provenance({"round_protocol": "xml"})


def test_fallback_answer_rules():
    rounds = [{"base": {"answer": "A"}, "guide": {"answer": "B"}}, {"base": {"answer": "C"}, "guide": {"answer": ""}}]
    assert fallback_answer(rounds, "abstain") is None
    assert fallback_answer(rounds[:1], "guide") == {"role": "guide", "round": 1, "answer": "B"}
    assert fallback_answer(rounds, "guide") == {"role": "base", "round": 2, "answer": "C"}  # guide's empty
    assert fallback_answer(rounds, "base") == {"role": "base", "round": 2, "answer": "C"}
    assert fallback_answer([{"base": {"answer": "x"}}], "guide")["role"] == "base"  # a cascade: no guide


# -- data collect: the json protocol is the default ---------------------------------------------


def test_collect_default_is_the_json_protocol(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    scripts = make_scripts(6)
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"id": f"q{i}", "question": k, "gold": s.gold}) + "\n"
                         for i, (k, s) in enumerate(scripts.items())))
    out = tmp_path / "c.jsonl"
    with FakeChatServer(scripts, log_requests=True) as srv:
        assert main(["data", "collect", "--questions", str(q), "--base", f"{srv.url},{BASE_MODEL}", "--guide",
                     f"{srv.url},{GUIDE_MODEL}", "--rounds", "2", "--out", str(out), "--base-price", "0,0",
                     "--guide-price", "2.5,10", "--no-progress"]) == 0
        asked = list(srv.asked)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    man = lines[0]["manifest"]
    assert man["provenance"]["round_protocol"] == "json"
    assert man["provenance"]["requests"]["max_tokens"] == {"base": 48, "guide": 48, "decisions": 8}
    assert asked[0]["messages"][0]["content"].startswith("Answer the question. Reply with a JSON object")
    rec = {r["id"]: r for r in lines[1:]}
    # question 0: the base answers the gold in round 1 (JSON), the guide says yes
    r0 = rec["q0"]["rounds"][0]
    text = json.dumps({"answer": scripts[list(scripts)[0]].gold})
    toks = [t for t in __import__("re").findall(r"\s*\S+", text)]
    s, e = S.value_span(text, "answer")
    pos, lps = 0, []
    for t in toks:
        if pos + len(t) > s and pos < e:
            lps.append(token_logprob(t))
        pos += len(t)
    assert r0["base"]["correct"] and r0["base"]["confidence"] == pytest.approx(math.exp(sum(lps) / len(lps)), abs=1e-6)
    assert r0["guide"]["verdict"] is True and "uncertainty" in r0["guide"]
    assert main(["data", "check", str(out)]) == 0


def test_collect_sends_the_schema(tmp_path, monkeypatch):
    """The request bodies of the json protocol carry ``response_format`` (the call log keeps them)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    scripts = make_scripts(1)
    q = tmp_path / "q.jsonl"
    k, s = next(iter(scripts.items()))
    q.write_text(json.dumps({"id": "q0", "question": k + "\nA. one\nB. two", "gold": s.gold}) + "\n")
    seen = []
    with FakeChatServer(scripts) as srv:
        orig = srv.completion

        def spy(body, *a, **kw):
            seen.append(body)
            return orig(body, *a, **kw)
        srv.completion = spy
        assert main(["data", "collect", "--questions", str(q), "--base", f"{srv.url},{BASE_MODEL}", "--guide",
                     f"{srv.url},{GUIDE_MODEL}", "--rounds", "1", "--out", str(tmp_path / "c.jsonl"),
                     "--base-price", "0,0", "--guide-price", "0,0", "--no-progress"]) == 0
    assert [b["response_format"]["json_schema"]["name"] for b in seen] == ["ccpo_base", "ccpo_guide"]
    assert seen[0]["response_format"]["json_schema"]["schema"]["properties"]["answer"]["enum"] == ["A", "B"]


# -- the gateway: the artefact's protocol, --on-empty ----------------------------------------------


@pytest.fixture(scope="module")
def json_art(tmp_path_factory):
    from ccpo_jax.testing.gateway_harness import build_artefact
    from envs.generators.synthetic import generate

    cache = generate("hotpotqa-llama2", 60, 3)
    man = dataclasses.replace(cache.manifest, provenance={**cache.manifest.provenance, "round_protocol": "json"})
    # kappa 0.99: every set is empty, so every reply is --on-empty's
    return build_artefact(tmp_path_factory.mktemp("gwj"), cache=dataclasses.replace(cache, manifest=man), kappa=0.99)


@pytest.mark.parametrize("on_empty", ["guide", "base", "abstain"])
def test_gateway_runs_the_artefacts_protocol_and_marks_fallbacks(json_art, tmp_path, on_empty):
    from ccpo_jax.testing.gateway_harness import GatewayThread
    from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway

    scripts = make_scripts(3)
    q = list(scripts)[1]  # round 1: the base answers wrong, the guide corrects it to the gold
    fast = RetryPolicy(retries=0, timeout_s=5.0, attempt_timeout_s=10.0)
    with FakeChatServer(scripts, log_requests=True) as up:
        cfg = GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=fast,
                            max_batch=1, on_empty=on_empty)
        gw = load_gateway(json_art, cfg)
        assert gw.cfg.protocol.round_protocol == "json"
        with GatewayThread(gw) as g:
            client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=30)
            r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}],
                                               extra_body={"max_rounds": 1})
            metrics = __import__("httpx").get(g.url.replace("/v1", "") + "/metrics").text
        first = up.asked[0]
    assert first["messages"][0]["content"].startswith("Answer the question. Reply with a JSON object")
    c = r.model_extra["ccpo"]
    assert c["empty_set"] is True and c["answer_set"] == []
    want = {"guide": scripts[q].gold, "base": scripts[q].base[0], "abstain": ""}[on_empty]
    assert r.choices[0].message.content == want
    if on_empty == "abstain":
        assert c["fallback"] is None and c["abstained"] is True
        assert 'ccpo_gateway_empty_sets_total{reply="abstain"} 1.0' in metrics
    else:
        assert c["fallback"] == {"role": on_empty, "round": 1, "answer": want, "guaranteed": False,
                                 "on_empty": on_empty}
        assert c["abstained"] is False
        assert f'ccpo_gateway_empty_sets_total{{reply="{on_empty}"}} 1.0' in metrics


# -- recorded real replies ----------------------------------------------------------------------


@pytest.mark.skipif(not REPLIES.is_file(), reason="no recorded real replies (tests/end_to_end/real_llm_loop.py record)")
def test_recorded_real_replies_are_read_with_their_measures():
    """SmolLM2-135M-Instruct's replies under the json protocol (llama-server, response_format): every base
    reply an option letter or a short answer with its confidence, every guide reply a verdict with its
    uncertainty; the measures recomputed by hand from the recorded log-probs."""
    rec = json.loads(REPLIES.read_text())
    assert rec["replies"], "empty recording"
    for r in rec["replies"]:
        lps = [tuple(x) for x in r["logprobs"]]
        assert "".join(t for t, _ in lps) == r["text"]
        if r["role"] == "base":
            b = JSON.read_base(r["question"], r["text"], lps)
            assert b.parsed and b.confidence is not None
            labels = S.option_labels(r["question"])
            assert labels is None or b.answer in labels
            s, e = S.value_span(r["text"], "answer")
            pos, inside = 0, []
            for t, lp in lps:
                if pos + len(t) > s and pos < e:
                    inside.append(lp)
                pos += len(t)
            assert b.confidence == pytest.approx(math.exp(sum(inside) / len(inside)), abs=1e-6)
        else:
            g = JSON.read_guide(r["question"], r["text"], lps, "A")
            assert g.verdict is not None and g.uncertainty is not None and 0.0 <= g.uncertainty <= 1.0


IRREGULAR = REPO / "tests" / "fixtures" / "real_llms" / "irregular_replies.json"


@pytest.mark.parametrize("text, members", [
    ('{"verdict": "yes", "answer": "10000', {"verdict": "yes"}),               # cut inside the answer
    ('{\n  "verdict": "no",\n  "answer": "C"', {"verdict": "no", "answer": "C"}),  # closed string at the cut
    ('{"verdict": "ye', {}),                                                     # cut inside the verdict
    ('{"answer": 12', {}),                                                       # a number at the cut may go on
    ('{"answer": 12, "verdict": "no"}', {"answer": 12, "verdict": "no"}),
    ('{"verdict": "yes", "answer": "100} If the answer is correct', {"verdict": "yes"}),  # unterminated string
    ('```json\n{"verdict": "no", "answer": {"x": 1}, "z": tr', {"verdict": "no", "answer": {"x": 1}}),
    ('Sure! {"verdict": "yes"', {}),                                             # does not start an object
    ("", {}), ("{", {}), ('{"verdict" "yes"}', {}),
])
def test_complete_members_of_a_cut_reply(text, members):
    assert S.complete_members(text) == members


def test_cut_guide_reply_reads_its_complete_verdict_hand_derived():
    text = '{"verdict": "no", "answer": "12345678'                 # cut at max_tokens
    toks = [('{"verdict": "', -0.1), ("no", -0.7), ('", "answer": "', -0.01), ("1234", -0.2), ("5678", -0.3)]
    g = JSON.read_guide("What is 6 * 7?", text, toks, "40")
    assert (g.verdict, g.correction, g.answer) == (False, None, "")   # a cut answer is no correction
    assert g.uncertainty == pytest.approx(1 - math.exp(-0.7), abs=1e-6)
    b = JSON.read_base("What is 6 * 7?", '{"answer": "4242', [('{"answer": "', -0.1), ("4242", -0.2)])
    assert not b.parsed and b.confidence is None                       # the answer itself was cut: unreadable


@pytest.mark.parametrize("spelled, text, expected", [
    ("abc", "abc", 0),
    ("```json\n{}\n```", "{}", 8),          # the server returned the object without its fence
    ('{"a": "b"}\n\n', '{"a": "b"}', 0),    # ... or without trailing whitespace
    ("ab ab", "ab", None),                  # twice: which tokens measured it is unknown
    ("abc", "abd", None), ("abc", "", None),
])
def test_token_offset(spelled, text, expected):
    from ccpo_jax.llm import paper as P

    toks = [(ch, -0.5) for ch in spelled]
    assert P.token_offset(toks, text) == expected


def test_real_replies_the_reader_once_missed():
    """Verbatim replies of the real cache's call log that were unreadable or unmeasured before the cut-reply
    reader and the token offset: each guide reply's verdict is read and its uncertainty is 1 - p of the token
    named by hand in the fixture; the cut base answer stays unreadable (its value is incomplete)."""
    rec = json.loads(IRREGULAR.read_text())
    assert len(rec["replies"]) >= 5
    for r in rec["replies"]:
        lps = [tuple(x) for x in r["logprobs"]]
        if r["role"] == "guide":
            g = JSON.read_guide(r["question"], r["text"], lps, "7")
            assert g.verdict is (r["expect"]["verdict"] == "yes"), r["id"]
            want = 1 - math.exp(lps[r["expect"]["verdict_token"]][1])
            assert g.uncertainty == pytest.approx(want, abs=1e-6), r["id"]
        else:
            b = JSON.read_base(r["question"], r["text"], lps)
            assert b.parsed is r["expect"]["parsed"] and b.confidence is None, r["id"]
