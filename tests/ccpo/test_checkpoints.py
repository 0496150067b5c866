"""Checkpoints verified before use (issue 15): a flipped byte or a truncation in any file of a
checkpoint is refused (falling back to the previous good step) and never restored silently.
The same through the trainer (a killed run resumed past a damaged step): tests/ccpo/test_train.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ccpo_jax.errors import UserError
from ccpo_jax.runtime.checkpoints import DIGEST_SUFFIX, VerifiedCheckpoints


def _args(state, metrics=None, restore=False):
    import orbax.checkpoint as ocp

    if restore:
        return ocp.args.Composite(state=ocp.args.StandardRestore(state), metrics=ocp.args.JsonRestore())
    return ocp.args.Composite(state=ocp.args.StandardSave(state), metrics=ocp.args.JsonSave(metrics))


def _state(v: float):
    return {"policy": {"kernel": np.full((64, 32), v, np.float32), "bias": np.arange(32, dtype=np.float32) + v},
            "kappa": np.full((1,), v, np.float32)}


def _saved(root: Path, warn=None) -> VerifiedCheckpoints:
    ck = VerifiedCheckpoints(root, warn=warn or (lambda s: None))
    for step in (1, 2):
        ck.save(step, _args(_state(float(step)), {"history": [step]}))
    return ck


def _kind(rel: str) -> str:
    # OCDBT data files are named by content hash: one kind, whatever the name
    return rel.rsplit("/d/", 1)[0] + "/d/*" if "/d/" in rel else rel


def _file_kinds(step_dir: Path) -> dict[str, Path]:
    """One file of each kind in an orbax step (metadata, OCDBT manifest, array data, JSON items, ...)."""
    kinds: dict[str, Path] = {}
    for p in sorted(step_dir.rglob("*"), key=lambda p: -p.stat().st_size if p.is_file() else 0):
        if p.is_file() and p.stat().st_size > 0:
            kinds.setdefault(_kind(p.relative_to(step_dir).as_posix()), p)  # the largest of each kind
    return kinds


def test_digest_written_beside_each_step_and_old_ones_dropped(tmp_path):
    ck = _saved(tmp_path / "orbax")
    ck.save(3, _args(_state(3.0), {"history": [3]}))
    assert ck.all_steps() == [2, 3]  # two kept
    assert sorted(p.name for p in (tmp_path / "orbax").glob(f"*{DIGEST_SUFFIX}")) == ["2.digest.json", "3.digest.json"]
    d = json.loads((tmp_path / "orbax" / "3.digest.json").read_text())
    assert d["step"] == 3 and d["files"] and all(len(v["sha256"]) == 64 for v in d["files"].values())
    assert ck.problem(3) is None and ck.latest_step() == 3


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_every_kind_of_checkpoint_file_damaged_falls_back(tmp_path, damage):
    root = tmp_path / "orbax"
    kinds = sorted(_file_kinds(_saved(tmp_path / "probe" / "orbax").step_dir(2)))
    assert any("/d/" in k for k in kinds) and any("metrics" in k for k in kinds) and len(kinds) >= 5, kinds
    for kind in kinds:
        if root.parent.exists():
            import shutil

            shutil.rmtree(root.parent)
        notes: list[str] = []
        ck = _saved(root, warn=notes.append)
        f = _file_kinds(ck.step_dir(2))[kind]
        rel = f.relative_to(ck.step_dir(2)).as_posix()
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            data = data[: len(data) // 2]
        f.write_bytes(bytes(data))
        assert ck.problem(2) is not None and str(f) in ck.problem(2)
        with pytest.raises(UserError, match="refused"):
            ck.restore(2, _args(_state(0.0), restore=True))
        ck2 = VerifiedCheckpoints(root, warn=notes.append)  # as a resumed run opens it
        step, got = ck2.restore_latest_good(lambda: _args(_state(0.0), restore=True))
        assert step == 1, kind
        np.testing.assert_array_equal(got["state"]["policy"]["kernel"], _state(1.0)["policy"]["kernel"])
        assert got["metrics"]["history"] == [1]
        assert len(notes) == 1 and notes[0].startswith("warning: checkpoint step 2 refused: ") and rel in notes[0]
        assert "resuming from step 1" in notes[0] and ck2.all_steps() == [1]
        # the run can save step 2 again (the damaged one was moved aside)
        ck2.save(2, _args(_state(2.0), {"history": [1, 2]}))
        assert ck2.latest_step() == 2 and list((tmp_path / "orbax.damaged").iterdir())


def test_no_good_checkpoint_is_one_line_offering_a_fresh_start(tmp_path):
    ck = _saved(tmp_path / "orbax")
    for step in (1, 2):
        (ck.step_dir(step) / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(UserError) as e:
        VerifiedCheckpoints(tmp_path / "orbax").latest_step()
    msg = str(e.value)
    assert "\n" not in msg and "_CHECKPOINT_METADATA" in msg and "start this run afresh" in msg


def test_missing_or_edited_digest_is_refused(tmp_path):
    ck = _saved(tmp_path / "orbax")
    ck.digest_path(2).unlink()
    assert "missing" in ck.problem(2)
    d = json.loads(ck.digest_path(1).read_text())
    d["step"] = 7
    ck.digest_path(1).write_text(json.dumps(d))
    assert "damaged digest" in ck.problem(1)
    (ck.step_dir(1) / "extra").write_text("x")
    with pytest.raises(UserError, match="no usable checkpoint"):
        VerifiedCheckpoints(tmp_path / "orbax", warn=lambda s: None).latest_step()


def test_full_disk_during_save_is_one_exception_without_log_noise(tmp_path, monkeypatch, capfd):
    """An ENOSPC inside orbax's save propagates (the CLI prints one line); orbax's own error logs
    about it are held back, and no digest is written for the failed step."""
    ck = VerifiedCheckpoints(tmp_path / "orbax", warn=lambda s: None)
    real = ck._mgr.save

    def full(step, args):
        import logging

        logging.getLogger("absl").error("writer thread raised: No space left on device [os_error_code='28']")
        raise ValueError('RESOURCE_EXHAUSTED: Failed writing: "/x/d/1": No space left on device')

    monkeypatch.setattr(ck._mgr, "save", full)
    with pytest.raises(ValueError, match="RESOURCE_EXHAUSTED"):
        ck.save(1, _args(_state(1.0), {"history": [1]}))
    assert not ck.digest_path(1).exists()
    assert "No space left" not in capfd.readouterr().err
    monkeypatch.setattr(ck._mgr, "save", real)
    ck.save(1, _args(_state(1.0), {"history": [1]}))
    assert ck.latest_step() == 1


def _toy_chunk_run():
    """A TensorBoard stand-in and a toy (init, run) pair for the Stackelberg chunk loop."""
    import jax
    import jax.numpy as jnp

    class Writer:
        def add_scalar(self, *a, **k):
            pass

    def init(k):
        return {"w": jax.random.normal(k, (8, 4))}

    def run(st, n):
        return {"w": st["w"] * 1.5 + n}, {"loss": jnp.zeros((n,))}

    return Writer, init, run


def test_stackelberg_chunk_loop_refuses_a_damaged_checkpoint(tmp_path):
    """The Stackelberg chunk loop uses the same module: a damaged newest step is not resumed."""
    import jax

    from ccpo_jax.stackelberg.training import _train_chunks

    Writer, init, run = _toy_chunk_run()

    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    ref, ref_m = _train_chunks("t", init, run, (), (), keys, 3, 3, tmp_path / "ref", Writer(), False, {})
    root = tmp_path / "ck"
    _train_chunks("t", init, run, (), (), keys, 3, 3, root, Writer(), False, {})
    steps = root / "t" / "orbax"
    assert sorted(p.name for p in steps.iterdir() if p.is_dir()) == ["2", "3"]
    f = max((p for p in (steps / "3").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x40
    f.write_bytes(bytes(b))
    again, m = _train_chunks("t", init, run, (), (), keys, 3, 3, root, Writer(), False, {})
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(ref["w"]))
    # chunk 3 ran again from step 2; the metrics of chunks 1-2 came back from the checkpoint
    assert m["loss"].shape == (2, 3) and ref_m["loss"].shape == (2, 3)
    assert (root / "t" / "orbax.damaged").is_dir()


def test_a_save_cut_short_by_a_kill_is_removed_quietly_on_resume(tmp_path, capfd, caplog):
    """Issue 41 item 9c: a run killed while orbax saved a step leaves ``<step>.orbax-checkpoint-tmp``;
    the resume saved that step again and orbax removed the folder with an absl WARNING on stderr.
    Through the Stackelberg chunk loop (the path of ``stackelberg --resume``): no WARNING, the same
    result as an uninterrupted run, and the half-written folder is never taken for a step."""
    import logging

    import jax

    from ccpo_jax.stackelberg.training import _train_chunks

    Writer, init, run = _toy_chunk_run()

    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    root = tmp_path / "ck"
    ref, _ = _train_chunks("t", init, run, (), (), keys, 3, 3, root, Writer(), False, {})
    steps = root / "t" / "orbax"
    # what a kill during the save of step 3 leaves: step 2 complete, step 3 only as orbax's temporary folder
    for p in (steps / "3", steps / "3.digest.json"):
        p.rename(steps / "3.orbax-checkpoint-tmp") if p.is_dir() else p.unlink()
    ck = VerifiedCheckpoints(steps, warn=lambda s: None)
    assert not (steps / "3.orbax-checkpoint-tmp").exists() and ck.latest_step() == 2
    ck.close()
    (steps / "3.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG):
        again, _ = _train_chunks("t", init, run, (), (), keys, 3, 3, root, Writer(), False, {})
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(ref["w"]))
    err = capfd.readouterr().err
    assert "WARNING" not in err, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert sorted(p.name for p in steps.iterdir()) == ["2", "2.digest.json", "3", "3.digest.json"]
