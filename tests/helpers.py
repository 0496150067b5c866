"""What the tests share besides fixtures: the checkout's paths, the CI switch, the CLI runner and
the calibration oracles' random problems (``from tests.helpers import X``; the fixtures and hooks stay in
conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path


#: XLA flags of the subprocess tests (multi-device, multi-host, the Stackelberg CLI): their
#: programs run for well under a second and compiling them dominates; backend optimisation
#: level 0 halves XLA:CPU's compile time (measured 7.6 s -> 3.7 s for the trainer's chunk) and
#: triples its run time. Every comparison in those tests runs under the same flags. (For the
#: whole suite it saved 10 % of the wall time, slowed the long learning tests and changed
#: last bits that in-process/subprocess comparisons check, so the rest keeps the default.)
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0"

REPO = Path(__file__).resolve().parents[1]
FIXTURE_DATA = REPO / "tests" / "fixtures" / "data"
SHARED_DATA = Path(os.environ.get("CCPO_SHARED_DATA") or REPO.parent / "shared" / "data")
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def run_cli(args: list[str], *, cwd: Path | None = None, in_subprocess: bool = False, env: dict | None = None):
    """``ccpo-jax ARGS`` as a ``subprocess.CompletedProcess`` (returncode, stdout, stderr).

    In-process by default: ``ccpo_jax.cli.main`` with stdout/stderr captured and ``cwd`` as
    the working directory, which spares the ~3 s of CPU a fresh interpreter spends importing
    JAX. An unexpected exception propagates (the test fails on it, which is what a traceback
    in a subprocess would mean). ``in_subprocess=True`` runs ``python -m ccpo_jax.cli`` for
    real; each command keeps at least one such case, for the exit status of the process.
    """
    import contextlib
    import io
    import subprocess
    import sys

    if in_subprocess:
        env = dict(env or os.environ, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return subprocess.run([sys.executable, "-m", "ccpo_jax.cli", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
    from ccpo_jax.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse errors and --help
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return subprocess.CompletedProcess(["ccpo-jax", *args], rc, out.getvalue(), err.getvalue())


def random_rounds(seed: int, Q: int, T: int, p_avail: float):
    """A random set-policy problem for the calibration oracles (test_ltt, test_cost_cap): probabilities
    [Q, T, 3], availability [Q, T, 3] (base always; no 'next' at a question's last round), each question's
    number of rounds [Q] and the round mask [Q, T]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(3), (Q, T)).astype(np.float32)
    avail = rng.random((Q, T, 3)) < p_avail
    avail[..., 0] = True
    n_rounds = rng.integers(1, T + 1, Q)
    round_mask = np.arange(T)[None] < n_rounds[:, None]
    avail[np.arange(Q), n_rounds - 1, 2] = False  # no "next" at a question's last round
    return rng, probs, avail, n_rounds, round_mask
