"""Exported-router throughput: ``Router`` decisions per second and the HTTP endpoint's requests per second.

Measures (compile excluded: one warm-up call per shape first):
  * ``router_action_set_per_s``: decisions/s of ``Router.action_set(obs [B, F], available [B, 3])``
    (input validation + the jax.export module), at B = 1 and B = 1024;
  * ``router_decide_per_s``: decisions/s of ``Router.decide_many`` on raw rounds (parse, featurise
    with envs.replay.features, module), at B = 1 and B = 1024;
  * ``http_requests_per_s``: ``POST /v1/route`` (one decision each) from one local client on one
    keep-alive connection, ``--requests`` requests (default 2,000), server in a thread of the same
    process, on 127.0.0.1.

The artefact is ``--artifact`` or, by default, an export of an UNTRAINED policy (same network,
3 x 64) on a SYNTHETIC cache (hotpotqa-llama2, 200 questions): throughput does not depend on the
weights. Prints a table and writes JSON records {"name","value","unit","backend","device","config"}.

    python benchmarks/router_throughput.py [--artifact DIR | --members N] [--seconds 2] [--requests 2000] [--out FILE]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def make_artifact(root: Path, members: int = 1) -> Path:
    """Export an untrained policy trained-format run dir (SYNTHETIC cache); ``members`` > 1: the ensemble row of
    that many untrained policies (``ROW [ensemble]``: pi the members' mean)."""
    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.features import n_features
    from envs.generators.synthetic import generate

    cache = generate("hotpotqa-llama2", 200, 0)
    ps = [policy_net().init(jax.random.PRNGKey(m), jnp.zeros((n_features(cache.T),), jnp.float32))
          for m in range(members)]
    state = types.SimpleNamespace(policy=jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a])[None, None], *ps),
                                  kappa=np.full((1, 1, members), 0.3, np.float32))  # [V, S, N seeds]
    kappas = {"CCPO (lambda=0)": np.full((members, 1), 0.3, np.float32),
              "CCPO (lambda=0) [ensemble]": np.array([[0.3]], np.float32)}
    save_policies(root / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  kappas, cache, "recalibrate", ensembles=members > 1)
    return export_router(root / "run", root / "art", row="CCPO (lambda=0) [ensemble]" if members > 1 else None)


def rate(fn, n_per_call: int, seconds: float, min_calls: int = 5) -> tuple[float, int]:
    fn()  # warm-up / compile
    calls, t0 = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    dt = time.perf_counter() - t0
    return calls * n_per_call / dt, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=None, help="exported router (default: export an untrained one, SYNTHETIC cache)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per Router measurement (default 2)")
    ap.add_argument("--requests", type=int, default=2000, help="HTTP requests (default 2000)")
    ap.add_argument("--out", default=None, help="JSON records file (default: print only)")
    ap.add_argument("--members", type=int, default=1, help="the default artefact's policies: >1 exports an ensemble "
                    "of that many (the row ROW [ensemble]; default 1)")
    args = ap.parse_args(argv)

    from ccpo_jax.serving import Router
    from ccpo_jax.serving.app import start_in_thread
    from envs.cache.jsonl import cache_to_records
    from envs.generators.synthetic import generate

    with tempfile.TemporaryDirectory() as tmp:
        art = Path(args.artifact) if args.artifact else make_artifact(Path(tmp), args.members)
        router = Router.load(art)
        cache = generate("hotpotqa-llama2", 1024, 1)
        recs = cache_to_records(cache)
        reqs = [{"rounds": r["rounds"][: 1 + i % cache.T]} for i, r in enumerate(recs)]
        obs, avail, _ = router.featurise(reqs)
        backend = jax.default_backend()
        device = str(jax.devices()[0].device_kind)
        synthetic = "SYNTHETIC cache hotpotqa-llama2" + ("" if args.artifact else ", untrained 3x64 policy")
        records = []

        def add(name, value, unit, **config):
            records.append({"name": name, "value": round(float(value), 1), "unit": unit, "backend": backend,
                            "device": device, "config": {**config, "data": synthetic, "cpus": os.cpu_count(),
                                                             "members": args.members if not args.artifact else None}})

        for B in (1, 1024):
            r, calls = rate(lambda: router.action_set(obs[:B], avail[:B]), B, args.seconds)
            add("router_action_set_per_s", r, "decisions/s", batch=B, calls=calls)
            r, calls = rate(lambda: router.decide_many(reqs[:B]), B, args.seconds)
            add("router_decide_per_s", r, "decisions/s", batch=B, calls=calls)

        server, thread = start_in_thread(router, "127.0.0.1", 0)
        try:
            host, port = server.server_address[:2]
            conn = http.client.HTTPConnection(host, port, timeout=30)
            bodies = [json.dumps(reqs[i % len(reqs)]).encode() for i in range(args.requests)]
            hdr = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/route", body=bodies[0], headers=hdr)
            conn.getresponse().read()  # warm-up
            t0 = time.perf_counter()
            for b in bodies:
                conn.request("POST", "/v1/route", body=b, headers=hdr)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise SystemExit(f"HTTP {resp.status}")
            dt = time.perf_counter() - t0
            conn.close()
            add("http_requests_per_s", args.requests / dt, "requests/s", requests=args.requests,
                client="1 keep-alive connection, sequential", decisions_per_request=1)
            add("http_latency_mean_ms", dt / args.requests * 1e3, "ms", requests=args.requests)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    for r in records:
        print(f"{r['name']:26s} {r['value']:>12,.1f} {r['unit']:12s} {json.dumps({k: v for k, v in r['config'].items() if k in ('batch', 'requests')})}")
    print("(data: SYNTHETIC)")
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
