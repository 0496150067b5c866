"""How a run's training executes: one frozen object, built once from the run options.

:class:`Execution` holds everything that decides where and how the members of a run are
computed, and nothing that changes what they compute: the device mesh, the member block,
the checkpoint and TensorBoard directories and the progress bar. The run commands build it
once (``ccpo_jax.ccpo.prepare.prepare``, where the member block's default is decided) and
every step below takes it as it is: ``learned_rows`` -> ``train_seeds`` / ``train_sweep`` ->
``train_many`` -> :func:`ccpo_jax.runtime.loop.run_chunks`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class Execution:
    """Where and how the members train.

    mesh:               a 1-D ``ccpo_jax.runtime.sharding.make_mesh`` mesh, or None (one device);
    member_block:       members computed that many at a time (``sharding.blocked_vmap``), None: one vmap;
    ckpt_dir:           checkpoints after every chunk, and resumption from the latest (None: none);
    tb_dir:             TensorBoard curves (None: none);
    progress:           a progress bar;
    stop_after_chunks:  stop after that many chunks, as if killed (tests).
    """

    mesh: Any = None
    member_block: int | None = None
    ckpt_dir: Path | None = None
    tb_dir: Path | None = None
    progress: bool = True
    stop_after_chunks: int | None = None

    def status(self, text: str) -> None:
        """A phase line on stdout (``ccpo_jax.runtime.progress.status``) unless progress is off."""
        from ccpo_jax.runtime.progress import status

        status(text, self.progress)

    @contextlib.contextmanager
    def scalar_writer(self) -> Iterator[Any]:
        """The TensorBoard writer of ``tb_dir`` (None without one), closed when the block ends."""
        if self.tb_dir is None:
            yield None
            return
        from ccpo_jax.runtime.scalars import ScalarWriter

        writer = ScalarWriter(Path(self.tb_dir), ".train")
        try:
            yield writer
        finally:
            writer.close()


#: No bar, no checkpoints, one device: what tests and experiments mostly want.
QUIET = Execution(progress=False)
