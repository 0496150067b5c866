"""Journal records a shared store did not take yet, kept on local disk until it does (``--spool DIR``).

A replica answers a completion only once its journal record is durable: in the
store, or, when the store does not answer, here (one line, fsync-ed). A
background task sends the spooled records to the store when it answers again;
the store's append is idempotent (the same id with the same line is taken
once), so a record sent twice, e.g. by a replica killed between the send and
the spool's rewrite, is one record.

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


def _read_lines(path: Path) -> list[dict]:
    """The whole lines of a spool file (a last line cut by a kill is dropped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the empty tail, or a line cut by a kill (it was never acknowledged)
    return out


class Spool:
    """This process's spool: ``add`` (durable when it returns), ``records``, ``drop(n)`` (the first n sent)."""

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
        self.records: list[dict] = _read_lines(self.path)
        self.adopted = self._adopt()

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
                    self.records += recs
                    # ours first, durable, then theirs removed (a crash between: sent twice, taken once)
                    self._rewrite()
                    n += len(recs)
                data.unlink()
            finally:
                f.close()
        return n

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records))

    def add(self, rec: dict) -> None:
        """Append a record; on disk (fsync-ed) when this returns."""
        with self._mutex, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            self.records.append(rec)

    def drop(self, n: int) -> None:
        """The first ``n`` records reached the store: remove them (atomically)."""
        if n:
            with self._mutex:
                self.records = self.records[n:]
                self._rewrite()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
