"""Atomic writes: every file and directory the package writes goes through here.

A write goes to a temporary name in the destination's own folder (so the final
``os.replace`` is a rename within one file system), is flushed and
``fsync``-ed, gets the permissions a plain ``open`` (or ``mkdir``) would give
under the current umask (``mkstemp``/``mkdtemp`` make 0600/0700), and is then
renamed into place. A failed or interrupted write (an exception, including
KeyboardInterrupt) removes the temporary and leaves an existing file untouched.

The caller creates the destination's folder; errors propagate as ``OSError``. Appended files (call
logs, journals) are repaired after a kill by :func:`truncate_partial_line`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_path", "atomic_dir",
           "truncate_partial_line"]


def current_umask() -> int:
    """The process umask (read by setting and restoring it; there is no getter)."""
    old = os.umask(0o022)
    os.umask(old)
    return old


def _unlink_quietly(path: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkstemp(path: Path, suffix: str) -> tuple[int, str]:
    """A temporary file beside ``path`` with the permissions a plain ``open`` would give."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    return fd, tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path`` as a Path."""
    path = Path(path)
    fd, tmp = _mkstemp(path, ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns ``path`` as a Path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **json_kwargs: Any) -> Path:
    """Write ``json.dumps(obj, **json_kwargs)`` and a final newline to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, **json_kwargs) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """For writers that want a file name (``savefig``, ``np.savez``): yields a
    temporary name beside ``path`` (ending in ``suffix``, which some writers read
    as the format); when the block ends normally the file there is fsync-ed and
    renamed to ``path``, otherwise it is removed."""
    path = Path(path)
    fd, tmp = _mkstemp(path, suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """A directory built aside and renamed into place: yields a fresh temporary
    directory beside ``path`` (mode 0777 less the umask); when the block ends
    normally every file in it is fsync-ed and it is renamed to ``path``, otherwise
    it is removed with everything in it.

    ``overwrite``: an existing directory at ``path`` is first renamed to
    ``.NAME.old`` beside it, then removed once the new one is in place (so a
    crash never leaves ``path`` missing both). Without it, an existing non-empty
    directory at ``path`` makes the final rename fail (``OSError``).
    """
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                _fsync_path(os.path.join(root, name))
        if overwrite and path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def truncate_partial_line(path: Path) -> bool:
    """Drop a last line without its newline (a write cut by a kill); True when one was dropped."""
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
    return True
