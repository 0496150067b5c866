"""TensorBoard scalars of the training curves (CCPO and Stackelberg), written synchronously."""
from __future__ import annotations

import os
import time
from pathlib import Path


class ScalarWriter:
    """TensorBoard scalars written in the calling thread (``add_scalar``, ``close``; a context manager).

    tensorboardX's SummaryWriter writes from a background thread: when the disk
    is full that thread dies with a traceback and the next ``add_scalar`` past
    its queue of 10 blocks forever. Here a full disk is an OSError raised where
    the scalar is added (the CLI prints one line). ``suffix`` ends the event
    file's name, so writers created in the same second do not share a file.
    """

    def __init__(self, logdir: str | os.PathLike, suffix: str = ""):
        from tensorboardX.event_file_writer import EventsWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._w = EventsWriter(str(Path(logdir) / "events"), suffix)

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        from tensorboardX.proto import event_pb2
        from tensorboardX.summary import scalar

        self._w.write_event(event_pb2.Event(wall_time=time.time(), step=int(global_step),
                                            summary=scalar(tag, float(value))))

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> "ScalarWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
