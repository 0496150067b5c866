"""Progress of the long commands (reproduce, sweep, stackelberg, export): phase lines and bars.

Every phase (loading, compiling, training, evaluating, writing) says that it starts, on stdout (flushed,
so a pipe or a log file sees it at once), with the seconds since the command started, so a run is
never silent. The training loops show a tqdm bar (on stderr) when stdout is a terminal; otherwise (a
log file, a pipe, CI) a bar is a plain status line per chunk on stdout instead, since a bar's carriage
returns make an unreadable log. ``--no-progress`` turns both off.
"""
from __future__ import annotations

import sys
import time
from typing import Any

_START = time.perf_counter()


def restart_clock() -> None:
    """Count the seconds of the phase lines from now (a command's start)."""
    global _START
    _START = time.perf_counter()


def is_terminal(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def status(text: str, enabled: bool = True) -> None:
    """One phase line on stdout: ``[  12.3 s] text`` (nothing when not ``enabled``)."""
    if enabled:
        print(f"[{time.perf_counter() - _START:7.1f} s] {text}", flush=True)


class PlainBar:
    """tqdm's interface as plain lines: one when the description changes (a compilation) and one per
    update, with the iterations done, the seconds and the postfix."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "it", **_: Any):
        self.total, self.n, self.desc, self.unit, self.postfix = int(total), int(initial), desc, unit, ""
        self.t0 = time.perf_counter()

    def set_description_str(self, desc: str) -> None:
        if "compiling" in desc and desc != self.desc:
            status(desc + " ...")
        self.desc = desc

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text  # shown by the next update (the loop sets it first)

    def update(self, n: int = 1) -> None:
        self.n += int(n)
        status(f"{self.desc}: {self.n}/{self.total} {self.unit} ({time.perf_counter() - self.t0:.0f} s)"
               + (f"; {self.postfix}" if self.postfix else ""))

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, initial: int = 0, enabled: bool = True, unit: str = "it"):
    """A tqdm bar on a terminal, a :class:`PlainBar` otherwise (tqdm disabled when not ``enabled``)."""
    from tqdm.auto import tqdm

    if enabled and not is_terminal():
        return PlainBar(total, initial=initial, desc=desc, unit=unit)
    return tqdm(total=int(total), initial=initial, desc=desc, unit=unit, disable=not enabled, leave=False)
