"""The chunked host loop shared by every trainer (CCPO's and the Stackelberg pipeline's).

A trainer compiles ``n`` of its iterations into one program (a ``lax.scan``);
:func:`run_chunks` calls that program chunk after chunk and, between chunks,

* advances a progress bar (which says when a chunk is being compiled),
* writes the chunk's per-iteration scalars to TensorBoard,
* saves an orbax checkpoint of the state and the metrics so far
  (:class:`ccpo_jax.runtime.checkpoints.VerifiedCheckpoints`, digests checked before a
  restore), beside a ``loop_meta.json`` that records the configuration.

Called again on the same checkpoint directory, it refuses a different
configuration and otherwise continues from the last saved chunk. The PRNG key
is part of the state, so a resumed run ends bit-identical to an uninterrupted
one. The loop runs exactly ``iterations`` iterations (the last chunk is
shorter when ``chunk`` does not divide them).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
from ccpo_jax.runtime.progress import bar as progress_bar

from ccpo_jax.errors import UserError
from ccpo_jax.runtime.checkpoints import VerifiedCheckpoints
from envs.cache.atomic import atomic_write_text

META_FILE = "loop_meta.json"
ORBAX_DIR = "orbax"

#: ``compile_chunk(n, state) -> step``: the trainer's program for ``n`` iterations, compiled for
#: ``state``; ``step(state) -> (state, metrics)`` with host metrics ``name -> np.ndarray [..., n]``.
CompileChunk = Callable[[int, Any], Callable[[Any], tuple[Any, dict[str, np.ndarray]]]]


@dataclasses.dataclass
class LoopResult:
    """What :func:`run_chunks` returns.

    state:     the final state (as ``unplace`` returns it);
    metrics:   name -> np.ndarray [..., iterations run so far], chunks concatenated;
    compile_s: seconds spent compiling chunks in this call;
    train_s:   seconds spent running them;
    finished:  False when ``stop_after_chunks`` cut the run short.
    """

    state: Any
    metrics: dict[str, np.ndarray]
    compile_s: float
    train_s: float
    finished: bool


def chunk_sizes(iterations: int, chunk: int) -> list[int]:
    """``iterations`` split into chunks of ``chunk`` (the last one shorter): 10, 4 -> [4, 4, 2]."""
    if int(iterations) < 1 or int(chunk) < 1:
        raise UserError(f"iterations={iterations}, chunk={chunk}: both must be integers >= 1")
    n = -(-int(iterations) // int(chunk))
    return [min(int(chunk), int(iterations) - i * int(chunk)) for i in range(n)]


def mean_scalars(prefix: str) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
    """TensorBoard tags ``<prefix>/<metric>``: each metric's mean over its leading (member) axes."""

    def scalars(metrics: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for k, v in metrics.items():
            v = np.asarray(v, np.float64)
            out[f"{prefix}/{k}"] = v.reshape(-1, v.shape[-1]).mean(0) if v.ndim > 1 else v
        return out

    return scalars


class _Checkpoints:
    """The loop's checkpoint directory: ``loop_meta.json`` (configuration) and ``orbax/`` (chunks)."""

    def __init__(self, root: Path, meta: Mapping[str, Any]):
        self.root = Path(root)
        meta = json.loads(json.dumps(dict(meta), default=str))
        path = self.root / META_FILE
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except ValueError:
                raise UserError(f"{path}: damaged (not JSON); delete {self.root} to start afresh") from None
            if old != meta:
                changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
                raise UserError(f"{self.root}: the checkpoints were written by a different configuration "
                                f"({', '.join(changed)} differ); resume with the same configuration or start afresh")
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(meta, indent=1, sort_keys=True) + "\n")
        self.manager = VerifiedCheckpoints(self.root / ORBAX_DIR, max_to_keep=2)

    def restore(self, template: Any) -> tuple[int, Any, list[dict]]:
        """(chunks done, state, metric history) of the newest good step; (0, template, []) if none."""
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return 0, template, []
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(template), metrics=ocp.args.JsonRestore()))
        # As host arrays, like the fresh template: device arrays committed by the restore would
        # lower to another program (explicit input shardings) and cost a second compilation.
        state = jax.tree.map(np.asarray, restored["state"])
        return int(step), state, restored["metrics"]["history"]

    def save(self, chunks_done: int, state: Any, history: list[dict]) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(chunks_done, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metrics=ocp.args.JsonSave({"history": history})))


def run_chunks(
    compile_chunk: CompileChunk,
    state: Any,
    *,
    iterations: int,
    chunk: int,
    desc: str,
    ckpt_dir: Path | None = None,
    meta: Mapping[str, Any] | None = None,
    place: Callable[[Any], Any] = lambda s: s,
    unplace: Callable[[Any], Any] = lambda s: s,
    tensorboard: Any = None,
    scalars: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]] | None = None,
    postfix: Callable[[Mapping[str, np.ndarray]], str] | None = None,
    progress: bool = True,
    stop_after_chunks: int | None = None,
) -> LoopResult:
    """Run ``iterations`` iterations of a trainer, ``chunk`` per compiled program.

    ``state`` is the host-side initial state (the template a checkpoint is restored
    into); ``place`` puts it on the devices (padding, sharding) and ``unplace`` takes a
    placed state back (what is checkpointed and returned). ``meta`` (JSON-able, the
    configuration) is compared with the checkpoint's on resume. ``tensorboard`` is a
    writer with ``add_scalar(tag, value, step)`` (``ccpo_jax.runtime.scalars.ScalarWriter``);
    ``scalars`` maps a chunk's metrics to ``tag -> values [n]``, written at iteration
    numbers 1..iterations. ``postfix`` gives the progress bar's text after a chunk.
    ``stop_after_chunks`` ends the call early after that many chunks (a simulated kill).
    """
    sizes = chunk_sizes(iterations, chunk)
    store = None if ckpt_dir is None else _Checkpoints(Path(ckpt_dir), meta or {})
    start, history = 0, []
    if store is not None:
        start, state, history = store.restore(state)
    state = place(state)

    compiled: dict[int, Callable] = {}
    compile_s = 0.0
    t_start = time.perf_counter()
    bar = progress_bar(int(iterations), desc, initial=sum(sizes[:start]), enabled=progress)  # plain lines off a tty
    finished = True
    for ci in range(start, len(sizes)):
        n = sizes[ci]
        if n not in compiled:
            bar.set_description_str(f"{desc} (compiling a {n}-iteration chunk)")
            bar.refresh()
            t0 = time.perf_counter()
            compiled[n] = compile_chunk(n, state)
            compile_s += time.perf_counter() - t0
            bar.set_description_str(desc)
        state, m = compiled[n](state)
        history.append({k: np.asarray(v).tolist() for k, v in m.items()})
        if tensorboard is not None and scalars is not None:
            first = sum(sizes[:ci]) + 1
            for tag, values in scalars(m).items():
                for i, x in enumerate(np.asarray(values, np.float64).reshape(-1)):
                    if np.isfinite(x):
                        tensorboard.add_scalar(tag, float(x), first + i)
        if postfix is not None:
            bar.set_postfix_str(postfix(m))
        bar.update(n)
        if store is not None:
            store.save(ci + 1, unplace(state), history)
        if stop_after_chunks is not None and ci + 1 - start >= stop_after_chunks and ci + 1 < len(sizes):
            finished = False
            break
    bar.close()
    jax.block_until_ready(state)
    train_s = time.perf_counter() - t_start - compile_s
    metrics = {k: np.concatenate([np.asarray(h[k]) for h in history], axis=-1) for k in (history[0] if history else {})}
    return LoopResult(state=unplace(state), metrics=metrics, compile_s=compile_s, train_s=train_s, finished=finished)
