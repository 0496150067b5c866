"""A run's output directory built in a hidden work directory, shared by ``reproduce``, ``sweep`` and ``stackelberg``.

A run writes into ``<parent>/.<name>.partial`` (:func:`work_dir`) and renames it to ``out`` only when
complete, so ``out`` never holds a half-written run. A killed run leaves the work directory (with its
checkpoints and the saved configuration, ``run_file``) behind, and ``--resume OUT`` continues it:
:func:`interrupted_run` finds it. :func:`committed` is the one place that creates the work directory,
renames it when the run completes and decides what stays after an interrupt or a failure. Errors are :class:`ccpo_jax.errors.UserError` naming the field.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from ccpo_jax.errors import UserError, add_hint
from ccpo_jax.runtime.checkpoints import completed_steps

SUFFIX = ".partial"


def work_dir(out: Path) -> Path:
    """The hidden work directory of ``out``: ``<parent>/.<name>.partial``."""
    return out.parent / f".{out.name}{SUFFIX}"


def has_checkpoints(work: Path, ckpt_dir: str = "checkpoints") -> bool:
    """Whether the work directory holds at least one completed training checkpoint (a step with its
    digest): a save cut short by a full disk leaves folders, but nothing a resume could start from."""
    return bool(completed_steps(work / ckpt_dir))


def after_failure(exc: BaseException, work: Path, *, created: bool, resume_hint: str, discard: bool = False,
                  ckpt_dir: str = "checkpoints") -> None:
    """Keep or remove the work directory of a run that failed with ``exc``, and say which (a hint on ``exc``).

    A completed checkpoint is worth keeping (unless ``discard``): ``resume_hint`` says how to go on. With
    none, a new run's (``created``) work directory is removed, a resumed run's stays as it was. Once
    training had started (``ckpt_dir`` exists) the hint says that no checkpoint had completed, so that
    a full disk during the first save is not reported as a run that can be continued from a checkpoint.
    """
    if has_checkpoints(work, ckpt_dir) and not discard:
        add_hint(exc, f"the training checkpoints are kept in {work}; {resume_hint} (or delete {work})")
        return
    started = (work / ckpt_dir).is_dir()
    if created or discard:
        shutil.rmtree(work, ignore_errors=True)
        if started:
            add_hint(exc, "no training checkpoint had completed; nothing was kept")
    elif started:
        add_hint(exc, f"no training checkpoint had completed; {work} keeps the run's configuration; "
                      f"{resume_hint} (or delete {work})")


def check_new_out(out: Path, field: str = "out_dir") -> None:
    """``out`` must not exist yet (nor an interrupted run of it), and its folder must be creatable."""
    if out.exists() or out.is_symlink():
        raise UserError(f"{field}: {out} already exists; choose a new directory (results are never overwritten)",
                        field=field)
    anc = out.parent
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise UserError(f"{field}: cannot create {out}: {anc} is not a directory", field=field)
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"{field}: cannot create {out}: {anc} is not writable", field=field)
    work = work_dir(out)
    if work.exists():
        raise UserError(f"{field}: an interrupted run for {out} exists ({work}); resume that run, "
                        f"or delete {work}", field=field)


def interrupted_run(resume: Path, run_file: str, results_file: str = "results.json",
                    field: str = "resume") -> tuple[Path, Path]:
    """(out, work dir) of the killed run named by ``resume`` (its out dir, or the work dir itself);
    refuses a finished run and a directory without the saved configuration ``run_file``."""
    if resume.name.startswith(".") and resume.name.endswith(SUFFIX):
        out = resume.parent / resume.name[1:-len(SUFFIX)]
    else:
        out = resume
    work = work_dir(out)
    if (out / results_file).is_file():
        raise UserError(f"{field}: {out} holds a finished run ({results_file} exists); nothing to resume", field=field)
    if not (work / run_file).is_file():
        raise UserError(f"{field}: no interrupted run for {out} (expected {work / run_file})", field=field)
    return out, work


def made_by(saved: Any) -> str | None:
    """The command whose run.json ``saved`` is: ``sweep`` and ``reproduce`` write ``command`` (a
    reproduce run.json from before that has none), ``stackelberg`` writes ``{"config": ...}``."""
    if not isinstance(saved, dict):
        return None
    if "command" in saved:
        return saved["command"] if isinstance(saved["command"], str) else None
    return "stackelberg" if set(saved) == {"config"} else "reproduce"


def refuse_other_command(saved: Any, command: str, out: Path) -> None:
    """A killed run resumed by another command than the one that made it: one error naming both."""
    maker = made_by(saved)
    if maker is not None and maker != command:
        raise UserError(f"resume: {out} was made by `ccpo-jax {maker}`, not `ccpo-jax {command}`; resume it with "
                        f"`ccpo-jax {maker} --resume {out}`", field="resume")


@contextlib.contextmanager
def committed(out: Path, *, resuming: bool, resume: str, save: Callable[[Path], Any] | None = None,
              discard: bool = False, say: Callable[[str], Any] | None = None,
              ckpt_dir: str = "checkpoints") -> Iterator[Path]:
    """The work directory of ``out`` for the body of a run; renamed to ``out`` when the body completes.

    A new run (not ``resuming``) creates the work directory and ``save`` writes its configuration
    into it first. ``resume`` is how to continue the run (e.g. ``ccpo-jax reproduce --resume OUT``).
    Interrupted (KeyboardInterrupt): once training started (``ckpt_dir`` exists) the directory stays
    and ``say`` tells how to go on (unless ``discard``); before, a new run's is removed. Failed:
    :func:`after_failure` (the checkpoints stay, the error says how to go on).
    """
    work = work_dir(out)
    created = False
    try:
        if not resuming:
            work.mkdir(parents=True)
            created = True
            if save is not None:
                save(work)
        yield work
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, out)
    except KeyboardInterrupt:
        if (work / ckpt_dir).exists() and not discard:
            if say is not None:
                say(f"interrupted; continue with: {resume}")
        elif work.exists() and (created or discard):
            shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException as e:
        # A failure after training started (a full disk while writing outputs, a bug in the
        # report) must not cost the training: the checkpoints stay, and the error says how to go on.
        after_failure(e, work, created=created, discard=discard, ckpt_dir=ckpt_dir,
                      resume_hint=f"after fixing the cause, continue with `{resume}`")
        raise
