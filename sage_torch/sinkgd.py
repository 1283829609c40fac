"""SinkGD: Sinkhorn-normalised gradient descent, ``θ ← θ − η·(α·X + w·θ)`` (stateless).

The :class:`SinkGD` optimizer, its rule (:class:`SinkGDRule`), the normalisation
(:func:`sinkhorn_normalize`, :func:`sinkhorn_scales`, :func:`range_scale`) and the step
functions in ``torch.optim``'s shape, all taking keyword hyperparameters:
:func:`_single_tensor_sinkgd` (matrix by matrix), :func:`_multi_tensor_sinkgd` (the
Sinkhorn iterations of every same-shape matrix at once, as one batched ``torch.bmm`` per
shape and half-iteration, the scale vectors of all shapes updated by one kernel per
operation; the update by ``torch._foreach_*``) and :func:`_chunked_sinkgd` (the in-place
CPU path of :mod:`sage_torch.chunked`).  ``docs/algorithms.md`` states the math.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from sage_optim.hyperparams import SINKHORN_GROUP_BYTES
from sage_optim.presets import PRESETS, RULE_DEFAULTS
from sage_torch import chunked, fused_check
from sage_torch.common import (
    Axes,
    ConstCache,
    MatrixView,
    UpdateRule,
    axis_group,
    by_device_dtype,
    decayed_step,
    is_dtensor,
    lr_of,
    lr_tensor,
    matrix_axes,
    pow2_floor,
    pow2_sqrt_floor,
    shared_docs,
    wide,
)
from sage_torch.optimizer import ParamsT, RuleOptimizer
from sage_torch.registry import register

_SINK = RULE_DEFAULTS["sinkgd"]

FOREACH_ROUND_PARAMS: int = 2
"""The multi-tensor SinkGD's default round limit, in parameters: rounds of ``K`` up to this
many times the optimizer's largest parameter (see :meth:`SinkGDRule.group_bytes`)."""

AxisGroups = tuple[tuple[int, ...], tuple[int, ...]]
"""A parameter's ``(fan_in, fan_out)`` dim groups (non-negative)."""


def sinkhorn_normalize(g: Tensor, fan_in_dim: Axes, fan_out_dim: Axes, num_iters: int = 5,
                       eps: float = 1e-8, normalization: str = "unit", *,
                       matvec: bool | None = None) -> Tensor:
    """Sinkhorn-normalise ``g``: fan-in norms then fan-out norms, ``num_iters`` times.

    Kept as ``X = c ⊙ G ⊙ r`` with two scale vectors, as in :mod:`sage_optax.sinkgd`:
    each half-iteration is one reduction of ``G²`` weighted by the other vector: blocks of
    matrix-vector products (:func:`sinkhorn_scales`, :func:`stacked_sinkhorn_scales`: no
    ``K``) when ``matvec`` (default: for a plain tensor, stacked matrices included), else
    an element-wise product and a sum over ``K = G²``, which works on FSDP2 DTensors (the
    two differ only in the order of summation).

    ``fan_in_dim``/``fan_out_dim`` may be groups of dims (tuples): ``g`` is then normalised
    as one matrix per batch index, each group merged into one axis (:class:`MatrixView`);
    the dims of neither group are batch dims.  ``X`` has ``g``'s shape, in float32 or wider
    (:mod:`sage_optax`'s :func:`~sage_optax.sinkhorn_normalize` returns ``g``'s dtype).

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD; SR-Sinkhorn, ``"sqrt"``).

      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Unit-Norm SinkGD, ``"unit"``).
    """
    if not isinstance(fan_in_dim, int) or not isinstance(fan_out_dim, int):
        fan_in = axis_group(fan_in_dim, g.dim(), "fan_in_dim")
        fan_out = axis_group(fan_out_dim, g.dim(), "fan_out_dim")
        if len(fan_in) > 1 or len(fan_out) > 1:
            mv = MatrixView(g.shape, fan_in, fan_out)
            x = sinkhorn_normalize(mv.to_matrix(g), -1, -2, num_iters, eps, normalization,
                                   matvec=matvec)
            return mv.from_matrix(x)
        fan_in_dim, fan_out_dim = fan_in[0], fan_out[0]
    w = wide(g.dtype)
    if matvec is None and g.dim() > 2 and not is_dtensor(g):  # stacked: by blocks, no K
        gm = g.movedim((fan_out_dim, fan_in_dim), (-2, -1))
        out, inp = gm.shape[-2:]
        c, r = stacked_sinkhorn_scales(gm.reshape(math.prod(gm.shape[:-2]), out, inp),
                                       num_iters, eps, normalization)
        x = (c.view(*gm.shape[:-2], 1, inp) * gm.to(w)) * r.view(*gm.shape[:-2], out, 1)
        return x.movedim((-2, -1), (fan_out_dim, fan_in_dim))
    g = g.to(w)
    if matvec is None:
        matvec = g.dim() == 2 and not is_dtensor(g)
    if matvec:
        c, r = sinkhorn_scales(g, fan_in_dim, fan_out_dim, num_iters, eps, normalization)
        return c.unsqueeze(fan_out_dim % 2) * g * r.unsqueeze(fan_in_dim % 2)
    m = range_scale(g, (fan_in_dim, fan_out_dim))
    g2 = (g / m).square()  # g / m is exact: m is a power of two
    c = torch.ones_like(g2.sum(dim=fan_out_dim, keepdim=True))
    r = torch.ones_like(g2.sum(dim=fan_in_dim, keepdim=True))
    t_in, t_out = _sinkhorn_targets(g, fan_in_dim, fan_out_dim, normalization)
    for i in range(int(num_iters)):
        q = (g2 * c.square()).sum(dim=fan_in_dim, keepdim=True).sqrt()
        r = torch.where(q > 0, r * t_in / (r * q + (eps / m if i == 0 else eps)), r)
        q = (g2 * r.square()).sum(dim=fan_out_dim, keepdim=True).sqrt()
        c = torch.where(q > 0, c * t_out / (c * q + eps), c)
    half = pow2_sqrt_floor(m)
    return (c / half) * g * (r / (m / half))


def range_scale(g: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``m``: a power of two with ``m ≤ max|g| < 2m`` over ``dims`` (kept, size 1).

    As :func:`sage_optax.numerics.range_scale`: 1 for an all-zero, zero-size or non-finite
    matrix, and at least the dtype's smallest normal number.  The Sinkhorn iteration runs
    on ``g / m``, whose squares are in range for any finite ``g``; dividing by a power of
    two is exact, so in-range gradients give bit-for-bit the plain computation's result.
    """
    if g.numel() == 0:
        shape = [1 if d in {x % g.dim() for x in dims} else n for d, n in enumerate(g.shape)]
        return torch.ones(shape, dtype=g.dtype, device=g.device)
    return pow2_floor(g.abs().amax(dim=dims, keepdim=True))


def _sinkhorn_targets(g: Tensor, fan_in_dim: int, fan_out_dim: int,
                      normalization: str) -> tuple[float, float]:
    if normalization == "unit":
        return 1.0, 1.0
    return math.sqrt(g.shape[fan_in_dim]), math.sqrt(g.shape[fan_out_dim])


def sinkhorn_scales(g: Tensor, fan_in_dim: int, fan_out_dim: int, num_iters: int = 5,
                    eps: float = 1e-8, normalization: str = "unit", *,
                    buffer: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The scale vectors ``(c, r)`` of a plain 2-D ``g``: ``X = c ⊙ G ⊙ r``.

    ``c`` has one entry per fan-in index and ``r`` one per fan-out index (1-D, float32 or
    wider).  The iterations run on ``G/m`` (``m``: :func:`range_scale`, so that the
    squares are in range for any finite ``G``; the first half-iteration then uses
    ``eps/m``, and ``1/m`` is split between ``c`` and ``r``, as in
    :mod:`sage_optax.sinkgd`), by blocks of rows (:func:`_block_iterations`, the
    operations of :func:`_multi_tensor_sinkgd` on a stack of one): no ``K = (G/m)²`` is
    formed, only one block of it at a time.  ``buffer``: a tensor of ``g``'s wide dtype
    to hold the block (reused across matrices: no fresh allocation, and so no page
    faults, per matrix); any size (too small: a fresh block).
    """
    c, r = stacked_sinkhorn_scales(g.t() if fan_out_dim % 2 != 0 else g, num_iters, eps,
                                   normalization, buffer=buffer)
    return c.view(-1), r.view(-1)


def stacked_sinkhorn_scales(g: Tensor, num_iters: int = 5, eps: float = 1e-8,
                            normalization: str = "unit", *,
                            buffer: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The scales ``(c, r)`` of ``g`` ``([B,] OUT, IN)`` (any strides): ``(B, IN)``, ``(B, OUT)``.

    Each matrix as :func:`sinkhorn_scales` (by blocks of rows, no ``K``); a 2-D ``g`` is
    one matrix (``B = 1``).  ``g`` is read, never copied (but for a wider dtype per block).
    """
    g3 = g.unsqueeze(0) if g.dim() == 2 else g
    w = wide(g.dtype)
    b, out, inp = g3.shape
    amax = (_abs_max(g3).to(w) if g3.numel() else torch.zeros(b, dtype=w, device=g.device))
    m = pow2_floor(amax)  # (B,): range_scale per matrix
    c = torch.ones(b * inp, dtype=w, device=g.device)
    r = torch.ones(b * out, dtype=w, device=g.device)
    q_c = torch.empty_like(c)
    t_in: float | Tensor = 1.0
    t_out: float | Tensor = 1.0
    if normalization != "unit":  # per entry, as _multi_tensor_sinkgd's (the same rounding)
        t_in = torch.full((b * out,), math.sqrt(inp), dtype=w, device=g.device)
        t_out = torch.full((b * inp,), math.sqrt(out), dtype=w, device=g.device)
    _block_iterations([g3], [m.view(b, 1, 1)], c, r, q_c=q_c,
                      eps_first=eps / m if b == 1 else torch.repeat_interleave(eps / m, out),
                      t_in=t_in,
                      t_out=t_out, num_iters=num_iters, eps=eps,
                      buffer=buffer if buffer is not None and buffer.dtype == w else None)
    half = pow2_sqrt_floor(m).view(b, 1)
    return c.view(b, inp) / half, r.view(b, out) / (m.view(b, 1) / half)



BLOCK_ELEMENTS: int | None = None
"""Elements of one block of ``(G/m)²`` per matrix in the Sinkhorn iterations of
:func:`sinkhorn_scales` and :func:`_multi_tensor_sinkgd` (``2**18``: 1 MiB of float32), or
``None`` (the default): ``K = (G/m)²`` whole, formed once per step.  With blocks, no ``K``
exists: each sweep squares a block, uses it for two matrix-vector products while it is in
the cache, and drops it (temporaries: a block and vectors).  ``None`` because on this
project's CPU the blocks were slower (1.5-2.7x on the Sinkhorn iterations of the 270M
model's matrices: each sweep squares ``G`` again; ``benchmarks/RESULTS.md``, issue 41).
The block's rows depend only on the matrix's ``IN`` (never on how many matrices are
stacked), so every path makes the same operations on each matrix either way."""


def block_rows(inp: int, out: int) -> int:
    """Rows of one block of a ``(OUT, IN)`` matrix.

    :data:`BLOCK_ELEMENTS` / ``IN`` (at least 1), or all ``OUT`` rows (``K`` whole) when
    it is ``None``.
    """
    if BLOCK_ELEMENTS is None:
        return max(1, out)
    return max(1, BLOCK_ELEMENTS // max(1, inp))


def _block_iterations(stacks: list[Tensor], ms: list[Tensor], c: Tensor, r: Tensor, *,
                      q_c: Tensor, eps_first: Tensor, t_in: float | Tensor,
                      t_out: float | Tensor, num_iters: int, eps: float,
                      buffer: Tensor | None = None) -> None:
    """The ``L`` Sinkhorn iterations of same-shape stacks, by blocks of rows, in place.

    ``stacks[k]``: ``(B, OUT, IN)`` gradients (any strides, ``G`` itself: the range scale
    ``ms[k] = m``, ``(B, 1, 1)``, a power of two, is divided out per block, exactly); ``c``
    and ``r``: the flat scale vectors of every stack (``B·IN`` and ``B·OUT`` entries per
    stack, in order); ``eps_first`` (or its one entry, for one matrix) and a tensor ``t_in``
    are flat like ``r``, a tensor ``t_out`` like ``c``; ``q_c``: scratch like ``c``.  One
    sweep per iteration: per block of rows (:func:`block_rows`), ``(G/m)²`` of the block,
    the row half-iteration of its rows (one norm per output unit, from the block alone) and
    the block's part of the column sums (``torch.baddbmm``); after the sweep, the column
    half-iteration of all stacks at once.  With blocks, no ``K``: the temporaries are a
    block per stack (in ``buffer`` if given: a tensor of the wide dtype with at least a
    block's elements) and vectors; without (:data:`BLOCK_ELEMENTS` ``None``),
    :func:`_whole_k_iterations`.
    """
    if BLOCK_ELEMENTS is None:
        _whole_k_iterations(stacks, ms, c, r, q_c=q_c, eps_first=eps_first, t_in=t_in,
                            t_out=t_out,
                            num_iters=num_iters, eps=eps, buffer=buffer)
        return
    if eps_first.numel() != r.numel():  # one matrix's ε/m: one entry per row
        eps_first = eps_first.expand(r.numel()).contiguous()
    r_views, qc_views = _views(r, stacks, 1), _views(q_c, stacks, 2)
    eps_first_views = _like_views(eps_first, r_views)
    t_in_views = None if isinstance(t_in, float) else _like_views(t_in, r_views)

    for it in range(int(num_iters)):
        c2 = c.square()
        c2_views = _views(c2, stacks, 2)
        q_c.zero_()  # (a stack in one block writes its sums instead)
        for k, (g, m) in enumerate(zip(stacks, ms, strict=True)):
            b, out, inp = g.shape
            rows = block_rows(inp, out)
            for i in range(0, out, rows):
                j = min(i + rows, out)
                kb = _squares(g, m, i, j, buffer)
                q = torch.bmm(kb, c2_views[k]).sqrt_()  # one norm per output unit
                rv = r_views[k][:, i:j]
                e = eps_first_views[k][:, i:j] if it == 0 else eps
                den = (rv * q).add_(e)
                t = t_in if t_in_views is None else t_in_views[k][:, i:j]
                rv.copy_(torch.where(q > 0, _scaled(rv, t) / den, rv))
                qc_views[k].baddbmm_(kb.transpose(1, 2), rv.square())
        q_c.sqrt_()
        den = (c * q_c).add_(eps)
        torch.where(q_c > 0, _scaled(c, t_out) / den, c, out=c)


def _scaled(x: Tensor, t: float | Tensor) -> Tensor:
    """``x·t``; a float target is 1.0 and ``x·1.0`` is ``x`` (the same rounding)."""
    return x if isinstance(t, float) else x * t


def _whole_k_iterations(stacks: list[Tensor], ms: list[Tensor], c: Tensor, r: Tensor, *,
                        q_c: Tensor, eps_first: Tensor, t_in: float | Tensor,
                        t_out: float | Tensor, num_iters: int, eps: float,
                        buffer: Tensor | None = None) -> None:
    """:func:`_block_iterations` with ``K = (G/m)²`` of each stack formed once, whole.

    Arguments as there (``buffer`` holds ``K`` of a single stack where it fits);
    ``stacks`` is emptied once ``K`` is formed.  Each
    half-iteration is one ``torch.bmm`` per stack and one kernel per element-wise operation
    for all stacks together (the launches of the ``foreach`` path before issue 41).
    """
    ks = [_squares(g, m, 0, g.shape[1], buffer if len(stacks) == 1 else None)
          for g, m in zip(stacks, ms, strict=True)]
    kts = [k.transpose(1, 2) for k in ks]
    c2, q_r, r2 = torch.empty_like(c), torch.empty_like(r), torch.empty_like(r)
    c2_views, qc_views = _views(c2, ks, 2), _views(q_c, ks, 2)
    r2_views, qr_views = _views(r2, ks, 1), _views(q_r, ks, 1)
    stacks.clear()  # a caller's stacked copies are freed while K lives (not both at once)
    for it in range(int(num_iters)):
        torch.square(c, out=c2)
        for k, cv, qv in zip(ks, c2_views, qr_views, strict=True):
            torch.bmm(k, cv, out=qv)  # one norm per output unit (over the fan-in)
        q_r.sqrt_()
        den = (r * q_r).add_(eps_first if it == 0 else eps)
        torch.where(q_r > 0, _scaled(r, t_in) / den, r, out=r)
        torch.square(r, out=r2)
        for kt, rv, qv in zip(kts, r2_views, qc_views, strict=True):
            torch.bmm(kt, rv, out=qv)
        q_c.sqrt_()
        den = (c * q_c).add_(eps)
        torch.where(q_c > 0, _scaled(c, t_out) / den, c, out=c)


def _abs_max(g: Tensor) -> Tensor:
    """``max|G|`` per matrix of a ``(B, OUT, IN)`` stack, without a temporary of its size.

    On a GPU one kernel (the infinity norm); on the CPU the larger of ``max G`` and
    ``-min G`` (the infinity norm's CPU kernel took 14 ms for a 1024 x 1024 matrix, five
    times the two reductions).  A NaN gives NaN either way (``m = 1``).
    """
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, math.inf, dim=(1, 2))
    return torch.maximum(g.amax(dim=(1, 2)), g.amin(dim=(1, 2)).neg())


def _squares(g: Tensor, m: Tensor, i: int, j: int, buffer: Tensor | None) -> Tensor:
    """``(G/m)²`` of rows ``i:j`` of the stack ``g`` (in ``buffer`` where it fits)."""
    b, out, inp = g.shape
    rows = g if i == 0 and j == out else g[:, i:j]
    n = b * (j - i) * inp
    if buffer is not None and buffer.numel() >= n:
        kb = torch.div(rows, m, out=buffer[:n].view(b, j - i, inp))
    else:
        kb = rows.div(m)
    return kb.square_()


def _views(flat: Tensor, stacks: list[Tensor], dim: int) -> list[Tensor]:
    """``flat`` cut into one ``(B, n, 1)`` view per stack.

    ``n``: the size of dim ``dim`` of the stack (1: one entry per row, like ``r``; 2: one
    per column, like ``c``).
    """
    sizes = [(g.shape[0], g.shape[dim]) for g in stacks]
    parts = flat.split([b * n for b, n in sizes])
    return [x.view(b, n, 1) for x, (b, n) in zip(parts, sizes, strict=True)]


def _like_views(flat: Tensor, views: list[Tensor]) -> list[Tensor]:
    """``flat`` (a vector laid out as the concatenated ``views``) cut into their shapes."""
    parts = flat.split([v.numel() for v in views])
    return [x.view(v.shape) for x, v in zip(parts, views, strict=True)]


def _single_tensor_sinkgd(params: list[Tensor], grads: list[Tensor], *,
                          axes: list[AxisGroups], lr: float | Tensor, alpha: float, num_iters: int,
                          eps: float, normalization: str, weight_decay: float) -> None:
    """One SinkGD step, matrix by matrix (``axes[i]``: parameter ``i``'s dim groups)."""
    updates = []
    for p, g, (fan_in, fan_out) in zip(params, grads, axes, strict=True):
        if len(fan_in) == 1 and len(fan_out) == 1:
            x = sinkhorn_normalize(g, fan_in[0], fan_out[0], num_iters, eps, normalization)
            updates.append(x.to(p.dtype) * alpha)
            continue
        # grouped axes: the (batch..., OUT, IN) matrix
        mv = MatrixView(p.shape, fan_in, fan_out)
        x = sinkhorn_normalize(mv.to_matrix(g), -1, -2, num_iters, eps, normalization)
        updates.append(mv.from_matrix(x.to(p.dtype) * alpha))
    if params:
        decayed_step(params, updates, lr, weight_decay, False)


class _Bucket:
    """Same-shape matrices of one multi-tensor step: ``B`` stacked ``(OUT, IN)`` matrices.

    ``plain``: 2-D parameters in PyTorch's ``(out, in)`` layout, stepped on the gradients
    themselves; otherwise each member's ``(batch..., OUT, IN)`` matrix (:class:`MatrixView`)
    contributes its batch indices.
    """

    def __init__(self, plain: bool, out: int, inp: int) -> None:
        self.plain, self.out, self.inp = plain, out, inp
        self.members: list[int] = []
        self.views: list[MatrixView | None] = []
        self.sizes: list[int] = []  # batch indices per member

    @property
    def batch(self) -> int:
        """``B``, the number of ``(OUT, IN)`` matrices."""
        return sum(self.sizes)


def _bucketed(params: list[Tensor], axes: list[AxisGroups]) -> list[_Bucket]:
    """The parameters' matrices grouped by ``(plain, OUT, IN)``, in order of appearance."""
    buckets: dict[tuple[bool, int, int], _Bucket] = {}
    for i, (p, (fan_in, fan_out)) in enumerate(zip(params, axes, strict=True)):
        plain = p.dim() == 2 and fan_in == (1,) and fan_out == (0,)
        mv = None if plain else MatrixView(p.shape, fan_in, fan_out)
        out, inp = (p.shape[0], p.shape[1]) if mv is None else mv.shape[-2:]
        b = buckets.setdefault((plain, out, inp), _Bucket(plain, out, inp))
        b.members.append(i)
        b.views.append(mv)
        b.sizes.append(1 if mv is None else math.prod(mv.shape[:-2]))
    return list(buckets.values())


def _split_views(flat: Tensor, buckets: list[_Bucket], dim: str, shape: str) -> list[Tensor]:
    """Per bucket, a view of ``flat`` (one entry per matrix row or column, bucket-major).

    ``dim``: ``"inp"`` or ``"out"`` (entries per matrix); ``shape``: ``"col"`` for
    ``(B, n, 1)`` (a ``torch.bmm`` operand), ``"row"`` for ``(B, 1, n)``.
    """
    parts = flat.split([b.batch * getattr(b, dim) for b in buckets])
    return [x.view(b.batch, getattr(b, dim), 1) if shape == "col"
            else x.view(b.batch, 1, getattr(b, dim)) for x, b in zip(parts, buckets, strict=True)]


def _multi_tensor_sinkgd(params: list[Tensor], grads: list[Tensor], *,
                         axes: list[AxisGroups], lr: float | Tensor, alpha: float, num_iters: int,
                         eps: float, normalization: str, weight_decay: float,
                         cache: dict[Any, tuple[Tensor, ...]] | None = None,
                         group_bytes: int = SINKHORN_GROUP_BYTES) -> None:
    """One SinkGD step, the Sinkhorn iterations of all matrices at once.

    The matrices are bucketed by their ``(OUT, IN)`` shape (a ``Conv2d`` kernel is its
    merged matrix, a stacked tensor one matrix per batch index), each bucket stacked into
    ``K = (G/m)²`` of shape ``(B, OUT, IN)``.  The scale vectors ``c`` and ``r`` of every
    matrix live in two flat tensors, and so do the per-matrix scalars (``m``, ``ε/m``, the
    final split of ``1/m``): a half-iteration is one ``torch.bmm`` per bucket (written into
    a view of the flat norms) and one kernel per element-wise operation for all buckets
    together, the operations of :func:`sinkhorn_scales` in the same order.  The update
    ``α·(c·G·r)`` and the decayed step run as ``torch._foreach_*`` kernels.  No host
    synchronisation.  DTensors (FSDP2) take the single-tensor path.

    Memory: a bucket is split into chunks whose ``K`` has at most ``group_bytes`` bytes
    (at least one matrix each; :class:`SinkGD`'s default is :meth:`SinkGDRule.group_bytes`,
    twice the optimizer's largest parameter, at least 128 MiB), and the chunks run in
    rounds of at most ``group_bytes`` of ``K`` together: the peak extra memory is about
    ``2·group_bytes`` (a round's ``K`` and stacked gradients) or one matrix's, not the sum
    of all the group's gradients.  Every matrix sees the same operations whatever the
    chunking (element-wise kernels and one ``torch.bmm`` batch entry each), so the result
    does not depend on ``group_bytes``.

    ``cache``: a dict kept by the caller across steps, holding the small index tensors of
    each bucket layout, so that a step after the first copies nothing from the host (CUDA
    graph capture forbids such copies).  Under ``torch.compile`` it is read, never written:
    the tensors are constants of the graph, and a store would fail the guard on the cache
    at the next step (a recompile).
    """
    if not params:
        return
    if any(is_dtensor(p) or is_dtensor(g) for p, g in zip(params, grads, strict=True)):
        _single_tensor_sinkgd(params, grads, axes=axes, lr=lr, alpha=alpha,
                              num_iters=num_iters, eps=eps, normalization=normalization,
                              weight_decay=weight_decay)
        return
    buckets = _bucketed(params, axes)
    for round_ in _rounds(buckets, wide(grads[0].dtype).itemsize, group_bytes):
        _sinkgd_round(params, grads, round_, lr=lr, alpha=alpha, num_iters=num_iters,
                      eps=eps, normalization=normalization, weight_decay=weight_decay,
                      cache=cache)


def _chunks(buckets: list[_Bucket], itemsize: int, group_bytes: int) -> list[_Bucket]:
    """The buckets split, in order, into chunks of at most ``group_bytes`` of stacked matrices.

    ``itemsize``: bytes per element of the stack (``K`` in :func:`_multi_tensor_sinkgd`, the
    stacked gradient in :func:`_fused_sinkgd`).  A chunk holds at least one member (a
    member with more matrices than fit is alone in its chunk) and never splits a member.
    """
    chunks: list[_Bucket] = []
    for b in buckets:
        per_matrix = max(1, b.out * b.inp * itemsize)
        cap = max(1, group_bytes // per_matrix)
        cur = _Bucket(b.plain, b.out, b.inp)
        for i, mv, n in zip(b.members, b.views, b.sizes, strict=True):
            if cur.members and cur.batch + n > cap:
                chunks.append(cur)
                cur = _Bucket(b.plain, b.out, b.inp)
            cur.members.append(i)
            cur.views.append(mv)
            cur.sizes.append(n)
        chunks.append(cur)
    return chunks


def _rounds(buckets: list[_Bucket], itemsize: int, group_bytes: int) -> list[list[_Bucket]]:
    """The buckets split into chunks of at most ``group_bytes`` of ``K``, packed into rounds.

    The chunks of :func:`_chunks`; a round holds chunks (in bucket order) while their ``K``
    together stays within ``group_bytes`` (at least one chunk).
    """
    rounds: list[list[_Bucket]] = []
    used = 0
    for c in _chunks(buckets, itemsize, group_bytes):
        size = c.batch * c.out * c.inp * itemsize
        if rounds and used + size <= group_bytes:
            rounds[-1].append(c)
            used += size
        else:
            rounds.append([c])
            used = size
    return rounds


def _round_fixed(buckets: list[_Bucket], w: torch.dtype, device: torch.device,
                 normalization: str, n_c: int, n_r: int,
                 cache: dict[Any, tuple[Tensor, ...]] | None) -> tuple[Tensor, ...]:
    """:func:`_sinkgd_round`'s tensors fixed by the layout of ``buckets``, kept in ``cache``.

    ``(reps_c, reps_r)``: each matrix's ``IN`` and ``OUT`` (its scalars' repeat counts in
    ``c`` and ``r``); then, unless ``normalization == "unit"``, the targets ``√IN`` per
    entry of ``r`` and ``√OUT`` per entry of ``c``.
    """
    layout = (device, w, normalization,
              tuple((b.plain, b.out, b.inp, b.batch) for b in buckets))
    fixed = None if cache is None else cache.get(layout)
    if fixed is None:
        reps_c = torch.tensor([b.inp for b in buckets for _ in range(b.batch)], device=device)
        reps_r = torch.tensor([b.out for b in buckets for _ in range(b.batch)], device=device)
        fixed = (reps_c, reps_r)
        if normalization != "unit":  # the targets √IN, √OUT per entry of r and c
            fixed += (
                torch.repeat_interleave(
                    torch.tensor([math.sqrt(b.inp) for b in buckets for _ in range(b.batch)],
                                 dtype=w, device=device), reps_r, output_size=n_r),
                torch.repeat_interleave(
                    torch.tensor([math.sqrt(b.out) for b in buckets for _ in range(b.batch)],
                                 dtype=w, device=device), reps_c, output_size=n_c))
        if cache is not None and not torch.compiler.is_compiling():
            cache[layout] = fixed  # (a traced store would make the next step recompile)
    return fixed


def _sinkgd_round(params: list[Tensor], grads: list[Tensor], buckets: list[_Bucket], *,
                  lr: float | Tensor, alpha: float, num_iters: int, eps: float,
                  normalization: str, weight_decay: float,
                  cache: dict[Any, tuple[Tensor, ...]] | None) -> None:
    """The multi-tensor SinkGD step of the matrices of ``buckets`` (one round, see above)."""
    w = wide(grads[0].dtype)  # RuleOptimizer splits a foreach group by device and dtype
    device = grads[0].device
    # G per bucket (B, OUT, IN) and the flat max|G| per matrix
    gs, amaxes = [], []
    for b in buckets:
        if b.plain:
            mats = [grads[i] for i in b.members]
            g = mats[0].unsqueeze(0) if len(mats) == 1 else torch.stack(mats)
        else:
            mats = [mv.to_matrix(grads[i]).reshape(-1, b.out, b.inp)  # type: ignore[union-attr]
                    for i, mv in zip(b.members, b.views, strict=True)]
            g = mats[0] if len(mats) == 1 else torch.cat(mats)
        gs.append(g)  # in its own dtype: each block is widened (no wide copy of G)
        # max|G| per matrix in one kernel (the same value as g.abs().amax(dim=(1, 2)))
        amaxes.append(_abs_max(g).to(w) if g.numel()
                      else torch.zeros(b.batch, dtype=w, device=device))
    m = pow2_floor(amaxes[0] if len(amaxes) == 1 else torch.cat(amaxes))  # (sum B,)
    ms = [mb.view(-1, 1, 1) for mb in m.split([b.batch for b in buckets])]
    # per-matrix scalars repeated for every entry of c (IN per matrix) and r (OUT per matrix)
    n_c = sum(b.batch * b.inp for b in buckets)
    n_r = sum(b.batch * b.out for b in buckets)
    fixed = _round_fixed(buckets, w, device, normalization, n_c, n_r, cache)
    reps_c, reps_r = fixed[:2]
    eps_first = torch.repeat_interleave(eps / m, reps_r, output_size=n_r)
    t_in: float | Tensor = 1.0 if normalization == "unit" else fixed[2]
    t_out: float | Tensor = 1.0 if normalization == "unit" else fixed[3]
    c = torch.ones(n_c, dtype=w, device=device)
    r = torch.ones(n_r, dtype=w, device=device)
    q_c = torch.empty_like(c)
    _block_iterations(gs, ms, c, r, q_c=q_c, eps_first=eps_first,
                      t_in=t_in, t_out=t_out, num_iters=num_iters, eps=eps)
    del gs
    # X = (c/2^⌊k/2⌋)·G·(r/2^⌈k/2⌉) per matrix, as sinkhorn_scales; then α·X, decayed step
    half = pow2_sqrt_floor(m)
    c = c / torch.repeat_interleave(half, reps_c, output_size=n_c)
    r = r / torch.repeat_interleave(m / half, reps_r, output_size=n_r)
    updates: dict[int, Tensor] = {}
    plain_idx: list[int] = []
    plain_g: list[Tensor] = []
    plain_c: list[Tensor] = []
    plain_r: list[Tensor] = []
    for b, cb, rb in zip(buckets, _split_views(c, buckets, "inp", "row"),
                         _split_views(r, buckets, "out", "col"), strict=True):
        if b.plain:
            plain_idx += b.members
            plain_g += [grads[i] if grads[i].dtype == w else grads[i].to(w) for i in b.members]
            plain_c += cb.unbind(0)
            plain_r += rb.unbind(0)
            continue
        for i, mv, cs, rs in zip(b.members, b.views, cb.split(b.sizes), rb.split(b.sizes),
                                 strict=True):
            assert mv is not None
            gm = mv.to_matrix(grads[i]).to(w)
            x = (cs.view(*gm.shape[:-2], 1, b.inp) * gm) * rs.view(*gm.shape[:-2], b.out, 1)
            updates[i] = mv.from_matrix(x.to(params[i].dtype) * alpha)
    if plain_idx:
        xs = list(torch._foreach_mul(plain_g, plain_c))
        torch._foreach_mul_(xs, plain_r)
        xs = [x if x.dtype == params[i].dtype else x.to(params[i].dtype)
              for x, i in zip(xs, plain_idx, strict=True)]
        torch._foreach_mul_(xs, alpha)
        for i, x in zip(plain_idx, xs, strict=True):
            updates[i] = x
    order = [i for b in buckets for i in b.members]
    decayed_step([params[i] for i in order], [updates[i] for i in order], lr, weight_decay,
                 True)


def _fused_view(t: Tensor, mv: MatrixView) -> Tensor | None:
    """``t`` as a ``(B, OUT, IN)`` view sharing its storage (any strides), or ``None``."""
    try:
        return t.permute(mv.perm).view(-1, *mv.shape[-2:])
    except RuntimeError:  # the permuted dims cannot be merged without a copy
        return None


def _fused_views(params: list[Tensor], grads: list[Tensor], axes: list[AxisGroups],
                 use_sweep: bool) -> tuple[list[tuple[Tensor, Tensor]], dict[Any, _Bucket],
                                           list[tuple[Tensor, Tensor, int]], list[int]]:
    """The fused step's parameters by path: ``(mats, buckets, sweep, rest)``.

    ``sweep``: ``(θ, G, b)`` for the sweep kernel (matrix ``b`` of ``(B, OUT, IN)`` views);
    ``mats`` and ``buckets``: the views and same-shape buckets of the two-launch kernels
    (wider matrices, or every matrix without ``use_sweep``); ``rest``: the indices of
    parameters with no such view (the multi-tensor path).
    """
    from sage_torch import triton_kernels as tk

    mats: list[tuple[Tensor, Tensor]] = []  # (p view, g view)
    sweep: list[tuple[Tensor, Tensor, int]] = []  # (p, g, b): matrix b of the views
    rest: list[int] = []
    buckets: dict[tuple[Any, ...], _Bucket] = {}
    for i, (p, g, (fan_in, fan_out)) in enumerate(zip(params, grads, axes, strict=True)):
        if p.numel() == 0:
            continue  # nothing to update
        mv = MatrixView(p.shape, fan_in, fan_out)
        pv = None if is_dtensor(p) or is_dtensor(g) or g.dtype != p.dtype else _fused_view(p, mv)
        gv = None if pv is None else _fused_view(g, mv)
        if pv is None or gv is None:
            rest.append(i)
            continue
        out, inp = gv.shape[1], gv.shape[2]
        if use_sweep and inp <= tk.SWEEP_MAX_COLS:
            sweep += [(pv, gv, k) for k in range(gv.shape[0])]
            continue
        b = buckets.setdefault((p.device, p.dtype, out, inp), _Bucket(False, out, inp))
        b.members.append(len(mats))
        b.views.append(None)
        b.sizes.append(gv.shape[0])
        mats.append((pv, gv))
    return mats, buckets, sweep, rest


def _fused_chunks(mats: list[tuple[Tensor, Tensor]], buckets: dict[Any, _Bucket], *,
                  consts: ConstCache, group_bytes: int, lr: float | Tensor, alpha: float,
                  num_iters: int, eps: float, normalization: str, weight_decay: float
                  ) -> None:
    """:func:`_fused_sinkgd`'s two-launch path: ``mats`` (one device and dtype), by chunks.

    ``mats`` and ``buckets``: the ``(θ, G)`` views and their same-shape buckets of
    :func:`_fused_views`; per chunk, ``2·num_iters`` launches then one update per parameter.
    """
    from sage_torch import triton_kernels as tk

    chunks = [ch for (_, dtype, _, _), b in buckets.items()
              for ch in _chunks([b], dtype.itemsize, group_bytes)]
    single = [ch for ch in chunks if len(ch.members) == 1]
    device, dtype = mats[0][0].device, mats[0][0].dtype
    w = wide(dtype)  # the scales' and the arithmetic's dtype
    lr_t = lr_tensor(lr, mats[0][0])
    c_all = torch.ones(sum(ch.batch * ch.inp for ch in chunks), dtype=w, device=device)
    r_all = torch.ones(sum(ch.batch * ch.out for ch in chunks), dtype=w, device=device)
    c_parts = c_all.split([ch.batch * ch.inp for ch in chunks])
    r_parts = r_all.split([ch.batch * ch.out for ch in chunks])
    scalars: dict[int, tuple[Tensor, ...]] = {}  # id(chunk) -> (m, ε/m, h, m/h)
    if single:  # the in-place chunks: their m in one batch of small kernels
        amax = [torch.linalg.vector_norm(mats[ch.members[0]][1], math.inf, dim=(1, 2)).to(w)
                for ch in single]
        sizes = [ch.batch for ch in single]
        split = [x.split(sizes) for x in
                 _fused_scalars(amax[0] if len(amax) == 1 else torch.cat(amax), eps)]
        for k, ch in enumerate(single):
            scalars[id(ch)] = tuple(x[k] for x in split)
    for ch, c, r in zip(chunks, c_parts, r_parts, strict=True):
        views = [mats[k] for k in ch.members]
        if len(views) == 1:
            g = views[0][1]
            m, eps_first, half, m_half = scalars[id(ch)]
        else:  # one contiguous (ΣB, OUT, IN) copy of the chunk's gradients
            g = torch.cat([gv for _, gv in views])
            m, eps_first, half, m_half = _fused_scalars(
                torch.linalg.vector_norm(g, math.inf, dim=(1, 2)).to(w), eps)
        t_in, t_out = ((1.0, 1.0) if normalization == "unit"
                       else (math.sqrt(ch.inp), math.sqrt(ch.out)))
        hpt = consts.get((t_in, t_out, eps, alpha, weight_decay), w, g.device)
        cv, rv = c.view(ch.batch, ch.inp), r.view(ch.batch, ch.out)
        tk.sinkhorn_iterations(g, cv, rv, m, eps_first, hpt, num_iters)
        # one split per tensor, not one slice per parameter
        for (pv, _), gs, cs, rs, hs, mhs in zip(
                views, *(x.split(ch.sizes) for x in (g, cv, rv, half, m_half)), strict=True):
            tk.sinkgd_update(pv, gs, cs, rs, hs, mhs, hpt, lr_t,
                             lr_is_tensor=isinstance(lr, Tensor))
        del g, gs  # the chunk's stack (if any) is freed before the next chunk's


def _fused_sinkgd(params: list[Tensor], grads: list[Tensor], *, axes: list[AxisGroups],
                  lr: float | Tensor, alpha: float, num_iters: int, eps: float,
                  normalization: str, weight_decay: float,
                  consts: ConstCache | None = None,
                  group_bytes: int = SINKHORN_GROUP_BYTES,
                  sweep_bytes: int | None = None,
                  tables: dict[Any, Any] | None = None) -> None:
    """One SinkGD step with the Triton kernels of :mod:`sage_torch.triton_kernels`.

    Each matrix is a ``(B, OUT, IN)`` strided view of its gradient and parameter
    (PyTorch's ``(out, in)``, the transposed ``(in, out)``, a ``Conv2d`` kernel's
    ``(out, in·kh·kw)``, stacked layers ``(L, out, in)``; no ``K`` is ever formed).  The
    views are grouped by device, dtype and ``(OUT, IN)``, and each group is split into
    chunks of at most ``group_bytes`` of stacked gradients by :func:`_chunks`, the
    chunking of :func:`_multi_tensor_sinkgd`.  A chunk of one parameter runs on its views
    in place (no copy).  A chunk of several is stacked once into a contiguous
    ``(ΣB, OUT, IN)`` gradient (the one matrix-sized temporary, at most ``group_bytes``,
    freed before the next chunk's), whose ``m`` (the range
    scale of each matrix) is one reduction.  Per chunk, ``2·num_iters`` launches (per-row
    then per-column sums of ``(G/m)²`` weighted by the other scale's square, each with its
    scale update, as :func:`sinkhorn_scales`) for all its matrices at once, then one
    launch per parameter of the update ``θ ← θ − η·(α·c·G·r + w·θ)``, reading its slice
    of the stack and of the scales and writing the parameter in place.  The kernels treat
    every batch index alone, so the result does not depend on the chunking (bit for bit
    under the interpreter).  No host synchronisation: the learning rate is a device
    tensor (``capturable``).  bfloat16 parameters: the scales, ``m`` and the arithmetic
    in float32, the update rounded as :func:`_single_tensor_sinkgd` rounds it.
    Parameters whose matrix is not such a view (a permutation that cannot be merged), or
    whose gradient has another dtype, or DTensors, take :func:`_multi_tensor_sinkgd`.
    Parameters on several devices or of several dtypes are stepped one device and dtype
    at a time (every launch's tensors on its device).
    ``consts``: the cache of the kernels' hyperparameter tensors (kept by the rule).
    """
    consts = ConstCache() if consts is None else consts
    hp: dict[str, Any] = {"lr": lr, "alpha": alpha, "num_iters": num_iters, "eps": eps,
                          "normalization": normalization, "weight_decay": weight_decay}
    parts = by_device_dtype(params)
    if len(parts) > 1:
        for idx in parts:
            _fused_sinkgd([params[i] for i in idx], [grads[i] for i in idx],
                          axes=[axes[i] for i in idx], consts=consts,
                          group_bytes=group_bytes, sweep_bytes=sweep_bytes, tables=tables,
                          **hp)
        return
    key = None
    if tables is not None and len(tables) > TABLES_KEPT and not (
            params[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        tables.clear()  # tables of tensors that will not come back
    if tables is not None and sweep_enabled(num_iters) and not torch.compiler.is_compiling():
        key = ("step", group_bytes, sweep_bytes, int(num_iters), *(
            (p.data_ptr(), g.data_ptr(), *p.shape, *p.stride(), *g.stride(), g.dtype, ax)
            for p, g, ax in zip(params, grads, axes, strict=True)))
        plan = tables.get(key)
        if plan is not None:  # the same tensors as a step before: its launches as they were
            _run_sweeps(plan, consts=consts, **hp)
            return
    mats, buckets, sweep, rest = _fused_views(params, grads, axes, sweep_enabled(num_iters))
    if rest:
        _multi_tensor_sinkgd([params[i] for i in rest], [grads[i] for i in rest],
                             axes=[axes[i] for i in rest], group_bytes=group_bytes, **hp)
    if sweep:
        plan = _sweep_plan(sweep, consts.anchor(sweep[0][0]), tables,
                           SWEEP_GROUP_BYTES if sweep_bytes is None else sweep_bytes)
        _run_sweeps(plan, consts=consts, **hp)
        if key is not None and not rest and not mats:
            _remember(tables, key, plan)  # type: ignore[arg-type]
    if mats:
        _fused_chunks(mats, buckets, consts=consts, group_bytes=group_bytes, **hp)


FUSED_SWEEP: bool = True
"""Whether the fused path steps matrices with the sweep kernel (:func:`_run_sweeps`);
``False`` gives the two-launch-per-iteration kernels of before (benchmarks' A/B only)."""

SWEEP_GROUP_BYTES: int = 2**30
"""Gradient bytes of one sweep group (:func:`_run_sweeps`): the matrices whose ``L + 1``
sweeps are launched together.  Large, because on an H200 the step was bound by launches
(about 40 us of host time each), not by bytes: 270M, float32, sage-hybrid fused 22.2 /
13.4 / 12.1 / 11.7 ms with groups of 8 / 24 / 64 / 512 MiB (``benchmarks/RESULTS.md``)."""


def sweep_enabled(num_iters: int) -> bool:
    """Whether the fused path steps matrices with the sweep kernel (:func:`_run_sweeps`).

    Not under ``torch.use_deterministic_algorithms(True)``: its column sums are added with
    atomics, so on a GPU their order, and the last bits of a step, may change from run to
    run; the two-launch kernels (:func:`~sage_torch.triton_kernels.sinkhorn_iterations`)
    then run instead, which are deterministic.
    """
    return (FUSED_SWEEP and int(num_iters) >= 1
            and not torch.are_deterministic_algorithms_enabled())


def _sweep_groups(mats: list[tuple[Tensor, Tensor, int]], group_bytes: int
                  ) -> list[list[tuple[Tensor, Tensor, int]]]:
    """``mats`` grouped by tile shape, cut into groups of at most ``group_bytes``.

    Tile shape: :func:`~sage_torch.triton_kernels.sweep_blocks`; the groups of a class are
    cut in order, at least one matrix each, by the bytes of their gradients.
    """
    from sage_torch import triton_kernels as tk

    classes: dict[tuple[int, int, int], list[tuple[Tensor, Tensor, int]]] = {}
    for m in mats:
        classes.setdefault(tk.sweep_blocks(m[1].shape[2]), []).append(m)
    groups: list[list[tuple[Tensor, Tensor, int]]] = []
    for members in classes.values():
        used = group_bytes
        for m in members:
            size = m[1].shape[1] * m[1].shape[2] * m[1].element_size()
            if used + size > group_bytes:
                groups.append([])
                used = 0
            groups[-1].append(m)
            used += size
    return groups


class _Sweep(NamedTuple):
    """One sweep group's launches: the anchor, the tables, buffer sizes and tile."""

    anchor: Tensor
    desc: Tensor
    progs: Tensor
    n_r: int
    n_c: int
    blocks: tuple[int, int, int]


TABLES_KEPT: int = 256
"""Entries of a SinkGD rule's launch tables kept across steps: past this many, they are
forgotten at the start of the next fused step (never during one, so that a step being
captured in a CUDA graph finds every table its warm-up step made)."""


def _remember(tables: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` under ``key`` (entries are keyed by addresses and contents)."""
    if torch.compiler.is_compiling():
        return  # a traced store would make the next step recompile
    tables[key] = value


def _upload(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a tensor on ``device`` (one non-blocking copy from the host).

    Refused while the current CUDA stream is being captured: the graph would replay a
    copy from host memory freed after the capture (tables the warm-up steps made, with
    the same tensors, are found instead).
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "SinkGD's fused step met tensors it had not stepped before while a CUDA graph "
            "was being captured: run the warm-up steps with the same parameters and "
            "gradients (the same tensors) before capturing")
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _sweep_plan(mats: list[tuple[Tensor, Tensor, int]], anchor: Tensor,
                tables: dict[Any, Any] | None, group_bytes: int) -> list[_Sweep]:
    """The sweep groups of ``mats`` and their device tables.

    ``mats``: ``(θ, G, b)``, matrix ``b`` of ``(B, OUT, IN)`` views.  The tables are kept in
    ``tables`` by their contents.
    """
    from sage_torch import triton_kernels as tk

    plan = []
    for group in _sweep_groups(mats, group_bytes):
        blocks = tk.sweep_blocks(max(g.shape[2] for _, g, _ in group))
        desc, progs, n_r, n_c = tk.sweep_tables(anchor, group, blocks[0])
        # device copies of the tables, kept by their contents: a step on the same tensors
        # copies nothing from the host (what CUDA graph capture requires)
        found = None if tables is None else tables.get((anchor.device, *desc))
        if found is None:
            found = (_upload(desc, torch.int64, anchor.device),
                     _upload(progs, torch.int32, anchor.device))
            if tables is not None:
                _remember(tables, (anchor.device, *desc), found)
        plan.append(_Sweep(anchor, found[0], found[1], n_r, n_c, blocks))
    return plan


def _run_sweeps(plan: list[_Sweep], *, lr: float | Tensor, alpha: float, num_iters: int,
                eps: float, normalization: str, weight_decay: float,
                consts: ConstCache) -> None:
    """SinkGD's fused step of the matrices of ``plan`` by their scale vectors.

    Neither ``K = G²`` nor ``X`` is formed: per group of matrices (:func:`_sweep_groups`),
    ``L`` sweeps of :func:`~sage_torch.triton_kernels.sinkgd_sweeps` each read ``G`` once
    (the row step of the iteration and the next column sums), and a last one applies
    ``θ ← θ − η·(α·r·G·c + w·θ)``: ``L + 1`` launches per group.  Column sums are added
    with atomics: on a GPU the order of summation, and so the last bits, may differ from
    run to run.
    """
    from sage_torch import triton_kernels as tk

    anchor = plan[0].anchor
    w = wide(anchor.dtype)
    lr_t = lr_tensor(lr, anchor)
    hpt = consts.get((eps, alpha, weight_decay), w, anchor.device)
    for sw in plan:
        tk.sinkgd_sweeps(sw.anchor, sw.desc, sw.progs, sw.n_r, sw.n_c, hpt, lr_t, num_iters,
                         normalization != "unit", sw.blocks,
                         lr_is_tensor=isinstance(lr, Tensor))


def _fused_scalars(amax: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per matrix, from ``max|G|``: ``m``, ``ε/m`` and the split ``(h, m/h)`` of ``1/m``.

    ``X = (c/h)·G·(r/(m/h))``, as :func:`sinkhorn_scales`; element-wise, so the values do
    not depend on which matrices are computed together.
    """
    m = pow2_floor(amax)
    half = pow2_sqrt_floor(m)
    return m, eps / m, half, m / half


def _chunked_sinkgd(items: list[tuple[Tensor, Tensor, int, int]], *, lr: float, alpha: float,
                    num_iters: int, eps: float, normalization: str, weight_decay: float,
                    threads: int = 1) -> None:
    """Step plain CPU matrices ``(p, g, fan_in_dim, fan_out_dim)`` in place, chunk by chunk.

    A matrix's Sinkhorn loop is ``2L`` products and a few vector operations: split over
    threads, each would end on a barrier.  With ``threads > 1`` (opt-in) every matrix runs
    on one thread (:func:`chunked.parallel`), the matrices balanced by size over the
    threads, each thread reusing one buffer for ``K``.
    """
    n = max(1, min(threads, len(items)))
    bins: list[list[tuple[Tensor, Tensor, int, int]]] = [[] for _ in range(n)]
    loads = [0] * n
    for item in sorted(items, key=lambda it: -it[0].numel()):
        k = loads.index(min(loads))
        bins[k].append(item)
        loads[k] += item[0].numel()

    def run(batch: list[tuple[Tensor, Tensor, int, int]]) -> None:
        p0 = batch[0][0]  # the largest of the batch
        k_buf = torch.empty(p0.numel(), dtype=p0.dtype, device=p0.device)
        for p, g, fi, fo in batch:
            _chunked_matrix(p, g, fi, fo, k_buf, lr=lr, alpha=alpha, num_iters=num_iters,
                            eps=eps, normalization=normalization, weight_decay=weight_decay)

    chunked.parallel(run, [b for b in bins if b], n)


def _chunked_matrix(p: Tensor, g: Tensor, fi: int, fo: int, k_buf: Tensor | None, *,
                    lr: float, alpha: float, num_iters: int, eps: float, normalization: str,
                    weight_decay: float) -> None:
    """One plain CPU matrix: scales from :func:`sinkhorn_scales`, then the update by chunks.

    ``θ ← θ − η·(α·(c·G·r) + w·θ)`` one chunk of rows at a time, with the operations of
    the whole-tensor path (``c·G``, then ``·r``, then ``·α``), on the calling thread.
    """
    c, r = sinkhorn_scales(g, fi, fo, num_iters, eps, normalization, buffer=k_buf)
    # X = c·G·r with c one scale per fan-in index, r one per fan-out index (2-D here)
    rows, cols = (r, c) if fo == 0 else (c, r)
    rows, cols = rows.unsqueeze(1), cols.unsqueeze(0)

    def update(k: int, i: int, j: int, u: Tensor, _: Tensor) -> None:
        if fo == 0:
            torch.mul(cols, g[i:j], out=u).mul_(rows[i:j])
        else:
            torch.mul(rows[i:j], g[i:j], out=u).mul_(cols)
        u.mul_(alpha)
        chunked.decay_and_apply(u, p[i:j], lr, weight_decay)

    chunked.for_chunks(p, update)


@register
class SinkGDRule(UpdateRule):
    """SinkGD: ``u = α·X`` with ``X`` the Sinkhorn normalisation of the gradient (stateless)."""

    name = "sinkgd"

    needs_matrix = True

    complex_why = "normalises the rows and columns of real matrices (Sinkhorn)"

    checked = ("num_iters", "eps", "normalization")

    has_fused = True

    def __init__(self) -> None:
        self._layouts: dict[Any, tuple[Tensor, ...]] = {}  # _multi_tensor_sinkgd's cache
        self._consts = ConstCache()  # _fused_sinkgd's hyperparameter tensors
        self._sweep_tables: dict[Any, Any] = {}  # _fused_sinkgd's plans and program tables

    @classmethod
    def check_fused(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """SinkGD's fused path: two same-shape matrices (one stacked chunk), one alone."""
        ps, gs, _ = fused_check.problem([(24, 40), (24, 40), (17, 9)], device, dtype, 3)
        kw: dict[str, Any] = {"axes": [((1,), (0,))] * 3, "lr": fused_check.LR,
                              "alpha": 10.0, "num_iters": fused_check.ITERS, "eps": 1e-8,
                              "normalization": "unit", "weight_decay": fused_check.WD}
        out: dict[str, tuple[list[Tensor], ...]] = {}
        for path, fn in (("fused", _fused_sinkgd), ("single", _single_tensor_sinkgd)):
            p = fused_check.clones(ps)
            fn(p, gs, **kw)
            out[path] = (p,)
        return fused_check.first_error(ps, out, ("parameter",), dtype)

    def validate(self, group: dict[str, Any]) -> None:  # noqa: D102
        super().validate(group)
        gb = group.get("group_bytes")
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, int) or gb < 1):
            raise ValueError(f"group_bytes must be None or a positive int (bytes), got {gb!r}")

    def group_bytes(self, group: dict[str, Any], fused: bool) -> int:
        """The stacking limit of ``group``'s step (``group_bytes``, or its default).

        Default (``None``): :data:`~sage_optim.hyperparams.SINKHORN_GROUP_BYTES` on the
        fused path (its one stacked copy of gradients); on the multi-tensor path the larger
        of that and :data:`FOREACH_ROUND_PARAMS` times the optimizer's largest parameter.
        The multi-tensor steps of the other rules hold about that much at once already
        (two temporaries of each tensor; ``python benchmarks/torch_step.py --op-count``,
        peak column), so rounds that size add little to the step's peak, while every
        further round repeats the ``2L`` iterations' element-wise kernels (at 270M: one
        round, 296 aten ops and 1,092 MiB per sage-hybrid step; 128 MiB rounds: 968 ops
        and 1,002 MiB).
        """
        gb = group.get("group_bytes")
        if gb is not None:
            return int(gb)
        if fused:
            return SINKHORN_GROUP_BYTES
        return max(SINKHORN_GROUP_BYTES, FOREACH_ROUND_PARAMS * self.largest_param_bytes)

    def init_state(self, p, group, name, index=0):  # noqa: D102
        matrix_axes(p, group, "SinkGD", name)
        return {}

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        hp: dict[str, Any] = {"lr": lr_of(group), "alpha": group["alpha"],
                              "num_iters": group["num_iters"], "eps": group["eps"],
                              "normalization": group["normalization"],
                              "weight_decay": group["weight_decay"]}
        if fused:
            _fused_sinkgd(params, grads, consts=self._consts, **hp,
                          group_bytes=self.group_bytes(group, True),
                          sweep_bytes=group.get("group_bytes"), tables=self._sweep_tables,
                          axes=[matrix_axes(p, group, "SinkGD", n)
                                for p, n in zip(params, names, strict=True)])
            return
        rest, rest_g, rest_axes, fast = [], [], [], []
        chunk_ok = not group.get("capturable", False)
        for p, g, name in zip(params, grads, names, strict=True):
            fan_in, fan_out = matrix_axes(p, group, "SinkGD", name)
            if not chunk_ok:
                pass
            elif len(fan_in) == 1 and len(fan_out) == 1:
                if p.dim() == 2 and chunked.use_fast_path(p, g):
                    fast.append((p, g, fan_in[0], fan_out[0]))
                    continue
            else:  # grouped axes: the (OUT, IN) matrix, a view of p where one exists
                mv = MatrixView(p.shape, fan_in, fan_out)
                pv, gv = mv.view(p), mv.view(g)
                if (pv is not None and gv is not None and pv.dim() == 2
                        and chunked.use_fast_path(pv, gv)):
                    fast.append((pv, gv, 1, 0))
                    continue
            rest.append(p)
            rest_g.append(g)
            rest_axes.append((fan_in, fan_out))
        if fast:
            _chunked_sinkgd(fast, threads=self.cpu_threads, **hp)
        if foreach:
            _multi_tensor_sinkgd(rest, rest_g, axes=rest_axes, cache=self._layouts,
                                 group_bytes=self.group_bytes(group, False),
                                 **hp)
        else:
            _single_tensor_sinkgd(rest, rest_g, axes=rest_axes, **hp)


@shared_docs
class SinkGD(RuleOptimizer):
    """SinkGD (``docs/algorithms.md``): ``θ ← θ − η·(α·X + w·θ)``.

    ``X`` is the Sinkhorn-normalised gradient (fan-in norms, then fan-out norms,
    ``num_iters`` times).  Stateless but for the float32 ``step`` count every rule keeps
    (:class:`RuleOptimizer`), which SinkGD's update does not read.

    ``normalization="unit"`` is the SAGE paper's Unit-Norm SinkGD (α = 10); ``"sqrt"`` is
    Scetbon et al.'s SR-Sinkhorn (α = 0.05).  Parameters with fewer than two dims go to
    the ``fallback`` rule; without one they are rejected with an error naming their size.

    Args:
      params: parameters or param groups.
      lr: learning rate.
      alpha: update scale α.
      num_iters: Sinkhorn iterations.
      weight_decay: decoupled decay ``w`` (multiplied by ``lr``, not ``lr·α``).
      normalization: ``"unit"`` or ``"sqrt"``.
      eps: ε added to every norm.
      fan_in_dim: dim of the fan-in axis (``-1`` for ``nn.Linear.weight`` ``(out, in)``),
        or a tuple of dims merged into one (``(1, 2, 3)`` for a ``Conv2d`` weight).
      fan_out_dim: dim (or tuple of dims) of the fan-out axis.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path, the Sinkhorn iterations batched over
        same-shape matrices (default: on CUDA and under ``torch.compile``).
      {fused_doc}
      capturable: keep the ``step`` count on the parameters' device and accept a device
        tensor ``lr``, so the step reads nothing back to the host (CUDA graphs), as
        ``torch.optim.Adam``'s option (SinkGD's update does not read the count).
      cpu_threads: threads of the chunked CPU path (default 1: none started).
      group_bytes: the foreach path stacks same-shape matrices in chunks whose ``K`` holds
        at most this many bytes, the fused path in chunks of at most this many bytes of
        gradients; the result does not depend on it.  Default ``None``: 128 MiB on the
        fused path (as :mod:`sage_optax`'s ``group_bytes``), and on the foreach path the
        larger of 128 MiB and twice the optimizer's largest parameter
        (:meth:`SinkGDRule.group_bytes`).
      fallback: the rule for the parameters this one cannot treat (vectors and 0-D
        parameters, complex parameters):
        {fallback_doc}

    Examples:
      An ``nn.Linear(4, 3)`` weight ``(out, in)`` (the transpose of
      :func:`sage_optax.scale_by_sinkhorn`'s example): the last half-iteration divides each
      input's column by its norm, so the columns of ``X`` have norm 1:

      >>> import torch, sage_torch
      >>> w = torch.nn.Parameter(torch.zeros(3, 4))
      >>> opt = sage_torch.SinkGD([w], lr=0.1, alpha=1.0, weight_decay=0.0)
      >>> w.grad = torch.tensor([[1.0, 3.0, 0.1, 1.0], [2.0, -4.0, 0.2, 1.0],
      ...                        [0.5, 1.0, 0.3, 1.0]])
      >>> opt.step()
      >>> x = -w.detach() / 0.1  # α·X with α = 1
      >>> print(" ".join(f"{n:.3f}" for n in x.norm(dim=0)))
      1.000 1.000 1.000 1.000

      A layer's bias is a vector, which SinkGD cannot normalise: ``fallback`` gives it a
      param group of its own:

      >>> layer = torch.nn.Linear(4, 3)
      >>> opt = sage_torch.SinkGD(layer.parameters(), fallback="adamw")
      >>> print([(group["rule"], len(group["params"])) for group in opt.param_groups])
      [('sinkgd', 1), ('adamw', 1)]

    References:
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD; SR-Sinkhorn, ``"sqrt"``).

      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Unit-Norm SinkGD, ``"unit"``).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["sage-hybrid"].learning_rate,
                 alpha: float = _SINK["alpha"], num_iters: int = _SINK["num_iters"],
                 weight_decay: float = _SINK["weight_decay"],
                 normalization: str = _SINK["normalization"], *, eps: float = _SINK["eps"],
                 fan_in_dim: Axes = -1, fan_out_dim: Axes = -2, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, cpu_threads: int = 1,
                 group_bytes: int | None = None,
                 fallback: str | dict[str, Any] | None = None) -> None:
        super().__init__(params, {"group_bytes": group_bytes,
            "rule": "sinkgd", "fallback": fallback, "lr": lr, "alpha": alpha,
            "num_iters": num_iters,
            "weight_decay": weight_decay, "normalization": normalization, "eps": eps,
            "fan_in_dim": fan_in_dim, "fan_out_dim": fan_out_dim, "maximize": maximize,
            "foreach": foreach, "fused": fused, "capturable": capturable,
        }, cpu_threads=cpu_threads)
