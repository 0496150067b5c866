"""The typed options of ``ccpo-jax stackelberg``: one field per flag (``ccpo_jax.runtime.options``).

From the fields come the flags, their help and defaults, the checks (a bad value is a
:class:`ccpo_jax.errors.UserError` naming the field, which the CLI turns into the flag) and
:meth:`StackelbergOptions.config`, the pipeline's :class:`ccpo_jax.stackelberg.config.StackelbergConfig`.
Nothing here imports jax at module level, so ``ccpo-jax --help`` stays fast.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ccpo_jax.errors import UserError
from ccpo_jax.runtime import options
from ccpo_jax.runtime.options import check_int, option


def _path(name: str, v: Any, cfg: Any) -> Path | None:
    return None if v is None else Path(v)


def _resume(name: str, v: Any, cfg: Any) -> Path | None:
    """``--resume OUT`` continues the run of ``--out`` (the same directory, or no ``--out``); one of them is needed."""
    if v is not None and cfg.out is not None and Path(cfg.out) != Path(v):
        raise UserError("resume: do not combine with a different `out` (the run resumes into its own)", field=name)
    if v is None and cfg.out is None:
        raise UserError("out: the output directory is required (or `resume` OUT to continue a killed run)", field="out")
    return None if v is None else Path(v)


def _episodes(name: str, v: Any, cfg: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
        raise UserError(f"episodes: need at least 2 episodes, got {v}", field=name)
    return v


def _turns(name: str, v: Any, cfg: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64):
        raise UserError(f"turns: must be between 1 and 64, got {v}", field=name)
    return v


def _seed_list(name: str, v: Any, cfg: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    try:
        seeds = [int(x) for x in v.split(",")] if isinstance(v, str) else [int(x) for x in v]
    except (TypeError, ValueError):
        raise UserError(f"seed_list: expected integers separated by commas, got {v!r}", field=name) from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise UserError(f"seed_list: expected distinct non-negative seeds, got {v!r}", field=name)
    return tuple(seeds)


def _leader_profile(name: str, v: Any, cfg: Any) -> str:
    from envs.governance.session import LEADER_PROFILES

    if v not in LEADER_PROFILES:
        raise UserError(f"leader_profile: must be one of {', '.join(sorted(LEADER_PROFILES))}, got {v!r}", field=name)
    return v


@dataclasses.dataclass(frozen=True)
class StackelbergOptions:
    """``ccpo-jax stackelberg``: where the run goes and the few sizes a user sets (None = default)."""

    out: Path | None = option("--out", help="output directory, must not exist (results.json, table.md, pareto PNGs, "
                              "tb/, checkpoints/, run.json); built in .OUT.partial and renamed when complete",
                              metavar="OUT", check=_path)
    resume: Path | None = option("--resume", help="continue the killed run of OUT (its .OUT.partial work directory) "
                                 "from its last checkpoint; pass the options of that run (a different configuration "
                                 "is refused). With --seed-list: finished seeds are kept, the interrupted one "
                                 "continues, the rest run", metavar="OUT", check=_resume)
    episodes: int | None = option("--episodes", help="episodes of the large evaluation", metavar="EPISODES", type=int,
                                  default_doc="10000; --quick: 1000", check=_episodes)
    turns: int | None = option("--turns", help="turns per evaluated session", metavar="TURNS", type=int,
                               default_doc="3, as in the paper", check=_turns)
    seed: int = option("--seed", help="PRNG seed of training and evaluation", metavar="SEED", type=int, default=0)
    seed_list: tuple[int, ...] | None = option("--seed-list", help="run once per seed into OUT/seed_S and write the "
                                               "seed spread to OUT/spread.md and spread.json", metavar="S,S,...",
                                               check=_seed_list)
    seeds: int | None = option("--seeds", help="training seeds vmapped in one program", metavar="SEEDS", type=int,
                               default_doc="2", check=check_int("the number of seeds", 1))
    grid: str | None = option("--grid", help="a response grid (.jsonl human format or fast-format directory)",
                              metavar="GRID", default_doc="SYNTHETIC")  # as given: run.json records it
    write_grid: Path | None = option("--write-grid", help="also write the grid used to PATH (.jsonl or directory)",
                                     metavar="PATH", check=_path)
    leader_profile: str = option("--leader-profile", help="the leader's utility: 'paper' or the SYNTHETIC "
                                 "'state-feedback' (the leader gains from tokens on chat, QA and writing and pays "
                                 "them on the other three task types, so its best policy depends on the task; "
                                 "docs/stackelberg.md)", metavar="NAME", default="paper", check=_leader_profile)
    quick: bool = option("--quick", help="tiny sizes for a smoke run (same code paths)", switch=True, default=False)
    progress: bool = option("--no-progress", help="no progress bars", switch=False, default=True)

    def __post_init__(self) -> None:
        options.resolve(self)

    @property
    def out_dir(self) -> Path:
        """The run's directory: ``--out``, or the run ``--resume`` continues."""
        return self.out if self.out is not None else self.resume

    def config(self) -> Any:
        """The pipeline's configuration: the leader profile, ``--quick``'s sizes, then the sizes given."""
        from ccpo_jax.stackelberg.config import StackelbergConfig

        r = dataclasses.replace
        cfg = StackelbergConfig().with_leader_profile(self.leader_profile)
        if self.quick:
            cfg = cfg.quick()
        if self.episodes is not None:
            cfg = r(cfg, eval=r(cfg.eval, episodes=self.episodes))
        if self.turns is not None:
            cfg = r(cfg, eval=r(cfg.eval, turns=self.turns))
        if self.seeds is not None:
            cfg = r(cfg, seeds=self.seeds)
        return r(cfg, seed=self.seed, eval=r(cfg.eval, seed=self.seed), grid=r(cfg.grid, path=self.grid))


#: Field -> flag, for error messages.
STACKELBERG_FLAGS = options.flag_names(StackelbergOptions)
