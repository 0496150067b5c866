"""Helpers of the gateway's tests and benchmark: a small exported router, the gateway on a free port.

The router is a random policy over a SYNTHETIC cache (as tests/serving/test_serving.py builds one):
its decisions vary with the features, which is what the protocol tests need; it is not a
trained router.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types
from pathlib import Path

import numpy as np


def build_artefact(root: Path, scale: float = 300.0, seed: int = 5, kappa: float = 0.3, cache=None,
                   members: int = 1) -> Path:
    """An exported router (T = 3) of a random policy: ``scale`` sharpens its probabilities. ``cache``:
    the cache it is exported with (its models: a ladder, a guide-less cascade); default SYNTHETIC.
    ``members`` > 1: the ensemble row of that many random policies (seeds ``seed``, ``seed + 1``, ...)."""
    import jax
    import jax.numpy as jnp

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.env import make_env_params
    from envs.generators.synthetic import generate

    cache = generate("hotpotqa-llama2", 60, 3) if cache is None else cache
    F = make_env_params(cache).F
    def sharpened(key):
        p = policy_net().init(key, jnp.zeros((F,), jnp.float32))
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x * scale if "Dense_3" in jax.tree_util.keystr(path) else x, p)

    ps = [sharpened(jax.random.PRNGKey(seed + m)) for m in range(members)]
    stack = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a])[None, None], *ps)  # [1, 1, members, ...]
    state = types.SimpleNamespace(policy=stack, kappa=np.full((1, 1, members), kappa, np.float32))
    kappas = {"CCPO (lambda=0)": np.full((members, 1), kappa, np.float32)}
    if members > 1:
        kappas["CCPO (lambda=0) [ensemble]"] = np.array([[kappa]], np.float32)
    save_policies(root / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  kappas, cache, "recalibrate", ensembles=members > 1)
    return export_router(root / "run", root / "art", row="CCPO (lambda=0) [ensemble]" if members > 1 else None)


class GatewayThread:
    """A gateway app served by uvicorn in a daemon thread on 127.0.0.1 (a free port)."""

    def __init__(self, gw):
        import uvicorn

        from ccpo_jax.gateway.app import build_app
        from ccpo_jax.serving.server import uvicorn_config

        self.gw = gw
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # the gateway's own server configuration (its bounds on every client: ccpo_jax.serving.server)
        self.server = uvicorn.Server(uvicorn_config(build_app(gw), gw.cfg.server, lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 20 or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def post(url: str, path: str, body, timeout: float = 30.0) -> tuple[int, dict]:
    """POST JSON (or raw bytes) with httpx: (status, parsed body)."""
    import httpx

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url.rstrip("/") + path, content=data, headers={"Content-Type": "application/json"},
                   timeout=timeout)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"raw": r.text}
