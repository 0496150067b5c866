"""The gateway's state in Redis (``--state redis://HOST:PORT/DB``): any number of replicas, one gateway.

Keys (one deployment per Redis database; docs/gateway.md, "Replicas"):

* ``ccpo:deployment`` (hash): ``epoch`` (random, set once when the deployment is created), ``manifest``
  (the journal's manifest line), ``identity`` (what every replica must share: the artefact's manifest
  hash, row, alpha, kappa, T, models, request settings, online step, window), ``created``;
* ``ccpo:req`` (hash id -> the request's journal line) and ``ccpo:order`` (list of ids): the journal of
  record, one line per id (a second append of the same id and line is a no-op: spool retries);
* ``ccpo:fb`` (hash id -> the id's latest feedback line);
* ``ccpo:outcomes`` (list of ``"1 ID"`` / ``"0 ID"``): every coverage outcome, in the order recorded;
* ``ccpo:kappa`` (hash ``version``, ``kappa``): a checkpoint of Eq. 9 over the first ``version`` outcomes.

Atomicity is Redis's: each write is one Lua script (run atomically by the server), and each checks the
deployment's epoch first, so a store restarted empty (or flushed) is detected, never written into as
if it were this deployment. Feedback's script records the id's line and its outcome together, and only
if the id's line is still the one the replica read (else it reads again): one outcome per id, whatever
the replicas and the concurrency. Online kappa is a pure function of the pooled outcome sequence:
kappa at version n is Eq. 9 (:func:`ccpo_jax.core.conformal.kappa_step`, as the embedded
:class:`~ccpo_jax.gateway.online.CoverageState` steps it) folded over the first n outcomes; any replica
folds the outcomes past the checkpoint and moves the checkpoint forward (compare-and-set on the version).

Faults: every call is bounded by ``timeout_s``, and once a call has failed completions stop
asking the store (the background task probes it every second) until it answers again; feedback
always asks (at most ``timeout_s``). A store that does not answer leaves decisions on the
last good kappa (``kappa_stale`` in the reply), journal records go to the local spool
(:mod:`ccpo_jax.gateway.spool`) and are sent when it answers again, and feedback answers 503 with
Retry-After (its one script either ran whole or not at all).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ccpo_jax.errors import UserError
from ccpo_jax.gateway.journal import FeedbackError, apply_feedback, check_feedback_line, is_labelled, parse_feedback
from ccpo_jax.gateway.online import XI, alarm_test
from ccpo_jax.gateway.spool import Spool
from ccpo_jax.gateway.state import CoverageView, FeedbackResult, GatewayState, StateUnavailable

log = logging.getLogger("ccpo_jax.gateway")

K_DEP, K_REQ, K_ORDER, K_FB, K_OUT, K_KAPPA = (f"ccpo:{k}" for k in ("deployment", "req", "order", "fb", "outcomes",
                                                                    "kappa"))
_EPOCH_OK = "if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return {'EPOCH'} end\n"

LUA_JOIN = """
local e = redis.call('HGET', KEYS[1], 'epoch')
if e then return {'JOINED', e, redis.call('HGET', KEYS[1], 'identity')} end
if ARGV[1] == '0' then return {'EMPTY'} end
redis.call('HSET', KEYS[1], 'epoch', ARGV[2], 'manifest', ARGV[3], 'identity', ARGV[4], 'created', ARGV[6])
redis.call('HSET', KEYS[2], 'version', '0', 'kappa', ARGV[5])
return {'NEW', ARGV[2], ARGV[4]}
"""
LUA_APPEND = _EPOCH_OK + """
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur then if cur == ARGV[3] then return {'DUP'} end return {'CLASH'} end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('RPUSH', KEYS[3], ARGV[2])
return {'OK'}
"""
LUA_GET = _EPOCH_OK + """
return {'OK', redis.call('HGET', KEYS[2], ARGV[2]), redis.call('HGET', KEYS[3], ARGV[2])}
"""
LUA_FEEDBACK = _EPOCH_OK + """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return {'NOREQ'} end
local prev = redis.call('HGET', KEYS[3], ARGV[2]) or ''
if prev ~= ARGV[3] then return {'CHANGED'} end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
local n = redis.call('LLEN', KEYS[4])
if ARGV[5] ~= '' then n = redis.call('RPUSH', KEYS[4], ARGV[5] .. ' ' .. ARGV[2]) end
return {'OK', n}
"""
LUA_READ = _EPOCH_OK + """
local v = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')
local n = redis.call('LLEN', KEYS[3])
return {'OK', tostring(v), redis.call('HGET', KEYS[2], 'kappa'), tostring(n),
        redis.call('LRANGE', KEYS[3], v, -1), redis.call('LRANGE', KEYS[3], -tonumber(ARGV[2]), -1)}
"""
LUA_SETKAPPA = _EPOCH_OK + """
if tonumber(redis.call('HGET', KEYS[2], 'version') or '0') < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[2], 'version', ARGV[2], 'kappa', ARGV[3])
  return {'OK'}
end
return {'OLD'}
"""


def parse_state_url(url: str, flag: str = "--state") -> str:
    """``redis://HOST:PORT/DB`` checked (UserError naming ``flag`` otherwise); returned as given."""
    u = urllib.parse.urlparse(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "redis" or not u.hostname or port is None or not u.path.lstrip("/").isdigit():
        raise UserError(f"{flag}: expected redis://HOST:PORT/DB (e.g. redis://127.0.0.1:6379/0), got {url!r}")
    return url


def fold_kappa(kappa: float, outcomes: list[int], start: int, alpha: float, eta0: float | None) -> float:
    """Eq. 9 over ``outcomes`` (1: covered), the first being step ``start + 1``: the embedded
    CoverageState's steps, value for value (the same kappa_step on the same float32 inputs)."""
    if eta0 is None:
        return kappa
    from ccpo_jax.core.conformal import kappa_step

    for k, c in enumerate(outcomes, start=start + 1):
        kappa = float(kappa_step(np.float32(kappa), float(not c), k, alpha, eta0, XI))
    return kappa


class SharedCoverage:
    """What decisions read (``online``, ``kappa``, ``version``, ``stale``): the deployment's state as of
    this replica's last read of the store."""

    def __init__(self, alpha: float, kappa: float, eta0: float | None, window: int, alarm_p: float):
        self.alpha, self.kappa, self.eta0, self.window, self.alarm_p = alpha, kappa, eta0, window, alarm_p
        self.version = self.seen = 0
        self.rolling: float | None = None
        self.alarm, self.p_value, self.stale = False, 1.0, False

    @property
    def online(self) -> bool:
        return self.eta0 is not None


class _Down(Exception):
    """The store did not answer in time."""


class _Lost(Exception):
    """The store no longer holds this deployment (its epoch is gone)."""


def _client(url: str, timeout_s: float, asyncio_api: bool):
    import redis
    import redis.asyncio
    import redis.asyncio.retry
    import redis.retry
    from redis.backoff import NoBackoff

    mod, retry = (redis.asyncio, redis.asyncio.retry) if asyncio_api else (redis, redis.retry)
    # no client-side retries: the caller's deadline is the timeout, and a timed-out write is spooled
    return mod.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True,
                              retry=retry.Retry(NoBackoff(), 0), health_check_interval=0)


class RedisState(GatewayState):
    """The deployment's state in Redis (module doc). Joined (or created) at construction, synchronously,
    so that a refusal is one error line before anything is served."""

    kind = "redis"

    def __init__(self, url: str, *, manifest: dict, identity: dict, kappa0: float, alpha: float,
                 eta0: float | None, window: int, alarm_p: float, spool: str | os.PathLike,
                 timeout_s: float = 0.5, new_deployment: bool = False, replica: str | None = None):
        self.url, self.timeout_s = parse_state_url(url), timeout_s
        self.public_url = url
        self.coverage = SharedCoverage(alpha, kappa0, eta0, window, alarm_p)
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.up, self.lost = True, False
        self.on_call = lambda op, seconds: None  # the gateway's latency histogram
        self.manifest = manifest  # (a feedback line is checked against it before it is written)
        self.spool = Spool(spool)
        who = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self._check_spool(who, None, new_deployment)  # (another router's records: refused before joining)
        self.epoch, self.created = self._join(manifest, identity, kappa0, new_deployment)
        self._check_spool(who, self.epoch, new_deployment and self.created)
        self._task: asyncio.Task | None = None
        self._r = None

    # ------------------------------------------------------------------ start-up (synchronous)
    def _join(self, manifest: dict, identity: dict, kappa0: float, new_deployment: bool) -> tuple[str, bool]:
        import redis

        identity = json.loads(json.dumps(identity, sort_keys=True))  # (as the store gives it back)
        r = _client(self.url, max(self.timeout_s, 2.0), asyncio_api=False)
        marker = Path(self.spool.folder) / "deployment.json"
        try:
            join = r.register_script(LUA_JOIN)
            res = join(keys=[K_DEP, K_KAPPA], args=["0"])
            created = res[0] == "EMPTY"
            if created:
                if marker.exists() and not new_deployment:
                    old = json.loads(marker.read_text())
                    raise UserError(f"--state {self.url}: the store holds no deployment, but this replica's spool "
                                    f"({self.spool.folder}) belongs to deployment {old.get('epoch')} created "
                                    f"{old.get('created', '?')}: was Redis restarted empty (no persistence)? "
                                    "Restore its data, or pass --new-deployment to begin a new deployment (another deployment started "
                                    "from this directory: give it its own --spool DIR)")
                epoch, now = uuid.uuid4().hex, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                manifest = json.loads(json.dumps(manifest))
                manifest["provenance"]["journal"]["deployment"] = {"store": "redis", "epoch": epoch, "created": now}
                res = join(keys=[K_DEP, K_KAPPA], args=["1", epoch, json.dumps(manifest, ensure_ascii=False),
                                                         json.dumps(identity, sort_keys=True), repr(kappa0), now])
                created = res[0] == "NEW"  # (another replica may have created it first)
            theirs = json.loads(res[2])
            diff = [f"{k}: {theirs.get(k)!r} (the deployment's) vs {identity.get(k)!r} (this replica's)"
                    for k in sorted(set(theirs) | set(identity)) if theirs.get(k) != identity.get(k)]
            if diff:
                raise UserError(f"--state {self.url}: the deployment in this store serves another router or "
                                f"settings; refusing to join it. Differs: {'; '.join(diff)}")
            self._read_sync(r, res[1])
        except (redis.RedisError, OSError) as e:
            raise UserError(f"--state {self.url}: cannot use the store ({type(e).__name__}: {e})") from None
        finally:
            r.close()
        marker.write_text(json.dumps({"epoch": res[1], "store": self.url,
                                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        return res[1], created

    def _check_spool(self, who: str, epoch: str | None, carry: bool) -> None:
        """Refuse to start on a spool holding records answered for another deployment: another router or
        settings (``who``: this replica's identity hash), or, once joined (``epoch``), another deployment;
        they would be sent into this deployment's journal of record. ``carry``: this replica began a new
        deployment (``--new-deployment``): the same router's records of a lost deployment of the same store
        (Redis restarted empty) go into it."""
        self.spool.bind({"store": self.url, "epoch": epoch, "identity": who})
        ours = lambda d, *keys: isinstance(d, dict) and all(d.get(k) == self.spool.deployment[k] for k in keys)  # noqa: E731
        theirs = [d for d in self.spool.foreign() if epoch is not None or not ours(d, "identity")]
        if not theirs:
            return
        if carry and all(ours(d, "identity", "store") for d in theirs):
            self.spool.carry()
            return
        self.spool.close()
        what = "this router, another deployment" if all(ours(d, "identity") for d in theirs) else \
            "another router or settings"
        names = sorted({f"{d.get('store')} {d.get('epoch')}" if isinstance(d, dict) else "unknown" for d in theirs})
        raise UserError(f"{self.spool.folder}: {len(theirs)} journal record(s) answered for another deployment "
                        f"({what}: {', '.join(names)}) wait in this folder; a spool holds one deployment's records, "
                        "and these would go into this one's journal. Give this replica its own --spool DIR (or "
                        "start a replica of that deployment on this folder to send them)", field="spool")

    def _read_sync(self, r, epoch: str) -> None:
        res = r.register_script(LUA_READ)(keys=[K_DEP, K_KAPPA, K_OUT], args=[epoch, self.coverage.window])
        self._take(res)

    # ------------------------------------------------------------------ serving (asyncio)
    async def start(self) -> None:
        self._r = _client(self.url, self.timeout_s, asyncio_api=True)
        self._s = {name: self._r.register_script(src) for name, src in (
            ("append", LUA_APPEND), ("get", LUA_GET), ("feedback", LUA_FEEDBACK), ("read", LUA_READ),
            ("setkappa", LUA_SETKAPPA))}
        self._task = asyncio.get_running_loop().create_task(self._background())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self._r is not None:
            try:
                await asyncio.wait_for(self._flush(), 2 * self.timeout_s)
            except (asyncio.TimeoutError, _Down, _Lost):
                pass  # the spool keeps them for the next start
            await self._r.aclose()
        self.spool.close()

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> list:
        import redis

        if self.lost:
            raise _Lost()
        t0 = time.perf_counter()
        try:
            res = await asyncio.wait_for(self._s[name](keys=keys, args=[self.epoch, *args]), self.timeout_s)
        except (asyncio.TimeoutError, redis.RedisError, OSError) as e:
            self.up = False
            raise _Down(f"{type(e).__name__}: {e}") from None
        self.up = True
        self.on_call(name, time.perf_counter() - t0)
        if res[0] == "EPOCH":
            self._lose()
            raise _Lost()
        return res

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.coverage.stale = True
            log.error("the store %s no longer holds this deployment (epoch %s): Redis restarted empty or was "
                      "flushed. This replica goes on answering with the last good kappa (%.6g, version %d), keeps "
                      "its journal records in %s, and refuses feedback (503 state_lost). Restore the store's data, "
                      "or restart the replicas (the first with --new-deployment) to begin a new deployment.",
                      self.url, self.epoch, self.coverage.kappa, self.coverage.version, self.spool.path)

    async def _background(self) -> None:
        """Every second: send spooled records, and read the deployment's kappa and coverage."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._flush()
                await self._pull()
            except (_Down, _Lost):
                self.coverage.stale = True

    async def _flush(self) -> None:
        recs, sent = list(self.spool.records), 0
        try:
            for rec in recs:
                res = await self._call("append", [K_DEP, K_REQ, K_ORDER], [rec["id"], _line(rec)])
                if res[0] == "CLASH":
                    log.error("spooled request %s: the store holds another line under its id; kept the store's",
                              rec["id"])
                sent += 1
        finally:
            if sent:
                await asyncio.to_thread(self.spool.drop, sent)

    def _take(self, res: list) -> tuple[int, float]:
        """Fold a READ result into the local view: (how many outcomes were past the checkpoint, kappa
        after them)."""
        c = self.coverage
        v, n = int(res[1]), int(res[3])
        tail = [int(x[0]) for x in res[4]]
        recent = [int(x[0]) for x in res[5]]
        kappa = fold_kappa(float(res[2]) if res[2] is not None else c.kappa, tail, v, c.alpha, c.eta0)
        if n >= c.version:
            c.kappa, c.version, c.seen = kappa, n, n
            c.rolling = sum(recent) / len(recent) if recent else None
            c.p_value, c.alarm = alarm_test(recent, c.alpha, c.window, c.alarm_p)
            c.stale = self.lost
        return len(tail), kappa

    async def _pull(self) -> None:
        res = await self._call("read", [K_DEP, K_KAPPA, K_OUT], [self.coverage.window])
        n_new, kappa = self._take(res)
        if n_new and self.coverage.online:  # move the checkpoint (any replica may; the highest version wins)
            await self._call("setkappa", [K_DEP, K_KAPPA], [int(res[1]) + n_new, repr(kappa)])

    async def refresh(self) -> None:
        if not self.up or self.lost:  # known down: no request waits for it; the background task probes it
            self.coverage.stale = True
            return
        try:
            await self._pull()
        except (_Down, _Lost):
            self.coverage.stale = True

    # ------------------------------------------------------------------ the interface
    async def append(self, rec: dict) -> str:
        try:
            if not self.up:  # known down (the background task probes it every second): spool at once
                raise _Down("the store did not answer the last call")
            res = await self._call("append", [K_DEP, K_REQ, K_ORDER], [rec["id"], _line(rec)])
            if res[0] != "CLASH":
                return "store"
            raise RuntimeError(f"request id {rec['id']} is already in the store with another line")
        except (_Down, _Lost):
            await asyncio.to_thread(self.spool.add, rec)  # durable here before the reply; sent later
            return "spooled"

    async def feedback(self, body: Any) -> FeedbackResult:
        qid, gold, correct, aliases = parse_feedback(body)
        was = self.coverage.alarm
        try:
            out, cov = await self._record(qid, gold, correct, aliases)
        except _Down as e:
            raise StateUnavailable(f"the shared state ({self.url}) did not answer within {self.timeout_s:g} s "
                                   f"({e}); nothing was recorded: send the feedback again") from None
        except _Lost:
            raise StateUnavailable(f"the shared state ({self.url}) no longer holds this deployment (epoch "
                                   f"{self.epoch}; Redis restarted empty?): nothing was recorded", "state_lost",
                                   retry_after_s=60.0) from None
        await self.refresh()  # the outcome is recorded; a store gone since leaves the view one step behind
        v = self.view()
        return FeedbackResult(out, cov, v.alarm and not was, v)

    async def _record(self, qid: str, gold, correct, aliases) -> tuple[dict, bool | None]:
        for _ in range(64):  # each retry means another replica recorded feedback for this id meanwhile
            _, req, prev = await self._call("get", [K_DEP, K_REQ, K_FB], [qid])
            if req is None:
                raise FeedbackError(f"id {qid!r}: no request with this id in the deployment's journal "
                                    f"({self.url}; a request answered while the store was down is sent from its "
                                    "replica's spool when the store answers again)", 404, "id")
            base = json.loads(prev if prev is not None else req)
            if prev is not None and is_labelled(base):
                raise FeedbackError(f"id {qid!r}: its outcome is already recorded", 409, "id")
            out, cov = apply_feedback(base, qid, gold, correct, aliases)
            check_feedback_line(self.manifest, out, self.url)  # as the embedded journal: data pull's reader
            res = await self._call("feedback", [K_DEP, K_REQ, K_FB, K_OUT],
                                   [qid, prev or "", _line(out), "" if cov is None else str(int(cov))])
            if res[0] == "OK":
                return out, cov
        raise _Down("feedback for this id kept changing under this replica")

    def view(self) -> CoverageView:
        c = self.coverage
        return CoverageView(c.kappa, c.version, c.rolling, c.alarm, c.p_value, c.seen, c.stale)

    def reply_info(self) -> dict:
        c = self.coverage
        return {"store": "redis", "replica": self.replica, "kappa_version": c.version, "kappa_stale": c.stale}


def _line(rec: dict) -> str:
    return json.dumps(rec, ensure_ascii=False, allow_nan=False)


def pull_journal(url: str, timeout_s: float = 5.0) -> tuple[dict, list[dict]]:
    """The deployment's journal: (manifest, one line per request in the order journaled: its latest
    feedback line, else its request line). The same store gives the same lines."""
    import redis

    parse_state_url(url, "data pull")
    r = _client(url, timeout_s, asyncio_api=False)
    try:
        man = r.hget(K_DEP, "manifest")
        if man is None:
            raise UserError(f"data pull: {url} holds no gateway deployment (no {K_DEP} key)")
        ids = r.lrange(K_ORDER, 0, -1)
        lines = []
        for i in range(0, len(ids), 1000):
            chunk = ids[i: i + 1000]
            for qid, req, fb in zip(chunk, r.hmget(K_REQ, chunk), r.hmget(K_FB, chunk)):
                lines.append(json.loads(fb if fb is not None else req))
        return json.loads(man), lines
    except redis.RedisError as e:
        raise UserError(f"data pull: cannot read {url} ({type(e).__name__}: {e})") from None
    finally:
        r.close()
