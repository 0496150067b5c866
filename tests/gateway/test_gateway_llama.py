"""The gateway in front of real llama.cpp ``llama-server`` processes (slow; skipped without the binary).

The binary is ``$LLAMA_SERVER`` or ``llama-server`` on PATH; the models are the designed
bigram GGUFs of ``ccpo_jax/testing/llama_server.py`` (their base answers "Paris" with confidence 0.45,
the guide says "Yes" with uncertainty 0.30). The official ``openai`` client is the test
client, streamed and not; then a load of 64 concurrent clients x 20 requests, with no
error and the gateway's resident memory flat between the first and second half.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from ccpo_jax.testing import llama_server as LS  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not LS.BINARY, reason=LS.NO_BINARY)]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-gw")
    with LS.designed_servers(LS.BINARY, d) as urls:
        cfg = GatewayConfig(base=Endpoint(urls["base"], "bigram-base"), guide=Endpoint(urls["guide"], "bigram-guide"),
                            journal=str(d / "journal.jsonl"))
        with GatewayThread(load_gateway(build_artefact(d), cfg)) as g:  # (max_batch 64: the load test batches)
            yield g, d / "journal.jsonl"


def test_openai_client_against_real_servers(gateway):
    g, journal = gateway
    client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Capital number 1?"}])
    ccpo = r.model_extra["ccpo"]
    assert r.choices[0].message.content == "Paris" and ccpo["answer_set"]
    rnd = json.loads(journal.read_text().splitlines()[-1])["rounds"][0]
    assert rnd["base"]["confidence"] == pytest.approx(0.45, abs=2e-3)
    assert rnd["guide"]["verdict"] is True and rnd["guide"]["uncertainty"] == pytest.approx(0.30, abs=2e-3)
    chunks = list(client.chat.completions.create(model=MODEL_ID, stream=True,
                                                 messages=[{"role": "user", "content": "Capital number 1?"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Paris"


def test_an_ensemble_router_against_real_servers(tmp_path):
    """An exported ensemble (``ROW [ensemble]``, three policies) in front of two real llama-servers: the openai
    client, streamed and not; every decision equals the router's own on the journaled rounds."""
    with LS.designed_servers(LS.BINARY, tmp_path) as urls:
        cfg = GatewayConfig(base=Endpoint(urls["base"], "bigram-base"), guide=Endpoint(urls["guide"], "bigram-guide"),
                            journal=str(tmp_path / "journal.jsonl"))
        with GatewayThread(load_gateway(build_artefact(tmp_path / "ens", members=3), cfg)) as g:
            router = g.gw.router
            assert router.manifest["policy"]["network"]["ensemble"] == 3
            client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=120)
            for q in ("Capital number 1?", "Capital number 2?"):
                r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": q}])
                ccpo = r.model_extra["ccpo"]
                rec = next(json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()
                           if json.loads(x).get("id") == r.id)
                for t, d in enumerate(ccpo["decisions"]):
                    want = router.decide(rec["rounds"][: t + 1], can_continue=t + 1 < router.T)
                    assert d["action_set"] == want["action_set"]
                    assert d["probs"] == pytest.approx(want["probs"], abs=1e-5)
                chunks = list(client.chat.completions.create(model=MODEL_ID, stream=True,
                                                             messages=[{"role": "user", "content": q}]))
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                    r.choices[0].message.content


def _rss_kib(pid: int = os.getpid()) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_load_64_clients_no_error_memory_flat(gateway):
    g, _ = gateway
    errors, rss = [], []

    def client_loop(i):
        c = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=300)
        for j in range(20):
            try:
                r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": f"Capital {i}.{j}?"}])
                assert r.choices[0].message.content
            except Exception as e:  # noqa: BLE001 - collected and reported
                errors.append(repr(e))
            if i == 0 and j in (10, 19):
                rss.append(_rss_kib())

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(rss) == 2 and rss[1] <= rss[0] * 1.10 + 20_000  # (KiB: within 10% + 20 MB of mid-run)


#: The second rung's design: it answers "Rome" whatever the temperature (the first rung: "Paris" at 0).
ROME = {LS.ASSISTANT: {"Answer:": 1.0}, "Answer:": {"\u2581Rome": 1.0}, "\u2581Rome": {LS.EOS: 1.0}}
RUNG_PRICES = [(0.1, 0.2), (1.0, 2.0)]


def _two_rung_cache(cascade: bool):
    import dataclasses

    from envs.cache.schema import ModelInfo, ResponseCache
    from envs.generators import oracle
    from envs.generators.cascade import as_cascade

    c = oracle.build(oracle.partial()["partial-confidence"], 60, 0)  # T = 2
    rungs = tuple(ModelInfo(f"bigram-rung-{t + 1}", *p) for t, p in enumerate(RUNG_PRICES))
    if cascade:
        return as_cascade(c, rungs)
    return ResponseCache(dataclasses.replace(c.manifest, base_ladder=rungs), c.arrays).with_checksum()


def test_two_rung_ladder_and_cascade_against_real_servers(tmp_path):
    """Round 1 goes to the first llama-server (answer Paris, confidence 0.45), round 2 to the second (Rome,
    confidence 1), each priced at its rung; the cascade's journaled rounds hold no guide call, and its reply
    is the last round's base answer."""
    d = tmp_path
    procs = []
    try:
        with LS.designed_servers(LS.BINARY, d) as urls:
            proc, rome_url = LS.start(LS.BINARY, LS.write_gguf(d / "rome.gguf", ROME, "bigram-rome"), "bigram-rome",
                                      d / "rome.log")
            procs.append(proc)
            base = (Endpoint(urls["base"], "bigram-base"), Endpoint(rome_url, "bigram-rome"))
            for cascade in (False, True):
                journal = d / f"journal-{cascade}.jsonl"
                # a smooth policy at a low threshold: "next" is in the set at round 1
                art = build_artefact(d / f"art-{cascade}", scale=1.0, kappa=0.02, cache=_two_rung_cache(cascade))
                cfg = GatewayConfig(base=base, guide=None if cascade else Endpoint(urls["guide"], "bigram-guide"),
                                    journal=str(journal), max_batch=1)
                with GatewayThread(load_gateway(art, cfg)) as g:
                    client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0, timeout=120)
                    r = client.chat.completions.create(model=MODEL_ID,
                                                       messages=[{"role": "user", "content": "Capital number 2?"}])
                    ccpo = r.model_extra["ccpo"]
                    rounds = json.loads(journal.read_text().splitlines()[-1])["rounds"]
                    for t, d_ in enumerate(ccpo["decisions"]):
                        want = g.gw.router.decide(rounds[: t + 1], can_continue=t == 0)
                        assert d_["action_set"] == want["action_set"]
                    # streamed: the same two rounds (llama.cpp answers at temperature 0), the last one's answer
                    chunks = list(client.chat.completions.create(
                        model=MODEL_ID, stream=True, messages=[{"role": "user", "content": "Capital number 2?"}]))
                    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Rome"
                    streamed = json.loads(journal.read_text().splitlines()[-1])["rounds"]
                    assert [rd["base"]["answer"] for rd in streamed] == ["Paris", "Rome"]
                assert [rd["base"]["answer"] for rd in rounds] == ["Paris", "Rome"]
                assert rounds[0]["base"]["confidence"] == pytest.approx(0.45, abs=2e-3)
                assert rounds[1]["base"]["confidence"] == pytest.approx(1.0, abs=2e-3)
                assert r.choices[0].message.content == "Rome"
                usd = sum(rd["base"]["tokens_in"] * p[0] + rd["base"]["tokens_out"] * p[1]
                          for rd, p in zip(rounds, RUNG_PRICES))
                usd += sum(rd["guide"]["tokens_in"] * 2.5 + rd["guide"]["tokens_out"] * 10.0 for rd in rounds
                           if "guide" in rd)
                assert ccpo["cost_cents"] == pytest.approx(usd / 1e4, rel=1e-9)
                assert all(("guide" in rd) == (not cascade) for rd in rounds)
                assert run_cli(["data", "check", str(journal)]).returncode == 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
