"""SinkGD: Sinkhorn-normalised gradient descent (Scetbon et al. 2025; SAGE paper, Unit-Norm).

For a gradient matrix ``G`` (per batch index of stacked layers; a leaf with several fan-in
or fan-out axes is one matrix with each group merged), repeat ``num_iters`` times (axis groups:
``docs/routing.md``)::

    X ← X / (‖X‖₂ along the fan-in axis + eps) · t_in     (each output unit's vector)
    X ← X / (‖X‖₂ along the fan-out axis + eps) · t_out

with ``t_in = t_out = 1`` for ``normalization="unit"`` (the SAGE paper's Unit-Norm SinkGD)
and ``t_in = sqrt(fan-in size)``, ``t_out = sqrt(fan-out size)`` for ``"sqrt"`` (Scetbon et
al.'s SR-Sinkhorn).  The update of :func:`sinkgd` is ``θ ← θ(1 − ηw) − η·α·X``.

Implementation: ``X`` is kept as ``diag(c) · G · diag(r)`` with two scale vectors; each
half-iteration is one matrix-vector product of ``K = G²`` (formed once per step) with the
other vector's square, and ``X`` is formed once at the end, fused into the parameter update.
This is exactly the matrix rewrite above (the norm of a scaled column is the scale times the
weighted norm) but writes no matrix per half-iteration: the only matrix temporary is ``K``,
and a layer's ``K`` is small enough to stay in the CPU's last-level cache across the ``2L``
products (``benchmarks/jax_step.py``).

Range: ``K`` is formed from ``G/m`` with ``m`` a power of two close to the matrix's largest
magnitude (one per batch index), so the squares neither overflow (a float32 gradient entry
of 1e19 would make ``G²`` infinite) nor underflow; the first normalisation then uses
``eps/m``, since ``(G/m)/(‖G/m‖ + ε/m) = G/(‖G‖ + ε)``, and the later ones are unchanged.
Dividing by a power of two is exact, so for gradients whose squares are in range the
result is bit-for-bit that of the plain computation: the rescaling changes no number, it
only keeps every finite gradient finite.  An all-zero matrix stays zero.  Finding ``m`` is
a pass over ``G``: for arrays on the CPU, :func:`scale_by_sinkhorn` skips it
(:func:`checked_sinkhorn_scales`): it iterates on ``G²`` and checks on the scale vectors
that every sum stayed in range, and only where one did not computes the above.

With ``impl="pallas"``, :func:`scale_by_sinkhorn` computes the scales of arrays on a CUDA
GPU with the Pallas kernel of :mod:`sage_optax.sinkgd_pallas` instead: the same iteration
without forming ``K``.  The choice follows where the arrays are, not JAX's default backend
(:mod:`sage_optax.placement`): one jitted update runs the kernel on CUDA arrays and this
module on CPU arrays.  ``impl="auto"`` (the default) takes the kernel only on a GPU where
``scripts/gpu-check`` has shown it correct and faster (:mod:`sage_optim.kernels`; on none
yet), and ``SAGE_KERNELS=off`` turns it off everywhere.  This module stays the reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sage_optax import axes as axes_lib
from sage_optax import placement, validation
from sage_optax.numerics import pow2_floor, pow2_sqrt_floor, range_scale
from sage_optax.registry import RuleContext, register
from sage_optim import hyperparams, kernels
from sage_optim.hyperparams import SinkGDHyperparams
from sage_optim.presets import RULE_DEFAULTS
from sage_optim.routing import ResolvedRoute

_DEFAULTS = RULE_DEFAULTS["sinkgd"]

GROUPINGS: tuple[str, ...] = ("auto", "leaf", "stack", "sequence")
"""How :func:`scale_by_sinkhorn` runs the matrices of a tree: ``"leaf"`` one computation
per leaf, ``"stack"`` one batched computation per group of leaves sharing a shape, dtype and
axes (stacked in chunks of at most ``group_bytes``), ``"sequence"`` one loop per such group
that computes its leaves one after another (:func:`sequenced_sinkhorn_scales`: no copy of
the gradients, one leaf's ``K`` alive at a time, the loop's body compiled once per group;
the ``K`` computations, the others per leaf), ``"auto"`` :func:`resolved_grouping`: a
sequence for arrays on the CPU and stacks for arrays on an accelerator (where each
matrix's ~25 small kernels cost more in launches than in bytes), decided by placement, as
the implementation.  Every choice computes the same numbers (each matrix gets exactly
its own iteration)."""

CPU_GROUPING: str = "sequence"
"""What ``grouping="auto"`` is for arrays on the CPU.  ``"sequence"``: on this project's
CPU it compiled the 270M model's update (and train step) about 2x faster than one
computation per leaf and ran the update about 8% faster (each layer's ``K`` stays in the
last-level cache), ``benchmarks/RESULTS.md`` (issue 41)."""


def resolved_grouping(grouping: str, platform: str) -> str:
    """``"leaf"``, ``"stack"`` or ``"sequence"``: what ``grouping`` is on ``platform``.

    ``platform`` is where the arrays are (``"cpu"``, ``"cuda"``, ...); ``"auto"`` is
    :data:`CPU_GROUPING` on the CPU and ``"stack"`` elsewhere.
    """
    validation.check_choice("grouping", grouping, GROUPINGS)
    if grouping != "auto":
        return grouping
    return CPU_GROUPING if platform == "cpu" else "stack"


GROUP_BYTES: int = hyperparams.SINKHORN_GROUP_BYTES
"""Default size limit of one stacked group: its copy of the gradients and its ``K`` (shared
with :mod:`sage_torch`: :data:`sage_optim.hyperparams.SINKHORN_GROUP_BYTES`)."""

IMPLS: tuple[str, ...] = ("auto", "pallas", "jnp", "stream", "blocked", "native")
"""Which code computes the scales in :func:`scale_by_sinkhorn`: ``"jnp"`` this module (the
reference), ``"pallas"`` the Pallas kernel of :mod:`sage_optax.sinkgd_pallas` (compiled
with Triton for arrays on a CUDA GPU, run by Pallas's interpreter for arrays elsewhere),
``"stream"`` this module without ``K`` (:func:`streamed_sinkhorn_scales`: every pass reads
``G`` itself, in batches of at most :data:`STREAM_GROUP_BYTES` so that a GPU's L2 holds a
batch across its passes), ``"blocked"`` this module by blocks of rows
(:func:`blocked_sinkhorn_scales`: neither ``K`` nor a copy of ``G``, for the layouts of
:func:`blocked_layout`; the others as ``"jnp"``), ``"native"`` the compiled CPU kernel of
:mod:`sage_optax.sinkgd_native` for arrays on the CPU (one XLA FFI call per leaf, no ``K``;
elsewhere as ``"auto"``), ``"auto"`` the kernel or the streamed computation on a single GPU
where ``scripts/gpu-check`` has validated it (:func:`use_kernel`, :func:`use_stream`), on
a single CPU device the native kernel for leaves of at least :data:`CPU_NATIVE_BYTES` where
it compiles (:func:`use_native`, :data:`CPU_NATIVE`), and ``"jnp"`` everywhere else.
Leaves a kernel does not support
(:func:`sage_optax.sinkgd_pallas.supports`: float64, other layouts, zero-size, explicit
sharding; the native kernel's: :func:`sage_optax.sinkgd_native.supports`) use this module
whatever the choice; ``SAGE_KERNELS=off`` in the environment makes every choice this
module."""

STREAM_GROUP_BYTES: int = 24 * 2**20
"""Default size limit of one stacked batch of the streamed computation (``impl="stream"``,
:func:`streamed_sinkhorn_scales`): its ``2L + 1`` passes over ``G/m`` then stay in the
50 MB L2 of an H100 or H200 (an explicit ``group_bytes`` overrides it)."""
CPU_BLOCKED: bool = False
"""Whether ``impl="auto"`` computes the scales of arrays on the CPU by blocks
(:func:`blocked_sinkhorn_scales`: no ``K``, no ``X``, as ``impl="blocked"``) rather than
on ``K = G²`` with the range checks (:func:`checked_sinkhorn_scales`).  Off: on this
project's CPU the ``K`` path was faster (XLA:CPU's matrix-vector products over a whole
``K`` against a loop of block products; ``benchmarks/RESULTS.md``, issue 41)."""

CPU_NATIVE: bool = True
"""Whether ``impl="auto"`` computes the scales of large leaves on the CPU with the compiled
kernel (:mod:`sage_optax.sinkgd_native`; those of at least :data:`CPU_NATIVE_BYTES`), where it
compiles, in a one-process job on one CPU device (:func:`use_native`)."""

CPU_NATIVE_BYTES: int = 16 * 2**20
"""The smallest leaf (bytes of its matrices in float32: the ``K`` the jnp path forms) whose
scales ``impl="auto"`` computes with the native kernel on the CPU.  Below it the jnp path's
``K`` stays in the last-level cache across its ``2L`` products and was faster on this
project's CPU (16 MiB of L3: a 1024 x 2816 matrix, 11 MiB, 2.1 against 3.3 ms); above it
``K`` does not, and the kernel, which reads ``G`` once per iteration, was faster (1536 x
4096, 24 MiB: 7.7 against 9.7 ms; 2048 x 5632: 14.4 against 20.6 ms; the 270M model's
501 MiB embedding under sinkgd-pure: the update 1.35x ``optax.adamw``'s time against 2.16x,
its temporaries 11.6 against 503 MiB; ``benchmarks/RESULTS.md``, issue 41)."""

_KERNEL = axes_lib.KERNEL  # a Flax kernel (in, out), leading axes stacked


def sinkhorn_normalize(
    g: jax.Array,
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
) -> jax.Array:
    """Sinkhorn-normalise one matrix leaf along its named axes (see module docstring).

    Args:
      g: the gradient leaf.
      axes: its resolved axes (a matrix: ``fan_in`` and ``fan_out`` set; the rest batch).
      num_iters: number of (fan-in, fan-out) iteration pairs ``L``.
      eps: ε added to every norm.
      normalization: ``"unit"`` or ``"sqrt"``.

    Returns:
      ``X`` with the shape and dtype of ``g``.

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD; SR-Sinkhorn, ``"sqrt"``).

      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Unit-Norm SinkGD, ``"unit"``).
    """
    c, r = sinkhorn_scales(g, axes, num_iters, eps, normalization)
    return apply_scales(g, axes, c, r).astype(g.dtype)


def apply_scales(
    g: jax.Array, axes: ResolvedRoute, c: jax.Array, r: jax.Array
) -> jax.Array:
    """``X = diag(c) · G · diag(r)`` (in the wide dtype of ``c``) from :func:`sinkhorn_scales`.

    ``c · G`` is formed first; :func:`sinkhorn_scales` splits the range factor between
    ``c`` and ``r`` so that this partial product is finite for any finite ``G``.
    """
    g = g.astype(c.dtype) if g.dtype != c.dtype else g
    return jnp.expand_dims(c, axes.fan_out) * g * jnp.expand_dims(r, axes.fan_in)


def sinkhorn_scales(
    g: jax.Array,
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scale vectors ``(c, r)`` with ``X = diag(c) · G · diag(r)``.

    ``c`` has ``g``'s shape without the fan-out axes (one scale per fan-in index), ``r``
    without the fan-in axes (one per output unit), both in float32 or wider.  With axis
    groups the norms run over every axis of a group: the merged matrix, without a reshape.

    The iteration runs on ``G/m`` (:func:`range_scale`), whose squares are in range for
    any finite ``G``: ``r`` then carries a factor ``m``, and ``1/m`` is split between the
    returned ``c`` and ``r`` (two exact powers of two) so that neither they nor ``c · G``
    leave the range.  Their product, and so ``X``, is that of the plain computation.
    """
    wide = jnp.promote_types(g.dtype, jnp.float32)
    g = g.astype(wide) if g.dtype != wide else g
    m, k = _range_squares(g, axes, after)
    c, r, _ = _iterate(k, m, axes, num_iters, eps, normalization)
    return c, r


def stacked_sinkhorn_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`sinkhorn_scales` of several leaves of one shape and ``axes``, as one batch.

    Returns ``(c, r)`` stacked along a new leading axis: ``c[k]``, ``r[k]`` are exactly the
    scales of ``gs[k]`` (the same operations, batched).  Only ``K`` is stacked (built from
    the leaves in one fused operation) and the scales; ``X`` is then applied to each leaf
    itself (:func:`apply_scales`), so no copy of the gradients is made.
    """
    wide = jnp.promote_types(gs[0].dtype, jnp.float32)
    gs = [g.astype(wide) if g.dtype != wide else g for g in gs]
    ms = [range_scale(g, axes) for g in gs]
    k = _squares([g / m for g, m in zip(gs, ms, strict=True)], after)
    c, r, _ = _iterate(k, jnp.stack(ms), axes_lib.stacked_route(axes, len(gs)), num_iters, eps,
                       normalization)
    return c, r


def _squares(gms: list[jax.Array], after: jax.Array | None, floor: bool = False
             ) -> jax.Array:
    """``K = (G/m)²`` of one leaf, or of several stacked along a new leading axis.

    ``floor``: a non-zero entry's square is at least the dtype's smallest normal number
    (where it would flush to zero), so that a slice of ``K`` sums to 0 only where ``G`` is
    zero (:func:`checked_sinkhorn_scales`).

    ``after``: a data dependency (the two branches are bitwise equal) that makes this K wait
    for it, so that consecutive leaves' K are not all alive at once.  The dependency is taken
    per leaf, before the stack: a stack of squares that did not depend on it could be formed
    before the previous chunk is done (on an H100, a stacked update held two chunks' worth of
    temporaries where the CPU holds one).
    """
    if after is None:
        squares = [jnp.square(x) for x in gms]
    else:  # each leaf's square waits for ``after``, so a stack cannot be formed before it
        squares = [jnp.where(after >= 0, jnp.square(x), jnp.abs(x) * jnp.abs(x)) for x in gms]
    if floor:
        tiny = jnp.finfo(gms[0].dtype).tiny
        squares = [jnp.where(x == 0, 0, jnp.maximum(k, tiny)) for x, k in zip(gms, squares,
                                                                              strict=True)]
    return squares[0] if len(squares) == 1 else jnp.stack(squares)


def checked_sinkhorn_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scales, without the pass over ``G`` that finds its range (on the CPU).

    :func:`sinkhorn_scales`' of one leaf, or :func:`stacked_sinkhorn_scales`' of several.
    The iteration runs on ``K = G²`` itself (the plain computation, each non-zero square
    floored at the smallest normal number) and checks, on the scale vectors only, that
    every one of its ``2L`` sums stayed in range (:data:`RANGE_CHECK`): finite, at most
    ``2^100``, and large enough that what float32 flushes to zero (below ``2^-126``)
    changes no sum by more than ``2^-26`` of itself; exactly-zero rows and columns are
    told apart and pass.  Where a check fails (an entry whose square overflows; a matrix,
    row or column so small that its squares underflow; a non-finite entry) the result is
    :func:`sinkhorn_scales`' (the range-scaled computation) instead, computed then.

    The range scale ``m`` is a power of two, so where no square leaves float32's normal
    range the two computations do the same operations on numbers that differ by exact
    powers of two: ``X`` is the same bit for bit; elsewhere the checks bound the difference
    by float32 rounding.  What is saved is a read of every gradient matrix (one of the
    ~14 matrix passes of a SinkGD step: on the CPU, the 270M model's matrices' step is
    ~15% faster, ``benchmarks/RESULTS.md``).  The choice between the two is a
    ``lax.cond``: on a GPU its predicate is read by the host before the rest of the step
    can run, so :func:`scale_by_sinkhorn` takes this path for arrays on the CPU only.
    """
    # One compiled program per shape and options, also when called eagerly: op by op, the
    # loop would be compiled again at every call (its body a new closure each time), and
    # XLA:CPU keeps every compiled kernel mapped (a process has 65,530 maps).
    if isinstance(num_iters, (int, np.integer)) and not isinstance(num_iters, bool):
        return _checked_static(gs, axes, int(num_iters), eps, normalization, after)
    return _checked_traced(gs, axes, num_iters, eps, normalization, after)


def _checked_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any,
    eps: Any,
    normalization: str,
    after: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`checked_sinkhorn_scales`' computation (compiled once per shape and options)."""
    wide = jnp.promote_types(gs[0].dtype, jnp.float32)
    gs = [g.astype(wide) if g.dtype != wide else g for g in gs]
    route = axes if len(gs) == 1 else axes_lib.stacked_route(axes, len(gs))
    c, r, in_range = _iterate(_squares(gs, after, floor=True), None, route, num_iters, eps,
                              normalization, check=True)

    return jax.lax.cond(in_range, lambda _: (c, r), lambda gs: range_scaled_scales(
        gs, axes, num_iters, eps, normalization, after), gs)


def range_scaled_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scales by the computation that finds the range (one leaf or a stacked batch).

    :func:`sinkhorn_scales` of one leaf, :func:`stacked_sinkhorn_scales` of several: what
    :func:`checked_sinkhorn_scales` falls back to, and every non-CPU branch's computation.
    """
    if len(gs) == 1:
        return sinkhorn_scales(gs[0], axes, num_iters, eps, normalization, after)
    return stacked_sinkhorn_scales(gs, axes, num_iters, eps, normalization, after)


def sequenced_sinkhorn_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
    checked: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The scales of several leaves of one shape, dtype and axes, one leaf after another.

    Returns ``(c, r)`` stacked along a new leading axis: ``c[k]``, ``r[k]`` are the scales
    of ``gs[k]`` by the computation of one leaf alone (:func:`checked_sinkhorn_scales` with
    ``checked``, else :func:`range_scaled_scales`), the same operations in the same order.
    One ``lax.scan`` runs the leaves in turn, so its body (the ``2L`` products and their
    checks) is compiled once for the group instead of once per leaf, and only one leaf's
    ``K`` is alive at a time: a layer's ``K`` then stays in the CPU's last-level cache for
    its products, undisturbed by the other leaves' work.  The body picks leaf ``k`` with a
    ``lax.switch`` whose branches form that leaf's ``K`` (and its range scale, where it is
    needed) from the leaf itself: no copy of the gradients is made.  With ``checked`` the
    range check's fallback is a second attempt of the same loop (:func:`_checked_attempts`),
    so the program holds one copy of the iteration, not two.
    """
    # One compiled program per shape and options, also when called eagerly (each call
    # would otherwise trace and compile a new loop, as checked_sinkhorn_scales says).
    if isinstance(num_iters, (int, np.integer)) and not isinstance(num_iters, bool):
        return _sequenced_static(gs, axes, int(num_iters), eps, normalization, after, checked)
    return _sequenced_traced(gs, axes, num_iters, eps, normalization, after, checked)


def _sequenced_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any,
    eps: Any,
    normalization: str,
    after: jax.Array | None,
    checked: bool,
) -> tuple[jax.Array, jax.Array]:
    """:func:`sequenced_sinkhorn_scales`' computation (compiled once per shape and options)."""
    wide = jnp.promote_types(gs[0].dtype, jnp.float32)

    def widened(g: jax.Array) -> jax.Array:
        return g.astype(wide) if g.dtype != wide else g

    def pick(k: jax.Array, make: Any) -> Any:  # make(leaf k), formed inside its branch
        return jax.lax.switch(k, [functools.partial(make, g) for g in gs])

    def body(prev: jax.Array, k: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        if checked:
            c, r = _checked_attempts(lambda make: pick(k, lambda g: make(widened(g))), gs[0],
                                     axes, num_iters, eps, normalization, prev)
        else:
            m, k2 = pick(k, lambda g: _range_squares(widened(g), axes, prev))
            c, r, _ = _iterate(k2, m, axes, num_iters, eps, normalization)
        # the next leaf's K waits for these scales (through _squares' dependency)
        return jnp.min(r, initial=jnp.inf), (c, r)

    start = jnp.asarray(jnp.inf, wide) if after is None else after.astype(wide)
    _, (c, r) = jax.lax.scan(body, start, jnp.arange(len(gs)))
    return c, r


def _checked_attempts(
    leaf: Any,
    like: jax.Array,
    axes: ResolvedRoute,
    num_iters: Any,
    eps: Any,
    normalization: str,
    after: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`checked_sinkhorn_scales`' scales of one leaf with one copy of the iteration.

    ``leaf(make)`` is ``make`` of the (widened) leaf; ``like`` an array of its shape.  At
    most two attempts of the checked iteration: the first on ``K = G²`` (``m = 1``: the
    checked path's operations, its numbers), the second, only where a sum left the range,
    on ``K = (G/m)²`` with the range scale ``m`` (the range-scaled computation, its squares
    floored as the first's).  One loop instead of two (the checked one and its fallback)
    is what the sequence compiles once per group.
    """
    wide = jnp.promote_types(like.dtype, jnp.float32)
    # shaped (and, on an explicit-axes mesh, sharded) like range_scale's m and the scales;
    # only their types are read from ``like``, not its values
    one = jnp.ones_like(jnp.max(like, axis=(*axes.fan_in, *axes.fan_out), keepdims=True),
                        dtype=wide)

    def attempt(state: tuple[Any, ...]) -> tuple[Any, ...]:
        tries = state[0]
        m = jax.lax.cond(tries == 0, lambda: one,
                         lambda: leaf(lambda g: range_scale(g, axes)))
        c, r, ok = _iterate(leaf(lambda g: _squares([g / m], after, floor=True)), m, axes,
                            num_iters, eps, normalization, check=True)
        return tries + 1, c, r, ok

    zeros = (jnp.zeros_like(jnp.sum(like, axis=axes.fan_out), dtype=wide),
             jnp.zeros_like(jnp.sum(like, axis=axes.fan_in), dtype=wide))
    _, c, r, _ = jax.lax.while_loop(lambda s: (s[0] < 2) & ~s[3], attempt,
                                    (jnp.asarray(0), *zeros, jnp.asarray(False)))
    return c, r


_sequenced_static = jax.jit(_sequenced_scales,
                            static_argnames=("axes", "num_iters", "normalization", "checked"))
_sequenced_traced = jax.jit(_sequenced_scales,
                            static_argnames=("axes", "normalization", "checked"))


def _range_squares(g: jax.Array, axes: ResolvedRoute, after: jax.Array | None
                   ) -> tuple[jax.Array, jax.Array]:
    """``(m, K = (G/m)²)`` of one leaf: :func:`sinkhorn_scales`' range scale and ``K``."""
    m = range_scale(g, axes)
    return m, _squares([g / m], after)


def streamed_sinkhorn_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scales of one leaf or a stacked batch without ``K``: ``G`` is read every pass.

    :func:`range_scaled_scales`' scales (the same range scale ``m``, first-iteration
    ``ε/m`` and final split of ``1/m``), but each half-iteration is one reduction of
    ``(G/m)²`` weighted by the other vector's square, the square formed inside it (XLA
    fuses it), so no matrix temporary is written but a stacked batch's copy of ``G/m``,
    and a batch small enough for the GPU's L2 is read from there by its ``2L`` passes.
    The iterations are unrolled (a GPU ``while`` loop reads its predicate back to the host
    at every iteration).  Float32 within rounding of :func:`range_scaled_scales` (another
    order of summation than its matrix-vector products), not bit for bit.
    """
    wide = jnp.promote_types(gs[0].dtype, jnp.float32)
    gs = [g.astype(wide) if g.dtype != wide else g for g in gs]
    ms = [range_scale(g, axes) for g in gs]
    xs = [g / m for g, m in zip(gs, ms, strict=True)]
    if after is not None:  # wait for the previous batch (x and -x have the same squares)
        xs = [jnp.where(after >= 0, x, -x) for x in xs]
    if len(gs) == 1:
        c, r, _ = _iterate(xs[0], ms[0], axes, num_iters, eps, normalization, streamed=True)
    else:
        c, r, _ = _iterate(jnp.stack(xs), jnp.stack(ms), axes_lib.stacked_route(axes, len(gs)),
                           num_iters, eps, normalization, streamed=True)
    return c, r


BLOCK_ELEMENTS: int = 2**18
"""Elements of one block of :func:`blocked_sinkhorn_scales` (1 MiB of float32: a block of
``(G/m)²`` stays in the CPU's caches for its two matrix-vector products).  Measured on a
1024 x 2816 matrix (``benchmarks/RESULTS.md``): blocks of 2^17 to 2^19 elements took about
half the time of the ``K`` path, blocks of 2^16 (16 rows) about as long."""


def blocked_layout(g: Any, axes: ResolvedRoute) -> tuple[int, int, int, bool] | None:
    """``(B, R, C, rows_are_fan_in)``: ``g`` as a ``(B, R, C)`` reshape, or ``None``.

    A reshape that moves no data: the batch axes lead, then one axis group, then the
    other (each group's axes consecutive).  ``None`` for any other layout (a view, batch
    axes between the groups) and for zero-size leaves: :func:`blocked_sinkhorn_scales`
    does not take them.
    """
    if axes.view is not None or g.size == 0:
        return None
    nb = len(axes.batch)
    if axes.batch != tuple(range(nb)):
        return None
    first, second = sorted((tuple(axes.fan_in), tuple(axes.fan_out)), key=min)
    if first + second != tuple(range(nb, g.ndim)):
        return None
    shape = tuple(g.shape)
    return (math.prod(shape[:nb]), math.prod(shape[a] for a in first),
            math.prod(shape[a] for a in second), first == tuple(axes.fan_in))


def block_rows(b: int, rows: int, cols: int, block: int | None = None) -> int:
    """Rows of one block of a ``(B, R, C)`` matrix (``block``: its most elements).

    At least one row; a divisor of ``R`` where one is at least half the most rows (then
    no tail block is compiled).
    """
    block = BLOCK_ELEMENTS if block is None else block
    rb = max(1, min(rows, block // max(1, b * cols)))
    for d in range(rb, max(0, rb // 2), -1):
        if rows % d == 0:
            return d
    return rb


def blocked_sinkhorn_scales(
    gs: list[jax.Array],
    axes: ResolvedRoute,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
    block: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scales of one leaf (or of several, stacked) by blocks of rows: no ``K``, no ``X``.

    ``impl="blocked"`` (and the CPU's ``"auto"`` where :data:`CPU_BLOCKED`).  Each matrix,
    as a ``(B, R, C)`` reshape (:func:`blocked_layout`), is read in blocks of rows of at
    most ``block`` elements (:data:`BLOCK_ELEMENTS`); a block's ``(G/m)²`` is formed, used
    by two matrix-vector products while it is in the cache, and dropped.  One sweep over
    the blocks does a whole iteration: the half-iteration whose norms run along the rows (each row's
    scale from its block alone) and the sums of the other (accumulated over the
    blocks), so ``L`` sweeps (``L + 1`` when the rows are the fan-in axis, whose
    half-iteration comes second) and one pass for the range scale ``m``
    (:func:`range_scale`, as :func:`sinkhorn_scales`: the same first-iteration ``ε/m``
    and final split of ``1/m``, so any finite ``G`` gives finite scales).  The only
    temporaries are a block and the scale vectors.  Float32 within rounding of
    :func:`sinkhorn_scales` (other orders of summation), not bit for bit.  The leaves of
    ``gs`` are computed one at a time (no stacked copy) and their scales stacked.
    """
    if len(gs) > 1:
        out = [blocked_sinkhorn_scales([g], axes, num_iters, eps, normalization, after, block)
               for g in gs]
        return jnp.stack([c for c, _ in out]), jnp.stack([r for _, r in out])
    g = gs[0]
    layout = blocked_layout(g, axes)
    if layout is None:
        raise ValueError(f"blocked_sinkhorn_scales: layout {axes} of shape {g.shape} is not "
                         "a (batch, rows, columns) reshape")
    b, rows, cols, rows_in = layout
    wide = jnp.promote_types(g.dtype, jnp.float32)
    g3 = g.reshape(b, rows, cols)
    # range_scale's m per matrix (max|G| is exact in G's own dtype: no wide copy of G)
    m = pow2_floor(jnp.max(jnp.abs(g3), axis=2, initial=0.0).max(axis=1, keepdims=True)
                   .astype(wide))
    if after is not None:  # wait for the previous batch (a dependency on a vector only;
        # both branches are m, so a NaN in the previous batch changes nothing here)
        m = jnp.where(after >= 0, m, jnp.abs(-m))
    if normalization == "unit":
        targets = (jnp.asarray(1.0, wide), jnp.asarray(1.0, wide))
    else:  # a row's norm runs over the columns, a column's over the rows
        targets = (jnp.sqrt(jnp.asarray(cols, wide)), jnp.sqrt(jnp.asarray(rows, wide)))
    row_scale, acc_scale = _block_sweeps(g3, m, rows_in, targets,
                                         block_rows(b, rows, cols, block), num_iters, eps)
    c, r = (row_scale, acc_scale) if rows_in else (acc_scale, row_scale)
    # X = c·(G/m)·r = (c·2^-a)·G·(r·2^-b) with 2^a·2^b = m, as _iterate
    half = pow2_sqrt_floor(m)
    c, r = c / half, r / (m / half)
    c_shape, r_shape = axes_lib.scale_shapes(axes)
    return c.reshape(c_shape), r.reshape(r_shape)


def _rescale(scale: jax.Array, norm_sq: jax.Array, target: jax.Array, eps: Any) -> jax.Array:
    """One half-iteration's new scales: ``scale·t/(scale·‖·‖ + eps)`` from the squared norms.

    An all-zero slice stays zero whatever its scale; its scale is kept (finite) there.
    """
    norm = jnp.sqrt(norm_sq)
    new = scale * target / (scale * norm + eps)
    return jnp.where(norm > 0, new, scale)


def _block_products(k: jax.Array, w: jax.Array, along_rows: bool) -> jax.Array:
    """The matrix-vector products of the blocks ``k`` ``(B, R, C)`` with the weights ``w``.

    ``along_rows``: ``w`` ``(B, C)`` weights the columns (one sum per row), else ``w``
    ``(B, R)`` the rows; one matrix (``B = 1``) as a plain, unbatched product.
    """
    hi = jax.lax.Precision.HIGHEST
    if k.shape[0] == 1:
        spec = "ij,j->i" if along_rows else "ij,i->j"
        return jnp.einsum(spec, k[0], w[0], precision=hi)[None]
    spec = "bij,bj->bi" if along_rows else "bij,bi->bj"
    return jnp.einsum(spec, k, w, precision=hi)


def _block_sweeps(g3: jax.Array, m: jax.Array, rows_in: bool,
                  targets: tuple[jax.Array, jax.Array], rb: int, num_iters: Any, eps: Any
                  ) -> tuple[jax.Array, jax.Array]:
    """:func:`blocked_sinkhorn_scales`' sweeps over ``g3`` ``(B, R, C)``, blocks of ``rb`` rows.

    ``m``: the range scale per matrix ``(B, 1)``; ``rows_in``: the rows are the fan-in
    axis; ``targets``: the norms' targets along the rows and along the columns.  Returns
    the row scales ``(B, R)`` and the column scales ``(B, C)`` (before the split of ``1/m``).
    """
    b, rows, cols = g3.shape
    wide = m.dtype
    t_rows, t_acc = targets
    n_full, tail = divmod(rows, rb)
    inv_m = (1 / m)[:, :, None]  # a power of two: G·(1/m) is G/m bit for bit
    eps_first = eps / m  # (B, 1)

    def rescale(scale: jax.Array, norm_sq: jax.Array, target: jax.Array, e: Any
                ) -> jax.Array:
        norm = jnp.sqrt(norm_sq)
        return jnp.where(norm > 0, scale * target / (scale * norm + e), scale)

    def squares(start: Any, size: int) -> jax.Array:
        blk = jax.lax.dynamic_slice_in_dim(g3, start, size, axis=1)
        blk = blk.astype(wide) if blk.dtype != wide else blk
        return jnp.square(blk * inv_m)

    def block_step(t: Any, start: Any, size: int, row_scale: jax.Array, acc: jax.Array,
                   acc_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        k = squares(start, size)  # (B, size, C): the only matrix-shaped temporary
        old = jax.lax.dynamic_slice_in_dim(row_scale, start, size, axis=1)
        q = _block_products(k, jnp.square(acc_scale), True)
        if rows_in:  # rows = fan-in: their half-iteration is the second (sweep 0 skips it)
            new = jnp.where(t > 0, rescale(old, q, t_rows, eps), old)
        else:  # rows = fan-out units: the first half-iteration (ε/m in the first)
            new = rescale(old, q, t_rows, jnp.where(t == 0, eps_first, eps))
        acc = acc + _block_products(k, jnp.square(new), False)
        return jax.lax.dynamic_update_slice_in_dim(row_scale, new, start, axis=1), acc

    def sweep(t: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        row_scale, acc_scale = carry
        acc = jnp.zeros_like(acc_scale)

        def body(i: Any, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return block_step(t, i * rb, rb, *c, acc_scale)

        row_scale, acc = jax.lax.fori_loop(0, n_full, body, (row_scale, acc))
        if tail:
            row_scale, acc = block_step(t, n_full * rb, tail, row_scale, acc, acc_scale)
        if not rows_in:
            return row_scale, rescale(acc_scale, acc, t_acc, eps)
        # rows = fan-in: the sums are the next iteration's first half (none after the last)
        new = rescale(acc_scale, acc, t_acc, jnp.where(t == 0, eps_first, eps))
        return row_scale, jnp.where(t < num_iters, new, acc_scale)

    row_scale = jnp.ones((b, rows), wide)
    acc_scale = jnp.ones((b, cols), wide)
    sweeps = num_iters + 1 if rows_in else num_iters
    return jax.lax.fori_loop(0, sweeps, sweep, (row_scale, acc_scale))


_checked_static = jax.jit(_checked_scales, static_argnames=("axes", "num_iters", "normalization"))
_checked_traced = jax.jit(_checked_scales, static_argnames=("axes", "normalization"))


RANGE_CHECK: tuple[float, float] = (2.0**-100, 2.0**100)
"""``(low, high)`` of :func:`checked_sinkhorn_scales`: a sum ``s`` of ``n`` terms ``K·w``
(``w`` the other scale vector's square, at most ``w_max``) is in range when
``n·(1 + w_max)·low ≤ s ≤ high``, or when its slice of ``G`` is exactly zero.  ``K``
floors a non-zero square at float32's smallest normal number ``2^-126`` (where it would
flush to zero), and a product below it flushes: each term is off by less than
``2^-126·(1 + w_max)``, so ``s`` by less than ``2^-26·s``.  With the floor, and weights of
at least 1 (the first iteration's: ``c = 1``, and ``r²`` lifted by an exact power of
two), only a zero slice sums to 0.  ``s ≤ 2^100`` keeps every norm, scale and ``c·G``
finite and every later square of a scale normal."""


def _iterate(
    k: jax.Array,
    m: jax.Array | None,
    axes: ResolvedRoute,
    num_iters: Any,
    eps: Any,
    normalization: str,
    check: bool = False,
    streamed: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``L`` Sinkhorn iterations on ``K = (G/m)²``; the scales of :func:`sinkhorn_scales`.

    ``m=None``: ``K = G²`` (no range scale; the scales are those of ``G`` itself).  Returns
    ``(c, r, in_range)``: with ``check``, whether every sum passed :data:`RANGE_CHECK`
    (otherwise ``True``).  ``streamed``: ``k`` is ``G/m`` itself, and every half-iteration
    squares it on the fly in the reduction that weights it (:func:`streamed_sinkhorn_scales`:
    no ``K``), the iterations unrolled when ``num_iters`` is a Python int.
    """
    wide = k.dtype
    fi, fo = axes.fan_in, axes.fan_out  # axis groups: a merged matrix needs no reshape here
    t_in, t_out = _targets(axes, normalization, wide)
    # Every half-iteration is one (batched) matrix-vector product with K, in full float32
    # precision on every backend (no TF32).
    sub = "abcdefghijklmnopqrstuvwxyz"[: k.ndim]
    c_sub = "".join(sub[a] for a in range(k.ndim) if a not in fo)
    r_sub = "".join(sub[a] for a in range(k.ndim) if a not in fi)
    # Scale vectors shaped (and, under explicit sharding, sharded) like reductions of K.
    c = jnp.ones_like(jnp.sum(k, axis=fo))  # one scale per fan-in index
    r = jnp.ones_like(jnp.sum(k, axis=fi))  # one scale per output unit
    hi = jax.lax.Precision.HIGHEST
    row_norms: Any = functools.partial(  # one squared norm per output unit (over the fan-in)
        jnp.einsum, f"{sub},{c_sub}->{r_sub}", precision=hi, out_sharding=axes_lib.sharding_of(r)
    )
    col_norms: Any = functools.partial(
        jnp.einsum, f"{sub},{r_sub}->{c_sub}", precision=hi, out_sharding=axes_lib.sharding_of(c)
    )
    if streamed:  # k is G/m: square it inside each weighted reduction (one read, no K)
        def row_norms(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.sum(jnp.square(x) * jnp.expand_dims(w, fo), axis=fi)

        def col_norms(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.sum(jnp.square(x) * jnp.expand_dims(w, fi), axis=fo)

    # The first half-iteration normalises G/m with eps/m (= G/(‖G‖ + eps)); from then on
    # r carries the factor m and every later half-iteration is the plain one.
    eps_first = eps if m is None else eps / jnp.squeeze(m, fi)
    if check:
        c, r, in_range = _checked_iterations(k, c, r, row_norms, col_norms, _rescale, axes,
                                             num_iters, eps, eps_first, (t_in, t_out))
    else:
        c, r = _plain_iterations(k, c, r, row_norms, col_norms, num_iters, eps, eps_first,
                                 (t_in, t_out), streamed)
        in_range = jnp.asarray(True)
    if m is None:
        return c, r, in_range
    # X = c·(G/m)·r = (c·2^-a)·G·(r·2^-b) with 2^a·2^b = m, a ≈ b: both scales and c·G
    # stay in range.
    half = pow2_sqrt_floor(m)
    return c / jnp.squeeze(half, fo), r / jnp.squeeze(m / half, fi), in_range


def _targets(axes: ResolvedRoute, normalization: str, wide: Any
             ) -> tuple[jax.Array, jax.Array]:
    """The norms' targets ``(t_in, t_out)`` of :func:`_iterate`, in the dtype ``wide``."""
    if normalization == "unit":
        t_in = t_out = jnp.asarray(1.0, wide)
    else:
        t_in = jnp.sqrt(jnp.asarray(axes.fan_in_size, wide))
        t_out = jnp.sqrt(jnp.asarray(axes.fan_out_size, wide))
    return t_in, t_out


def _plain_iterations(
    k: jax.Array,
    c: jax.Array,
    r: jax.Array,
    row_norms: Any,
    col_norms: Any,
    num_iters: Any,
    eps: Any,
    eps_first: Any,
    targets: tuple[jax.Array, jax.Array],
    streamed: bool,
) -> tuple[jax.Array, jax.Array]:
    """:func:`_iterate`'s iterations without the range check: the scales ``(c, r)``.

    Unrolled when ``streamed`` and ``num_iters`` is a Python int, else one ``fori_loop``.
    """
    t_in, t_out = targets

    def body(i: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        c, r = carry
        r = _rescale(r, row_norms(k, jnp.square(c)), t_in, jnp.where(i == 0, eps_first, eps))
        c = _rescale(c, col_norms(k, jnp.square(r)), t_out, eps)
        return c, r

    static = isinstance(num_iters, (int, np.integer)) and not isinstance(num_iters, bool)
    if streamed and static:  # straight-line code: no loop, no predicate for the host
        for i in range(int(num_iters)):
            c, r = body(i, (c, r))
    else:
        c, r = jax.lax.fori_loop(0, num_iters, body, (c, r))
    return c, r


def _checked_iterations(
    k: jax.Array,
    c: jax.Array,
    r: jax.Array,
    row_norms: Any,
    col_norms: Any,
    rescale: Any,
    axes: ResolvedRoute,
    num_iters: Any,
    eps: Any,
    eps_first: Any,
    targets: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_iterate`'s iterations on a floored ``K = G²`` with the :data:`RANGE_CHECK`.

    The first iteration also finds the exactly-zero slices, whose scales stay as they are
    and which the checks leave out: the zero columns are the first sums' zeros (weights
    1); for the rows, the weights ``r²`` are lifted by a power of two to at least 1 (the
    sums are divided by it again, exactly), so that no non-zero term flushes and only a
    zero row sums to 0.  Each half-iteration then takes one reduction, of its sums (the
    smallest in range) and of its new scale's square (the largest and, once, smallest).
    """
    t_in, t_out = targets
    wide = k.dtype
    low, high = (jnp.asarray(b, wide) for b in RANGE_CHECK)

    def reduce(norm_sq: jax.Array, zero: jax.Array, scale: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        # (smallest sum: a NaN or one above `high` counts as -1, a zero slice as +inf,
        #  largest and smallest square of the new scale)
        masked = jnp.where(zero, jnp.inf, jnp.where(norm_sq <= high, norm_sq, -1))
        w = jnp.square(scale)
        inf = jnp.asarray(jnp.inf, wide)
        return jax.lax.reduce(
            (masked, w, w), (inf, jnp.asarray(0, wide), inf),
            lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]),
                          jnp.minimum(a[2], b[2])),
            tuple(range(masked.ndim)))

    def margin(smallest: jax.Array, n: int, w_max: jax.Array) -> jax.Array:
        return smallest / (n * (1 + w_max))  # in range: at least `low`

    n_in, n_out = axes.fan_in_size, axes.fan_out_size

    def body(i: Any, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # One loop, the first iteration included: a product outside the loop could be
        # compiled to another kernel, with another order of summation.
        c, r, w_c, worst, zero_cols, zero_rows = carry
        first = i == 0
        norm_sq = row_norms(k, jnp.square(c))
        zero_cols = jnp.where(first, norm_sq == 0, zero_cols)  # weights c² = 1
        r = rescale(r, norm_sq, t_in, jnp.where(first, eps_first, eps))
        smallest, w_r, w_r_min = reduce(norm_sq, zero_cols, r)
        worst = jnp.minimum(worst, margin(smallest, n_in, w_c))
        # first: weights r² lifted by a power of two to at least 1, sums divided back
        lift = jnp.where(first, 1 / pow2_floor(jnp.minimum(w_r_min, 1)), 1)
        lifted = col_norms(k, jnp.square(r) * lift)
        zero_rows = jnp.where(first, lifted == 0, zero_rows)
        norm_sq = lifted / lift
        c = rescale(c, norm_sq, t_out, eps)
        smallest, w_c, _ = reduce(norm_sq, zero_rows, c)
        worst = jnp.minimum(worst, margin(smallest, n_out, w_r))
        return c, r, w_c, worst, zero_cols, zero_rows

    start = (c, r, jnp.asarray(1, wide), jnp.asarray(jnp.inf, wide), r == 0, c == 0)
    c, r, _, worst, _, _ = jax.lax.fori_loop(0, num_iters, body, start)
    return c, r, worst >= low


def _check_matrix(path: str, spec: Any, x: Any) -> ResolvedRoute | None:
    if spec is None:
        return None
    if not axes_lib.is_axes(spec):
        raise TypeError(f"parameter {path!r}: axes must be a Route or None, got {spec!r}")
    if x.ndim < 2 or spec.fan_in is None or not spec.fan_in:
        raise ValueError(
            f"SinkGD needs a matrix, but parameter {path!r} has shape {tuple(x.shape)}"
            + ("" if x.ndim < 2 else " and vector axes")
            + "; route 1-D/0-D parameters to another rule (e.g. make_optimizer(...) or "
            "optax.partition)"
        )
    return axes_lib.resolve_axes(spec, tuple(x.shape), path)


def _batches(matrices: list[Any], group_bytes: int) -> list[list[Any]]:
    """The matrices in computation order: one each, or stacked groups (``group_bytes > 0``).

    A group is the matrices sharing shape, dtype, axes and (on a mesh with explicit axes)
    sharding, split into chunks of at most ``group_bytes``; groups come in the order of
    their first matrix.
    """
    if group_bytes <= 0:
        return [[m] for m in matrices]
    groups: dict[Any, list[Any]] = {}
    for m in matrices:
        _, g, resolved = m
        key = (tuple(g.shape), jnp.dtype(g.dtype), resolved, axes_lib.sharding_of(g))
        groups.setdefault(key, []).append(m)
    batches = []
    for members in groups.values():
        g = members[0][1]
        per_chunk = max(1, group_bytes // max(1, g.size * jnp.dtype(g.dtype).itemsize))
        batches += [members[k:k + per_chunk] for k in range(0, len(members), per_chunk)]
    return batches


def _layout_bytes(group_bytes: Any) -> int:
    """``group_bytes`` as a Python int (``None``: :data:`GROUP_BYTES`), or a one-line error.

    It shapes the compiled program (how many matrices one batch stacks), not the numbers, so
    it must be known when the update is traced: an array (``optax.inject_hyperparams``
    injects every numeric argument it is given) is refused at ``init``, with the remedy.
    """
    if group_bytes is None:
        return GROUP_BYTES
    if not validation.is_static_number(group_bytes) and not isinstance(group_bytes, bool):
        raise TypeError(
            "group_bytes is a memory layout option, not a hyperparameter: it must be a Python "
            f"int, got {type(group_bytes).__name__} (under optax.inject_hyperparams, leave it "
            "out or pass static_args=('group_bytes',))")
    validation.check_positive_int("group_bytes", group_bytes)
    return int(group_bytes)


def use_kernel(impl: str, platform: str, device_count: int,
               device_kind: str | None = None) -> bool:
    """Whether ``impl`` (:data:`IMPLS`) runs the Pallas kernel for arrays on ``platform``.

    ``platform`` is where the computation runs (``"cuda"``, ``"cpu"``, ...; ``"gpu"`` is
    taken as CUDA), ``device_count`` the number of that platform's devices and
    ``device_kind`` their name.  ``impl="pallas"`` runs the kernel (compiled on CUDA, in
    Pallas's interpreter elsewhere).  ``"auto"`` takes it on a single CUDA device of a kind
    on which ``scripts/gpu-check`` has shown it correct and faster
    (:func:`sage_optim.kernels.validated`; none yet: on an H100 it was correct but slower,
    so ``auto`` is the jnp path everywhere today), never on several devices: a Pallas
    call is one device's
    computation, so under sharding (FSDP) XLA would gather a sharded gradient to run it,
    and the jnp path partitions instead.  ``SAGE_KERNELS=off`` turns both off.
    """
    if impl == "jnp" or not kernels.kernels_enabled():
        return False
    if impl == "auto":
        return (platform in ("cuda", "gpu") and device_count == 1
                and kernels.validated("sinkgd-pallas", device_kind))
    return impl == "pallas"


def use_stream(impl: str, platform: str, device_count: int,
               device_kind: str | None = None) -> bool:
    """Whether ``impl`` computes the scales without ``K`` (:func:`streamed_sinkhorn_scales`).

    ``impl="stream"`` on every platform; ``"auto"`` on a single CUDA device of a kind on
    which ``scripts/gpu-check`` has shown it correct and faster than the ``K`` path
    (:func:`sage_optim.kernels.validated`, path ``"sinkgd-stream"``), and never where
    :func:`use_kernel` takes the Pallas kernel.  Arguments as :func:`use_kernel`.
    """
    if impl == "stream":
        return True
    return (impl == "auto" and platform in ("cuda", "gpu") and device_count == 1
            and not use_kernel(impl, platform, device_count, device_kind)
            and kernels.validated("sinkgd-stream", device_kind))


def use_native(impl: str, platform: str, device_count: int = 1) -> bool:
    """Whether ``impl`` computes the scales of arrays on ``platform`` with the native kernel.

    Only on the CPU: ``impl="native"`` always (refused when the kernel cannot be built:
    :func:`sage_optax.sinkgd_native.native_scales`), ``"auto"`` where :data:`CPU_NATIVE`,
    in a one-process job on one CPU device (``device_count``; as the GPU kernels, never on
    several: a job's numbers then do not depend on how its devices are split between
    processes), and where the kernel compiled and loaded
    (:func:`sage_optax.sinkgd_native.status`, which builds it on first use).
    ``SAGE_KERNELS=off`` turns both off.
    """
    if platform != "cpu" or impl not in ("native", "auto") or not kernels.kernels_enabled():
        return False
    if impl == "native":
        return True
    if not CPU_NATIVE or device_count != 1 or jax.process_count() != 1:
        return False
    from sage_optax import sinkgd_native  # builds the kernel on first use

    return sinkgd_native.status().ready


def resolved_impl(impl: str, platform: str, device_count: int,
                    device_kind: str | None = None) -> str:
    """``"pallas"``, ``"stream"``, ``"blocked"``, ``"native"``, ``"jnp+native"`` or ``"jnp"``.

    What computes SinkGD's scales; ``"jnp+native"``: the jnp path, and the native kernel for
    leaves of at least :data:`CPU_NATIVE_BYTES` (``impl="auto"`` on one CPU device).

    For a record of a run (``sage-train`` writes it into ``config.json``); the update itself
    decides per compiled program, by where its arrays are (:mod:`sage_optax.placement`).
    Arguments as :func:`use_kernel`.

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD).
    """
    validation.check_choice("impl", impl, IMPLS)
    if use_kernel(impl, platform, device_count, device_kind):
        return "pallas"
    if use_stream(impl, platform, device_count, device_kind):
        return "stream"
    if use_native(impl, platform, device_count):
        return "native" if impl == "native" else "jnp+native"
    if impl == "blocked" or (impl == "auto" and platform == "cpu" and CPU_BLOCKED):
        return "blocked"
    return "jnp"


def _sinkhorn_all(
    matrices: list[tuple[int, Any, ResolvedRoute]],
    on_kernel: bool,
    interpret: bool,
    checked: bool,
    streamed: bool,
    grouping: str,
    blocked: bool,
    group_bytes: int,
    num_iters: Any,
    eps: Any,
    normalization: str,
    gs: list[jax.Array],
    native: int | None = None,
) -> list[jax.Array]:
    """``X`` of every matrix ``gs[k]`` (axes ``matrices[k][2]``), in the order of ``gs``.

    ``on_kernel``: the Pallas kernel computes the scales of the leaves it supports
    (compiled, or in Pallas's interpreter with ``interpret``); ``checked``: the other
    leaves' scales come from :func:`checked_sinkhorn_scales` (no range pass); ``streamed``:
    from :func:`streamed_sinkhorn_scales` (no ``K``); ``grouping``: ``"leaf"``, ``"stack"``
    (same-shape matrices stacked in groups of at most ``group_bytes``) or ``"sequence"``
    (same-shape matrices one after another in one loop, :func:`sequenced_sinkhorn_scales`:
    the ``K`` paths; the others per leaf); ``blocked``: the leaves that
    :func:`blocked_layout` takes get :func:`blocked_sinkhorn_scales` (no ``K``, no ``X``),
    before the other choices; ``native``: the leaves the native CPU kernel supports and of at
    least this many bytes in float32 get :func:`sage_optax.sinkgd_native.native_scales`
    (one call each), before all of them (``None``: none).
    """
    pallas: Any = None
    if on_kernel:
        from sage_optax import sinkgd_pallas as pallas  # imports Pallas only when used
    if native is not None:
        from sage_optax import sinkgd_native
    items = [(k, g, res) for k, ((_, _, res), g) in enumerate(zip(matrices, gs, strict=True))]
    by_native = [native is not None and 4 * math.prod(g.shape) >= native
                 and sinkgd_native.supports(g, res) for _, g, res in items]
    on_native = [m for m, n in zip(items, by_native, strict=True) if n]
    items = [m for m, n in zip(items, by_native, strict=True) if not n]
    by_kernel = [pallas is not None and pallas.supports(g, res) for _, g, res in items]
    on_kernel_items = [m for m, k in zip(items, by_kernel, strict=True) if k]
    on_jnp = [m for m, k in zip(items, by_kernel, strict=True) if not k]
    stack = grouping == "stack"
    kernel_bytes = min(group_bytes, pallas.KERNEL_GROUP_BYTES) if on_kernel_items else 0
    batches = [([m], "native") for m in on_native]
    batches += [(b, "kernel") for b in _batches(on_kernel_items, kernel_bytes if stack else 0)]
    batches += _jnp_batches(on_jnp, grouping, group_bytes, streamed, blocked)
    out: list[Any] = [None] * len(gs)
    after = None
    for batch, how in batches:
        # Order the batches: this batch's K = G² (the kernel path: its stacked gradients)
        # is formed only once the previous one's scales are done, so one is alive at a
        # time (the compiled temporary memory is the largest batch's, not the sum of all).
        group, resolved = [g for _, g, _ in batch], batch[0][2]
        if how == "native":
            c, r = sinkgd_native.native_scales(group[0], resolved, num_iters, eps,
                                               normalization)
        elif how == "kernel":
            c, r = pallas.pallas_scales(group, resolved, num_iters, eps, normalization,
                                        after, interpret=interpret)
        elif how == "blocked":
            c, r = blocked_sinkhorn_scales(group, resolved, num_iters, eps, normalization,
                                           after)
        elif how == "sequence":
            c, r = sequenced_sinkhorn_scales(group, resolved, num_iters, eps, normalization,
                                             after, checked=checked)
        else:
            scales = (checked_sinkhorn_scales if checked else
                      streamed_sinkhorn_scales if streamed else range_scaled_scales)
            c, r = scales(group, resolved, num_iters, eps, normalization, after)
        if len(batch) == 1:
            (k, g, _), = batch
            out[k] = apply_scales(g, resolved, c, r).astype(g.dtype)
        else:
            for j, (k, g, _) in enumerate(batch):
                out[k] = apply_scales(g, resolved, c[j], r[j]).astype(g.dtype)
        after = jnp.min(r, initial=jnp.inf)  # defined for (n, 0) too
    return out


def _jnp_batches(items: list[Any], grouping: str, group_bytes: int, streamed: bool,
                 blocked: bool) -> list[tuple[list[Any], str]]:
    """:func:`_sinkhorn_all`'s batches of the matrices off the kernel, each with its path.

    ``"blocked"`` for the leaves :func:`blocked_layout` takes (with ``blocked``), one each;
    then ``"sequence"`` groups of every other leaf's shape with ``grouping="sequence"``
    (the ``K`` paths; streamed leaves one each), or the ``"stack"``/per-leaf batches.
    """
    by_blocks = [m for m in items if blocked and blocked_layout(m[1], m[2]) is not None]
    rest = [m for m in items if not any(m is b for b in by_blocks)]
    batches = [(b, "blocked") for b in _batches(by_blocks, 0)]
    if grouping == "sequence" and not streamed:  # one loop per shape, however large
        return batches + [(b, "sequence" if len(b) > 1 else "jnp")
                          for b in _batches(rest, _UNLIMITED)]
    return batches + [(b, "jnp") for b in _batches(rest, group_bytes if grouping == "stack"
                                                   else 0)]


_UNLIMITED = 2**62  # a group size no group reaches


def _branches(matrices: list[tuple[int, Any, ResolvedRoute]], impl: str, grouping: str,
              group_bytes: int, default_bytes: bool, num_iters: Any, eps: Any,
              normalization: str) -> dict[str, Callable[[list[jax.Array]], list[jax.Array]]]:
    """:func:`scale_by_sinkhorn`'s computation of every matrix, per platform of its arrays.

    The path follows where the arrays are (:mod:`sage_optax.placement`): the CUDA branch runs
    the compiled kernel (``impl="auto"``: on a single GPU only), the CPU branch the native
    kernel or the jnp path (``impl="pallas"``: the interpreted kernel); under jit only the
    branch of the platform the program is compiled for is lowered.  ``default_bytes``: no
    ``group_bytes`` was given (the streamed path then has its own default).
    """
    cuda = (placement.cuda_device_count(), placement.cuda_device_kind())
    off_cpu = "auto" if impl == "native" else impl  # the native kernel is the CPU's
    stream_cpu = use_stream(impl, "cpu", 1)
    stream_cuda = use_stream(off_cpu, "cuda", *cuda)
    stream_other = use_stream(off_cpu, "other", 1)
    blocked = impl == "blocked" or (impl == "auto" and CPU_BLOCKED)

    def batch_bytes(streamed: bool) -> int:  # the streamed path's own default
        return STREAM_GROUP_BYTES if streamed and default_bytes else group_bytes

    def cpu(gs: list[jax.Array]) -> list[jax.Array]:
        # decided when the CPU's branch is traced: the native kernel is built (on first use)
        # only for a program that runs on the CPU; the checked path's lax.cond only in a
        # one-process job (its predicate must agree across processes)
        return _sinkhorn_all(
            matrices, use_kernel(impl, "cpu", 1), True,
            jax.process_count() == 1 and not stream_cpu, stream_cpu,
            resolved_grouping(grouping, "cpu"), blocked, batch_bytes(stream_cpu),
            num_iters, eps, normalization, gs, native=(
                None if not use_native(impl, "cpu", jax.device_count("cpu"))
                else 0 if impl == "native" else CPU_NATIVE_BYTES))

    return {
        "cpu": cpu,
        "cuda": functools.partial(
            _sinkhorn_all, matrices, use_kernel(off_cpu, "cuda", *cuda), False, False,
            stream_cuda, resolved_grouping(grouping, "cuda"), impl == "blocked",
            batch_bytes(stream_cuda), num_iters, eps, normalization),
        "other": functools.partial(
            _sinkhorn_all, matrices, use_kernel(off_cpu, "other", 1), True, False,
            stream_other, resolved_grouping(grouping, "other"), impl == "blocked",
            batch_bytes(stream_other), num_iters, eps, normalization),
    }


def scale_by_sinkhorn(
    num_iters: int = _DEFAULTS["num_iters"],
    eps: float = _DEFAULTS["eps"],
    normalization: str = _DEFAULTS["normalization"],
    *,
    axes: axes_lib.AxesSpec = _KERNEL,
    grouping: str = "auto",
    group_bytes: int | None = None,
    impl: str = "auto",
) -> optax.GradientTransformation:
    """Replace each gradient matrix by its Sinkhorn normalisation ``X`` (stateless).

    Args:
      num_iters: number ``L`` of (fan-in, fan-out) iteration pairs (paper: 5).
      eps: ε added to every norm.
      normalization: ``"unit"`` (Unit-Norm SinkGD) or ``"sqrt"`` (SR-Sinkhorn).
      axes: axes of each leaf: one :class:`~sage_optax.Route` (default: a Flax kernel
        ``(in, out)``, leading axes stacked), a pytree of them (``None`` leaves pass
        through unchanged) or a callable of the params.
      grouping: :data:`GROUPINGS`; every choice computes the same numbers (each matrix
        of a stacked group gets exactly its own iteration).
      group_bytes: largest stacked group, in bytes of gradients (``"stack"``, and
        ``"auto"`` off the CPU; ``None``: :data:`GROUP_BYTES`): the batched computation
        holds a copy of the group and its ``K``.  The kernel path caps it at
        :data:`~sage_optax.sinkgd_pallas.KERNEL_GROUP_BYTES` (32 MiB: a chunk's ``2L``
        passes stay in an H100's L2).  A layout option, so a Python int: under
        ``optax.inject_hyperparams`` leave it out (or name it in ``static_args``).
      impl: :data:`IMPLS`; decided by where the arrays are (:func:`use_kernel`):
        ``"pallas"`` runs the Pallas kernel (compiled on CUDA arrays), ``"auto"`` only on a
        single GPU where ``scripts/gpu-check`` has validated it (none yet: slower on an
        H100) and the jnp path
        elsewhere; ``"stream"`` and ``"blocked"`` compute without ``K`` (every platform);
        ``"native"`` runs the compiled CPU kernel on CPU arrays, ``"auto"`` elsewhere
        (:func:`use_native`: ``"auto"`` takes it on one CPU device for leaves of at least
        :data:`CPU_NATIVE_BYTES`, where it builds).  All compute the same math (float32
        within rounding, not bit for bit).

    Returns:
      An ``optax.GradientTransformation`` with empty state.  A leaf with fewer than two
      dimensions raises a ``ValueError`` naming its path and shape.

    Examples:
      A Flax kernel ``(in, out) = (4, 3)``: the last half-iteration divides every row (one
      input's weights to all outputs) by its norm, so the rows have norm 1 and the columns
      are on their way to it; ``"sqrt"`` aims the rows at ``√3`` instead:

      >>> import jax.numpy as jnp, sage_optax
      >>> grads = {"kernel": jnp.array([[1.0, 2.0, 0.5], [3.0, -4.0, 1.0],
      ...                                [0.1, 0.2, 0.3], [1.0, 1.0, 1.0]])}
      >>> tx = sage_optax.scale_by_sinkhorn()
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> x = updates["kernel"]
      >>> print(x.shape, " ".join(f"{n:.3f}" for n in jnp.linalg.norm(x, axis=1)))
      (4, 3) 1.000 1.000 1.000 1.000
      >>> tx = sage_optax.scale_by_sinkhorn(normalization="sqrt")
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> print(" ".join(f"{n:.3f}" for n in jnp.linalg.norm(updates["kernel"], axis=1)))
      1.732 1.732 1.732 1.732

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD; SR-Sinkhorn, ``"sqrt"``).

      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Unit-Norm SinkGD, ``"unit"``).
    """
    validation.check_hyperparameters(
        "sinkgd", num_iters=num_iters, eps=eps, normalization=normalization
    )
    validation.check_choice("grouping", grouping, GROUPINGS)
    explicit_bytes = group_bytes
    group_bytes = _layout_bytes(group_bytes)
    validation.check_choice("impl", impl, IMPLS)

    def init_fn(params: optax.Params) -> optax.EmptyState:
        axes_lib.map_leaves(_check_matrix, params, axes)  # fail at init, before any step
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        treedef, leaves = axes_lib.flatten_with_spec(updates, axes_lib.resolve_spec(axes, updates))
        out = [x for _, _, x in leaves]
        matrices = []
        for i, (path, spec, g) in enumerate(leaves):
            if not axes_lib.is_masked(g):
                resolved = _check_matrix(path, spec, g)
                if resolved is not None:  # a None spec: pass through
                    matrices.append((i, g, resolved))
        if not matrices:
            return jax.tree_util.tree_unflatten(treedef, out), state
        if impl in ("pallas", "native") and not kernels.kernels_enabled():
            kernels.warn_overridden(f'impl="{impl}"')
        branches = _branches(matrices, impl, grouping, group_bytes, explicit_bytes is None,
                             num_iters, eps, normalization)
        results = placement.by_platform(([g for _, g, _ in matrices],), **branches)
        for (i, _, _), x in zip(matrices, results, strict=True):
            out[i] = x
        return jax.tree_util.tree_unflatten(treedef, out), state

    return optax.GradientTransformation(init_fn, update_fn)


def sinkgd(
    learning_rate: optax.ScalarOrSchedule,
    alpha: float = _DEFAULTS["alpha"],
    num_iters: int = _DEFAULTS["num_iters"],
    weight_decay: float = _DEFAULTS["weight_decay"],
    normalization: str = _DEFAULTS["normalization"],
    *,
    eps: float = _DEFAULTS["eps"],
    mask: Any | None = None,
    axes: axes_lib.AxesSpec = _KERNEL,
    grouping: str = "auto",
    group_bytes: int | None = None,
    impl: str = "auto",
) -> optax.GradientTransformation:
    r"""SinkGD with decoupled weight decay: :math:`\theta(1-\eta w) - \eta\alpha X`.

    ``chain(scale_by_sinkhorn, scale(alpha), add_decayed_weights(w, mask),
    scale_by_learning_rate(η))``: the decay uses ``η``, not ``η·α`` (``docs/algorithms.md``).

    Args:
      learning_rate: a float or an optax schedule.
      alpha: update scale α (paper: 10 for ``unit``; Scetbon et al.: 0.05 for ``sqrt``).
      num_iters: Sinkhorn iterations ``L``.
      weight_decay: decoupled decay ``w``.
      normalization: ``"unit"`` or ``"sqrt"``.
      eps: ε added to every norm.
      mask: which leaves get weight decay (pytree of bools or callable).
      axes: per-leaf axes, see :func:`scale_by_sinkhorn`.
      grouping: see :func:`scale_by_sinkhorn`.
      group_bytes: see :func:`scale_by_sinkhorn`.
      impl: see :func:`scale_by_sinkhorn` (``"pallas"``: the Pallas kernel on a GPU).

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      SinkGD trains matrices only (route vectors elsewhere, e.g. with
      :func:`~sage_optax.make_optimizer`); a Flax kernel ``(in, out)``:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> target = jnp.array([[1.0, -1.0, 0.5], [0.0, 2.0, 1.0]])
      >>> def loss(params):
      ...     return jnp.sum((params["kernel"] - target) ** 2)
      >>> params = {"kernel": jnp.zeros((2, 3))}
      >>> tx = sage_optax.sinkgd(learning_rate=0.01)
      >>> state = tx.init(params)
      >>> print(f"{loss(params):.3f}")
      7.250
      >>> for _ in range(5):
      ...     updates, state = tx.update(jax.grad(loss)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(f"{loss(params):.3f}")
      4.202

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD; SR-Sinkhorn, ``"sqrt"``).

      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Unit-Norm SinkGD, ``"unit"``).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("sinkgd", alpha=alpha, weight_decay=weight_decay)
    return optax.chain(
        scale_by_sinkhorn(num_iters, eps, normalization, axes=axes, grouping=grouping,
                          group_bytes=group_bytes, impl=impl),
        optax.scale(alpha),
        optax.add_decayed_weights(weight_decay, validation.checked_mask(mask)),
        optax.scale_by_learning_rate(learning_rate),
    )


@register("sinkgd")
def build(learning_rate: optax.ScalarOrSchedule, hp: SinkGDHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """:func:`sinkgd` with the ``sinkgd`` rule's hyperparameters ``hp`` (its builder)."""
    return sinkgd(learning_rate, alpha=hp.alpha, num_iters=hp.num_iters,
                  weight_decay=hp.weight_decay, normalization=hp.normalization, eps=hp.eps,
                  mask=context.mask, axes=context.axes, impl=context.impl)
