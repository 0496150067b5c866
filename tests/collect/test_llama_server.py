"""``data collect`` against a real llama.cpp ``llama-server`` (slow; skipped without the binary).

The binary is ``$LLAMA_SERVER`` or ``llama-server`` on PATH; nothing is downloaded or built
here. The models are the designed bigram GGUFs of ``ccpo_jax/testing/llama_server.py`` (written in the
test's temporary folder), so the right confidence (0.45) and uncertainty (0.30) are known.
The default tier replays this server's recorded replies instead
(``tests/collect/test_llama_server_replies.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ccpo_jax.testing import llama_server as LS
from ccpo_jax.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not LS.BINARY, reason=LS.NO_BINARY)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with LS.designed_servers(LS.BINARY, tmp_path_factory.mktemp("llama")) as urls:
        yield urls


def _questions(path: Path, n: int) -> Path:
    golds = ["Paris", "Rome", "Berlin"]
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Capital number {i}?", "gold": golds[i % 3]}) + "\n"
                            for i in range(n)))
    return path


def test_collect_gets_the_designed_confidence_and_uncertainty(servers, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    out = tmp_path / "real.jsonl"
    q = _questions(tmp_path / "questions.jsonl", 6)
    args = ["data", "collect", "--round-protocol", "paper", "--questions", str(q), "--base", f"{servers['base']},bigram-base",
            "--guide", f"{servers['guide']},bigram-guide", "--base-price", "0,0", "--guide-price", "0,0",
            "--rounds", "2", "--concurrency", "1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "log-probs: base confidence given for 100% (12/12) of the rounds collected in this run, " \
           "guide uncertainty for 100% (12/12)" in printed.out, printed.out
    assert "returned no log-probs" not in printed.out + printed.err
    lines = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    first = [q["rounds"][0] for q in lines]  # round 1: temperature 0 on both
    assert {r["base"]["answer"] for r in first} == {"Paris"}
    assert all(r["base"]["confidence"] == pytest.approx(0.45, abs=2e-3) for r in first)
    assert all(r["guide"]["verdict"] is True and r["guide"]["uncertainty"] == pytest.approx(0.30, abs=2e-3)
               for r in first)

    # a model the server does not list: refused before any call
    assert main([*args[:args.index("--base") + 1], f"{servers['base']},gpt-4o",
                 *args[args.index("--base") + 2:-1], str(tmp_path / "wrong.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the base endpoint {servers['base']}/chat/completions does not serve the model "
                          "'gpt-4o'; it lists: 'bigram-base'"), err


def test_collect_a_ladder_against_two_real_servers(servers, tmp_path, monkeypatch):
    """``--base`` once per round: round 1's base call goes to the base server, round 2's to the other one
    (its loaded model names itself in every reply), each priced at its rung's prices."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    out = tmp_path / "ladder.jsonl"
    q = _questions(tmp_path / "questions.jsonl", 4)
    args = ["data", "collect", "--round-protocol", "paper", "--questions", str(q), "--rounds", "2",
            "--base", f"{servers['base']},bigram-base", "--base-price", "1,2",
            "--base", f"{servers['guide']},bigram-guide", "--base-price", "10,20",
            "--guide", f"{servers['guide']},bigram-guide", "--guide-price", "0,0",
            "--concurrency", "1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    calls = [json.loads(x) for x in Path(str(out) + ".calls").read_text().splitlines()]
    base = [c for c in calls if c.get("call") in ("r0.base", "r1.base") and "text" in c]
    assert {c["call"] for c in base} == {"r0.base", "r1.base"}
    for c in base:
        want, (p_in, p_out) = (("bigram-base", (1, 2)) if c["call"] == "r0.base" else ("bigram-guide", (10, 20)))
        assert c["model"] == want and want in str(c["served_model"])
        assert c["cost_usd"] == pytest.approx((c["tokens_in"] * p_in + c["tokens_out"] * p_out) / 1e6)
    man = json.loads(out.read_text().splitlines()[0])["manifest"]
    assert [m["name"] for m in man["models"]["base"]] == ["bigram-base", "bigram-guide"]


def test_collect_a_guide_less_cascade_against_two_real_servers(servers, tmp_path, monkeypatch, capsys):
    """``--guide none`` on the same two-rung ladder: two calls per question, one per server, each asked
    the question alone at temperature 0 (round 1's answer Paris at the designed confidence 0.45; the
    second rung, the guide's model, says "Yes": no answer line), no guide call, ``models.guide: null``,
    and ``data check`` reads it."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796083200")
    out = tmp_path / "cascade.jsonl"
    q = _questions(tmp_path / "questions.jsonl", 4)
    assert main(["data", "collect", "--round-protocol", "paper", "--questions", str(q), "--rounds", "2", "--guide", "none",
                 "--base", f"{servers['base']},bigram-base", "--base-price", "1,2",
                 "--base", f"{servers['guide']},bigram-guide", "--base-price", "10,20",
                 "--concurrency", "1", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    calls = [json.loads(x) for x in Path(str(out) + ".calls").read_text().splitlines()]
    assert sorted(c["call"] for c in calls) == ["r0.base"] * 4 + ["r1.base"] * 4
    for c in calls:
        want, (p_in, p_out) = (("bigram-base", (1, 2)) if c["call"] == "r0.base" else ("bigram-guide", (10, 20)))
        assert c["model"] == want and want in str(c["served_model"])
        assert c["cost_usd"] == pytest.approx((c["tokens_in"] * p_in + c["tokens_out"] * p_out) / 1e6)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["manifest"]["models"]["guide"] is None
    for rec in lines[1:]:
        r0, r1 = (rd["base"] for rd in rec["rounds"])
        assert [list(rd) for rd in rec["rounds"]] == [["base"], ["base"]]
        assert r0["answer"] == "Paris" and r0["confidence"] == pytest.approx(0.45, abs=2e-3)
        assert r1["answer"] == "" and r1["answer_parsed"] is False
    assert main(["data", "check", str(out)]) == 0
    assert "guide model: none (a cascade" in capsys.readouterr().out
