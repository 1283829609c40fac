"""Triton kernels of the fused path (``fused=True``): SinkGD scales and update, SAGE, Lion.

Imported lazily (only by a fused step): :mod:`sage_torch` imports without ``triton``.  The
kernels are plain functions wrapped on first use, for the device of the tensors they run
on: compiled by Triton (``triton.runtime.jit.JITFunction``) for CUDA tensors, or run by
Triton's interpreter (``triton.runtime.interpreter.InterpretedFunction``) for CPU tensors,
which :func:`sage_torch.common.fused_unsupported` allows only under
``TRITON_INTERPRET=1`` (the CPU tests).
Both wrappers of a kernel are built directly, so the choice is made per call and does not
depend on the environment at import time.

``triton.language``'s own ``@jit`` helpers (``tl.sum``, ``tl.zeros``, the combine
functions of ``tl.standard``) are built once, when ``triton`` is first imported: for the
interpreter if ``TRITON_INTERPRET=1`` is set then, else for the compiler.  So the kernels
call none of them directly (a compiler-built one raises when an interpreted kernel calls
it); the one they use, ``tl.standard._sum_combine``, is only passed to ``tl.reduce``,
whose interpreted version calls the plain function inside.  Their own device functions
(:func:`_round_bf16`, :func:`_decayed`) are :class:`_DeviceFunction` objects, which both
modes can call.  A process that imported ``triton`` with ``TRITON_INTERPRET=1`` set cannot
compile the kernels (``tl.reduce``'s combine function is then an interpreter function):
the test that compiles them for an H100 runs in a process of its own, without the
variable and with an empty Triton cache.

Arithmetic: every kernel computes in ``w``, float32 or float64
(:func:`~sage_torch.common.wide` of the parameters' dtype, :data:`DTYPES`), with the
operations of the single-tensor functions in the same order (``docs/algorithms.md``
states the math); compiled without floating-point contraction (``enable_fp_fusion=False``:
no ``a·b + c`` becomes an FMA), so a kernel rounds as the interpreter does and as the
reference paths' separate torch operations do.  bfloat16 parameters and gradients are
read into float32, their state is kept as the other paths keep it (SAGE's and Lion's
``M`` in bfloat16, SAGE's ``S`` in float32) and every value the reference paths store in
a bfloat16 tensor (the update, ``u + w·θ``, ``θ``, ``M``, Lion's intermediate products) is
rounded to bfloat16 where they round it (:func:`_round_bf16`, round to nearest even).
The hyperparameters come from a small tensor in ``w`` (``hp``, each rounded to ``w``
once, as torch's CUDA kernels take a Python scalar, ``alpha=`` included; torch's CPU
``add`` of bfloat16 rounds ``alpha`` to bfloat16 in its vectorised loop only), and the
learning rate from a one-element device tensor (``lr``), so a fused step reads nothing
back to the host and can be captured in a CUDA graph (``capturable=True``).

Indexing: offsets are int32 (fast) unless one the kernel forms could reach ``2**31``
(:data:`INDEX_LIMIT`); the launchers then set the kernel's ``INT64`` flag, which forms
program ids, lanes and every offset in int64 (:func:`needs_int64` and the ``*_int64``
functions, pure functions of the sizes and strides).  A launch on a CUDA device that is
not the current one runs under ``torch.cuda.device`` of the tensors' device
(:func:`_launch`): Triton launches on the current device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

ELEMENTWISE_BLOCK = 1024
"""Elements per program of the element-wise kernels."""

SINKHORN_BLOCKS = {"rows": (16, 256), "cols": (64, 64)}
"""``(BLOCK_R, BLOCK_C)`` tiles (rows, columns of ``G``) of the per-row and per-column
Sinkhorn reductions (:func:`_sinkhorn_half`)."""

INDEX_LIMIT = 2**31
"""The first offset int32 cannot hold: a launch forming one this large takes ``INT64``."""

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16)
"""Parameter dtypes the kernels take (:data:`sage_torch.common.FUSED_DTYPES`)."""

_COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}
"""Options of every compiled launch: no FMA contraction (see the module docstring)."""


class _DeviceFunction(JITFunction):
    """A ``@jit`` device function that compiled and interpreted kernels can both call.

    The compiler inlines a call to a ``JITFunction`` itself and never calls the object;
    an interpreted kernel calls it as Python, which a plain ``JITFunction`` refuses, so
    here the call runs the interpreter's rewritten copy of the function (the kernel's
    run has already put the interpreter's ``triton.language`` in place).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(self.fn).rewrite()(*args, **kwargs)


# --- device functions -------------------------------------------------------------------


def _round_bf16_fn(x):  # pragma: no cover - Triton
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32.

    As torch's ``.to(torch.bfloat16)`` (``c10::round_to_nearest_even``): add ``0x7FFF``
    plus the lowest kept bit, drop the 16 low bits; NaN stays NaN.  The bits are rounded
    here, not by ``x.to(tl.bfloat16)``, because Triton 3.6's interpreter truncates that
    conversion (the GPU rounds it): written this way both give torch's result.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 is 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


_round_bf16 = _DeviceFunction(_round_bf16_fn)


def _decayed_fn(p, u, wd, lr, BF16: tl.constexpr, LR_TENSOR: tl.constexpr):  # pragma: no cover
    """``θ − η·(u + w·θ)``, rounded as :func:`sage_torch.common.decayed_step` rounds it.

    bfloat16 (``BF16``): ``d = u + w·θ`` and the new ``θ`` are each rounded to bfloat16
    (``u.add(θ, alpha=w)``, ``θ.add_(d, alpha=−η)``), and with a tensor ``η``
    (``LR_TENSOR``, ``capturable=True``) the product ``η·d`` too (``θ.sub_(d * η)``).
    """
    if BF16:
        d = _round_bf16(u + wd * p)
        if LR_TENSOR:
            return _round_bf16(p - _round_bf16(lr * d))
        return _round_bf16(p - lr * d)
    return p - lr * (u + wd * p)


_decayed = _DeviceFunction(_decayed_fn)


# --- kernel bodies (wrapped by _kernel) -------------------------------------------------


def _sinkhorn_half(g_ptr, u_ptr, w_ptr, m_ptr, eps_ptr, eps_stride, t_ptr, N_OUT, N_RED,
                   s_gb, s_go, s_gr, IS_F32: tl.constexpr, INT64: tl.constexpr,
                   BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):  # pragma: no cover - Triton
    """One Sinkhorn half-iteration for a block of output entries ``o`` of matrix ``b``.

    ``q_o = sqrt(Σ_k (G_ok/m)²·w_k²)`` over the reduced axis (tiles of ``G`` squared on
    chip), then ``u_o ← where(q > 0, u·t / (u·q + ε_b), u)`` with ``t = t_ptr[0]`` and
    ``ε_b = eps_ptr[b·eps_stride]``.  The rows half (``u = r``, ``w = c``, reducing over
    the fan-in columns) and the columns half (``u = c``, ``w = r``) are this kernel with
    the sizes and strides of the two axes swapped (:func:`sinkhorn_iterations`).  ``G``
    may be bfloat16; everything else is in the scales' dtype (``u``), the arithmetic's.
    """
    if INT64:
        b = tl.program_id(0).to(tl.int64)
        outs = tl.program_id(1).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
        lanes = tl.arange(0, BLOCK_R).to(tl.int64)
    else:
        b = tl.program_id(0)
        outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        lanes = tl.arange(0, BLOCK_R)
    out_ok = outs < N_OUT
    m = tl.load(m_ptr + b)
    acc = tl.full((BLOCK_O,), 0.0, u_ptr.dtype.element_ty)
    for k0 in range(0, N_RED, BLOCK_R):
        reds = k0 + lanes
        red_ok = reds < N_RED
        g = tl.load(g_ptr + b * s_gb + outs[:, None] * s_go + reds[None, :] * s_gr,
                    mask=out_ok[:, None] & red_ok[None, :], other=0.0)
        g = g.to(u_ptr.dtype.element_ty)
        if IS_F32:
            x = tl.div_rn(g, m)  # exact: m is a power of two
        else:
            x = g / m
        w = tl.load(w_ptr + b * N_RED + reds, mask=red_ok, other=0.0)
        acc += tl.reduce((x * x) * (w * w)[None, :], 1, tl.standard._sum_combine)
    if IS_F32:
        q = tl.sqrt_rn(acc)
    else:
        q = tl.sqrt(acc)
    u = tl.load(u_ptr + b * N_OUT + outs, mask=out_ok, other=1.0)
    eps = tl.load(eps_ptr + b * eps_stride)
    t = tl.load(t_ptr)
    den = tl.where(q > 0, u * q + eps, 1.0)  # the kept entries divide by nothing
    if IS_F32:
        new = tl.div_rn(u * t, den)
    else:
        new = (u * t) / den
    tl.store(u_ptr + b * N_OUT + outs, tl.where(q > 0, new, u), mask=out_ok)


def _sinkgd_update(p_ptr, g_ptr, r_ptr, c_ptr, half_ptr, mh_ptr, hp_ptr, lr_ptr, N, R, C,
                   s_pb, s_pr, s_pc, s_gb, s_gr, s_gc, IS_F32: tl.constexpr,
                   BF16: tl.constexpr, LR_TENSOR: tl.constexpr, INT64: tl.constexpr,
                   BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """``θ ← θ − η·(α·((c_j/h)·G_ij·(r_i/(m/h))) + w·θ)`` element-wise; ``hp[3:5] = (α, w)``.

    ``h = half_ptr[b]`` and ``m/h = mh_ptr[b]`` split ``1/m`` between the scales (powers of
    two: the divisions are exact).  bfloat16 (``BF16``): ``X`` is rounded to bfloat16, then
    ``α·X`` (``x.to(θ.dtype) * α`` of :func:`sage_torch.sinkgd._single_tensor_sinkgd`).
    """
    if INT64:
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    row = idx // C  # b·R + i: no R·C product, which could overflow
    j = idx % C
    i = row % R
    b = row // R
    cdt = hp_ptr.dtype.element_ty
    g = tl.load(g_ptr + b * s_gb + i * s_gr + j * s_gc, mask=ok, other=0.0).to(cdt)
    c = tl.load(c_ptr + b * C + j, mask=ok, other=0.0)
    r = tl.load(r_ptr + b * R + i, mask=ok, other=0.0)
    half = tl.load(half_ptr + b, mask=ok, other=1.0)
    mh = tl.load(mh_ptr + b, mask=ok, other=1.0)
    if IS_F32:
        c = tl.div_rn(c, half)
        r = tl.div_rn(r, mh)
    else:
        c = c / half
        r = r / mh
    p_off = b * s_pb + i * s_pr + j * s_pc
    p = tl.load(p_ptr + p_off, mask=ok, other=0.0).to(cdt)
    alpha = tl.load(hp_ptr + 3)
    wd = tl.load(hp_ptr + 4)
    lr = tl.load(lr_ptr).to(cdt)
    x = (c * g) * r
    if BF16:
        u = _round_bf16(_round_bf16(x) * alpha)
    else:
        u = x * alpha
    tl.store(p_ptr + p_off, _decayed(p, u, wd, lr, BF16, LR_TENSOR), mask=ok)


def _sage_update(p_ptr, g_ptr, m_ptr, h_ptr, hp_ptr, lr_ptr, N, C, s_hr, s_hc,
                 B2_ZERO: tl.constexpr, BF16: tl.constexpr, LR_TENSOR: tl.constexpr,
                 INT64: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """SAGE's element-wise part on a contiguous ``(N/C, C)`` tensor, ``H`` broadcast by strides.

    ``M ← g·(1−b2) + M·b2``; ``u = sign(M·b1 + g·(b2−b1))·H`` (``sign(g·(1−b1) + M·b1)``
    with the old ``M`` when ``b2 = 0``); ``θ ← θ − η·(u + w·θ)``.
    ``hp = (1−b2, b2, b1, b2−b1, 1−b1, w)``.  bfloat16 (``BF16``): the sign's argument
    comes from the float32 ``M``; ``M`` and ``u`` are rounded to bfloat16 when stored,
    as :func:`sage_torch.sage._single_tensor_sage` does.
    """
    if INT64:
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    cdt = hp_ptr.dtype.element_ty
    g = tl.load(g_ptr + idx, mask=ok, other=0.0).to(cdt)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0).to(cdt)
    p = tl.load(p_ptr + idx, mask=ok, other=0.0).to(cdt)
    h = tl.load(h_ptr + (idx // C) * s_hr + (idx % C) * s_hc, mask=ok, other=0.0).to(cdt)
    one_b2 = tl.load(hp_ptr)
    b2 = tl.load(hp_ptr + 1)
    b1 = tl.load(hp_ptr + 2)
    b2_b1 = tl.load(hp_ptr + 3)
    one_b1 = tl.load(hp_ptr + 4)
    wd = tl.load(hp_ptr + 5)
    lr = tl.load(lr_ptr).to(cdt)
    m_new = g * one_b2 + m * b2
    if B2_ZERO:
        arg = g * one_b1 + m * b1
    else:
        arg = m_new * b1 + g * b2_b1
    sign = tl.where(arg > 0, 1.0, tl.where(arg < 0, -1.0, 0.0)).to(cdt)
    sign = tl.where(arg != arg, arg, sign)  # NaN stays NaN, as torch.sign
    u = sign * h
    if BF16:
        m_new = _round_bf16(m_new)
        u = _round_bf16(u)
    tl.store(m_ptr + idx, m_new, mask=ok)
    tl.store(p_ptr + idx, _decayed(p, u, wd, lr, BF16, LR_TENSOR), mask=ok)


def _lion_update(p_ptr, g_ptr, m_ptr, hp_ptr, lr_ptr, N, BF16: tl.constexpr,
                 LR_TENSOR: tl.constexpr, INT64: tl.constexpr,
                 BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """Lion element-wise: ``u = sign(g·(1−b1) + m·b1)``, ``m ← g·(1−b2) + m·b2``, decayed step.

    ``hp = (1−b1, b1, 1−b2, b2, w)``.  bfloat16 (``BF16``): every product and sum is
    rounded to bfloat16, as the bfloat16 tensor operations of
    :func:`sage_torch.lion._single_tensor_lion` round them.
    """
    if INT64:
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    cdt = hp_ptr.dtype.element_ty
    g = tl.load(g_ptr + idx, mask=ok, other=0.0).to(cdt)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0).to(cdt)
    p = tl.load(p_ptr + idx, mask=ok, other=0.0).to(cdt)
    one_b1 = tl.load(hp_ptr)
    b1 = tl.load(hp_ptr + 1)
    one_b2 = tl.load(hp_ptr + 2)
    b2 = tl.load(hp_ptr + 3)
    wd = tl.load(hp_ptr + 4)
    lr = tl.load(lr_ptr).to(cdt)
    if BF16:
        arg = _round_bf16(_round_bf16(g * one_b1) + _round_bf16(m * b1))
        m_new = _round_bf16(_round_bf16(g * one_b2) + _round_bf16(m * b2))
    else:
        arg = g * one_b1 + m * b1
        m_new = g * one_b2 + m * b2
    u = tl.where(arg > 0, 1.0, tl.where(arg < 0, -1.0, 0.0)).to(cdt)
    u = tl.where(arg != arg, arg, u)
    tl.store(m_ptr + idx, m_new, mask=ok)
    tl.store(p_ptr + idx, _decayed(p, u, wd, lr, BF16, LR_TENSOR), mask=ok)


SWEEP_TILE = 4096
"""Elements of ``G`` one program of :func:`_sinkgd_sweep` holds in registers (a block of
whole rows: ``BLOCK_ROWS · BLOCK_COLS``)."""

SWEEP_MAX_COLS = 32768
"""Widest matrix (fan-in size) the sweep kernel takes: one program holds at least one whole
row.  Wider matrices take the two-launch-per-iteration kernels (:func:`_sinkhorn_half`)."""

SWEEP_DESC = 10
"""int64 fields per matrix of a sweep launch: ``G``'s and ``θ``'s element offsets from the
base pointer, ``R``, ``C``, ``G``'s and ``θ``'s row and column strides, and the matrix's
offsets into the row buffers and the column buffers (:func:`sweep_tables`)."""


def _pow2_floor_fn(x, IS_F32: tl.constexpr):  # pragma: no cover - Triton
    """The largest power of two ``<= x`` for a positive normal ``x`` (its exponent bits)."""
    if IS_F32:
        out = (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    else:
        out = (x.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    return out


_pow2_floor = _DeviceFunction(_pow2_floor_fn)


def _rescale_fn(scale, norm_sq, t, eps, IS_F32: tl.constexpr):  # pragma: no cover - Triton
    """One half-iteration's scale update: ``s·t/(s·‖·‖ + ε)``, ``s`` kept where the norm is 0.

    ``norm_sq``: the squared norm of the slice of ``G`` weighted by the other scale (the
    slice of ``X`` has norm ``scale·sqrt(norm_sq)``); the rescale of
    :func:`sage_optax.sinkgd._iterate`, for the row and the column step alike.
    """
    if IS_F32:
        q = tl.sqrt_rn(norm_sq)
    else:
        q = tl.sqrt(norm_sq)
    den = tl.where(q > 0, scale * q + eps, 1.0)
    if IS_F32:
        new = tl.div_rn(scale * t, den)
    else:
        new = (scale * t) / den
    return tl.where(q > 0, new, scale)


_rescale = _DeviceFunction(_rescale_fn)


def _sinkgd_sweep(base_ptr, desc_ptr, prog_ptr, r_ptr, ia_ptr, c_ptr, cs_ptr, hp_ptr, lr_ptr,
                  it, n_c, FIRST: tl.constexpr, APPLY: tl.constexpr, SQRT: tl.constexpr,
                  IS_F32: tl.constexpr, BF16: tl.constexpr, LR_TENSOR: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):  # pragma: no cover
    """One sweep of SinkGD by its scale vectors over a block of whole rows of one matrix.

    ``X = diag(r)·G·diag(c)`` is never formed: a program holds ``BLOCK_ROWS`` whole rows of
    ``G`` (fan-out units of the ``(OUT, IN)`` view) in registers.  Sweep ``it < L`` (one
    launch for every matrix of a group, ``prog_ptr`` mapping programs to ``(matrix, first
    row)``): ``c`` of this iteration from the previous sweep's column sums (``c_ptr`` slot
    ``it``, written by each matrix's first block), the row step ``r ← r·t/(r·‖G_i c‖ + ε)``
    on its rows, and the next column sums ``Σ_i (G_ij r_i)²`` of its rows added atomically
    into ``cs_ptr`` slot ``it``.  The apply sweep (``APPLY``, ``it = L``): the last ``c``
    and the decayed step ``θ ← θ − η·(α·r_i·G_ij·c_j + w·θ)`` (:func:`_decayed`).

    Range: the first sweep finds each row's largest magnitude ``a_i`` (a power of two,
    kept as ``1/a_i`` in ``ia_ptr``) and runs on ``G_ij/a_i`` with ``r`` carrying
    ``a_i`` (``ε/a_i`` in the first row step, as the reference's ``ε/m``): every square
    the kernel forms is of an entry of ``X`` or of ``G/a`` (at most 4), so no finite
    gradient overflows.  ``hp = (ε, α, w)``.
    """
    pid = tl.program_id(0)
    mat = tl.load(prog_ptr + 2 * pid)
    row0 = tl.load(prog_ptr + 2 * pid + 1)
    d = desc_ptr + mat * 10
    g_off = tl.load(d)
    p_off = tl.load(d + 1)
    n_rows = tl.load(d + 2)
    n_cols = tl.load(d + 3)
    s_gr = tl.load(d + 4)
    s_gc = tl.load(d + 5)
    s_pr = tl.load(d + 6)
    s_pc = tl.load(d + 7)
    r_off = tl.load(d + 8)
    c_off = tl.load(d + 9)
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    cdt = hp_ptr.dtype.element_ty
    g = tl.load(base_ptr + g_off + rows[:, None] * s_gr + cols[None, :] * s_gc, mask=ok,
                other=0.0).to(cdt)
    eps = tl.load(hp_ptr)
    one = tl.full((BLOCK_ROWS,), 1.0, cdt)
    if SQRT:
        if IS_F32:
            t_in = tl.sqrt_rn(n_cols.to(cdt))
            t_out = tl.sqrt_rn(n_rows.to(cdt))
        else:
            t_in = tl.sqrt(n_cols.to(cdt))
            t_out = tl.sqrt(n_rows.to(cdt))
    else:
        t_in = 1.0
        t_out = 1.0
    if FIRST:
        amax = tl.reduce(tl.abs(g), 1, tl.standard._elementwise_max)
        if IS_F32:
            finite = (amax > 0) & (amax <= 3.4028234663852886e38)
            a = _pow2_floor(tl.maximum(amax, 1.1754943508222875e-38), IS_F32)
        else:
            finite = (amax > 0) & (amax <= 1.7976931348623157e308)
            a = _pow2_floor(tl.maximum(amax, 2.2250738585072014e-308), IS_F32)
        ia = tl.where(finite, 1.0 / a, one)
        tl.store(ia_ptr + r_off + rows, ia, mask=row_ok)
        x = g * ia[:, None]
        xc = x
        r_old = one
        eps_r = eps * ia
    else:
        ia = tl.load(ia_ptr + r_off + rows, mask=row_ok, other=1.0)
        x = g * ia[:, None]
        c_prev = tl.load(c_ptr + (it - 1) * n_c + c_off + cols, mask=col_ok & (it > 1),
                         other=1.0)
        c_sq = tl.load(cs_ptr + (it - 1) * n_c + c_off + cols, mask=col_ok, other=0.0)
        c = _rescale(c_prev, c_sq, t_out, eps, IS_F32)
        tl.store(c_ptr + it * n_c + c_off + cols, c, mask=col_ok & (row0 == 0))
        xc = x * c[None, :]
        r_old = tl.load(r_ptr + r_off + rows, mask=row_ok, other=1.0)
        eps_r = tl.full((BLOCK_ROWS,), 0.0, cdt) + eps
    if APPLY:
        xu = xc * r_old[:, None]
        alpha = tl.load(hp_ptr + 1)
        wd = tl.load(hp_ptr + 2)
        lr = tl.load(lr_ptr).to(cdt)
        if BF16:
            u = _round_bf16(_round_bf16(xu) * alpha)
        else:
            u = xu * alpha
        p_ptrs = base_ptr + p_off + rows[:, None] * s_pr + cols[None, :] * s_pc
        p = tl.load(p_ptrs, mask=ok, other=0.0).to(cdt)
        tl.store(p_ptrs, _decayed(p, u, wd, lr, BF16, LR_TENSOR), mask=ok)
    else:
        r = _rescale(r_old, tl.reduce(xc * xc, 1, tl.standard._sum_combine), t_in, eps_r,
                     IS_F32)
        tl.store(r_ptr + r_off + rows, r, mask=row_ok)
        y = x * r[:, None]
        col = tl.reduce(y * y, 0, tl.standard._sum_combine)
        tl.atomic_add(cs_ptr + it * n_c + c_off + cols, col, mask=col_ok)


KERNELS: tuple[Callable[..., Any], ...] = (_sinkhorn_half, _sinkgd_update, _sage_update,
                                           _lion_update, _sinkgd_sweep)
"""Every kernel body (the fused step of each rule launches some of them)."""

_LOOP_BOUNDS: dict[str, tuple[str, ...]] = {"_sinkhorn_half": ("N_OUT", "N_RED")}
"""Integer arguments a kernel loops up to: compile-time values under the interpreter only."""


@functools.cache
def _kernel(fn: Callable[..., Any], interpret: bool) -> Any:
    """``fn`` as a Triton kernel: interpreted (CPU tensors) or compiled (CUDA).

    The interpreter of Triton 3.6 takes ``range(0, C, ...)`` with a run-time ``C`` through
    ``int()`` of a one-element array, which NumPy ≥ 2.4 refuses; so for the interpreter
    only, the interpreter's copy of ``fn`` marks its loop bounds (:data:`_LOOP_BOUNDS`)
    as ``constexpr`` (plain Python ints there; the compiled kernel keeps them run-time
    arguments).
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        bounds = _LOOP_BOUNDS.get(fn.__name__, ())

        class Interpreted(InterpretedFunction):
            def rewrite(self) -> Any:
                out = super().rewrite()  # the interpreter's rewritten copy of fn (cached)
                out.__annotations__ = {**out.__annotations__,
                                       **dict.fromkeys(bounds, "constexpr")}
                return out

        return Interpreted(fn)
    return JITFunction(fn)


def _launch(fn: Callable[..., Any], device: torch.device, grid: tuple[int, ...],
            *args: Any, **meta: Any) -> None:
    """Launch kernel ``fn`` on ``grid`` for tensors on ``device``.

    CPU: Triton's interpreter.  CUDA: the compiled kernel (:data:`_COMPILE_OPTIONS`), under
    ``torch.cuda.device(device)`` when ``device`` is not the current device (Triton
    launches on the current device and stream); reading the current device is a host
    call, no synchronisation.
    """
    if device.type == "cpu":
        _kernel(fn, True)[grid](*args, **meta)
        return
    kernel = _kernel(fn, False)
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[grid](*args, **meta, **_COMPILE_OPTIONS)
    else:
        kernel[grid](*args, **meta, **_COMPILE_OPTIONS)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- int32 or int64 offsets (pure functions of sizes and strides) -----------------------


def needs_int64(*offsets: int) -> bool:
    """Whether the largest of ``offsets`` does not fit in int32 (:data:`INDEX_LIMIT`).

    ``offsets``: for each offset formula of a kernel, the largest value it forms.
    """
    return max(offsets, default=0) >= INDEX_LIMIT


def _last_flat(n: int) -> int:
    """The largest flat index an element-wise launch over ``n`` elements forms.

    Its lanes past ``n`` included: they are masked, but their index is compared with ``n``.
    """
    return _cdiv(n, ELEMENTWISE_BLOCK) * ELEMENTWISE_BLOCK - 1


def elementwise_int64(n: int) -> bool:
    """``INT64`` of :func:`_lion_update` over ``n`` contiguous elements."""
    return needs_int64(_last_flat(n))


def sage_int64(n: int, cols: int, h_strides: tuple[int, int]) -> bool:
    """``INT64`` of :func:`_sage_update`: the flat index and ``H``'s strided offset."""
    last = _last_flat(n)
    return needs_int64(last, (last // cols) * h_strides[0] + (cols - 1) * h_strides[1])


def sinkgd_update_int64(shape: tuple[int, int, int], p_strides: tuple[int, ...],
                        g_strides: tuple[int, ...]) -> bool:
    """``INT64`` of :func:`_sinkgd_update` on ``(B, R, C)`` views of ``θ`` and ``G``."""
    _, rows, cols = shape
    last = _last_flat(math.prod(shape))
    b = last // cols // rows
    offsets = [last, b * rows + rows - 1, b * cols + cols - 1]
    for s_b, s_r, s_c in (p_strides, g_strides):
        offsets.append(b * s_b + (rows - 1) * s_r + (cols - 1) * s_c)
    return needs_int64(*offsets)


def sinkhorn_int64(shape: tuple[int, int, int], strides: tuple[int, ...],
                   blocks: tuple[int, int]) -> bool:
    """``INT64`` of a :func:`_sinkhorn_half` launch.

    ``shape = (B, N_OUT, N_RED)``, ``strides`` of ``G`` along them, ``blocks = (BLOCK_O,
    BLOCK_R)``.
    """
    bsz, n_out, n_red = shape
    outs = _cdiv(n_out, blocks[0]) * blocks[0] - 1
    reds = _cdiv(n_red, blocks[1]) * blocks[1] - 1
    b = bsz - 1
    return needs_int64(b * strides[0] + outs * strides[1] + reds * strides[2],
                       b * n_out + outs, b * n_red + reds)


# --- launchers ---------------------------------------------------------------------------


def sinkhorn_iterations(g: Tensor, c: Tensor, r: Tensor, m: Tensor, eps_first: Tensor,
                        hp: Tensor, num_iters: int) -> None:
    """Run ``num_iters`` Sinkhorn iterations of the ``(B, R, C)`` matrices ``g`` (any strides).

    ``c`` ``(B, C)`` and ``r`` ``(B, R)`` are the scale vectors (contiguous, in ``g``'s
    arithmetic dtype :func:`~sage_torch.common.wide`, updated in place), ``m`` ``(B,)`` the
    range scales, ``eps_first`` ``(B,)`` the ε of the first row half-iteration (``ε/m``),
    ``hp`` ``(t_in, t_out, ε, α, w)``, all in that dtype.  Two launches per iteration: the
    rows (a reduction over the fan-in), then the columns (over the fan-out), each program
    looping over the whole other axis (deterministic, no atomics); ``(G/m)²`` is formed
    tile by tile on chip, never stored.
    """
    bsz, rows, cols = g.shape
    is_f32 = c.dtype == torch.float32
    br, bc = SINKHORN_BLOCKS["rows"]
    cr, cc = SINKHORN_BLOCKS["cols"]
    s_b, s_r, s_c = g.stride()
    rows_64 = sinkhorn_int64((bsz, rows, cols), (s_b, s_r, s_c), (br, bc))
    cols_64 = sinkhorn_int64((bsz, cols, rows), (s_b, s_c, s_r), (cc, cr))
    t_in, t_out, eps = hp[0:], hp[1:], hp[2:]
    for it in range(int(num_iters)):
        # r over the rows, reducing over the columns (weights c), then c over the columns
        eps_r, eps_stride = (eps_first, 1) if it == 0 else (eps, 0)
        _launch(_sinkhorn_half, g.device, (bsz, _cdiv(rows, br)), g, r, c, m, eps_r,
                eps_stride, t_in, rows, cols, s_b, s_r, s_c, IS_F32=is_f32, INT64=rows_64,
                BLOCK_O=br, BLOCK_R=bc)
        _launch(_sinkhorn_half, g.device, (bsz, _cdiv(cols, cc)), g, c, r, m, eps, 0, t_out,
                cols, rows, s_b, s_c, s_r, IS_F32=is_f32, INT64=cols_64, BLOCK_O=cc,
                BLOCK_R=cr)


def sinkgd_update(p: Tensor, g: Tensor, c: Tensor, r: Tensor, half: Tensor, m_half: Tensor,
                  hp: Tensor, lr: Tensor, lr_is_tensor: bool = False) -> None:
    """``p ← p − lr·(α·((c/h)·g·(r/(m/h))) + w·p)`` for ``(B, R, C)`` views (any strides).

    ``c`` ``(B, C)``, ``r`` ``(B, R)``: the scales of :func:`sinkhorn_iterations`;
    ``half``, ``m_half`` ``(B,)``: the split of ``1/m``; ``hp[3:5] = (α, w)``;
    ``lr_is_tensor``: ``lr`` is the group's own tensor (``capturable=True``), which
    changes the rounding of bfloat16 parameters (:func:`_decayed`).
    """
    bsz, rows, cols = g.shape
    n = bsz * rows * cols
    bf16 = p.dtype == torch.bfloat16
    _launch(_sinkgd_update, g.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, r, c, half, m_half,
            hp, lr, n, rows, cols, *p.stride(), *g.stride(), IS_F32=c.dtype == torch.float32,
            BF16=bf16, LR_TENSOR=bf16 and lr_is_tensor,
            INT64=sinkgd_update_int64((bsz, rows, cols), p.stride(), g.stride()),
            BLOCK=ELEMENTWISE_BLOCK)


def sage_update(p: Tensor, g: Tensor, m: Tensor, h: Tensor, h_strides: tuple[int, int],
                cols: int, hp: Tensor, lr: Tensor, b2_zero: bool,
                lr_is_tensor: bool = False) -> None:
    """SAGE's element-wise update of contiguous ``p``, ``g``, ``m`` (``M`` updated in place).

    ``h``: the damper (in the arithmetic dtype), read at ``(k // cols)·h_strides[0] +
    (k % cols)·h_strides[1]`` for the flat index ``k``; ``hp = (1−b2, b2, b1, b2−b1, 1−b1,
    w)``; ``lr_is_tensor`` as :func:`sinkgd_update`.
    """
    n = p.numel()
    bf16 = p.dtype == torch.bfloat16
    _launch(_sage_update, p.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, m, h, hp, lr, n,
            cols, h_strides[0], h_strides[1], B2_ZERO=b2_zero, BF16=bf16,
            LR_TENSOR=bf16 and lr_is_tensor, INT64=sage_int64(n, cols, h_strides),
            BLOCK=ELEMENTWISE_BLOCK)


def lion_update(p: Tensor, g: Tensor, m: Tensor, hp: Tensor, lr: Tensor,
                lr_is_tensor: bool = False) -> None:
    """Lion's update of contiguous ``p``, ``g``, ``m``; ``hp = (1−b1, b1, 1−b2, b2, w)``.

    ``lr_is_tensor`` as :func:`sinkgd_update`.
    """
    n = p.numel()
    bf16 = p.dtype == torch.bfloat16
    _launch(_lion_update, p.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, m, hp, lr, n,
            BF16=bf16, LR_TENSOR=bf16 and lr_is_tensor, INT64=elementwise_int64(n),
            BLOCK=ELEMENTWISE_BLOCK)


def sweep_blocks(cols: int) -> tuple[int, int, int]:
    """``(BLOCK_ROWS, BLOCK_COLS, num_warps)`` of :func:`_sinkgd_sweep` for ``cols`` columns.

    A program holds whole rows: ``BLOCK_COLS`` is the power of two at least ``cols`` (at
    least 16) and ``BLOCK_ROWS`` as many rows as fit :data:`SWEEP_TILE` elements (at least
    one); the warps grow with the tile so that each thread holds at most 32 elements.
    """
    block_cols = 1 << (max(cols, 16) - 1).bit_length()
    block_rows = max(1, SWEEP_TILE // block_cols)
    warps = min(16, max(4, block_rows * block_cols // 1024))
    return block_rows, block_cols, warps


def sweep_tables(anchor: Tensor, mats: list[tuple[Tensor, Tensor, int]], block_rows: int
                 ) -> tuple[list[int], list[int], int, int]:
    """The descriptor and program tables of one sweep group (host lists of ints).

    ``mats``: ``(θ, G, b)``: matrix ``b`` of ``(B, OUT, IN)`` views (any strides) of
    ``anchor``'s dtype.  Offsets are in elements from ``anchor``'s address: the kernel
    reaches every matrix from that one pointer (a tensor of the optimizer's own, so that the
    tables keep no gradient alive).  Returns ``(desc, progs, n_r, n_c)``: :data:`SWEEP_DESC`
    int64 fields per matrix, a ``(matrix, first row)`` pair per program, and the sizes of
    the row and column buffers.
    """
    size = anchor.element_size()
    origin = anchor.data_ptr()
    desc: list[int] = []
    progs: list[int] = []
    n_r = n_c = 0
    for k, (p, g, b) in enumerate(mats):
        _, rows, cols = g.shape
        desc += [(g.data_ptr() - origin) // size + b * g.stride(0),
                 (p.data_ptr() - origin) // size + b * p.stride(0), rows, cols,
                 g.stride(1), g.stride(2), p.stride(1), p.stride(2), n_r, n_c]
        for row0 in range(0, rows, block_rows):
            progs += [k, row0]
        n_r += rows
        n_c += cols
    return desc, progs, n_r, n_c


def sinkgd_sweeps(base: Tensor, desc: Tensor, progs: Tensor, n_r: int, n_c: int, hp: Tensor,
                  lr: Tensor, num_iters: int, sqrt: bool, blocks: tuple[int, int, int],
                  lr_is_tensor: bool = False) -> None:
    """SinkGD's step of one group of matrices: ``num_iters`` sweeps, then the apply sweep.

    ``base``: the anchor of :func:`sweep_tables` (its dtype is the matrices');
    ``desc``, ``progs``: :func:`sweep_tables`' tables as device tensors (int64, int32);
    ``hp = (ε, α, w)`` in the arithmetic dtype; ``blocks``: :func:`sweep_blocks` of the
    group's widest matrix.  ``num_iters + 1`` launches over the same programs; the scale
    vectors and column sums live in one zeroed buffer (``n_r`` rows and ``(2·L + 1)·n_c``
    columns' worth), the only memory the step allocates.
    """
    block_rows, block_cols, warps = blocks
    w = hp.dtype
    buf = torch.zeros(2 * n_r + (2 * num_iters + 1) * n_c, dtype=w, device=base.device)
    r, ia = buf[:n_r], buf[n_r:2 * n_r]
    c = buf[2 * n_r:2 * n_r + (num_iters + 1) * n_c]
    cs = buf[2 * n_r + (num_iters + 1) * n_c:]
    grid = (progs.numel() // 2,)
    bf16 = base.dtype == torch.bfloat16
    for it in range(int(num_iters) + 1):
        _launch(_sinkgd_sweep, base.device, grid, base, desc, progs, r, ia, c, cs, hp, lr, it,
                n_c, FIRST=it == 0, APPLY=it == num_iters, SQRT=sqrt,
                IS_F32=w == torch.float32, BF16=bf16, LR_TENSOR=bf16 and lr_is_tensor,
                BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps)
