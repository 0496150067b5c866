"""After training, ``learned_rows`` reshapes and slices the trained state (the seeds' axis, the calibrated
rows' twins, the saved seed's diagnostics and policy) as NumPy arrays on the host: exact copies either way,
but on jax arrays every such step on every state leaf was an eager XLA program, lowered and compiled (or read
back from the compilation cache) once per process: about 60 of the default reproduce's 145 programs
(docs/performance.md). Checked here by jax's compile log: no eager program is compiled for a step taken in
``ccpo_jax/ccpo/rows.py`` or ``policy_store.py`` once training has returned. That the rows themselves are
unchanged is checked by the twins' and the saved policies' tests (tests/ccpo/test_twin_rows.py) and by
``benchmarks/diff_results.py`` on a default reproduce."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import traceback

import jax
import numpy as np

from ccpo_jax.ccpo import rows as rows_mod
from ccpo_jax.ccpo.presets import DEFAULT
from ccpo_jax.ccpo.rows import RowsRun, RunData, learned_rows
from ccpo_jax.ccpo.splits import Splits
from ccpo_jax.runtime.execution import QUIET
from envs.generators.synthetic import generate
from envs.replay.env import make_env_params

_LOWERED = re.compile(r"Finished jaxpr to MLIR module conversion jit\((\w+)\)")
_LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.pjit", "jax._src.stages")
_HOST_SIDE = (os.path.join("ccpo", "rows.py"), os.path.join("ccpo", "policy_store.py"))


class _EagerSites(logging.Handler):
    """Every one-primitive program lowered while ``on``, with the innermost ``ccpo_jax`` frame that asked for it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.on, self.sites = False, []

    def emit(self, record):
        m = _LOWERED.search(record.getMessage())
        if not (self.on and m and m.group(1) in vars(jax.lax)):  # jit(<primitive>): an eager operation
            return
        ours = [f for f in traceback.extract_stack() if f"{os.sep}ccpo_jax{os.sep}" in f.filename]
        if ours:
            self.sites.append((m.group(1), f"{ours[-1].filename}:{ours[-1].lineno}"))


def _data() -> RunData:
    """140 SYNTHETIC questions, 2 splits (shapes no other test uses, so nothing is compiled already)."""
    cache = generate("hotpotqa-llama2", n_questions=140, seed=3)
    rng = np.random.default_rng(3)
    perm = rng.permutation(140)
    train = np.tile(perm[:70], (2, 1))
    draws = np.stack([rng.permutation(perm[70:]) for _ in range(2)])
    return RunData(cache, make_env_params(cache), Splits(train=train, cal=draws[:, :35], test=draws[:, 35:]),
                   jax.random.PRNGKey(3))


def test_trained_state_is_sliced_on_the_host(tmp_path, monkeypatch):
    run = RowsRun(DEFAULT.replace(iterations=2, chunk=2), (2e-4,), seeds=3)
    log, real = _EagerSites(), rows_mod.train_many

    def spy(*a, **k):
        out = real(*a, **k)
        log.on = True  # from here on: what the rows do with the trained state
        return out

    monkeypatch.setattr(rows_mod, "train_many", spy)
    saved = [(lg, lg.level, lg.propagate) for lg in map(logging.getLogger, _LOGGERS)]
    flag = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    for lg, _, _ in saved:
        lg.addHandler(log)
        lg.setLevel(logging.DEBUG)
        lg.propagate = False
    try:
        got = learned_rows(run, _data(), dataclasses.replace(QUIET, ckpt_dir=tmp_path / "run" / "checkpoints"))
    finally:
        jax.config.update("jax_log_compiles", flag)
        for lg, level, prop in saved:
            lg.removeHandler(log)
            lg.setLevel(level)
            lg.propagate = prop
    assert log.on and any(row.endswith("[ensemble]") for row in got.rows)  # the twins were evaluated
    assert (tmp_path / "run" / "policies").is_dir()  # and the policies saved
    on_host = [(op, site) for op, site in log.sites if site.rsplit(":", 1)[0].endswith(_HOST_SIDE)]
    assert on_host == []  # before: reshape, gather, dynamic_slice, squeeze ... on every state leaf
