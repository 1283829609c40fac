"""SinkGD's Sinkhorn scales on the CPU by a compiled kernel: one XLA FFI call per leaf.

The math is :func:`sage_optax.sinkgd.sinkhorn_scales`' (the range-scaled iteration: ``K =
(G/m)²`` with ``m`` the power of two below ``max|G|``, ``L`` pairs of half-iterations, the
first with ``ε/m``, ``1/m`` split between ``c`` and ``r``), computed by the C++ file
``native/sinkhorn_cpu.cc`` beside this module instead of by XLA:

* ``K`` is never stored: a pass squares two rows of ``G/m`` at a time, once for their own
  sums and once, from the core's cache, for their share of the other direction's, so a
  pass over ``G`` is a whole Sinkhorn iteration (XLA needs a pass over ``K`` for each half);
  where every square is a normal float32 number, ``G²`` times the weights scaled by
  ``1/m²`` stands for ``(G/m)²`` times the weights (the same products, bit for bit, with
  one multiplication less per entry);
* the rows are cut into chunks (fixed by the shape) shared with helper threads, as many as
  XLA's intra-op pool has threads besides the caller; each chunk sums its own share of the
  column sums and the shares are added in chunk order, so the scales are the same bit for
  bit whatever the number of threads;
* XLA compiles one opaque call per leaf instead of a loop of products (the update of the
  270M model compiles in a fraction of the time; ``benchmarks/RESULTS.md``).

The file is compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) against the XLA FFI headers that jaxlib ships, into a cache
(``$SAGE_OPTIM_CACHE``, else ``$XDG_CACHE_HOME/sage-optim``, else ``~/.cache/sage-optim``)
keyed by the source, jaxlib's version and the compiler, then registered with
``jax.ffi``.  Where that fails (no compiler, a read-only cache), :func:`status` says why and
``impl="auto"`` keeps XLA's path; ``impl="native"`` then refuses with that reason.
``impl="auto"`` takes the kernel in a one-process job on one CPU device only
(:func:`sage_optax.sinkgd.use_native`); ``impl="native"`` on several devices too (under
GSPMD each call sees the whole leaf).

Layouts: as the Pallas kernel's (:func:`sage_optax.axes.matrix_view`), a leaf
viewed for free as ``(B, R, C)``; float32 and bfloat16 gradients (float32 arithmetic);
never a leaf sharded over an explicit-axes mesh (:func:`supports`).  Numbers: float32
within rounding of the jnp path (another summation order), not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sage_optax import axes as axes_lib
from sage_optax.axes import matrix_view
from sage_optax.numerics import norm_target
from sage_optim.routing import ResolvedRoute

SOURCE: Path = Path(__file__).parent / "native" / "sinkhorn_cpu.cc"
"""The kernel's C++ source."""

TARGET: str = "sage_sinkhorn_scales"
"""The name the kernel is registered under with ``jax.ffi`` (platform ``cpu``)."""

SUPPORTED_DTYPES: tuple[Any, ...] = (jnp.float32, jnp.bfloat16)
"""Gradient dtypes the kernel reads (it computes in float32, as the jnp path)."""

_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
_COMPILE_SECONDS = 300


class Status(NamedTuple):
    """Whether the kernel is ready (compiled, loaded and registered), and where or why not."""

    ready: bool
    detail: str  # the library's path, or why it is not ready (one line)


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    explicit = os.environ.get("SAGE_OPTIM_CACHE")
    if explicit:
        return Path(explicit) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "sage-optim" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _library_name(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), importlib.metadata.version("jaxlib").encode(),
                 " ".join((*version, *_FLAGS)).encode()):
        key.update(part)
    return f"sinkhorn_cpu-{key.hexdigest()[:16]}.so"


def _build(cxx: str, target: Path) -> None:
    """Compile :data:`SOURCE` into ``target`` (atomically: a finished file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), "-o", tmp, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_SECONDS,
                              check=False)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
            raise RuntimeError(f"{cxx} failed on {SOURCE.name}: "
                               + (errors[0] if errors else done.stderr.strip()[-200:]))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _load() -> Status:
    cxx = _compiler()
    if cxx is None:
        return Status(False, "no C++ compiler found ($CXX, c++, g++ or clang++)")
    try:
        target = cache_dir() / _library_name(cxx)
        if not target.exists():
            _build(cxx, target)
        lib = ctypes.cdll.LoadLibrary(str(target))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SageSinkhornScales),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        return Status(False, f"{type(err).__name__}: {err}".splitlines()[0])
    return Status(True, str(target))


def status() -> Status:
    """Compile (once per machine), load and register the kernel; whether that worked.

    Cached for the process: a failure is not retried (``impl="auto"`` then keeps XLA's path).
    """
    return _load()


def supports(g: Any, axes: ResolvedRoute) -> bool:
    """Whether the kernel can compute the scales of leaf ``g`` (see the module docstring)."""
    return axes_lib.kernel_takes(g, axes, SUPPORTED_DTYPES)


def native_scales(
    g: jax.Array,
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
) -> tuple[jax.Array, jax.Array]:
    """The scales ``(c, r)`` of one leaf, as :func:`sage_optax.sinkgd.sinkhorn_scales`.

    Args:
      g: a leaf with :func:`supports` true, on the CPU.
      axes: its resolved axes.
      num_iters: ``L`` (a Python int or a traced integer).
      eps: ε.
      normalization: ``"unit"`` or ``"sqrt"``.

    Returns:
      ``c`` shaped as ``g`` without its fan-out axes, ``r`` without its fan-in axes, float32.
    """
    ready, detail = status()
    if not ready:
        raise RuntimeError(f"SinkGD's native CPU kernel is not available: {detail}")
    view = matrix_view(axes)
    assert view is not None, axes
    batch, n_rows, n_cols, rows_are_fan_in = view
    params = jnp.stack([jnp.asarray(x, jnp.float32) for x in (
        eps, norm_target(normalization, axes.fan_in_size),
        norm_target(normalization, axes.fan_out_size))])
    out = (jax.ShapeDtypeStruct((batch, n_rows), jnp.float32),
           jax.ShapeDtypeStruct((batch, n_cols), jnp.float32))
    row_s, col_s = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        g.reshape(batch, n_rows, n_cols), params, jnp.asarray(num_iters, jnp.int32),
        rows_in=np.int32(rows_are_fan_in))
    c, r = (row_s, col_s) if rows_are_fan_in else (col_s, row_s)
    c_shape, r_shape = axes_lib.scale_shapes(axes)
    return c.reshape(c_shape), r.reshape(r_shape)
