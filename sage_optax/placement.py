"""Code paths chosen by where the arrays are, not by JAX's default backend.

A host with a GPU also has CPU devices, and users put arrays there (a CPU mesh, an
evaluation on the host, ``jax.default_device(cpu)``).  A GPU-only path (a Pallas/Triton
kernel, cuDNN's attention) chosen because ``jax.default_backend()`` says ``"gpu"`` then fails
on those arrays.  :func:`by_platform` makes the choice where it is known:

* under a trace (``jit``, ``grad``, ...), with :func:`jax.lax.platform_dependent`: every
  present branch is traced, and the lowering keeps only the branch of the platform the
  program is compiled for (the compiler never sees a conditional); so one jitted function
  runs the kernel on CUDA arrays and the reference code on CPU arrays;
* on concrete arrays (eager calls), from the platform of the arrays' devices.

Branches that cannot run in this process are not traced at all: on a machine with no CUDA
device only the CPU/reference branch is, so programs there are exactly what they were
before the kernel existed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

_T = TypeVar("_T")


def cuda_device_count() -> int:
    """The number of CUDA devices of this process's JAX (0 when it has no CUDA backend)."""
    if jax.default_backend() == "gpu":
        return jax.device_count()
    try:
        return jax.device_count("cuda")
    except RuntimeError:  # no such backend in this jaxlib, or it failed to start
        return 0


def cuda_device_kind() -> str | None:
    """The name of this process's first CUDA device (``"NVIDIA H100 80GB HBM3"``), or None."""
    try:
        devices = jax.devices() if jax.default_backend() == "gpu" else jax.devices("cuda")
    except RuntimeError:
        return None
    return str(devices[0].device_kind) if devices else None


def _device_platform(device: Any) -> str:
    """``"cuda"``, ``"rocm"``, ``"cpu"``, ``"tpu"``... of one device (JAX's GPUs say ``"gpu"``)."""
    if device.platform != "gpu":
        return str(device.platform)
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def default_device() -> Any:
    """The device that uncommitted data and computations go to.

    ``jax.default_device``'s if set (a device or a platform name), else the first device of
    the default backend.
    """
    device = getattr(jax.config, "jax_default_device", None)  # a device, a name or None
    if device is None:
        return jax.devices()[0]
    if isinstance(device, str):
        return jax.devices(device)[0]
    return device


def concrete_platform(args: Any) -> str | None:
    """The platform an eager computation on ``args`` runs on, or None under a trace.

    As JAX places it: arrays committed to devices (``jax.device_put`` to a device, results
    of computations on them) decide; without any, the computation and its inputs (NumPy
    arrays, Python numbers, uncommitted arrays) go to the default device
    (:func:`default_device`).  Committed arrays on several platforms give ``"mixed"``.
    """
    leaves = jax.tree_util.tree_leaves(args)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    platforms: set[str] = set()
    for x in leaves:
        if isinstance(x, jax.Array) and x.committed:
            platforms.update(_device_platform(d) for d in x.devices())
    if not platforms:
        return _device_platform(default_device())
    return platforms.pop() if len(platforms) == 1 else "mixed"


def by_platform(
    args: tuple[Any, ...],
    *,
    cpu: Callable[..., _T],
    cuda: Callable[..., _T] | None = None,
    other: Callable[..., _T] | None = None,
) -> _T:
    """``cuda(*args)`` where the computation runs on CUDA devices, ``cpu(*args)`` on the CPU.

    Args:
      args: the arrays (pytrees) the branches take; under a trace, every branch gets them.
      cpu: the reference branch: the CPU's, and every platform's without a branch of its own.
      cuda: the CUDA branch (``None``: none; then ``cpu`` runs everywhere).  Traced only
        when this process has a CUDA device (:func:`cuda_device_count`).
      other: the branch of the platforms other than CPU and CUDA (TPU, ROCm; default
        ``cpu``).  Traced only when the default backend is such a platform.

    Returns:
      The chosen branch's result; all branches must return the same shapes and dtypes.
    """
    platform = concrete_platform(args)
    if platform is not None:  # eager: the arrays' own devices decide
        if platform == "cuda" and cuda is not None:
            return cuda(*args)
        if platform not in ("cpu", "cuda", "mixed") and other is not None:
            return other(*args)
        return cpu(*args)
    branches: dict[str, Callable[..., _T]] = {}
    if cuda is not None and cuda_device_count() > 0:
        branches["cuda"] = cuda
    default = cpu
    if other is not None and jax.default_backend() not in ("cpu", "gpu"):
        default = other
    if not branches and default is cpu:
        return cpu(*args)  # nothing else can run here: the program is the reference one
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default, **branches)
