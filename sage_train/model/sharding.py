"""Data and fully-sharded-data parallelism over a mesh of every device of the job.

In a job of several processes (:mod:`sage_train.job.distributed`) the mesh spans the devices of
all of them; each process feeds only the rows of a batch that its own devices hold
(:func:`local_rows`, :func:`shard_batch`), and the global batch is the same whatever the
number of processes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sage_optax import placement
from sage_train.job.errors import ConfigError

MODES: tuple[str, ...] = ("none", "dp", "fsdp")
"""``none``: one device; ``dp``: batch split, state replicated; ``fsdp``: state split too."""

AXIS = "data"


def make_mesh(mode: str = "dp") -> Mesh:
    """A 1-D mesh named ``data`` over every device (one device for ``none``).

    On several hosts call ``jax.distributed.initialize()`` first (``sage-train
    --distributed`` does); ``jax.devices()`` then spans all hosts.
    """
    if mode not in MODES:
        raise ValueError(f"sharding must be one of {MODES}, got {mode!r}")
    if mode == "none" and jax.process_count() > 1:
        raise ConfigError(f"--sharding none trains on one device, not on the "
                          f"{jax.process_count()} processes of this job: use dp or fsdp")
    devices = mesh_devices()
    return Mesh(np.array(devices[:1] if mode == "none" else devices), (AXIS,))


def mesh_devices() -> list[Any]:
    """The devices a run's mesh spans: every device of the default backend."""
    return list(jax.devices())


def mesh_platform(mesh: Mesh) -> str:
    """The platform of ``mesh``'s devices as :mod:`sage_optax.placement` names it.

    ``"cuda"``, ``"rocm"``, ``"cpu"``, ``"tpu"``...: the platform a run's arrays are on,
    which decides its code paths, not ``jax.default_backend()`` (a GPU host's CPU mesh is
    ``"cpu"``).  Read from a one-byte array put on one of the mesh's devices of this
    process (a mesh has devices of one platform).
    """
    local = mesh.local_devices or list(mesh.devices.flat)
    probe = jax.device_put(np.zeros((), np.int8), local[0])
    return placement.concrete_platform(probe) or "cpu"


def leaf_spec(shape: tuple[int, ...], n: int, mode: str) -> P:
    """FSDP: split the largest axis that ``n`` divides; replicate otherwise (and in DP)."""
    if mode != "fsdp" or n == 1:
        return P()
    axes = sorted(range(len(shape)), key=lambda a: -shape[a])
    for a in axes:
        if shape[a] % n == 0 and shape[a] >= n:
            spec: list[str | None] = [None] * len(shape)
            spec[a] = AXIS
            return P(*spec)
    return P()


def state_shardings(state: Any, mesh: Mesh, mode: str) -> Any:
    """A ``NamedSharding`` per leaf of ``state`` (same structure)."""
    n = mesh.devices.size
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(tuple(x.shape), n, mode)), state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """How a batch lies on ``mesh``: split along its first (batch) axis."""
    return NamedSharding(mesh, P(AXIS) if mesh.devices.size > 1 else P())


def local_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global batch of ``batch_size`` that this process's devices hold.

    All of them with one process; in a job, the contiguous block of the devices of this
    process (the mesh lists the devices process by process).

    Raises:
      ConfigError: ``batch_size`` is not divisible by the devices of the mesh.
    """
    n = int(mesh.devices.size)
    if batch_size % n:
        raise ConfigError(f"batch size {batch_size} is not divisible by the {n} devices of the "
                          "mesh; pick a multiple (or --sharding none on one process)")
    index = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    spans = sorted({s[0].indices(batch_size)[:2] for s in index.values() if s is not None})
    if not spans:
        raise ConfigError("this process holds no device of the mesh")
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise ConfigError("the devices of this process hold rows of the batch that are not "
                          "contiguous; sage-train's mesh lists the devices process by process")
    return slice(start, stop)


def shard_batch(batch: tuple[np.ndarray, np.ndarray], mesh: Mesh,
                batch_size: int | None = None) -> tuple[Any, Any]:
    """Put a batch on the mesh, split along its first (batch) axis.

    ``batch`` holds this process's rows (:func:`local_rows`) of a global batch of
    ``batch_size`` rows (default: all of them, as with one process); every process passes
    its own rows (``jax.make_array_from_process_local_data``).
    """
    n = mesh.devices.size
    size = batch[0].shape[0] if batch_size is None else batch_size
    if size % n:
        raise ValueError(
            f"batch size {size} is not divisible by the {n} devices of the mesh; "
            "pick a multiple, or --sharding none"
        )
    sharding = batch_sharding(mesh)
    inputs, targets = (jax.make_array_from_process_local_data(
        sharding, x, (size, *x.shape[1:])) for x in batch)
    return inputs, targets
