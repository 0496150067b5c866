"""The typed run configuration (ccpo_jax.runtime.options, ccpo_jax.ccpo.run_config): the flags,
checks, error flag names, run.json and the resume check all come from the dataclass fields."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

from ccpo_jax.ccpo.run_config import REPRODUCE_FLAGS, ReproduceConfig, RunOptions
from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import option


def _parse(cls, argv):
    p = argparse.ArgumentParser()
    options.add_flags(p, cls)
    return options.given(cls, p.parse_args(argv))


def test_the_flags_are_the_fields():
    # the flag of every field, as the hand-written flag map before the typed configuration had it
    assert REPRODUCE_FLAGS == {
        "setting": "--setting", "cache": "--cache", "n_splits": "--splits", "protocol": "--protocol",
        "alpha": "--alpha", "iterations": "--iterations", "split_sizes": "--split-sizes", "out_dir": "--out",
        "seed": "--seed", "resume": "--resume", "devices": "--devices", "member_block": "--member-block",
        "seeds": "--seeds", "preset": "--preset", "overrides": "--set", "progress": "--no-progress",
        "discard_failed": "--discard-failed", "calibration": "--calibration", "group_min": "--group-min",
        "guarantee": "--guarantee", "delta": "--delta", "guide_cap": "--guide-cap",
        "cost_cap": "--cost-cap"}
    assert _parse(ReproduceConfig, []) == {}  # flags left out are not passed (the fields' defaults apply)
    got = _parse(ReproduceConfig, ["--splits", "3", "--set", "batch_size=20", "--set", "lr=0.01", "--no-progress",
                                   "--alpha", "0.2", "--split-sizes", "60,20,20", "--devices", "all"])
    assert got == {"n_splits": 3, "overrides": ["batch_size=20", "lr=0.01"], "progress": False, "alpha": 0.2,
                   "split_sizes": "60,20,20", "devices": "all"}
    with pytest.raises(SystemExit):  # choices come from the field
        _parse(ReproduceConfig, ["--protocol", "sometimes"])


def test_a_configuration_is_checked_and_resolved_when_built():
    cfg = ReproduceConfig()
    assert (cfg.setting, cfg.n_splits, cfg.protocol, cfg.seed, cfg.seeds, cfg.preset) == \
        ("hotpotqa-llama2-a0.1", 100, "recalibrate", 0, 5, "default")
    assert cfg.alpha == 0.1 and cfg.split_sizes == (1000, 200, 200) and cfg.lambdas == (2e-4,)  # the setting's
    mmlu = ReproduceConfig(setting="mmlu-llama3-a0.2", split_sizes="60, 20,20", overrides="batch_size=20")
    assert mmlu.alpha == 0.2 and mmlu.split_sizes == (60, 20, 20) and mmlu.overrides == ("batch_size=20",)
    assert ReproduceConfig(n_splits=None).n_splits == 100  # None = the default
    assert dataclasses.replace(mmlu, seed=3) == ReproduceConfig(setting="mmlu-llama3-a0.2", split_sizes=(60, 20, 20),
                                                                 overrides=["batch_size=20"], seed=3)
    for kw, field in [({"n_splits": 0}, "n_splits"), ({"alpha": 1.5}, "alpha"), ({"seed": -1}, "seed"),
                      ({"split_sizes": "60,20"}, "split_sizes"), ({"protocol": "x"}, "protocol"),
                      ({"preset": "fast"}, "preset"), ({"overrides": ["nope=1"]}, "overrides"),
                      ({"overrides": ["alpha=0.2"]}, "overrides"), ({"setting": "gpt5"}, "setting"),
                      ({"cache": "does/not/exist"}, "cache"), ({"member_block": 0}, "member_block"),
                      ({"iterations": True}, "iterations")]:
        with pytest.raises(UserError) as e:
            ReproduceConfig(**kw)
        assert e.value.field == field and str(e.value).startswith(field), (kw, e.value)
        assert str(e.value.for_cli(REPRODUCE_FLAGS)).startswith(REPRODUCE_FLAGS[field])


def test_every_integer_option_stops_at_int32_before_anything_runs(tmp_path):
    """Integer options end up in the trainer's int32 arrays: --group-min 2147483648 trained, then
    crashed in mondrian_kappa with an OverflowError (and its resume crashed the same way)."""
    from ccpo_jax.ccpo.run_config import SweepConfig
    from tests.helpers import run_cli

    for cls in (ReproduceConfig, SweepConfig):
        ints = [f.name for f in dataclasses.fields(cls) if "option" in f.metadata and f.metadata["option"].type is int]
        assert set(ints) == {"n_splits", "iterations", "seed", "seeds", "member_block"} | (
            {"group_min"} if cls is ReproduceConfig else set())
        for name in ints:
            assert getattr(cls(**{name: options.INT32_MAX}), name) == 2**31 - 1
            with pytest.raises(UserError, match=r"must be at most 2147483647 \(the largest int32") as e:
                cls(**{name: 2**31})
            assert e.value.field == name
    r = run_cli(["reproduce", "--calibration", "mondrian", "--group-min", "2147483648", "--out", str(tmp_path / "o")],
                cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --group-min: the smallest group must be at most "
                                                     "2147483647") and r.stderr.count("\n") == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_real_options_must_survive_float32():
    """alpha and the trainer's real fields reach JAX as float32: past its range they are inf, below its
    smallest normal the compiled code flushes them to 0, and 1 - 1e-10 is 1."""
    for alpha, why in [(1 - 1e-10, "0.9999999999 is 1.0 in float32, the precision the trainer computes in, which is "
                                   "not in (0, 1)"),
                       (1e-50, "1e-50 is 0 to the trainer (below 1.175e-38, the smallest normal float32")]:
        with pytest.raises(UserError) as e:
            ReproduceConfig(alpha=alpha)
        assert e.value.field == "alpha" and str(e.value).startswith("alpha: " + why), e.value
    assert ReproduceConfig(alpha=1e-30).alpha == 1e-30  # a normal float32 (refused or warned of only by its calibration size)
    for item, why in [("batch_size=2147483648", "2147483648 is past the int32 range"),
                      ("hidden=64,2147483648", "2147483648 is past the int32 range"),
                      ("delta=1e300", "1e+300 is not finite in float32"), ("damping=1e-40", "1e-40 is 0 to the trainer")]:
        with pytest.raises(UserError) as e:
            ReproduceConfig(overrides=[item])
        assert e.value.field == "overrides" and why in str(e.value), (item, e.value)
    assert ReproduceConfig(overrides=["delta=3e38", "batch_size=2147483647"]).overrides == ("delta=3e38",
                                                                                          "batch_size=2147483647")


def test_run_json_round_trip_and_the_resume_check(tmp_path):
    cache = tmp_path / "c.jsonl"
    cache.write_text("")
    cfg = ReproduceConfig(cache=str(cache), n_splits=2, split_sizes="60,20,20", seeds=2, overrides=["batch_size=20"],
                          out_dir=tmp_path / "o", devices=2)
    saved = json.loads(json.dumps(options.saved(cfg)))
    assert set(saved) == {"setting", "cache", "n_splits", "protocol", "alpha", "iterations", "split_sizes", "seed",
                          "lambdas", "seeds", "preset", "overrides", "calibration", "group_min", "guarantee",
                          "delta", "guide_cap", "cost_cap"}  # execution options are not saved
    assert saved["split_sizes"] == [60, 20, 20] and saved["cache"] == str(cache.absolute())
    back = options.from_saved(ReproduceConfig, saved, out_dir=tmp_path / "o", devices=2)
    assert back == cfg
    # a run.json written before `seeds`, `preset` and `overrides` existed
    old = options.from_saved(ReproduceConfig, {k: v for k, v in saved.items()
                                               if k not in ("seeds", "preset", "overrides", "calibration", "group_min")})
    assert (old.seeds, old.preset, old.overrides, old.calibration, old.group_min) == (1, "default", (), "marginal", 20)
    assert options.resume_mismatch(back, {}) is None
    # given again: equal once checked (a relative path, "a,b,c", the preset's iterations for a saved None)
    same = {"split_sizes": "60,20,20", "seeds": 2, "iterations": back.train_config().iterations,
            "overrides": "batch_size=20", "progress": False, "devices": 4, "member_block": 1}
    assert options.resume_mismatch(back, same) is None
    assert options.resume_mismatch(back, {"n_splits": 5}) == ("n_splits", 2, 5)
    assert options.resume_mismatch(back, {"iterations": back.train_config().iterations + 1})[0] == "iterations"
    assert options.resume_mismatch(back, {"overrides": []}) == ("overrides", ("batch_size=20",), ())


def _killed_run(tmp_path, name, saved):
    """``tmp_path/name`` as a killed run: its work directory with ``saved`` as run.json."""
    out = tmp_path / name
    work = tmp_path / f".{name}.partial"
    work.mkdir()
    (work / "run.json").write_text(json.dumps(saved))
    return out, work


def test_resume_names_the_command_that_made_the_run(tmp_path):
    """A sweep's run resumed by reproduce said "run.json is damaged ('alpha')" (and the reverse
    'alphas'); now the command that made it. A reproduce run.json written before reproduce saved
    `command` (none) is reproduce's; stackelberg's is {"config": ...}."""
    from ccpo_jax.ccpo.run_config import SweepConfig
    from tests.helpers import run_cli

    sweep_json = dict(options.saved(SweepConfig(split_sizes="60,20,20")), command="sweep")
    old_reproduce_json = options.saved(ReproduceConfig(split_sizes="60,20,20"))
    for name, saved, command, maker in [("sw", sweep_json, "reproduce", "sweep"),
                                        ("old", old_reproduce_json, "sweep", "reproduce"),
                                        ("new", dict(old_reproduce_json, command="reproduce"), "sweep", "reproduce"),
                                        ("stk", {"config": {"quick": True}}, "sweep", "stackelberg"),
                                        ("stk2", {"config": {"quick": True}}, "reproduce", "stackelberg"),
                                        ("sw2", sweep_json, "stackelberg", "sweep"),  # said "damaged ('config')"
                                        ("old2", old_reproduce_json, "stackelberg", "reproduce")]:
        out, work = _killed_run(tmp_path, name, saved)
        r = run_cli([command, "--resume", str(out)], cwd=tmp_path)
        assert r.returncode == 2 and r.stderr == (
            f"error: --resume: {out} was made by `ccpo-jax {maker}`, not `ccpo-jax {command}`; resume it with "
            f"`ccpo-jax {maker} --resume {out}`\n"), r.stderr
        assert (work / "run.json").is_file()  # left as it was


def test_resume_refuses_a_saved_value_that_the_checks_refuse(tmp_path):
    """A run.json saved before a check existed (--group-min 2147483648 was accepted, then crashed after
    training, and so did every resume): the resume names the saved value and the way out."""
    from tests.helpers import run_cli

    saved = dict(options.saved(ReproduceConfig(split_sizes="60,20,20", calibration="mondrian")), group_min=2**31)
    out, work = _killed_run(tmp_path, "gm", saved)
    r = run_cli(["reproduce", "--resume", str(out)], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == (
        f"error: --resume: {work / 'run.json'}: the saved --group-min is refused now (the smallest group must be at "
        f"most 2147483647 (the largest int32, the trainer's integer type), got 2147483648); this run cannot be "
        f"resumed: delete {work} and start it afresh\n"), r.stderr
    # a damaged run.json is still called damaged, naming what is missing
    _, work2 = _killed_run(tmp_path, "cut", {k: v for k, v in saved.items() if k != "alpha"})
    with pytest.raises(UserError, match=r"run.json is damaged \(KeyError: 'alpha'\)") as e:
        from ccpo_jax.ccpo.reproduce import reproduce

        reproduce(resume=tmp_path / "cut", echo=None)
    assert e.value.field == "resume" and (work2 / "run.json").is_file()


def test_adding_an_option_is_adding_a_field():
    """What a new command or option needs: a field; here a sweep-like command on the shared options
    (issue 23's `sweep`) and an evaluation option with a choice (issue 24's `--calibration`)."""

    def _alphas(name, v, cfg):
        alphas = tuple(float(a) for a in (v.split(",") if isinstance(v, str) else v or (0.1,)))
        if not all(0 < a < 1 for a in alphas):
            raise UserError(f"{name}: every alpha must be in (0, 1), got {v!r}", field=name)
        return alphas

    @dataclasses.dataclass(frozen=True)
    class Sweep(RunOptions):
        alphas: tuple[float, ...] = option("--alphas", help="miscoverages, comma-separated", metavar="A,B",
                                           check=_alphas)
        calibration: str = option("--calibration", help="conformal calibration", choices=("marginal", "mondrian"),
                                  default="marginal")

    flags = options.flag_names(Sweep)
    assert set(flags) == set(options.flag_names(RunOptions)) | {"alphas", "calibration"}
    got = _parse(Sweep, ["--alphas", "0.1,0.2", "--calibration", "mondrian", "--splits", "4"])
    cfg = Sweep(**got)
    assert cfg.alphas == (0.1, 0.2) and cfg.calibration == "mondrian" and cfg.n_splits == 4
    assert options.saved(cfg)["alphas"] == [0.1, 0.2] and "--calibration marginal|mondrian" in options.markdown(Sweep)
    assert options.resume_mismatch(cfg, {"alphas": "0.1,0.3"})[0] == "alphas"
    with pytest.raises(UserError) as e:
        Sweep(alphas="0.1,2")
    assert str(e.value.for_cli(flags)).startswith("--alphas: ")


def test_devices_all_forces_one_host_device_per_core(monkeypatch):
    """``--devices all`` on a CPU host: one forced host device per usable core (JAX not started yet);
    a user's own XLA_FLAGS count wins; an integer is taken as it is."""
    from jax._src import xla_bridge

    from ccpo_jax.cli import main as cli_main

    assert 1 <= cli_main.usable_cores() <= (os.cpu_count() or 1)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(cli_main, "usable_cores", lambda: 3)
    monkeypatch.delenv("CCPO_JAX_DISTRIBUTED", raising=False)
    for devices, want in (("all", "--xla_force_host_platform_device_count=3"),
                          (" ALL ", "--xla_force_host_platform_device_count=3"),
                          ("2", "--xla_force_host_platform_device_count=2"), (None, ""), ("1", "")):
        monkeypatch.setenv("XLA_FLAGS", "")
        cli_main.force_host_devices(devices)
        assert os.environ["XLA_FLAGS"] == want, devices
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=5")
    cli_main.force_host_devices("all")
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=5"


# -- options that carry their values (issue 39, items 3) ------------------------------------

def test_calibration_is_one_enum_read_where_it_is_used(tmp_path):
    """``--calibration`` resolves to the Calibration StrEnum (equal to its text, saved as it in
    run.json); a configuration without the option (a sweep's) reads as marginal."""
    from ccpo_jax.ccpo.calibration import CALIBRATIONS, Calibration
    from ccpo_jax.ccpo.run_config import SweepConfig

    cfg = ReproduceConfig(calibration="mondrian")
    assert cfg.calibration is Calibration.MONDRIAN and cfg.calibration == "mondrian"
    assert json.loads(json.dumps(options.saved(cfg)))["calibration"] == "mondrian"
    assert Calibration.of(ReproduceConfig()) is Calibration.MARGINAL
    assert Calibration.of(SweepConfig()) is Calibration.MARGINAL
    assert CALIBRATIONS == ("marginal", "mondrian")
    with pytest.raises(UserError, match="^calibration: unknown calibration 'x'") as e:
        ReproduceConfig(calibration="x")
    assert e.value.field == "calibration"


def test_alpha_has_one_home_and_the_variants_carry_it():
    """The run's alpha (ReproduceConfig.alpha, or each of SweepConfig.alphas) is on every row
    variant; the trainer configuration has no alpha of its own (no stand-in for a sweep)."""
    from ccpo_jax.ccpo.rows import row_variants
    from ccpo_jax.ccpo.run_config import SweepConfig

    cfg = ReproduceConfig(alpha=0.2)
    tc = cfg.train_config()
    assert not hasattr(tc, "alpha") and not hasattr(SweepConfig().train_config(), "alpha")
    variants = row_variants(cfg.lambdas, tc, cfg.alpha)
    assert len(variants) == 4 and {v.alpha for v in variants} == {0.2}


def test_the_guarantee_is_looked_up_once_and_each_command_says_its_alphas(tmp_path):
    """One lookup (``guarantee_of``, built once per configuration) and ``run_alphas`` typed per command: what
    the calibration, the learned rows and ``prepare`` read instead of ``getattr`` / ``hasattr(cfg, "alphas")``."""
    from ccpo_jax.ccpo.prepare import default_member_block
    from ccpo_jax.ccpo.rows import RowsRun
    from ccpo_jax.ccpo.run_config import SweepConfig
    from ccpo_jax.core.guarantee import PAC, Marginal

    cfg = ReproduceConfig(guarantee="pac", delta=0.2, alpha=0.5, guide_cap=0.9, split_sizes="100,60,60")
    assert cfg.guarantee_of == PAC(0.2, 0.9) and cfg.guarantee_of is cfg.guarantee_of
    assert cfg.run_alphas == (0.5,) and ReproduceConfig().guarantee_of == Marginal()
    sw = SweepConfig(alphas="0.1,0.2", guarantee="pac", split_sizes="100,60,60")
    assert sw.run_alphas == (0.1, 0.2) and sw.guarantee_of == PAC(0.1)
    # --delta's check reads every alpha of the sweep: 0.05 needs 45 calibration questions at delta 0.1
    with pytest.raises(UserError, match="at alpha 0.05"):
        SweepConfig(alphas="0.05,0.2", guarantee="pac", split_sizes="100,40,60")
    assert RowsRun(None, alpha=0.3).run_alphas == (0.3,) and RowsRun(None, alphas=(0.1, 0.2)).run_alphas == (0.1, 0.2)
    # a sweep's member block is one reproduce run's batch under either protocol; reproduce's only under retrain
    assert default_member_block(SweepConfig(seeds=2)) == 8 and default_member_block(ReproduceConfig(seeds=2)) is None
    assert default_member_block(ReproduceConfig(seeds=2, protocol="retrain")) == 4 * 2  # CPO twice, CCPO 0 and 2e-4


def test_stackelberg_and_export_flags_are_their_typed_fields():
    """``stackelberg`` and ``export`` take their flags from typed fields, as ``reproduce``: the
    parser has exactly those flags, and a bad value is refused by the field's check."""
    from ccpo_jax.ccpo.run_config import EXPORT_FLAGS, ExportConfig
    from ccpo_jax.stackelberg.options import STACKELBERG_FLAGS, StackelbergOptions

    assert STACKELBERG_FLAGS == {
        "out": "--out", "resume": "--resume", "episodes": "--episodes", "turns": "--turns", "seed": "--seed",
        "seed_list": "--seed-list", "seeds": "--seeds", "grid": "--grid", "write_grid": "--write-grid",
        "leader_profile": "--leader-profile", "quick": "--quick", "progress": "--no-progress"}
    assert EXPORT_FLAGS == {"run_dir": "RUN_DIR", "row": "--row", "force": "--force", "calibration": "--calibration",
                            "guarantee": "--guarantee", "out": "--out"}
    got = _parse(StackelbergOptions, ["--out", "o", "--quick", "--no-progress", "--seed-list", "3,1"])
    s = StackelbergOptions(**got)
    assert s.quick and not s.progress and s.seed_list == (3, 1) and str(s.out_dir) == "o" and s.seed == 0
    assert s.config().seed == 0 and s.config().eval.episodes == StackelbergOptions(out="o", quick=True).config().eval.episodes
    for kw, field in ((dict(out="o", episodes=1), "episodes"), (dict(out="o", turns=65), "turns"),
                      (dict(out="o", seeds=0), "seeds"), (dict(out="o", seed_list="0,a"), "seed_list"),
                      (dict(out="o", leader_profile="nope"), "leader_profile"), (dict(out="a", resume="b"), "resume"),
                      ({}, "out")):
        with pytest.raises(UserError) as e:
            StackelbergOptions(**kw)
        assert e.value.field == field and str(e.value.for_cli(STACKELBERG_FLAGS)).startswith(STACKELBERG_FLAGS[field])
    e_cfg = ExportConfig(**_parse(ExportConfig, ["run", "--out", "art", "--calibration", "mondrian"]))
    assert str(e_cfg.run_dir) == "run" and str(e_cfg.out) == "art" and e_cfg.calibration == "mondrian"
    assert e_cfg.row is None and e_cfg.force is False and e_cfg.guarantee is None
    with pytest.raises(SystemExit):  # --out is required on the command line
        _parse(ExportConfig, ["run"])


def test_stackelberg_bad_flag_is_one_error_line_naming_it(tmp_path):
    from tests.helpers import run_cli

    for argv, flag in ((["--episodes", "1"], "--episodes"), (["--turns", "0"], "--turns"), (["--seeds", "0"], "--seeds"),
                       (["--resume", str(tmp_path / "other")], "--resume")):
        r = run_cli(["stackelberg", "--out", str(tmp_path / "x"), *argv])
        assert r.returncode == 2 and r.stderr.startswith(f"error: {flag}") and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()
    r = run_cli(["stackelberg"])
    assert r.returncode == 2 and r.stderr.startswith("error: --out: the output directory is required (or --resume OUT")
