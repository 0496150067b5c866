"""Helpers of the gateway's tests and benchmark: a small exported router, the gateway on a free port.

The router is a random policy over a SYNTHETIC cache (as tests/test_serving.py builds one):
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


def build_artefact(root: Path, scale: float = 300.0, seed: int = 5, kappa: float = 0.3, cache=None) -> Path:
    """An exported router (T = 3) of a random policy: ``scale`` sharpens its probabilities. ``cache``:
    the cache it is exported with (its models: a ladder, a guide-less cascade); default SYNTHETIC."""
    import jax
    import jax.numpy as jnp

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.export import export_router
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.env import make_env_params
    from envs.generators.synthetic import generate

    cache = generate("hotpotqa-llama2", 60, 3) if cache is None else cache
    p = policy_net().init(jax.random.PRNGKey(seed), jnp.zeros((make_env_params(cache).F,), jnp.float32))
    p = jax.tree_util.tree_map_with_path(
        lambda path, x: x * scale if "Dense_3" in jax.tree_util.keystr(path) else x, p)
    stack = jax.tree.map(lambda a: np.asarray(a)[None, None, None], p)
    state = types.SimpleNamespace(policy=stack, kappa=np.array([[[kappa]]], np.float32))
    save_policies(root / "run" / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[kappa]], np.float32)}, cache, "recalibrate")
    return export_router(root / "run", root / "art")


class GatewayThread:
    """A gateway app served by uvicorn in a daemon thread on 127.0.0.1 (a free port)."""

    def __init__(self, gw):
        import uvicorn

        from ccpo_jax.gateway.routes import build_app

        self.gw = gw
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(build_app(gw), log_level="warning", lifespan="on",
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
