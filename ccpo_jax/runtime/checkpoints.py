"""Checkpoints verified before use: orbax ``CheckpointManager`` plus a digest per step (docs/integrity.md).

orbax checks neither the bytes of an array file nor whether a file was cut
short: a flipped bit in a kernel is restored as a different number, and a run
resumed from it silently gives other results. :class:`VerifiedCheckpoints`
wraps the manager with the same ``save`` / ``latest_step`` / ``restore`` /
``wait_until_finished`` calls, and

* after each save (once orbax has finished and renamed the step into place)
  writes ``<root>/<step>.digest.json`` atomically: the size and sha256 of every
  file of the step directory;
* before restoring, recomputes them. A step whose digest is missing, whose
  files differ (a flipped byte, a truncation, a missing or an added file) is
  refused with one line naming the file; :meth:`latest_step` then falls back
  to the newest step that verifies (two are kept), moving the damaged one
  aside (``<root>/../<name>.damaged/``) so the run can save that step again.
  When no step verifies, :class:`ccpo_jax.errors.UserError` names the damaged
  file and offers a fresh start (delete the checkpoint directory).

Saves are synchronous (the digest needs the finished files). While orbax
saves, its own error logs of a full disk are held back: the exception still
propagates and the CLI prints it as one ``error:`` line.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from ccpo_jax.errors import UserError, disk_full_message
from envs.cache.atomic import atomic_write_text

DIGEST_SUFFIX = ".digest.json"
DIGEST_FORMAT = 1


def _say(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def file_digests(step_dir: Path) -> dict[str, dict[str, Any]]:
    """relative path -> {"bytes", "sha256"} for every regular file under ``step_dir`` (sorted)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(step_dir.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[p.relative_to(step_dir).as_posix()] = {"bytes": p.stat().st_size, "sha256": h.hexdigest()}
    return out


class _DiskFullFilter(logging.Filter):
    """Drops orbax's (absl's) log records about a full disk: the exception itself says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "No space left on device" in record.getMessage() or "Disk quota exceeded" in record.getMessage():
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or disk_full_message(exc) is None


def _closed_loop(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


@contextlib.contextmanager
def _quiet_disk_full():
    """Hold back orbax's noise about a failed save: its log records about a full disk, and the
    ``RuntimeError: Event loop is closed`` tracebacks that tensorstore's callbacks print (as
    unraisable exceptions) into the event loop of a save that already failed."""
    import sys

    f = _DiskFullFilter()
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "asyncio")]
    for lg in loggers:
        lg.addFilter(f)
    hook = sys.excepthook

    def quiet_hook(typ, value, tb):
        if not _closed_loop(value):
            hook(typ, value, tb)

    unraisable = sys.unraisablehook

    def quiet_unraisable(u):  # tensorstore reports a callback's failure as "unraisable"
        if not _closed_loop(u.exc_value):
            unraisable(u)

    sys.excepthook, sys.unraisablehook = quiet_hook, quiet_unraisable
    failed = False
    try:
        yield
    except BaseException:
        # orbax's and tensorstore's threads keep reporting the failed save after the
        # exception has left here; the process is about to stop on it, so stay quiet.
        failed = True
        raise
    finally:
        if not failed:
            for lg in loggers:
                lg.removeFilter(f)
            if sys.excepthook is quiet_hook:
                sys.excepthook = hook
            if sys.unraisablehook is quiet_unraisable:
                sys.unraisablehook = unraisable


def completed_steps(root: str | os.PathLike) -> list[Path]:
    """The step folders under ``root`` (searched recursively) whose save completed: those with a
    digest beside them. orbax's half-written ``*.orbax-checkpoint-tmp`` folders have none, and
    steps set aside in ``*.damaged/`` are not counted."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for dp in sorted(root.rglob(f"*{DIGEST_SUFFIX}")):
        step = dp.with_name(dp.name[: -len(DIGEST_SUFFIX)])
        if step.name.isdigit() and step.is_dir() and not any(
                q.name.endswith(".damaged") for q in step.relative_to(root).parents):
            out.append(step)
    return out


class VerifiedCheckpoints:
    """An orbax CheckpointManager whose steps are verified against digests before restore.

    ``VerifiedCheckpoints(root, max_to_keep=2)``; then ``save(step, args=...)``,
    ``latest_step()`` (the newest step that verifies, or None), ``restore(step,
    args=...)`` (verifies first), ``restore_latest_good(make_args)`` ->
    ``(step, restored)`` or ``(None, None)``. ``warn`` prints the one-line notices.
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int = 2, warn: Callable[[str], Any] = _say):
        import orbax.checkpoint as ocp

        self.root = Path(root).absolute()
        self.warn = warn
        self._mgr = None
        # Screen before orbax opens the directory: its manager parses every step's metadata
        # on start-up and fails with a traceback on a truncated one.
        self._screen()
        self._drop_tmp()
        with _quiet_disk_full():
            self._mgr = ocp.CheckpointManager(
                self.root, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    # -- files --------------------------------------------------------------------
    def digest_path(self, step: int) -> Path:
        return self.root / f"{int(step)}{DIGEST_SUFFIX}"

    def step_dir(self, step: int) -> Path:
        return self.root / str(int(step))

    def all_steps(self) -> list[int]:
        if self._mgr is None:
            return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit()) \
                if self.root.is_dir() else []
        return sorted(int(s) for s in self._mgr.all_steps())

    def _screen(self) -> None:
        """Verify every step; set the damaged ones aside (one line each); UserError if none is left."""
        steps = self.all_steps()
        first_problem = None
        for step in reversed(steps):
            why = self.problem(step)
            if why is None:
                continue
            first_problem = first_problem or why
            dest = self._set_aside(step)
            good = [s for s in steps if s != step and self.problem(s) is None]
            self.warn(f"warning: checkpoint step {step} refused: {why}; moved to {dest}"
                      + (f"; resuming from step {max(good)}" if good and max(good) < step else ""))
        if first_problem is not None and not self.all_steps():
            raise UserError(
                f"no usable checkpoint in {self.root}: {first_problem}; to start this run afresh, "
                f"delete {self.root.parent} (the damaged steps are kept in {self.root.name}.damaged/)"
            )

    # -- save ---------------------------------------------------------------------
    def save(self, step: int, args: Any) -> None:
        """Save ``step`` with orbax, wait for it, then write its digest (and drop digests of deleted steps).

        A save that fails (a full disk) leaves no trace of ``step``: its half-written files are removed."""
        try:
            with _quiet_disk_full():
                self._mgr.save(int(step), args=args)
                self._mgr.wait_until_finished()
                body = {"format": DIGEST_FORMAT, "step": int(step), "files": file_digests(self.step_dir(step))}
                atomic_write_text(self.digest_path(step), json.dumps(body, indent=1, sort_keys=True) + "\n")
        except BaseException:
            self._drop_unfinished(step)
            raise
        keep = set(self.all_steps())
        for p in self.root.glob(f"*{DIGEST_SUFFIX}"):
            name = p.name[: -len(DIGEST_SUFFIX)]
            if name.isdigit() and int(name) not in keep:
                p.unlink(missing_ok=True)

    def _drop_tmp(self) -> None:
        """Remove the ``<step>.orbax-checkpoint-tmp*`` folders of a save that a kill cut short. They are
        never a checkpoint (orbax renames a step into place only when it is complete), and orbax would
        otherwise remove one itself when that step is saved again, with an absl WARNING on stderr."""
        if self.root.is_dir():
            for p in self.root.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(p, ignore_errors=True)

    def _drop_unfinished(self, step: int) -> None:
        """Remove what a failed save of ``step`` wrote: orbax's ``<step>.orbax-checkpoint-tmp*`` folder,
        and the step folder if its digest was never written. Best effort: the save's error is what
        the caller reports, and a leftover is refused on resume anyway (no digest)."""
        if self.digest_path(step).exists():
            return
        for p in [*self.root.glob(f"{int(step)}.orbax-checkpoint-tmp*"), self.step_dir(step)]:
            shutil.rmtree(p, ignore_errors=True)

    def wait_until_finished(self) -> None:
        self._mgr.wait_until_finished()  # save() already waited; kept for the orbax interface

    # -- verify -------------------------------------------------------------------
    def problem(self, step: int) -> str | None:
        """None if ``step`` matches its digest, else one line naming the damaged file."""
        d, dp = self.step_dir(step), self.digest_path(step)
        if not dp.is_file():
            return f"{dp}: missing (the save did not finish, or the checkpoint predates digests)"
        try:
            want = json.loads(dp.read_text())
            files = want["files"]
            if want.get("format") != DIGEST_FORMAT or want.get("step") != int(step) or not isinstance(files, dict):
                raise ValueError("unexpected content")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            return f"{dp}: damaged digest ({type(e).__name__})"
        have = set()
        for p in sorted(d.rglob("*")) if d.is_dir() else []:
            if p.is_file():
                have.add(p.relative_to(d).as_posix())
        for rel in sorted(set(files) | have):
            p = d / rel
            if rel not in have:
                return f"{p}: missing"
            if rel not in files:
                return f"{p}: not in the digest (added after the save)"
            size = p.stat().st_size
            if size != files[rel].get("bytes"):
                return f"{p}: {size} bytes, the digest says {files[rel].get('bytes')} (truncated or damaged)"
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != files[rel].get("sha256"):
                return f"{p}: sha256 differs from the digest (the file is damaged)"
        return None

    def _set_aside(self, step: int) -> Path:
        """Move a damaged step (and its digest) out of orbax's sight, keeping it for inspection."""
        aside = self.root.parent / f"{self.root.name}.damaged"
        aside.mkdir(parents=True, exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"{int(step)}-", dir=aside))
        for src in (self.step_dir(step), self.digest_path(step)):
            if src.exists():
                os.replace(src, dest / src.name)
        if self._mgr is not None:
            self._mgr.reload()
        return dest

    def latest_step(self) -> int | None:
        """The newest step that verifies; newer damaged steps are set aside with one line each.

        Raises UserError (one line, naming the damaged file) when steps exist but none verifies.
        """
        steps = self.all_steps()
        first_problem = None
        for step in reversed(steps):
            why = self.problem(step)
            if why is None:
                return step
            first_problem = first_problem or why
            older = [s for s in steps if s < step]
            dest = self._set_aside(step)
            self.warn(f"warning: checkpoint step {step} refused: {why}; moved to {dest}"
                      + (f"; resuming from step {older[-1]}" if older else ""))
        if first_problem is not None:
            raise UserError(
                f"no usable checkpoint in {self.root}: {first_problem}; to start this run afresh, "
                f"delete {self.root.parent} (the damaged steps are kept in {self.root.name}.damaged/)"
            )
        return None

    def restore(self, step: int, args: Any) -> Any:
        """Verify ``step`` against its digest, then restore it (UserError naming the file if damaged)."""
        why = self.problem(step)
        if why is not None:
            raise UserError(f"checkpoint step {step} refused: {why}")
        return self._mgr.restore(int(step), args=args)

    def restore_latest_good(self, make_args: Callable[[], Any]) -> tuple[int | None, Any]:
        """``(step, restored)`` of the newest step that verifies, or ``(None, None)`` when there is none yet."""
        step = self.latest_step()
        if step is None:
            return None, None
        return step, self.restore(step, make_args())

    def close(self) -> None:
        self._mgr.close()
