"""Data and fully-sharded-data parallelism over a ``jax.make_mesh`` of all local devices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sage_optax import placement

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
            spec = [None] * len(shape)
            spec[a] = AXIS
            return P(*spec)
    return P()


def state_shardings(state: Any, mesh: Mesh, mode: str) -> Any:
    """A ``NamedSharding`` per leaf of ``state`` (same structure)."""
    n = mesh.devices.size
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(tuple(x.shape), n, mode)), state)


def shard_batch(batch: tuple[np.ndarray, np.ndarray], mesh: Mesh, mode: str) -> tuple[Any, Any]:
    """Put a batch on the mesh, split along its first (batch) axis."""
    n = mesh.devices.size
    if batch[0].shape[0] % n:
        raise ValueError(
            f"batch size {batch[0].shape[0]} is not divisible by the {n} devices of the mesh; "
            "pick a multiple, or --sharding none"
        )
    sharding = NamedSharding(mesh, P(AXIS) if n > 1 else P())
    return tuple(jax.device_put(x, sharding) for x in batch)  # type: ignore[return-value]
