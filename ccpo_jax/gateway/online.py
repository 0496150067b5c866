"""The online threshold (``--online-kappa ETA``) and the drift alarm, driven by feedback.

Online kappa is the paper's Eq. 9 step (:func:`ccpo_jax.core.conformal.kappa_step`,
the adaptive-conformal-inference update, ABB sign), one step per outcome the
feedback determines: ``kappa <- clip(kappa + eta_k (alpha - err), 0, 1)``,
``eta_k = ETA k^-(1/2 + xi)``, err = 1 when the request's answer set missed.
A miss lowers kappa (larger sets), a hit raises it.

The drift alarm: over the last ``window`` outcomes, a one-sided exact binomial
test (scipy) of "coverage >= 1 - alpha"; the alarm is on while its p-value is
below ``alarm_p``.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
from scipy.stats import binomtest

from ccpo_jax.core.conformal import kappa_step

#: The decay exponent xi of eta_k (the paper's 0.1, TrainConfig.xi's default).
XI = 0.1


def alarm_test(recent: list[int], alpha: float, window: int, alarm_p: float) -> tuple[float, bool]:
    """(p-value, alarm) of the last outcomes ``recent`` (1: covered; at most ``window``): the one-sided
    exact binomial test of coverage >= 1 - alpha, from min(window, 30) outcomes on ((1.0, False) before)."""
    n = len(recent)
    if n < min(window, 30):
        return 1.0, False
    p = float(binomtest(sum(recent), n, 1.0 - alpha, alternative="less").pvalue)
    return p, p < alarm_p


@dataclasses.dataclass
class CoverageState:
    """Rolling coverage from feedback, the alarm, and (when online) the live kappa."""

    alpha: float
    kappa: float
    eta0: float | None = None  # None: the artefact's fixed kappa
    window: int = 200
    alarm_p: float = 0.01
    steps: int = 0
    covered: int = 0
    seen: int = 0
    alarm: bool = False
    p_value: float = 1.0

    def __post_init__(self):
        self._recent: collections.deque[int] = collections.deque(maxlen=self.window)
        self._lock = threading.Lock()

    @property
    def online(self) -> bool:
        return self.eta0 is not None

    def record(self, covered: bool) -> bool:
        """One outcome; returns whether the alarm turned on with it."""
        with self._lock:
            self.seen += 1
            self.covered += int(covered)
            self._recent.append(int(covered))
            if self.online:
                self.steps += 1
                self.kappa = float(kappa_step(np.float32(self.kappa), float(not covered), self.steps,
                                              self.alpha, self.eta0, XI))
            was = self.alarm
            if len(self._recent) >= min(self.window, 30):
                self.p_value, self.alarm = alarm_test(list(self._recent), self.alpha, self.window, self.alarm_p)
            return self.alarm and not was

    @property
    def rolling(self) -> float | None:
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else None
