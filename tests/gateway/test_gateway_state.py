"""Replicas sharing one state through a real Redis (docs/gateway.md, "Replicas"): the contract tests.

Two gateways (replicas) in this process, each with its own store connection and spool, on one
``redis-server`` started by the test (ccpo_jax/testing/redis_server.py). Oracles: HTTP statuses counted by hand,
Eq. 9 written out in NumPy over the outcome order Redis recorded, the embedded CoverageState on the
same sequence, the cache reader (``data check``), the bytes of two pulls.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts  # noqa: E402
from ccpo_jax.testing.gateway_harness import GatewayThread, build_artefact, post  # noqa: E402
from ccpo_jax.testing.redis_server import RedisServer  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

from ccpo_jax.errors import UserError  # noqa: E402
from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway  # noqa: E402
from ccpo_jax.llm.wire import Endpoint, RetryPolicy  # noqa: E402

FAST = RetryPolicy(retries=1, backoff_s=0.01, max_backoff_s=0.02, max_retry_after_s=5.0, timeout_s=2.0,
                   attempt_timeout_s=4.0)
SCRIPTS = make_scripts(40)
QS = list(SCRIPTS)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return build_artefact(tmp_path_factory.mktemp("gws"))


@pytest.fixture(scope="module")
def up():
    with FakeChatServer(SCRIPTS) as s:
        yield s


@pytest.fixture
def redis(tmp_path):
    with RedisServer(tmp_path / "redis", persist=True) as r:
        yield r


def _replica(art, up, url, spool, **kw):
    kw.setdefault("max_batch", 4)
    kw.setdefault("state_timeout_s", 0.3)
    cfg = GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=FAST,
                        state=url, spool=str(spool), **kw)
    return GatewayThread(load_gateway(art, cfg))


def _ask(g, q: str) -> tuple[int, dict]:
    return post(g.url, "/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": q}]})


def _metric(g, name: str) -> float:
    text = httpx.get(g.url.replace("/v1", "/metrics")).text
    vals = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{") or
            ln.startswith(name + " ")]
    assert vals, name
    return vals[0]


def test_two_replicas_are_one_gateway_and_data_pull_is_a_cache(art, up, redis, tmp_path):
    with _replica(art, up, redis.url, tmp_path / "spool", online_eta=1.0) as a, \
            _replica(art, up, redis.url, tmp_path / "spool", online_eta=1.0) as b:
        ids = []
        for i, q in enumerate(QS[:6]):
            st, r = _ask(a if i % 2 == 0 else b, q)
            assert st == 200 and r["ccpo"]["state"]["journal"] == "store"
            assert r["ccpo"]["decisions"][0]["kappa_version"] == r["ccpo"]["state"]["kappa_version"]
            ids.append(r["id"])
        assert len(set(ids)) == 6
        # a completion answered by A takes its feedback at B, once
        st, fb = post(b.url, "/feedback", {"id": ids[0], "gold": SCRIPTS[QS[0]].gold})
        assert st == 200 and fb["recorded"] and fb["state"]["kappa_version"] == 1
        st, again = post(a.url, "/feedback", {"id": ids[0], "gold": SCRIPTS[QS[0]].gold})
        assert st == 409 and "already recorded" in again["error"]["message"]
        st, fb = post(a.url, "/feedback", {"id": ids[1], "gold": "not the answer"})
        assert st == 200 and fb["state"]["kappa_version"] == 2 and fb["covered"] is False
        st, _ = post(b.url, "/feedback", {"id": "chatcmpl-none", "gold": "x"})
        assert st == 404
        # the next reply of either replica decides with the latest version (2 outcomes)
        st, r = _ask(a, QS[7])
        assert r["ccpo"]["decisions"][0]["kappa_version"] == 2 and r["ccpo"]["decisions"][0]["kappa"] == fb["kappa"]
        assert _metric(b, "ccpo_gateway_kappa_version") == 2
        assert 'replica="127.0.0.1' not in httpx.get(b.url.replace("/v1", "/metrics")).text  # (port 0: host:pid)
    one, two = tmp_path / "pull1.jsonl", tmp_path / "pull2.jsonl"
    for out in (one, two):
        res = run_cli(["data", "pull", redis.url, "--out", str(out)])
        assert res.returncode == 0, res.stderr
    assert one.read_bytes() == two.read_bytes()
    lines = [json.loads(x) for x in one.read_text().splitlines()]
    man = lines[0]["manifest"]
    assert man["provenance"]["journal"]["router_manifest_sha256"] == a.gw.router.manifest["manifest_sha256"]
    assert [x["id"] for x in lines[1:]] == ids + [r["id"]]
    assert lines[1]["gold"] == SCRIPTS[QS[0]].gold and "gold" not in lines[3]
    res = run_cli(["data", "check", str(one)])
    assert res.returncode == 0 and "await feedback" in res.stdout, res.stdout + res.stderr


def test_feedback_race_across_two_replicas_is_one_200(art, up, redis, tmp_path):
    # (a 2 s deadline: 64 feedbacks at once on two replicas of one process share its GIL; a store call
    # past the deadline would be a 503, a correct answer, but not the race under test)
    with _replica(art, up, redis.url, tmp_path / "spool", state_timeout_s=2.0) as a, \
            _replica(art, up, redis.url, tmp_path / "spool", state_timeout_s=2.0) as b:
        st, r = _ask(a, QS[0])
        body = {"id": r["id"], "gold": SCRIPTS[QS[0]].gold}

        async def race():
            async with httpx.AsyncClient(timeout=30) as c:
                rs = await asyncio.gather(*(c.post((a if i % 2 else b).url + "/feedback", json=body)
                                            for i in range(64)))
            return [x.status_code for x in rs]

        codes = asyncio.run(race())
        assert sorted(codes) == [200] + [409] * 63
        import redis as redis_py

        outs = redis_py.Redis.from_url(redis.url).lrange("ccpo:outcomes", 0, -1)
        assert len(outs) == 1


def _eq9(kappa0: float, errs: list[int], alpha: float, eta0: float) -> float:
    """Eq. 9 written out (float32 like the trainer): kappa <- clip(kappa + eta0 k^-0.6 (alpha - err), 0, 1)."""
    k = np.float32(kappa0)
    for i, e in enumerate(errs, start=1):
        eta = np.float32(eta0) * np.float32(i) ** np.float32(-0.6)
        k = np.clip(k + eta * (np.float32(alpha) - np.float32(e)), np.float32(0), np.float32(1))
    return float(k)


def test_online_kappa_is_eq9_over_the_pooled_outcomes(art, up, redis, tmp_path):
    from ccpo_jax.gateway.online import CoverageState

    with _replica(art, up, redis.url, tmp_path / "spool", online_eta=0.5) as a, \
            _replica(art, up, redis.url, tmp_path / "spool", online_eta=0.5) as b:
        got = []
        for i, q in enumerate(QS[:12]):
            st, r = _ask(a if i % 3 else b, q)
            gold = SCRIPTS[q].gold if i % 4 else "nobody said this"
            st, fb = post((b if i % 2 else a).url, "/feedback", {"id": r["id"], "gold": gold})
            assert st == 200
            got.append(fb)
        import redis as redis_py

        order = [int(x.split(b" ")[0]) for x in redis_py.Redis.from_url(redis.url).lrange("ccpo:outcomes", 0, -1)]
        assert len(order) == 12
        alpha, k0 = float(a.gw.router.alpha), float(a.gw.router.kappa)
        want = _eq9(k0, [1 - c for c in order], alpha, 0.5)
        emb = CoverageState(alpha, k0, 0.5, 200, 0.01)
        for c in order:
            emb.record(bool(c))
        assert got[-1]["kappa"] == emb.kappa  # the embedded gateway's value, bit for bit
        assert got[-1]["kappa"] == pytest.approx(want, abs=1e-6)
        assert got[-1]["state"]["kappa_version"] == 12
        assert got[-1]["rolling_coverage"] == pytest.approx(sum(order) / 12)
        st, r = _ask(a, QS[20])  # every replica decides with the latest version
        assert r["ccpo"]["decisions"][0]["kappa"] == pytest.approx(want, abs=1e-6)
        assert r["ccpo"]["decisions"][0]["kappa_version"] == 12


def test_a_replica_of_another_artefact_or_settings_is_refused(art, up, redis, tmp_path):
    other = build_artefact(tmp_path / "other", seed=9)
    with _replica(art, up, redis.url, tmp_path / "spool"):
        with pytest.raises(UserError, match="router_manifest_sha256"):
            _replica(other, up, redis.url, tmp_path / "spool")
        with pytest.raises(UserError, match="online_kappa: None .* vs 1.0"):
            _replica(art, up, redis.url, tmp_path / "spool", online_eta=1.0)


def test_workers_need_state_and_state_needs_no_journal(art, tmp_path):
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,a", "--guide", "http://127.0.0.1:9/v1,b",
                   "--workers", "2"])
    assert res.returncode == 2 and "--workers 2: needs --state" in res.stderr
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,a", "--guide", "http://127.0.0.1:9/v1,b",
                   "--state", "redis://127.0.0.1/0"])
    assert res.returncode == 2 and "--state: expected redis://HOST:PORT/DB" in res.stderr
    res = run_cli(["gateway", str(art), "--base", "http://127.0.0.1:9/v1,a", "--guide", "http://127.0.0.1:9/v1,b",
                   "--state", "redis://127.0.0.1:1/0", "--spool", str(tmp_path / "spool")])
    assert res.returncode == 2 and "--state redis://127.0.0.1:1/0: cannot use the store" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1


def test_store_down_completions_go_on_feedback_503_then_spool_flushes(art, up, redis, tmp_path):
    with _replica(art, up, redis.url, tmp_path / "spool", online_eta=1.0) as a:
        st, r0 = _ask(a, QS[0])
        redis.stop()
        t0 = time.monotonic()
        st, r = _ask(a, QS[1])
        assert st == 200 and time.monotonic() - t0 < 5
        assert r["ccpo"]["state"]["journal"] == "spooled" and r["ccpo"]["decisions"][0]["kappa_stale"] is True
        assert _metric(a, "ccpo_gateway_stale_decisions_total") >= 1 and _metric(a, "ccpo_gateway_state_up") == 0
        assert _metric(a, "ccpo_gateway_journal_spooled") == 1
        resp = httpx.post(a.url + "/feedback", json={"id": r0["id"], "gold": SCRIPTS[QS[0]].gold})
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "state_unavailable"
        redis.start()  # (append-only file: the data is back)
        t0 = time.monotonic()
        while _metric(a, "ccpo_gateway_journal_spooled") and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        assert _metric(a, "ccpo_gateway_journal_spooled") == 0
        for cid, q in ((r0["id"], QS[0]), (r["id"], QS[1])):  # nothing half-recorded, the spooled one is there
            st, _ = post(a.url, "/feedback", {"id": cid, "gold": SCRIPTS[q].gold})
            assert st == 200


def test_store_slow_never_hangs_a_request(art, up, redis, tmp_path):
    with _replica(art, up, redis.url, tmp_path / "spool", online_eta=1.0) as a:
        st, r0 = _ask(a, QS[0])
        redis.pause()  # SIGSTOP: connections accepted, nothing answered
        try:
            t0 = time.monotonic()
            st, r = _ask(a, QS[1])
            took = time.monotonic() - t0
            assert st == 200 and took < 3, took
            assert r["ccpo"]["state"]["kappa_stale"] is True
            t0 = time.monotonic()
            resp = httpx.post(a.url + "/feedback", json={"id": r0["id"], "gold": "x"}, timeout=10)
            assert resp.status_code == 503 and time.monotonic() - t0 < 3
        finally:
            redis.resume()
        st, _ = post(a.url, "/feedback", {"id": r0["id"], "gold": SCRIPTS[QS[0]].gold})
        assert st == 200


def test_store_restarted_empty_is_detected(art, up, tmp_path):
    spool = tmp_path / "spool"
    with RedisServer(tmp_path / "redis", persist=False) as redis:
        with _replica(art, up, redis.url, spool) as a:
            st, r0 = _ask(a, QS[0])
            redis.kill()
            redis.start()  # the same port, empty
            resp = httpx.post(a.url + "/feedback", json={"id": r0["id"], "gold": "x"})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "state_lost"
            assert _metric(a, "ccpo_gateway_state_lost") == 1
            st, r1 = _ask(a, QS[1])  # completions go on; the record waits in the spool
            assert st == 200 and r1["ccpo"]["state"]["journal"] == "spooled"
            import redis as redis_py

            assert redis_py.Redis.from_url(redis.url).exists("ccpo:deployment") == 0  # not re-created silently
        with pytest.raises(UserError, match="Redis restarted empty"):
            _replica(art, up, redis.url, spool)
        with _replica(art, up, redis.url, spool, new_deployment=True) as b:
            t0 = time.monotonic()
            while b.gw.state.spool.records and time.monotonic() - t0 < 10:
                time.sleep(0.2)
            st, _ = post(b.url, "/feedback", {"id": r1["id"], "gold": SCRIPTS[QS[1]].gold})
            assert st == 200


def test_data_pull_errors_are_one_line(redis, tmp_path):
    res = run_cli(["data", "pull", redis.url, "--out", str(tmp_path / "j.jsonl")])
    assert res.returncode == 2 and "holds no gateway deployment" in res.stderr and not (tmp_path / "j.jsonl").exists()
    res = run_cli(["data", "pull", redis.url, "--out", str(tmp_path / "j.txt")])
    assert res.returncode == 2 and "ending in .jsonl" in res.stderr
    res = run_cli(["data", "pull", "redis://127.0.0.1:1/0", "--out", str(tmp_path / "j.jsonl")])
    assert res.returncode == 2 and "cannot read redis://127.0.0.1:1/0" in res.stderr, res.stderr


def test_a_spool_of_another_deployment_is_refused_not_sent_into_this_one(up, redis, tmp_path):
    """Two deployments started from one directory share the default spool folder: a request answered by
    deployment A while its store was down, by a replica killed before it sent it, must not be sent into
    deployment B's journal (before: a replica of B adopted it and B's pulled journal held A's request, which
    data check accepted). A replica of another router or another store on that folder is refused, naming the
    folder; a replica of A sends it."""
    art_a = build_artefact(tmp_path / "A", seed=5)
    art_b = build_artefact(tmp_path / "B", seed=9, kappa=0.5)
    db_a, db_b, spool = redis.url, redis.url[:-1] + "1", tmp_path / "spool"
    with _replica(art_a, up, db_a, spool):
        pass
    with _replica(art_b, up, db_b, spool, new_deployment=True) as b:  # (the marker belongs to A: it needs the flag)
        assert _ask(b, QS[1])[0] == 200
    with _replica(art_a, up, db_a, spool) as a:
        redis.stop()
        st, ra = _ask(a, QS[0])
        assert st == 200 and ra["ccpo"]["state"]["journal"] == "spooled"
        a.gw.state._task.cancel()
        a.gw.state.spool.entries = []  # as if killed -9 here: the record stays in its spool file only
    redis.start()
    for art, db, what in ((art_b, db_b, "another router"), (art_a, redis.url[:-1] + "2", "this router, another")):
        with pytest.raises(UserError, match=r"1 journal record\(s\) answered for another deployment") as e:
            _replica(art, up, db, spool, new_deployment=True)
        assert str(spool) in str(e.value) and what in str(e.value)
    pulled = tmp_path / "b.jsonl"
    assert run_cli(["data", "pull", db_b, "--out", str(pulled)]).returncode == 0
    assert ra["id"] not in pulled.read_text()
    with _replica(art_a, up, db_a, spool) as a2:  # A's own replica sends it
        t0 = time.monotonic()
        while a2.gw.state.spool.records and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        assert post(a2.url, "/feedback", {"id": ra["id"], "gold": SCRIPTS[QS[0]].gold})[0] == 200


def test_a_feedback_line_the_reader_would_refuse_is_not_recorded_in_the_store(art, up, redis, tmp_path,
                                                                              monkeypatch):
    """As the embedded journal's (tests/gateway/test_gateway_integrity.py): a feedback line goes through the cache
    reader's check before the store takes it; one it refuses (a labelling bug, simulated) is a 500, nothing
    recorded, and the pulled journal stays readable (before: the store took it and data check refused the
    pulled file)."""
    import ccpo_jax.gateway.journal as J

    real_label = J.label

    def bad_label(*a, **k):
        out = real_label(*a, **k)
        out["rounds"][0]["base"]["tokens_in"] = -1
        return out
    with _replica(art, up, redis.url, tmp_path / "spool") as a:
        st, r = _ask(a, QS[0])
        monkeypatch.setattr(J, "label", bad_label)
        st, err = post(a.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})
        assert st == 500 and err["error"]["code"] == "internal_error", err
        pulled = tmp_path / "p.jsonl"
        assert run_cli(["data", "pull", redis.url, "--out", str(pulled)]).returncode == 0
        res = run_cli(["data", "check", str(pulled)])
        assert res.returncode == 0 and "await feedback" in res.stdout, res.stderr
        monkeypatch.setattr(J, "label", real_label)
        assert post(a.url, "/feedback", {"id": r["id"], "gold": SCRIPTS[QS[0]].gold})[0] == 200
