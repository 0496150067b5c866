"""``reproduce --calibration mondrian`` end to end (real trainer, tiny), and the exported Mondrian router."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ccpo_jax.errors import UserError
from tests.helpers import run_cli

GROUPS = {"a": 100, "b": 80, "c": 20}  # c: about 6 of 60 calibration questions -> pooled at --group-min 20


def _grouped_cache(tmp_path):
    from envs.cache.schema import ResponseCache
    from envs.cache.formats import save_cache
    from envs.replay.reference import random_cache

    c = random_cache(200, T=3, seed=11)
    g = np.array([name for name, n in GROUPS.items() for _ in range(n)], dtype=str)
    g = g[np.random.default_rng(0).permutation(len(g))]
    c = ResponseCache(c.manifest, {**c.arrays, "group": g}).with_checksum()
    return save_cache(c, tmp_path / "grouped.jsonl"), g


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ccpo_jax.ccpo.reproduce import reproduce

    tmp = tmp_path_factory.mktemp("mondrian")
    path, groups = _grouped_cache(tmp)
    res = reproduce(cache=str(path), n_splits=3, split_sizes="100,60,40", seeds=2, iterations=4,
                    calibration="mondrian", group_min=20, out_dir=tmp / "run", echo=None, progress=False)
    return res, groups, tmp


def test_every_calibrated_row_has_a_mondrian_twin_and_per_group_coverage(run):
    res, groups, _ = run
    pol = res.results["policies"]
    cal = res.results["calibration"]
    assert cal["kind"] == "mondrian" and cal["n_groups"] == 3 and cal["group_min"] == 20
    for row in ("CPO batch", "CCPO (lambda=0)"):
        twin = row + " [Mondrian]"
        names = list(pol)  # with two seeds the kept-seed and ensemble twins sit between the row and its Mondrian twin
        assert twin in pol and names[names.index(row):names.index(twin) + 1] == [
            row, row + " [kept seed]", row + " [ensemble]", twin]
        for r in (row, twin):
            assert set(pol[r]["groups"]) == set(GROUPS)
            n_test = sum(pol[r]["groups"][g]["n_test"] for g in GROUPS)
            assert n_test == pytest.approx(40)
            # the row's coverage is the test-size-weighted mean of its groups' (per split, then averaged)
            gs = pol[r]["group_summary"]
            means = [pol[r]["groups"][g]["coverage"]["mean"] for g in GROUPS]
            assert gs["min"] == pytest.approx(min(means)) and gs["median"] == pytest.approx(float(np.median(means)))
        assert "mondrian_extra_cost" in pol[twin]
    assert pol["CPO online"].get("groups") is None  # not a calibrated row
    # pooling: the counts of the groups in each calibration split, as described
    assert cal["pooled_groups"]["mean"] >= 1 and cal["own_groups"]["max"] <= 3
    assert "## Group-conditional coverage" in res.table and (res.out_dir / "group_coverage.png").is_file()


def test_the_saved_policy_carries_its_group_thresholds(run):
    """policy.json of seed 0, split 0: a threshold for every group with its own, the pooled ones
    listed, the calibration counts summing to the split's 60."""
    res, groups, _ = run
    meta = json.loads((res.out_dir / "policies" / "ccpo-lambda-0" / "policy.json").read_text())
    m = meta["mondrian"]
    assert m["group_min"] == 20 and set(m["kappas"]) | set(m["rest_groups"]) == set(GROUPS)
    assert "c" in m["rest_groups"] and all(0.0 <= k <= 1.0 for k in m["kappas"].values())
    assert sum(m["n_cal"].values()) == 60


def test_exported_mondrian_router_takes_the_group_from_the_request(run, tmp_path):
    from ccpo_jax.serving import Router, RouterInputError

    res, _, _ = run
    r = run_cli(["export", str(res.out_dir), "--row", "CCPO (lambda=0)", "--calibration", "mondrian",
                 "--out", str(tmp_path / "art")])
    assert r.returncode == 0, r.stderr
    assert "Mondrian:" in r.stdout
    # the default row under --calibration mondrian is one saved with per-group thresholds (never an ensemble)
    from ccpo_jax.ccpo.export import export_router

    said = []
    default = Router.load(export_router(res.out_dir, tmp_path / "default", calibration="mondrian", echo=said.append))
    assert "[ensemble]" not in default.manifest["policy"]["row"] and default.manifest["mondrian"], said
    router = Router.load(tmp_path / "art")
    meta = json.loads((res.out_dir / "policies" / "ccpo-lambda-0" / "policy.json").read_text())["mondrian"]
    line = json.loads((res.out_dir.parent / "grouped.jsonl").read_text().splitlines()[1])
    rounds = line["rounds"][:1]
    own = next(iter(meta["kappas"]))
    d_own = router.decide(rounds, group=own)
    d_none = router.decide(rounds)
    d_unknown = router.decide(rounds, group="astronomy")
    assert d_own["kappa"] == pytest.approx(meta["kappas"][own]) and d_own["kappa_source"] == f"group {own!r}"
    assert d_none["kappa"] == pytest.approx(meta["rest_kappa"]) and d_none["kappa_source"].startswith("pooled")
    assert d_unknown["kappa"] == pytest.approx(meta["rest_kappa"]) and "astronomy" in d_unknown["kappa_source"]
    for d in (d_own, d_none, d_unknown):  # the set is {a available : pi(a|o) >= the request's kappa}
        assert d["action_set"] == [a for a in router.actions if a in d["available"]
                                   and np.float32(d["probs"][a]) >= np.float32(d["kappa"])]
    with pytest.raises(RouterInputError, match=r"request\.group: expected a string"):
        router.decide(rounds, group=3)
    # route: the group from each line; an unknown one is stated
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"id": 1, "rounds": rounds, "group": own}) + "\n" + json.dumps({"id": 2, "rounds": rounds}) + "\n")
    out = run_cli(["route", str(tmp_path / "art"), "--input", str(req)])
    got = [json.loads(x) for x in out.stdout.splitlines()]
    assert [g["kappa_source"] for g in got] == [f"group {own!r}", "pooled: the request gives no group"]
    req.write_text(json.dumps({"rounds": rounds, "group": ["x"]}) + "\n")
    bad = run_cli(["route", str(tmp_path / "art"), "--input", str(req)])
    assert bad.returncode == 2 and f"{req}:1.group: expected a string" in bad.stderr
    # a marginal export of the same row ignores groups
    assert run_cli(["export", str(res.out_dir), "--row", "CCPO (lambda=0)", "--out", str(tmp_path / "m")]).returncode == 0
    marg = Router.load(tmp_path / "m").decide(rounds, group=own)
    assert marg["kappa"] == pytest.approx(meta_kappa(res)) and "kappa_source" not in marg


def meta_kappa(res):
    return json.loads((res.out_dir / "policies" / "ccpo-lambda-0" / "policy.json").read_text())["kappa"]


def test_mondrian_needs_groups_in_the_cache(tmp_path):
    from ccpo_jax.ccpo.reproduce import reproduce

    with pytest.raises(UserError, match="calibration: mondrian needs a question group") as e:
        reproduce(calibration="mondrian", n_splits=1, out_dir=tmp_path / "x", echo=None, train=False)
    assert e.value.field == "calibration" and not (tmp_path / "x").exists()
    r = run_cli(["reproduce", "--calibration", "mondrian", "--splits", "1", "--out", str(tmp_path / "y")])
    assert r.returncode == 2 and r.stderr.startswith("error: --calibration: mondrian needs a question group")
    assert not (tmp_path / "y").exists()
    bad = run_cli(["reproduce", "--calibration", "mondrian", "--group-min", "0", "--out", str(tmp_path / "z")])
    assert bad.returncode == 2 and "--group-min" in bad.stderr


def test_export_mondrian_from_a_marginal_run_is_refused(run, tmp_path):
    """A policy saved without per-group thresholds (a marginal run's): refused naming the flag."""
    import shutil

    res, _, _ = run
    run_dir = tmp_path / "marg"
    shutil.copytree(res.out_dir / "policies", run_dir / "policies")
    meta_path = run_dir / "policies" / "ccpo-lambda-0" / "policy.json"
    meta = json.loads(meta_path.read_text())
    del meta["mondrian"]
    meta_path.write_text(json.dumps(meta))
    r = run_cli(["export", str(run_dir), "--row", "CCPO (lambda=0)", "--calibration", "mondrian",
                 "--out", str(tmp_path / "art")])
    assert r.returncode == 2 and "error: --calibration:" in r.stderr and "has no per-group thresholds" in r.stderr
    assert not (tmp_path / "art").exists()


def test_served_mondrian_router_says_which_threshold(run, tmp_path):
    import urllib.error
    import urllib.request

    from ccpo_jax.serving import Router
    from ccpo_jax.serving.app import start_in_thread

    res, _, _ = run
    assert run_cli(["export", str(res.out_dir), "--row", "CPO batch", "--calibration", "mondrian",
                    "--out", str(tmp_path / "art")]).returncode == 0
    router = Router.load(tmp_path / "art")
    rounds = json.loads((res.out_dir.parent / "grouped.jsonl").read_text().splitlines()[1])["rounds"][:1]
    srv, thread = start_in_thread(router, "127.0.0.1", 0, max_batch=8)
    try:
        def post(body):
            req = urllib.request.Request(srv.url + "/v1/route", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        status, got = post({"batch": [{"rounds": rounds, "group": "a"}, {"rounds": rounds}, {"rounds": rounds,
                                                                                              "group": "zz"}]})
        assert status == 200
        want = [router.kappa_for(g)[1] for g in ("a", None, "zz")]
        assert [d["kappa_source"] for d in got["decisions"]] == want
        status, err = post({"rounds": rounds, "group": 7})
        assert status == 422 and err["error"]["message"] == "request.group: expected a string (the question's group), got number"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
    assert router.describe()["calibration"]["kind"] == "mondrian"


def test_gateway_routes_with_the_exported_mondrian_thresholds(run, tmp_path):
    """The gateway in front of the scripted upstream with this run's exported Mondrian router: each
    request's `group` picks its threshold (own, or pooled), every decision equals Router.decide on
    the journaled rounds with that group, and the journal (one group per line) passes data check."""
    openai = pytest.importorskip("openai")
    from ccpo_jax.testing.chat_server import BASE_MODEL, GUIDE_MODEL, FakeChatServer, make_scripts
    from ccpo_jax.testing.gateway_harness import GatewayThread

    from ccpo_jax.gateway.service import MODEL_ID, GatewayConfig, load_gateway
    from ccpo_jax.llm.wire import Endpoint, RetryPolicy

    res, _, _ = run
    assert run_cli(["export", str(res.out_dir), "--row", "CPO batch", "--calibration", "mondrian",
                    "--out", str(tmp_path / "art")]).returncode == 0
    scripts = make_scripts(4)
    journal = tmp_path / "journal.jsonl"
    fast = RetryPolicy(retries=1, backoff_s=0.01, max_backoff_s=0.02, timeout_s=2.0, attempt_timeout_s=5.0)
    with FakeChatServer(scripts) as up:
        cfg = GatewayConfig(base=Endpoint(up.url, BASE_MODEL), guide=Endpoint(up.url, GUIDE_MODEL), retry=fast,
                            journal=str(journal), max_batch=2)
        with GatewayThread(load_gateway(tmp_path / "art", cfg)) as g:
            router = g.gw.router
            client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
            groups = ("a", "c", None, "zz")
            replies = [client.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": q}],
                extra_body=None if grp is None else {"group": grp}) for q, grp in zip(scripts, groups)]
    lines = {x["id"]: x for x in map(json.loads, journal.read_text().splitlines()[1:])}
    sources = set()
    for r, grp in zip(replies, groups):
        rec, ccpo = lines[r.id], r.model_extra["ccpo"]
        assert rec["group"] == (grp if grp is not None else "(none)")
        for t, d in enumerate(ccpo["decisions"]):
            want = router.decide(rec["rounds"][: t + 1], can_continue=t + 1 < router.T, group=grp)
            assert d["action_set"] == want["action_set"]
            assert (d["kappa"], d["kappa_source"], d["group"]) == (want["kappa"], want["kappa_source"], grp)
            assert d["kappa"] == pytest.approx(float(router.kappa_for(grp)[0]))
            sources.add(d["kappa_source"])
    assert "group 'a'" in sources and "pooled: the request gives no group" in sources
    assert router.group_kappas["a"] != router.rest_kappa  # the group changes the threshold here
    assert run_cli(["data", "check", str(journal)]).returncode == 0
