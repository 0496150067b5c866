"""``OUT.calls``, the call log: one JSON line per API call, the record that makes replays possible.

Each paid call's line holds the request's hash (``key``), the reply (text,
usage, log-probs, finish reason), attempts, the waits before retries and why,
latency and cost; replayed and failed calls get lines too. On ``--resume`` the
replies are loaded back and every call already paid for is answered from them.
One collection has one writer: the log is held with an exclusive ``flock``.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path

from ccpo_jax.collect.settings import CollectError
from envs.cache.atomic import truncate_partial_line


class CallLog:
    """Append-only JSON Lines, one record per call; thread-safe appends."""

    def __init__(self, path: Path, read_only: bool = False):
        self.path = path
        self.lock = threading.Lock()
        self.replies: dict[str, dict] = {}
        self.paid_usd = 0.0
        self.ratio: dict[str, float] = {}  # model -> highest prompt tokens per character seen
        self._f = None
        if not read_only:
            self._f = open(path, "a", encoding="utf-8")
            try:  # one writer per collection: a second run on the same --out would interleave
                fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._f.close()
                raise CollectError(f"{path}: another 'ccpo-jax data collect' is writing this collection "
                                   "(its call log is locked); wait for it or stop it first") from None
        if path.stat().st_size if path.exists() else 0:
            self._load(read_only)

    def _load(self, read_only: bool) -> None:
        if not read_only:
            truncate_partial_line(self.path)
        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if read_only:
                        continue  # (a dry run does not repair a cut last line)
                    raise CollectError(f"{self.path}:{i}: not valid JSON (the call log is damaged)") from None
                if "text" in rec and "key" in rec:
                    self.replies.setdefault(rec["key"], rec)
                    self.paid_usd += float(rec.get("cost_usd", 0.0))
                    self._observe(rec)

    def _observe(self, rec: dict) -> None:
        chars = rec.get("prompt_chars")
        if chars and not rec.get("tokens_estimated"):
            r = rec["tokens_in"] / chars
            m = rec.get("model", "")
            self.ratio[m] = max(self.ratio.get(m, 0.0), r)

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: escaped (\\udXXX), so the paid record is still written
            line = json.dumps(rec, ensure_ascii=True, allow_nan=False) + "\n"
        with self.lock:
            self._f.write(line)
            self._f.flush()  # in the OS from here: survives a kill of this process
            if "text" in rec:
                self.replies.setdefault(rec["key"], rec)
                self._observe(rec)
        # on disk before the reply is used (survives a machine crash); outside the lock, so that the
        # workers' fsyncs overlap (the kernel commits them together) instead of queueing
        os.fsync(self._f.fileno())

    def close(self) -> None:
        # under the lock: a worker left running by a second Ctrl-C cannot be midway through a line
        with self.lock:
            if self._f is not None:
                self._f.close()
