"""A Pallas (Triton) kernel path for SinkGD's Sinkhorn scales, chosen on a GPU.

The math is that of :mod:`sage_optax.sinkgd` (the SAGE paper's Unit-Norm SinkGD,
``X ← X / (‖X‖₂ along the fan-in axis + ε) · t_in`` then the same along the fan-out axis,
``L`` times; Scetbon et al.'s SR-Sinkhorn with ``t = sqrt(size)``), kept as
``X = diag(c) · G · diag(r)``; :func:`sage_optax.sinkgd.sinkhorn_scales` is the reference
and runs on the CPU.  What changes is where the bytes come from.  The jnp path forms
``K = (G/m)²`` once and streams it from device memory ``2L`` times (one matrix-vector
product per half-iteration).  Here ``K`` is never formed: each half-iteration is one
``pallas_call`` that reads tiles of ``G`` itself, squares them (times ``1/m``) in
registers and reduces them against the other scale vector's square, so

* the compiled temporary drops by a matrix (no ``K``; for a stacked group, only the stacked
  gradients in their own dtype, at most :data:`KERNEL_GROUP_BYTES`);
* the ``2L`` passes read ``G`` (2 bytes an entry in bfloat16, not ``K``'s 4), and a chunk of
  at most :data:`KERNEL_GROUP_BYTES` (32 MiB, below an H100's 50 MB of L2) is read from L2
  after the first pass rather than from device memory;
* the scale update (``rescale``: target, ε, the all-zero guard, the first half-iteration's
  ``ε/m``) is fused into the same kernel, so a half-iteration is one launch.

Layout: a leaf whose axes are ``(batch..., group A..., group B...)`` in memory order, one of
the groups the fan-in axes and the other the fan-out axes (a Flax kernel ``(in, out)`` with
leading stacked axes, a torch weight ``(out, in)``, a stack of such leaves), is viewed by a
free reshape as ``(B, R, C)``.  A half-iteration that reduces over rows runs a grid over
``(batch, column blocks)`` and each program loops over all row tiles; one that reduces over
columns runs a grid over ``(batch, row blocks)`` and loops over all column tiles.  Every
output element is written by exactly one program, in a fixed order: deterministic, no
atomics.  Blocks are powers of two (Triton's requirement); the edges of non-power-of-two
matrices are masked loads (``other=0``) and masked stores on whole-array refs.  Sums are
accumulated in float32.  Leaves of any other layout, float64 leaves (x64; the kernel is
float32 arithmetic), zero-size matrices and leaves sharded over an explicit-axes mesh use
the jnp path (:func:`supports`).

Numbers: the same operations as the reference, but a different summation order (a tile's
row of sums, then the tiles in turn, against XLA's reduction tree) and, compiled for a GPU,
Triton's division; the scales agree with the jnp path within float32 rounding
(``tests/optax/test_optax_sinkgd_pallas.py`` states the tolerance), not bit for bit.

:func:`pallas_scales` is the entry point; ``interpret=True`` runs the same kernels with
Pallas's interpreter on any backend (how the CPU tests check the kernel's math).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from sage_optax import axes as axes_lib
from sage_optax.axes import matrix_view
from sage_optax.numerics import norm_target, pow2_sqrt_floor, range_scale
from sage_optim.routing import ResolvedRoute

KERNEL_GROUP_BYTES: int = 32 * 2**20
"""Largest stacked group of the kernel path, in bytes of gradients: the ``2L`` passes over
a chunk this size stay in an H100's 50 MB L2 (the jnp path's default is
:data:`sage_optax.sinkgd.GROUP_BYTES`)."""

SUPPORTED_DTYPES: tuple[Any, ...] = (jnp.float32, jnp.bfloat16, jnp.float16)
"""Gradient dtypes the kernel reads (it computes in float32, as the jnp path)."""

_TILE_ELEMENTS = 4096  # elements of G per loop iteration of one program (16 KB of float32)
_MIN_PROGRAMS = 264  # about two programs per H100 SM before output blocks shrink to 16
_NUM_WARPS = 4
_NUM_STAGES = 3


def _pow2_at_least(n: int) -> int:
    """The smallest power of two ``>= n``, at least 16 (no degenerate 1-wide Triton tiles)."""
    return 1 << (max(n, 16) - 1).bit_length()


def supports(g: Any, axes: ResolvedRoute) -> bool:
    """Whether the kernel path can run leaf ``g`` (see the module docstring)."""
    return axes_lib.kernel_takes(g, axes, SUPPORTED_DTYPES)


def _half_iteration_kernel(
    g_ref: Any, s_ref: Any, other_ref: Any, old_ref: Any, eps_ref: Any, out_ref: Any, *,
    over_rows: bool, n_rows: int, n_cols: int, block_out: int, block_red: int,
    target: float,
) -> None:
    """One half-iteration for one output block: sums of ``(G/m)²`` against ``other²``, rescaled.

    ``over_rows``: reduce over rows (the output is one scale per column) or over columns.
    ``s_ref[b, 0]·s_ref[b, 1] = 1/m`` (two factors so that neither is subnormal); the
    output block is ``old · t / (old · sqrt(sum) + ε_b)``, or ``old`` where the sum is 0
    (an all-zero slice keeps its scale), as :func:`sage_optax.sinkgd._iterate`.
    """
    b, j = pl.program_id(0), pl.program_id(1)
    n_out, n_red = (n_cols, n_rows) if over_rows else (n_rows, n_cols)
    out_idx = j * block_out + jnp.arange(block_out)
    out_ok = out_idx < n_out
    s1, s2 = s_ref[b, 0], s_ref[b, 1]

    def body(t: Any, acc: jax.Array) -> jax.Array:
        red_idx = t * block_red + jnp.arange(block_red)
        red_ok = red_idx < n_red
        red = pl.ds(t * block_red, block_red)
        out = pl.ds(j * block_out, block_out)
        w = plt.load(other_ref.at[b, red], mask=red_ok, other=0.0)
        if over_rows:
            tile = plt.load(g_ref.at[b, red, out], mask=red_ok[:, None] & out_ok[None, :],
                            other=0.0)
            x = (tile.astype(jnp.float32) * s1) * s2
            return acc + jnp.sum(x * x * (w * w)[:, None], axis=0)
        tile = plt.load(g_ref.at[b, out, red], mask=out_ok[:, None] & red_ok[None, :],
                        other=0.0)
        x = (tile.astype(jnp.float32) * s1) * s2
        return acc + jnp.sum(x * x * (w * w)[None, :], axis=1)

    n_tiles = pl.cdiv(n_red, block_red)
    sums = jax.lax.fori_loop(0, n_tiles, body, jnp.zeros((block_out,), jnp.float32))
    out = pl.ds(j * block_out, block_out)
    old = plt.load(old_ref.at[b, out], mask=out_ok, other=1.0)
    norm = jnp.sqrt(sums)
    new = old * target / (old * norm + eps_ref[b])
    plt.store(out_ref.at[b, out], jnp.where(norm > 0, new, old), mask=out_ok)


def _half_iteration(
    g3: jax.Array, s: jax.Array, other: jax.Array, old: jax.Array, eps: jax.Array, *,
    over_rows: bool, target: float, interpret: bool,
) -> jax.Array:
    """The new scale vector (``old``'s shape ``(B, n_out)``) of one half-iteration."""
    batch, n_rows, n_cols = g3.shape
    n_out, n_red = (n_cols, n_rows) if over_rows else (n_rows, n_cols)
    block_out = min(_pow2_at_least(n_out), 64)
    while block_out > 16 and batch * pl.cdiv(n_out, block_out) < _MIN_PROGRAMS:
        block_out //= 2
    block_red = min(_pow2_at_least(n_red), max(16, _TILE_ELEMENTS // block_out))
    kernel = functools.partial(
        _half_iteration_kernel, over_rows=over_rows, n_rows=n_rows, n_cols=n_cols,
        block_out=block_out, block_red=block_red, target=target,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(old.shape, jnp.float32),
        grid=(batch, pl.cdiv(n_out, block_out)),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        name="sinkhorn_half_iteration",
    )(g3, s, other, old, eps)


def _view_scales(
    g3: jax.Array, m: jax.Array, rows_are_fan_in: bool, num_iters: Any, eps: Any,
    t_in: float, t_out: float, interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """The iteration on the ``(B, R, C)`` view: ``(c, r)`` before the final split of ``1/m``.

    ``m``: ``(B,)`` float32 powers of two (:func:`sage_optax.numerics.range_scale`).
    """
    batch, n_rows, n_cols = g3.shape
    half = pow2_sqrt_floor(m)
    s = jnp.stack([1 / half, half / m], axis=1)  # (1/half)·(half/m) = 1/m, both normal
    fan_in_size, fan_out_size = (n_rows, n_cols) if rows_are_fan_in else (n_cols, n_rows)
    c = jnp.ones((batch, fan_in_size), jnp.float32)  # one scale per fan-in index
    r = jnp.ones((batch, fan_out_size), jnp.float32)  # one per output unit
    # r's norms run over the fan-in axis: over the rows when the rows are the fan-in group.
    step = functools.partial(_half_iteration, g3, s, interpret=interpret)
    eps = jnp.asarray(eps, jnp.float32)
    eps_first = eps / m  # the first half-iteration normalises G/m with eps/m

    def body(i: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        c, r = carry
        eps_r = jnp.where(i == 0, eps_first, jnp.broadcast_to(eps, (batch,)))
        r = step(c, r, eps_r, over_rows=rows_are_fan_in, target=t_in)
        c = step(r, c, jnp.broadcast_to(eps, (batch,)), over_rows=not rows_are_fan_in,
                 target=t_out)
        return c, r

    return jax.lax.fori_loop(0, num_iters, body, (c, r))


def pallas_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The scales ``(c, r)`` of the leaves ``gs`` (one shape, ``axes``), by the Pallas kernel.

    One leaf: :func:`sage_optax.sinkgd.sinkhorn_scales`' ``(c, r)``; several:
    :func:`sage_optax.sinkgd.stacked_sinkhorn_scales`' (stacked along a new leading
    axis; the gradients are stacked in their own dtype, the one matrix temporary of this
    path).  Same range scaling by ``m``, same first-iteration ``ε/m``, same final split of
    ``1/m`` between ``c`` and ``r``; float32 within rounding, not bit for bit.

    Args:
      gs: leaves of one shape and dtype with :func:`supports` true.
      axes: their resolved axes.
      num_iters: ``L``.
      eps: ε.
      normalization: ``"unit"`` or ``"sqrt"``.
      after: a value this group's work waits for (orders consecutive groups).
      interpret: run the kernels with Pallas's interpreter (any backend).
    """
    if after is not None:
        gs, _ = jax.lax.optimization_barrier((gs, after))
    if len(gs) == 1:
        g = gs[0]
    else:
        g, axes = jnp.stack(gs), axes_lib.stacked_route(axes, len(gs))
    view = matrix_view(axes)
    assert view is not None, axes
    batch, n_rows, n_cols, rows_are_fan_in = view
    m = range_scale(g.astype(jnp.float32), axes)  # fused: no float32 copy of g
    m_b = m.reshape(batch)
    c, r = _view_scales(
        g.reshape(batch, n_rows, n_cols), m_b, rows_are_fan_in, num_iters, eps,
        norm_target(normalization, axes.fan_in_size),
        norm_target(normalization, axes.fan_out_size),
        interpret,
    )
    half = pow2_sqrt_floor(m_b)
    c, r = c / half[:, None], r / (m_b / half)[:, None]
    c_shape, r_shape = axes_lib.scale_shapes(axes)
    return c.reshape(c_shape), r.reshape(r_shape)
