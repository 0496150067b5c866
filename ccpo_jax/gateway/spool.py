"""Journal records a shared store did not take yet, kept on local disk until it does (``--spool DIR``).

A replica answers a completion only once its journal record is durable: in the
store, or, when the store does not answer, here (one line, fsync-ed). A
background task sends the spooled records to the store when it answers again;
the store's append is idempotent (the same id with the same line is taken
once), so a record sent twice, e.g. by a replica killed between the send and
the spool's rewrite, is one record.

Each record carries the deployment it was answered for (``deployment``: the store, its epoch and a hash of
the replica's identity, :meth:`Spool.bind`), so that a replica started on a folder that holds another
deployment's records (two deployments started from one directory share the default folder) refuses to
start rather than send them into its own journal (``redis_state.RedisState``).

Each process holds one spool, ``DIR/spool-<i>.jsonl``, under an exclusive
``flock`` of ``DIR/spool-<i>.lock`` (the kernel drops it when the process dies,
``kill -9`` included). At start a process takes the first free spool and adopts
the records of every other free one: those of a killed replica or worker are
sent by the next one started on the same folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path

from ccpo_jax.errors import UserError
from envs.cache.atomic import atomic_write_text

MAX_SPOOLS = 256


def _read_lines(path: Path) -> list[tuple[dict | None, dict]]:
    """The whole lines of a spool file as (deployment, record) (a last line cut by a kill is dropped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # the empty tail, or a line cut by a kill (it was never acknowledged)
        if isinstance(obj, dict) and isinstance(obj.get("record"), dict):
            out.append((obj.get("deployment"), obj["record"]))
        elif isinstance(obj, dict) and "id" in obj:  # a record spooled before records were tagged
            out.append((None, obj))
    return out


class Spool:
    """This process's spool: ``add`` (durable when it returns), ``records``, ``drop(n)`` (the first n sent).
    ``entries``: (deployment, record) of each; ``add`` tags a record with the deployment :meth:`bind` set."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{self.folder}: cannot create the spool folder ({e.strerror or e})",
                            field="spool") from None
        self._lock = None
        self._mutex = threading.Lock()  # add (a request's thread) and drop (the flusher's) on one list
        for i in range(MAX_SPOOLS):
            f = self._try_lock(i)
            if f is not None:
                self._lock, self.index = f, i
                break
        if self._lock is None:
            raise UserError(f"{self.folder}: all {MAX_SPOOLS} spools are held by running gateways", field="spool")
        self.path = self.folder / f"spool-{self.index}.jsonl"
        self.entries: list[tuple[dict | None, dict]] = _read_lines(self.path)
        self.deployment: dict | None = None
        self.adopted = self._adopt()

    @property
    def records(self) -> list[dict]:
        return [rec for _, rec in self.entries]

    def bind(self, deployment: dict) -> None:
        """The deployment this process's records belong to (what :meth:`add` tags them with)."""
        self.deployment = deployment

    def foreign(self) -> list[dict | None]:
        """The deployments of the records that are not of the bound one (one per record)."""
        return [d for d, _ in self.entries if d != self.deployment]

    def carry(self) -> None:
        """Tag every record with the bound deployment (``--new-deployment``: a lost deployment's records,
        answered by the same router and settings, go into the new one)."""
        with self._mutex:
            self.entries = [(self.deployment, rec) for _, rec in self.entries]
            self._rewrite()

    def _try_lock(self, i: int):
        f = open(self.folder / f"spool-{i}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        return f

    def _adopt(self) -> int:
        """Take over the records of the spools no running process holds (a killed replica's)."""
        n = 0
        for lock in sorted(self.folder.glob("spool-*.lock")):
            i = int(lock.stem.split("-")[1])
            data = self.folder / f"spool-{i}.jsonl"
            if i == self.index or not data.exists():
                continue
            f = self._try_lock(i)
            if f is None:
                continue
            try:
                recs = _read_lines(data)
                if recs:
                    self.entries += recs
                    # ours first, durable, then theirs removed (a crash between: sent twice, taken once)
                    self._rewrite()
                    n += len(recs)
                data.unlink()
            finally:
                f.close()
        return n

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(_line(d, r) for d, r in self.entries))

    def add(self, rec: dict) -> None:
        """Append a record; on disk (fsync-ed) when this returns."""
        with self._mutex, open(self.path, "a", encoding="utf-8") as f:
            f.write(_line(self.deployment, rec))
            f.flush()
            os.fsync(f.fileno())
            self.entries.append((self.deployment, rec))

    def drop(self, n: int) -> None:
        """The first ``n`` records reached the store: remove them (atomically)."""
        if n:
            with self._mutex:
                self.entries = self.entries[n:]
                self._rewrite()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _line(deployment: dict | None, rec: dict) -> str:
    return json.dumps({"deployment": deployment, "record": rec}, ensure_ascii=False) + "\n"
