"""Triton kernels of the fused path (``fused=True``): SinkGD scales and update, SAGE, Lion.

Imported lazily (only by a fused step): :mod:`sage_torch` imports without ``triton``.  The
kernels are plain functions wrapped on first use, for the device of the tensors they run
on: compiled by Triton (``triton.runtime.jit.JITFunction``) for CUDA tensors, or run by
Triton's interpreter (``triton.runtime.interpreter.InterpretedFunction``) for CPU tensors,
which :func:`sage_torch.common.fused_unsupported` allows only under
``TRITON_INTERPRET=1`` (the CPU tests).
Both wrappers of a kernel are built directly, so the choice is made per call and does not
depend on the environment at import time.

The kernels call only Triton builtins (``tl.full``, ``tl.reduce`` with ``tl.sum``'s own
combine function, not the ``@jit`` helpers ``tl.zeros``/``tl.sum``): Triton 3.6 builds those
helpers for the interpreter or the compiler when ``triton`` is first imported, and in a
process where ``torch.compile`` imported it first they cannot be interpreted.

Every kernel computes in the parameters' dtype (float32 or float64, :data:`DTYPES`); the
hyperparameters come from a small tensor of that dtype (``hp``, rounded by torch exactly
as torch rounds a Python scalar in the reference paths), and the learning rate from a
one-element device tensor (``lr``), so a fused step reads nothing back to the host and
can be captured in a CUDA graph (``capturable=True``).  ``docs/algorithms.md`` states the
math; the kernels follow the operations of the single-tensor functions in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from torch import Tensor

ELEMENTWISE_BLOCK = 1024
"""Elements per program of the element-wise kernels."""

SINKHORN_BLOCKS = {"rows": (16, 256), "cols": (64, 64)}
"""``(BLOCK_R, BLOCK_C)`` tiles (rows, columns of ``G``) of the per-row and per-column
Sinkhorn reductions (:func:`_sinkhorn_half`)."""


# --- kernel bodies (wrapped by _kernel) -------------------------------------------------


def _sinkhorn_half(g_ptr, u_ptr, w_ptr, m_ptr, eps_ptr, eps_stride, t_ptr, N_OUT, N_RED,
                   s_gb, s_go, s_gr, IS_F32: tl.constexpr, BLOCK_O: tl.constexpr,
                   BLOCK_R: tl.constexpr):  # pragma: no cover - Triton
    """One Sinkhorn half-iteration for a block of output entries ``o`` of matrix ``b``.

    ``q_o = sqrt(Σ_k (G_ok/m)²·w_k²)`` over the reduced axis (tiles of ``G`` squared on
    chip), then ``u_o ← where(q > 0, u·t / (u·q + ε_b), u)`` with ``t = t_ptr[0]`` and
    ``ε_b = eps_ptr[b·eps_stride]``.  The rows half (``u = r``, ``w = c``, reducing over
    the fan-in columns) and the columns half (``u = c``, ``w = r``) are this kernel with
    the sizes and strides of the two axes swapped (:func:`sinkhorn_iterations`).
    """
    b = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    out_ok = outs < N_OUT
    m = tl.load(m_ptr + b)
    acc = tl.full((BLOCK_O,), 0.0, g_ptr.dtype.element_ty)
    for k0 in range(0, N_RED, BLOCK_R):
        reds = k0 + tl.arange(0, BLOCK_R)
        red_ok = reds < N_RED
        g = tl.load(g_ptr + b * s_gb + outs[:, None] * s_go + reds[None, :] * s_gr,
                    mask=out_ok[:, None] & red_ok[None, :], other=0.0)
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
                   BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """``θ ← θ − η·(α·((c_j/h)·G_ij·(r_i/(m/h))) + w·θ)`` element-wise; ``hp[3:5] = (α, w)``.

    ``h = half_ptr[b]`` and ``m/h = mh_ptr[b]`` split ``1/m`` between the scales (powers of
    two: the divisions are exact).
    """
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    b = idx // (R * C)
    rem = idx % (R * C)
    i = rem // C
    j = rem % C
    g = tl.load(g_ptr + b * s_gb + i * s_gr + j * s_gc, mask=ok, other=0.0)
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
    p = tl.load(p_ptr + p_off, mask=ok, other=0.0)
    alpha = tl.load(hp_ptr + 3)
    wd = tl.load(hp_ptr + 4)
    lr = tl.load(lr_ptr).to(p.dtype)
    u = ((c * g) * r) * alpha
    tl.store(p_ptr + p_off, p - lr * (u + wd * p), mask=ok)


def _sage_update(p_ptr, g_ptr, m_ptr, h_ptr, hp_ptr, lr_ptr, N, C, s_hr, s_hc,
                 B2_ZERO: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """SAGE's element-wise part on a contiguous ``(N/C, C)`` tensor, ``H`` broadcast by strides.

    ``M ← g·(1−b2) + M·b2``; ``u = sign(M·b1 + g·(b2−b1))·H`` (``sign(g·(1−b1) + M·b1)``
    with the old ``M`` when ``b2 = 0``); ``θ ← θ − η·(u + w·θ)``.
    ``hp = (1−b2, b2, b1, b2−b1, 1−b1, w)``.
    """
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    g = tl.load(g_ptr + idx, mask=ok, other=0.0)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0)
    p = tl.load(p_ptr + idx, mask=ok, other=0.0)
    h = tl.load(h_ptr + (idx // C) * s_hr + (idx % C) * s_hc, mask=ok, other=0.0)
    one_b2 = tl.load(hp_ptr)
    b2 = tl.load(hp_ptr + 1)
    b1 = tl.load(hp_ptr + 2)
    b2_b1 = tl.load(hp_ptr + 3)
    one_b1 = tl.load(hp_ptr + 4)
    wd = tl.load(hp_ptr + 5)
    lr = tl.load(lr_ptr).to(p.dtype)
    m_new = g * one_b2 + m * b2
    if B2_ZERO:
        arg = g * one_b1 + m * b1
    else:
        arg = m_new * b1 + g * b2_b1
    sign = tl.where(arg > 0, 1.0, tl.where(arg < 0, -1.0, 0.0)).to(p.dtype)
    sign = tl.where(arg != arg, arg, sign)  # NaN stays NaN, as torch.sign
    u = sign * h
    tl.store(m_ptr + idx, m_new, mask=ok)
    tl.store(p_ptr + idx, p - lr * (u + wd * p), mask=ok)


def _lion_update(p_ptr, g_ptr, m_ptr, hp_ptr, lr_ptr, N,
                 BLOCK: tl.constexpr):  # pragma: no cover - Triton
    """Lion element-wise: ``u = sign(g·(1−b1) + m·b1)``, ``m ← g·(1−b2) + m·b2``, decayed step.

    ``hp = (1−b1, b1, 1−b2, b2, w)``.
    """
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    g = tl.load(g_ptr + idx, mask=ok, other=0.0)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0)
    p = tl.load(p_ptr + idx, mask=ok, other=0.0)
    one_b1 = tl.load(hp_ptr)
    b1 = tl.load(hp_ptr + 1)
    one_b2 = tl.load(hp_ptr + 2)
    b2 = tl.load(hp_ptr + 3)
    wd = tl.load(hp_ptr + 4)
    lr = tl.load(lr_ptr).to(p.dtype)
    arg = g * one_b1 + m * b1
    u = tl.where(arg > 0, 1.0, tl.where(arg < 0, -1.0, 0.0)).to(p.dtype)
    u = tl.where(arg != arg, arg, u)
    tl.store(m_ptr + idx, g * one_b2 + m * b2, mask=ok)
    tl.store(p_ptr + idx, p - lr * (u + wd * p), mask=ok)


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
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


def _launch(fn: Callable[..., Any], device: torch.device, grid: tuple[int, ...],
            *args: tl.constexpr, **meta: tl.constexpr) -> None:
    _kernel(fn, device.type == "cpu")[grid](*args, **meta)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sinkhorn_iterations(g: Tensor, c: Tensor, r: Tensor, m: Tensor, eps_first: Tensor,
                        hp: Tensor, num_iters: int) -> None:
    """Run ``num_iters`` Sinkhorn iterations of the ``(B, R, C)`` matrices ``g`` (any strides).

    ``c`` ``(B, C)`` and ``r`` ``(B, R)`` are the scale vectors (contiguous, ``g``'s dtype,
    updated in place), ``m`` ``(B,)`` the range scales, ``eps_first`` ``(B,)`` the ε of the
    first row half-iteration (``ε/m``), ``hp`` ``(t_in, t_out, ε, α, w)``.  Two launches
    per iteration: the rows (a reduction over the fan-in), then the columns (over the
    fan-out), each program looping over the whole other axis (deterministic, no atomics);
    ``(G/m)²`` is formed tile by tile on chip, never stored.
    """
    bsz, rows, cols = g.shape
    is_f32 = g.dtype == torch.float32
    br, bc = SINKHORN_BLOCKS["rows"]
    cr, cc = SINKHORN_BLOCKS["cols"]
    s_b, s_r, s_c = g.stride()
    t_in, t_out, eps = hp[0:], hp[1:], hp[2:]
    for it in range(int(num_iters)):
        # r over the rows, reducing over the columns (weights c), then c over the columns
        eps_r, eps_stride = (eps_first, 1) if it == 0 else (eps, 0)
        _launch(_sinkhorn_half, g.device, (bsz, _cdiv(rows, br)), g, r, c, m, eps_r,
                eps_stride, t_in, rows, cols, s_b, s_r, s_c, IS_F32=is_f32, BLOCK_O=br,
                BLOCK_R=bc)
        _launch(_sinkhorn_half, g.device, (bsz, _cdiv(cols, cc)), g, c, r, m, eps, 0, t_out,
                cols, rows, s_b, s_c, s_r, IS_F32=is_f32, BLOCK_O=cc, BLOCK_R=cr)


def sinkgd_update(p: Tensor, g: Tensor, c: Tensor, r: Tensor, half: Tensor, m_half: Tensor,
                  hp: Tensor, lr: Tensor) -> None:
    """``p ← p − lr·(α·((c/h)·g·(r/(m/h))) + w·p)`` for ``(B, R, C)`` views (any strides).

    ``c`` ``(B, C)``, ``r`` ``(B, R)``: the scales of :func:`sinkhorn_iterations`;
    ``half``, ``m_half`` ``(B,)``: the split of ``1/m``; ``hp[3:5] = (α, w)``.
    """
    bsz, rows, cols = g.shape
    n = bsz * rows * cols
    _launch(_sinkgd_update, g.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, r, c, half, m_half,
            hp, lr, n, rows, cols, *p.stride(), *g.stride(), IS_F32=g.dtype == torch.float32,
            BLOCK=ELEMENTWISE_BLOCK)


def sage_update(p: Tensor, g: Tensor, m: Tensor, h: Tensor, h_strides: tuple[int, int],
                cols: int, hp: Tensor, lr: Tensor, b2_zero: bool) -> None:
    """SAGE's element-wise update of contiguous ``p``, ``g``, ``m`` (``M`` updated in place).

    ``h``: the damper, read at ``(k // cols)·h_strides[0] + (k % cols)·h_strides[1]`` for
    the flat index ``k``; ``hp = (1−b2, b2, b1, b2−b1, 1−b1, w)``.
    """
    n = p.numel()
    _launch(_sage_update, p.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, m, h, hp, lr, n,
            cols, h_strides[0], h_strides[1], B2_ZERO=b2_zero, BLOCK=ELEMENTWISE_BLOCK)


def lion_update(p: Tensor, g: Tensor, m: Tensor, hp: Tensor, lr: Tensor) -> None:
    """Lion's update of contiguous ``p``, ``g``, ``m``; ``hp = (1−b1, b1, 1−b2, b2, w)``."""
    n = p.numel()
    _launch(_lion_update, p.device, (_cdiv(n, ELEMENTWISE_BLOCK),), p, g, m, hp, lr, n,
            BLOCK=ELEMENTWISE_BLOCK)
