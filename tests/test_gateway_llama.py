"""The gateway in front of real llama.cpp ``llama-server`` processes (slow; skipped without the binary).

The binary is ``$LLAMA_SERVER`` or ``llama-server`` on PATH; the models are the designed
bigram GGUFs of ``tests/llama_server.py`` (their base answers "Paris" with confidence 0.45,
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

import llama_server as LS  # noqa: E402
from gateway_harness import GatewayThread, build_artefact  # noqa: E402

from ccpo_jax.collect.client import Endpoint  # noqa: E402
from ccpo_jax.gateway.app import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402

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
