"""envs.cache.atomic: the one atomic-write helper (files and built-aside directories)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from envs.cache import atomic
from envs.cache.atomic import atomic_dir, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text


class Boom(Exception):
    pass


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask():
    """Set a umask for the test and restore the old one."""
    olds = []

    def set_(m: int) -> None:
        olds.append(os.umask(m))

    yield set_
    if olds:
        os.umask(olds[0])


def test_round_trips(tmp_path):
    b = bytes(range(256)) * 3
    assert atomic_write_bytes(tmp_path / "b.bin", b) == tmp_path / "b.bin"
    assert (tmp_path / "b.bin").read_bytes() == b
    t = "héllo\nwörld ✓\n"
    assert atomic_write_text(str(tmp_path / "t.txt"), t) == tmp_path / "t.txt"
    assert (tmp_path / "t.txt").read_bytes() == t.encode("utf-8")
    obj = {"b": [1, 2.5, None], "a": "x"}
    p = atomic_write_json(tmp_path / "o.json", obj, indent=2, sort_keys=True)
    assert p.read_text() == json.dumps(obj, indent=2, sort_keys=True) + "\n"
    assert json.loads(p.read_text()) == obj
    with pytest.raises(ValueError):  # json kwargs pass through; nothing is written on a dumps failure
        atomic_write_json(tmp_path / "nan.json", float("nan"), allow_nan=False)
    assert sorted(os.listdir(tmp_path)) == ["b.bin", "o.json", "t.txt"]


def test_replace_overwrites(tmp_path):
    p = tmp_path / "f"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert os.listdir(tmp_path) == ["f"]


def test_crash_mid_write_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    p.write_text("old contents")
    real_fsync = os.fsync

    def crash(fd):  # after the data reached the temporary file, before the rename
        real_fsync(fd)
        raise Boom("killed")

    monkeypatch.setattr(atomic.os, "fsync", crash)
    with pytest.raises(Boom):
        atomic_write_text(p, "new contents that never land")
    monkeypatch.undo()
    assert p.read_text() == "old contents"
    assert os.listdir(tmp_path) == ["f.txt"]  # no temporary left behind


def test_failed_rename_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    p.write_text("old")
    monkeypatch.setattr(atomic.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        atomic_write_bytes(p, b"new")
    monkeypatch.undo()
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_atomic_path_crash_and_success(tmp_path):
    p = tmp_path / "plot.png"
    p.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic_path(p, suffix=".png") as tmp:
            assert tmp.parent == tmp_path and tmp.name.endswith(".png")
            tmp.write_bytes(b"half")
            raise Boom
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["plot.png"]
    with atomic_path(p, suffix=".png") as tmp:
        tmp.write_bytes(b"new")
    assert p.read_bytes() == b"new" and os.listdir(tmp_path) == ["plot.png"]


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_permissions_follow_umask(tmp_path, umask, mask):
    umask(mask)
    assert _mode(atomic_write_text(tmp_path / "t", "x")) == 0o666 & ~mask
    assert _mode(atomic_write_bytes(tmp_path / "b", b"x")) == 0o666 & ~mask
    with atomic_path(tmp_path / "p") as tmp:
        tmp.write_bytes(b"x")
    assert _mode(tmp_path / "p") == 0o666 & ~mask
    with atomic_dir(tmp_path / "d") as d:
        (d / "f").write_text("x")
    assert _mode(tmp_path / "d") == 0o777 & ~mask


def test_atomic_dir_replaces_and_crash_keeps_old(tmp_path):
    out = tmp_path / "cache"
    with atomic_dir(out) as d:
        (d / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(Boom):
        with atomic_dir(out) as d:
            (d / "a").write_text("2")
            raise Boom
    assert (out / "a").read_text() == "1" and os.listdir(tmp_path) == ["cache"]
    with atomic_dir(out) as d:  # overwrite: the old directory is replaced whole
        (d / "b").write_text("3")
    assert os.listdir(out) == ["b"] and os.listdir(tmp_path) == ["cache"]


def test_atomic_dir_without_overwrite_refuses_existing(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep").write_text("k")
    with pytest.raises(OSError):
        with atomic_dir(out, overwrite=False) as d:
            (d / "new").write_text("n")
    assert os.listdir(out) == ["keep"] and os.listdir(tmp_path) == ["art"]
