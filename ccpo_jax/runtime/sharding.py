"""Device meshes for the member (split/seed/variant) axis and the episode axis (docs/performance.md, "Sharding and multi-host").

Everything the trainer and the evaluators vmap over is embarrassingly
parallel: CPO/CCPO variants x splits (the flat "member" axis of
:func:`ccpo_jax.ccpo.members.train_many`), evaluation splits, and parallel replay
episodes. So the whole scale-out story is a 1-D mesh over all devices and a
leading axis placed on it:

* :func:`make_mesh` builds a 1-D ``jax.make_mesh`` mesh over the devices
  (all of them by default, every host's under ``jax.distributed``);
* :func:`shard_leading` pads a pytree's leading axis to a multiple of the
  device count (repeating the last row, so padded members are valid inputs)
  and places it with ``NamedSharding(mesh, P(axis))``; :func:`unpad` strips
  the padding again;
* :func:`member_map` wraps a vmapped function in ``jax.shard_map`` so every
  device runs the same per-member program on its own block of members with
  no communication (closed-over constants, e.g. the replay cache, are
  replicated): one SPMD program, one compilation. Per-member results equal
  the one-device results up to floating-point rounding (an SPMD program
  is optimised differently; :class:`PerDevice` below is bit-exact);
* :class:`PerDevice` instead runs one single-device program per device
  (one compilation each), which is what makes a multi-device run equal a
  one-device run bitwise (with :func:`blocked_vmap`);
* :func:`init_distributed` calls ``jax.distributed.initialize()`` for
  multi-host runs when asked (``CCPO_JAX_DISTRIBUTED=1``).

Inputs are built with ``jax.make_array_from_callback`` (each process fills
only its addressable shards), and :func:`to_host` gathers a possibly
non-fully-addressable result with ``process_allgather``, so the same code
runs on one host and on several.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MEMBER_AXIS = "members"
EPISODE_AXIS = "episodes"
DISTRIBUTED_ENV = "CCPO_JAX_DISTRIBUTED"

_distributed_done = False


def init_distributed(enable: bool | None = None) -> bool:
    """Initialise multi-host JAX (``jax.distributed.initialize()``) if asked; return whether it ran.

    ``enable`` None reads the environment variable ``CCPO_JAX_DISTRIBUTED``
    ("1"/"true"/"yes"). The coordinator address, process count and process id
    come from ``jax.distributed.initialize``'s own discovery (SLURM, Open MPI,
    Cloud TPU, Kubernetes) or from ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. Call it before any other JAX
    call; calling it twice is a no-op.
    """
    global _distributed_done
    if enable is None:
        enable = os.environ.get(DISTRIBUTED_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not enable:
        return False
    if not _distributed_done:
        kw = {}
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):
            kw["coordinator_address"] = os.environ["JAX_COORDINATOR_ADDRESS"]
        if os.environ.get("JAX_NUM_PROCESSES"):
            kw["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
        if os.environ.get("JAX_PROCESS_ID"):
            kw["process_id"] = int(os.environ["JAX_PROCESS_ID"])
        jax.distributed.initialize(**kw)
        _distributed_done = True
    return True


def make_mesh(n_devices: int | None = None, axis: str = MEMBER_AXIS) -> Mesh:
    """A 1-D mesh named ``axis`` over the first ``n_devices`` devices (default: all, on all hosts)."""
    devices = jax.devices()
    n = len(devices) if n_devices is None else int(n_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"n_devices={n_devices}: {len(devices)} device(s) available")
    return jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n])


def _axis(mesh: Mesh) -> str:
    if len(mesh.axis_names) != 1:
        raise ValueError(f"expected a 1-D mesh, got axes {mesh.axis_names}")
    return mesh.axis_names[0]


def padded_size(n: int, mesh: Mesh | None, block: int = 1) -> int:
    """``n`` rounded up to a multiple of (mesh size x ``block``); ``mesh`` None counts as one device."""
    d = (1 if mesh is None else mesh.devices.size) * int(block)
    return -(-int(n) // d) * d


def pad_leading(tree: Any, n_to: int) -> Any:
    """Pad every leaf's leading axis to ``n_to`` by repeating its last row (padded rows stay valid inputs)."""

    def pad(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        extra = n_to - x.shape[0]
        if extra < 0:
            raise ValueError(f"leading axis {x.shape[0]} > {n_to}")
        if extra == 0:
            return x
        lib = np if isinstance(x, np.ndarray) else jax.numpy
        return lib.concatenate([x, lib.repeat(x[-1:], extra, axis=0)], axis=0)

    return jax.tree.map(pad, tree)


def unpad(tree: Any, n: int) -> Any:
    """The first ``n`` rows of every leaf (undo :func:`pad_leading`)."""
    return jax.tree.map(lambda x: x[:n], tree)


def _place(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Multi-host safe: every process fills only its own shards (x is the same on all).
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_leading(tree: Any, mesh: Mesh, block: int = 1) -> tuple[Any, int]:
    """Pad the leading axis of every leaf to a multiple of (mesh size x ``block``) and shard it over the mesh.

    Returns ``(sharded_tree, n)`` with ``n`` the original leading size (all
    leaves must share it); pass ``n`` to :func:`unpad` afterwards.
    """
    leaves = jax.tree.leaves(tree)
    sizes = {int(np.shape(x)[0]) for x in leaves}
    if len(sizes) != 1:
        raise ValueError(f"leaves disagree on the leading axis: {sorted(sizes)}")
    (n,) = sizes
    sh = NamedSharding(mesh, P(_axis(mesh)))
    tree = pad_leading(tree, padded_size(n, mesh, block))
    return jax.tree.map(lambda x: _place(x, sh), tree), n


def member_map(fn: Callable, mesh: Mesh) -> Callable:
    """``jax.shard_map`` of a function batched over the leading axis of all its inputs and outputs.

    ``fn`` must already be vmapped (it sees a block of members per device).
    No collectives: each device computes its block with the same per-member
    code. Results equal the unsharded call up to floating-point rounding (XLA
    optimises an SPMD program differently, see :class:`PerDevice`); for the
    evaluators and env rollouts in this project they are bitwise equal (tested).
    """
    spec = P(_axis(mesh))
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def blocked_vmap(fn: Callable, block: int | None) -> Callable:
    """``vmap(fn)`` over the leading axis, computed ``block`` members at a time when ``block`` is set.

    With ``block`` set, the leading axis (a multiple of ``block``) is reshaped
    to [n / block, block] and ``jax.lax.map`` runs one ``vmap`` of ``block``
    members per step. Every member is then computed by the same compiled
    block program whatever the total number of members: XLA picks its dot
    kernels (and so the last bit of rounding) by the batch shape, so a plain
    ``vmap`` over 8 members and over 2 members round differently. With
    :class:`PerDevice` this makes a sharded run bit-identical to a one-device
    run. ``block`` None is the plain ``vmap`` (fastest on one device).
    """
    vfn = jax.vmap(fn)
    if block is None:
        return vfn
    block = int(block)

    def run(*args):
        n = jax.tree.leaves(args)[0].shape[0]
        if n % block:
            raise ValueError(f"{n} members is not a multiple of member block {block}")
        split = jax.tree.map(lambda x: x.reshape((n // block, block) + x.shape[1:]), args)
        out = jax.lax.map(lambda a: vfn(*a), split)
        return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)

    return run


_BARRIERS = [0]  # calls of _align_processes so far (the same sequence on every process)


def _align_processes(timeout_s: float = 1800.0) -> None:
    """Wait until every process gets here (the coordination service's barrier, with a long deadline).

    The all-gather after each chunk initialises a gloo context whose key lookup times out after
    30 s; processes whose compilation or chunk took different times would miss it. The barrier
    absorbs that skew first (no-op without ``jax.distributed``)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    _BARRIERS[0] += 1
    client.wait_at_barrier(f"ccpo-jax-per-device-{_BARRIERS[0]}", int(timeout_s * 1000))


class PerDevice:
    """One single-device program per device, each on its own block of the leading axis.

    The alternative to :func:`member_map` (one SPMD program) when results must
    equal a ONE-device run bit for bit: XLA compiles a multi-partition (SPMD)
    program through another pass pipeline than a one-partition program, which
    changes floating-point rounding in the last bit. Here every device runs
    ``jax.jit(fn)`` compiled for that device alone, i.e. exactly the program a
    one-device run compiles (for its block's shapes). Combined with
    :func:`blocked_vmap` (results independent of how many blocks a device
    runs) a run on N devices equals the one-device run bitwise.

    Costs one compilation per local device (run concurrently in threads; XLA
    releases the GIL while compiling). Multi-host: each process runs its own
    devices' blocks and the outputs are gathered with ``process_allgather``
    (every process must own the same number of the devices). Inputs are host
    or device arrays whose leading axis is a multiple of the device count and
    that are the same on every process; outputs are NumPy arrays in device
    order, on every process.
    """

    def __init__(self, fn: Callable, devices):
        self.devices = list(devices)
        me = jax.process_index()
        self.local = [i for i, d in enumerate(self.devices) if d.process_index == me]
        if not self.local:
            raise ValueError("PerDevice: none of the devices belongs to this process")
        self._jit = jax.jit(fn)
        self._compiled: list | None = None

    def _split(self, args) -> list:
        n = {int(np.shape(x)[0]) for x in jax.tree.leaves(args)}
        if len(n) != 1:
            raise ValueError(f"leaves disagree on the leading axis: {sorted(n)}")
        (n,) = n
        k = len(self.devices)
        if n % k:
            raise ValueError(f"leading axis {n} is not a multiple of {k} devices")
        b = n // k
        host = jax.tree.map(np.asarray, args)
        return [jax.device_put(jax.tree.map(lambda x: x[i * b:(i + 1) * b], host), self.devices[i]) for i in self.local]

    def compile(self, *args) -> float:
        """Compile for every local device (in threads); returns the wall seconds it took."""
        import time
        from concurrent.futures import ThreadPoolExecutor

        parts = self._split(args)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:
            self._compiled = list(pool.map(lambda a: self._jit.lower(*a).compile(), parts))
        return time.perf_counter() - t0

    def __call__(self, *args):
        if self._compiled is None:
            self.compile(*args)
        parts = self._split(args)
        outs = [c(*a) for c, a in zip(self._compiled, parts)]  # asynchronous dispatch: devices run concurrently
        outs = jax.device_get(outs)
        if jax.process_count() == 1:
            return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=0), *outs)
        from jax.experimental import multihost_utils

        _align_processes()
        local = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)  # [n_local, b, ...]
        where = multihost_utils.process_allgather(np.asarray(self.local, np.int32))  # [P, n_local]
        every = multihost_utils.process_allgather(local)  # [P, n_local, b, ...]
        order = np.argsort(np.asarray(where).reshape(-1), kind="stable")

        def assemble(x):
            x = np.asarray(x)
            x = x.reshape((-1,) + x.shape[2:])[order]  # [n_devices, b, ...] in device order
            return x.reshape((-1,) + x.shape[2:])

        return jax.tree.map(assemble, every)


def to_host(tree: Any) -> Any:
    """NumPy copy of a pytree of (possibly multi-host) arrays."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(get, tree)


class MemberLayout:
    """How ``n`` members sit on the devices, and the one kind of program that computes them.

    ``mesh`` None: one device; ``block`` members per block (:func:`blocked_vmap`; None: one vmap).
    :meth:`place` pads the member axis to a multiple of devices x block (and, for the SPMD program,
    shards it), :meth:`unplace` strips the padding, :meth:`compile` compiles a vmapped function for
    the layout. Two program kinds stay, because they round differently: with a mesh and a block,
    one single-device program per device (:class:`PerDevice`, bitwise a one-device run with that
    block); with a mesh and no block, one SPMD program (:func:`member_map`), which matches a
    one-device run only up to rounding. Without a mesh the single-device program is the plain jit.
    """

    def __init__(self, n: int, mesh: Mesh | None, block: int | None):
        if block is not None and int(block) < 1:
            raise ValueError(f"member block {block}: must be >= 1")
        self.n, self.mesh, self.block = int(n), mesh, None if block is None else int(block)
        self.per_device = mesh is not None and block is not None
        self.spmd = mesh is not None and block is None
        self.padded = mesh is not None or self.n % (self.block or 1) != 0

    def place(self, tree: Any) -> Any:
        if self.spmd:
            return shard_leading(tree, self.mesh, 1)[0]
        if self.padded:
            return pad_leading(tree, padded_size(self.n, self.mesh, self.block or 1))
        return tree

    def unplace(self, tree: Any) -> Any:
        return unpad(tree, self.n) if self.padded else tree

    def compile(self, fn: Callable, *args) -> Callable:
        """``fn`` (vmapped over the leading axis) compiled for this layout on ``args`` (placed)."""
        if self.per_device:
            program = PerDevice(fn, self.mesh.devices.flat)
            program.compile(*args)
            return program
        return jax.jit(member_map(fn, self.mesh) if self.spmd else fn).lower(*args).compile()

    def devices(self) -> tuple | None:
        """What a compiled program depends on of the mesh (a cache key)."""
        return None if self.mesh is None else (tuple(d.id for d in self.mesh.devices.flat), tuple(self.mesh.axis_names))
