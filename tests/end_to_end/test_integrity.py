"""Integrity under damage (issue 15): cache and grid checksums cover the manifest, damaged
manifests and full disks are one ``error:`` line, ``--resume`` accepts explicit defaults."""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from envs.cache.fast import load_fast, save_fast
from envs.cache.schema import CacheError, arrays_checksum
from envs.cache.formats import load_cache
from envs.cache.jsonl import read_jsonl, write_jsonl
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def syn() -> "object":
    from envs.generators.synthetic import generate

    return generate("hotpotqa-llama2", n_questions=60, seed=0)


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ccpo-jax ARGS`` through a real subprocess (tests.helpers.run_cli)."""
    return run_cli(list(args), cwd=cwd, in_subprocess=True)


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _edit_manifest(d: Path, fn) -> None:
    man = json.loads((d / "manifest.json").read_text())
    fn(man)
    (d / "manifest.json").write_text(json.dumps(man, indent=2))


# -- (a) the checksum covers the manifest ----------------------------------------------------

EDITS = {
    "guide price": lambda m: m["models"]["guide"].__setitem__("price_in", m["models"]["guide"]["price_in"] * 10),
    "base model name": lambda m: m["models"]["base"].__setitem__("name", "another-model"),
    "provenance kind": lambda m: m["provenance"].__setitem__("kind", "real"),
    "cache name": lambda m: m.__setitem__("name", "renamed"),
    "exit model names": lambda m: m.__setitem__("exit_models", list(reversed(m["exit_models"]))),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_manifest_edit_is_refused(tmp_path, syn, edit):
    d = save_fast(syn, tmp_path / "fast")
    load_fast(d)
    _edit_manifest(d, EDITS[edit])
    with pytest.raises(CacheError, match="manifest.json: checksum mismatch") as e:
        load_fast(d)
    assert "was edited" in str(e.value)


def test_manifest_edit_is_one_error_line_in_data_check(tmp_path, syn):
    d = save_fast(syn, tmp_path / "fast")
    _edit_manifest(d, EDITS["guide price"])
    _one_error_line(_cli("data", "check", str(d)), str(d / "manifest.json"), "checksum mismatch")


def test_checksum_survives_formats_and_covers_each_hashed_field(tmp_path, syn):
    d = save_fast(syn, tmp_path / "fast")
    j = write_jsonl(load_fast(d), tmp_path / "c.jsonl")
    c = read_jsonl(j)
    assert c.manifest.checksum == syn.checksum() == load_fast(d).manifest.checksum
    assert c.manifest.arrays_checksum == arrays_checksum(syn.arrays) != c.manifest.checksum
    # an edited JSONL manifest line is legitimate input, but gives another checksum
    lines = j.read_text().splitlines()
    head = json.loads(lines[0])
    head["manifest"]["models"]["guide"]["price_in"] = 25.0
    j.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    assert read_jsonl(j).manifest.checksum != syn.checksum()


def test_old_cache_gets_a_reimport_message(tmp_path, syn):
    d = save_fast(syn, tmp_path / "fast")

    def to_old(m):  # what the build before manifest checksums wrote
        del m["arrays_checksum"]
        m["checksum"] = arrays_checksum(syn.arrays)

    _edit_manifest(d, to_old)
    with pytest.raises(CacheError, match="re-import it to upgrade"):
        load_cache(d)
    # an old cache whose arrays do not match is still called damaged
    with np.load(d / "arrays.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["base_tokens_in"][0, 0] += 1
    np.savez_compressed(d / "arrays.npz", **arrays)
    with pytest.raises(CacheError, match="arrays.npz: checksum mismatch"):
        load_cache(d)


def test_resume_refuses_a_cache_whose_manifest_changed(tmp_path):
    """A JSONL cache's manifest edited between the kill and --resume (the checksum covers it)."""
    from ccpo_jax.ccpo.reproduce import reproduce
    from ccpo_jax.errors import UserError
    from envs.generators.synthetic import generate

    src = write_jsonl(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path / "c.jsonl")

    def interrupted(run, data, execution):
        execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
        raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        reproduce(cache=str(src), n_splits=2, split_sizes="60,20,20", out_dir=out, trainer=interrupted, echo=None)
    lines = src.read_text().splitlines()
    head = json.loads(lines[0])
    head["manifest"]["provenance"]["kind"] = "real"
    src.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    with pytest.raises(UserError, match="the cache changed since the run was interrupted"):
        reproduce(resume=out, trainer=interrupted, echo=None)
    # (f) an explicit --iterations equal to the (default preset's) default matches the saved None
    from ccpo_jax.ccpo.presets import get_preset

    default = get_preset("default").iterations
    with pytest.raises(UserError, match="the cache changed"):  # past the flag check
        reproduce(resume=out, iterations=default, trainer=interrupted, echo=None)
    with pytest.raises(UserError, match="iterations"):
        reproduce(resume=out, iterations=default + 1, trainer=interrupted, echo=None)


def test_grid_manifest_edit_and_old_grid(tmp_path):
    from envs.governance.grid import load_grid, save_grid
    from envs.governance.synthetic import generate_grid

    grid = generate_grid(seed=0, levels=(0.0, 0.5, 1.0), trials=1, turns=2)
    d = save_grid(grid, tmp_path / "g")
    assert load_grid(d).manifest.checksum == grid.checksum()
    for edit in (lambda m: m["provenance"].__setitem__("kind", "real"),
                 lambda m: m.__setitem__("model_conditions", list(reversed(m["model_conditions"])))):
        d = save_grid(grid, tmp_path / "g")
        _edit_manifest(d, edit)
        with pytest.raises(CacheError, match="manifest.json: checksum mismatch"):
            load_grid(d)
    d = save_grid(grid, tmp_path / "g")

    def to_old(m):
        del m["arrays_checksum"]
        m["checksum"] = arrays_checksum(grid.arrays)

    _edit_manifest(d, to_old)
    with pytest.raises(CacheError, match="re-import it to upgrade"):
        load_grid(d)


# -- (e) the trainer gets the run's TensorBoard folder (live curves: tests/ccpo/test_loop.py) ----------

ROWS = ("CPO", "CPO batch", "CPO online", "CCPO (lambda=0)", "CCPO (lambda=2e-4)")


def _fake_trainer(interrupt: bool = False):
    from ccpo_jax.ccpo.rows import LearnedRows
    from ccpo_jax.ccpo.settings import METRICS

    def fn(run, data, execution):
        execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if interrupt:
            raise KeyboardInterrupt
        S = data.splits.test.shape[0]
        rows = {r: {m: np.full(S, 0.5) for m in METRICS} for r in ROWS}
        return LearnedRows(rows=rows, timing={})

    return fn


@pytest.fixture(scope="module")
def cache100(tmp_path_factory) -> Path:
    from envs.generators.synthetic import generate

    return save_fast(generate("hotpotqa-llama2", n_questions=100, seed=0), tmp_path_factory.mktemp("c") / "c100")


def test_trainer_writes_into_the_runs_tensorboard_folder(tmp_path, cache100):
    from ccpo_jax.ccpo.prepare import TB_DIR
    from ccpo_jax.ccpo.reproduce import reproduce

    seen = {}

    def trainer(run, data, execution):
        seen.update(run=run, data=data, execution=execution)
        return _fake_trainer()(run, data, execution)

    out = tmp_path / "run"
    reproduce(cache=str(cache100), n_splits=2, split_sizes="60,20,20", out_dir=out, trainer=trainer, echo=None)
    assert seen["execution"].tb_dir == tmp_path / ".run.partial" / TB_DIR and seen["execution"].ckpt_dir.parent == seen["execution"].tb_dir.parent


# -- (c) damaged manifests and full disks: one `error:` line, exit 2, nothing left behind -----------

def _main_one_line(capsys, argv: list[str], *needles: str) -> str:
    from ccpo_jax.cli.main import main

    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-3000:])
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


DAMAGED_JSON = {"invalid UTF-8": b'{"name": "\xff\xfe"}', "100,000 nested lists": b"[" * 100_000 + b"]" * 100_000}


@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_damaged_cache_and_grid_manifest_is_one_line(tmp_path, syn, capsys, damage):
    d = save_fast(syn, tmp_path / "fast")
    (d / "manifest.json").write_bytes(DAMAGED_JSON[damage])
    _main_one_line(capsys, ["data", "check", str(d)], str(d / "manifest.json"))
    _main_one_line(capsys, ["data", "export", str(d), "--out", str(tmp_path / "x.jsonl")], "manifest.json")
    assert not (tmp_path / "x.jsonl").exists()
    from envs.governance.grid import load_grid, save_grid
    from envs.governance.synthetic import generate_grid

    g = save_grid(generate_grid(seed=0, levels=(0.0, 1.0), trials=1, turns=1), tmp_path / "g")
    (g / "manifest.json").write_bytes(DAMAGED_JSON[damage])
    with pytest.raises(CacheError, match="manifest.json"):
        load_grid(g)
    j = tmp_path / "g.jsonl"
    j.write_bytes(DAMAGED_JSON[damage])
    with pytest.raises(CacheError, match="g.jsonl:1"):
        load_grid(j)


@pytest.fixture(scope="module")
def run_with_policies(tmp_path_factory, syn):
    """A reproduce --out with one trained-format policy (weights untrained), for export."""
    import types

    import jax
    import jax.numpy as jnp

    from ccpo_jax.ccpo.config import TrainConfig, Variant
    from ccpo_jax.ccpo.policy_store import save_policies
    from ccpo_jax.core.networks import policy_net
    from envs.replay.features import n_features

    root = tmp_path_factory.mktemp("run")
    p = policy_net().init(jax.random.PRNGKey(0), jnp.zeros((n_features(syn.T),), jnp.float32))
    state = types.SimpleNamespace(policy=jax.tree.map(lambda a: np.asarray(a)[None, None, None], p),
                                  kappa=np.array([[[0.3]]], np.float32))
    save_policies(root / "policies", TrainConfig(), [Variant("CCPO (lambda=0)", True, 0.0)], state,
                  {"CCPO (lambda=0)": np.array([[0.3]], np.float32)}, syn, "recalibrate")
    return root


@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_damaged_artefact_and_policy_manifest_is_one_line(tmp_path, run_with_policies, capsys, damage):
    import shutil

    from ccpo_jax.cli.main import main

    art = tmp_path / "art"
    assert main(["export", str(run_with_policies), "--out", str(art)]) == 0
    capsys.readouterr()
    (art / "manifest.json").write_bytes(DAMAGED_JSON[damage])
    req = tmp_path / "req.jsonl"
    req.write_text("{}\n")
    _main_one_line(capsys, ["route", str(art), "--input", str(req)], str(art / "manifest.json"))
    run = tmp_path / "run"
    shutil.copytree(run_with_policies, run)
    (run / "policies" / "ccpo-lambda-0" / "policy.json").write_bytes(DAMAGED_JSON[damage])
    _main_one_line(capsys, ["export", str(run), "--out", str(tmp_path / "art2")], "policies")
    _main_one_line(capsys, ["export", str(run), "--row", "CCPO (lambda=0)", "--out", str(tmp_path / "art2")],
                   "ccpo-lambda-0")
    assert not (tmp_path / "art2").exists()


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_in_data_commands(tmp_path, syn, capsys, monkeypatch):
    src = write_jsonl(syn, tmp_path / "src.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(np, "savez_compressed", _enospc)
    _main_one_line(capsys, ["data", "import", "--format", "jsonl", str(src), "--out", str(out / "fast")],
                   "No space left on device")
    _main_one_line(capsys, ["data", "synth", "--questions", "50", "--out", str(out / "syn")], "No space left")
    monkeypatch.setattr(os, "replace", _enospc)
    _main_one_line(capsys, ["data", "export", str(src), "--out", str(out / "e.jsonl")], "No space left")
    assert os.listdir(out) == []


def test_full_disk_in_export(tmp_path, run_with_policies, capsys, monkeypatch):
    import ccpo_jax.ccpo.export as ex

    monkeypatch.setattr(ex.np, "savez", _enospc)
    line = _main_one_line(capsys, ["export", str(run_with_policies), "--out", str(tmp_path / "art")])
    assert line == "error: no space left on device; free some space and run again"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["plots", "orbax", "atomic-write"])
def test_full_disk_in_reproduce(tmp_path, cache100, capsys, monkeypatch, where):
    import ccpo_jax.ccpo.rows as rows_module
    from ccpo_jax.ccpo import report

    fake = _fake_trainer()
    if where == "plots":
        monkeypatch.setattr(report, "write_boxplots", lambda *a, **k: _enospc())
    elif where == "orbax":  # what tensorstore raises from a checkpoint save on a full disk
        def fake(run, data, execution):
            execution.ckpt_dir.mkdir(parents=True, exist_ok=True)
            raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "policy.kernel/0.0" in OCDBT database: Failed '
                             f'writing: "{execution.ckpt_dir}/orbax/1/d/ab12": Failed to write 4096 bytes to file 4: '
                             "No space left on device [os_error_code='28']")
    else:  # every file write (run.json first) goes through envs.cache.atomic.atomic_write_bytes
        import envs.cache.atomic

        monkeypatch.setattr(envs.cache.atomic, "atomic_write_bytes", _enospc)
    monkeypatch.setattr(rows_module, "learned_rows", fake)
    out = tmp_path / "runs" / "r"
    line = _main_one_line(capsys, ["reproduce", "--cache", str(cache100), "--splits", "2", "--split-sizes",
                                   "60,20,20", "--out", str(out), "--no-progress"], "no space left on device")
    if where == "orbax":
        assert "writing " + str(tmp_path / "runs" / ".r.partial" / "checkpoints") in line
    assert not out.exists() and not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == []


def test_full_disk_in_stackelberg(tmp_path, capsys, monkeypatch):
    import ccpo_jax.stackelberg.pipeline as sp

    monkeypatch.setattr(sp, "ScalarWriter", _enospc)
    out = tmp_path / "stk"
    _main_one_line(capsys, ["stackelberg", "--quick", "--no-progress", "--out", str(out)], "no space left")
    assert not out.exists()


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_real_full_disk_on_a_small_tmpfs(tmp_path, syn):
    """Where the machine allows mounting a tmpfs (root): a real ENOSPC through the CLI subprocess."""
    mnt = tmp_path / "full"
    if not _tmpfs(mnt, "4k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        src = write_jsonl(syn, tmp_path / "src.jsonl")
        for argv in (["data", "import", "--format", "jsonl", str(src), "--out", str(mnt / "fast")],
                     ["data", "export", str(src), "--out", str(mnt / "e.jsonl")]):
            _one_error_line(_cli(*argv), "No space left on device")
            assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_while_writing_tensorboard_raises_instead_of_hanging(tmp_path, monkeypatch):
    """tensorboardX's background writer thread died on ENOSPC and the 11th add_scalar then blocked
    forever; the synchronous writer raises the OSError where the scalar is added."""
    import threading

    import tensorboardX.record_writer as rw

    from ccpo_jax.runtime.scalars import ScalarWriter

    calls = {"n": 0}
    real = rw.RecordWriter.write

    def write(self, data):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(rw.RecordWriter, "write", write)
    box: dict = {}

    def run():
        try:
            with ScalarWriter(tmp_path / "tb") as w:
                for i, x in enumerate(np.linspace(0, 1, 100)):
                    w.add_scalar("CPO/kappa", float(x), i)
        except OSError as e:
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and box["err"].errno == errno.ENOSPC
