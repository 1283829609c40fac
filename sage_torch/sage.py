"""SAGE, Sign-Adaptive GradiEnt (paper Algorithm 1 with the instantaneous damper).

The :class:`SAGE` optimizer, its rule (:class:`SageRule`), the damper
(:func:`sage_damper`) and the step functions in ``torch.optim``'s shape, all taking keyword
hyperparameters: :func:`_single_tensor_sage` (tensor by tensor), :func:`_multi_tensor_sage`
(``torch._foreach_*`` over the group, with the reductions of ``s``, ``σ`` and ``γ`` run once
for all parameters of the same device, dtype, shape and axes, stacked into one batched
tensor) and :func:`_chunked_sage` (the in-place CPU path of :mod:`sage_torch.chunked`).
``docs/algorithms.md`` states the math; it is that of :mod:`sage_optax`, in the same order
of floating-point operations where it matters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sage_optim.numerics import mean_scale
from sage_optim.presets import PRESETS, RULE_DEFAULTS
from sage_torch import chunked, fused_check
from sage_torch.common import (
    Axes,
    ConstCache,
    UpdateRule,
    axis_group,
    bias_correction,
    by_device_dtype,
    copy_all,
    decayed_step,
    is_dtensor,
    lr_of,
    lr_tensor,
    pow2_floor,
    shared_docs,
    wide,
)
from sage_torch.optimizer import ParamsT, RuleOptimizer
from sage_torch.registry import register

_SAGE = RULE_DEFAULTS["sage"]

ReduceDim = int | tuple[int, ...] | None
"""The fan-out dim(s) ``s`` averages over; ``None``: element-wise (vectors)."""


def _mean_abs(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """``mean(|x|)`` over ``dim``, finite for every finite ``x`` (``numerics.mean_scale``)."""
    dims = dim if isinstance(dim, tuple) else (dim,)
    c = mean_scale(math.prod([x.shape[d] for d in dims]))  # a list: torch.compile traces it
    if c == 1.0:
        return x.abs().mean(dim=dim)
    return x.abs().mul_(c).mean(dim=dim).div_(c)


def _rms_nonneg(x: Tensor) -> Tensor:
    """``sqrt(mean(x²))`` over every entry of ``x ≥ 0`` (0-D), as ``m · sqrt(mean((x/m)²))``.

    ``m`` (:func:`~sage_torch.common.pow2_floor`) is a power of two within a factor 2 of
    ``max x``, so the
    squares are in range for every finite ``x`` (a plain ``x²`` overflows float32 from
    ``x ≈ 1.8e19``); dividing by a power of two is exact and the root of ``y/m²`` is
    ``sqrt(y)/m``, so where ``x²`` is in range the result is bit for bit the plain
    formula's (the same reduction, on the same shape).
    """
    if x.numel() == 0:
        return x.square().mean()
    m = pow2_floor(x.amax(), edges=False)
    return (x / m).square().mean().sqrt().mul(m)


def sage_damper(s: Tensor, s_hat: Tensor, eps: float, damper: str = "both",
                dims: tuple[int, ...] | None = None) -> Tensor:
    """SAGE's ``H = min(σ/(Ŝ+ε), γ/(s+ε), 1)`` with σ, γ the RMS of ``Ŝ`` and ``s``.

    ``dims``: the dims the RMS averages over (default: every entry); the others are batch
    dims (stacked layers, or the stacked parameters of :func:`_multi_tensor_sage`), each
    with its own σ and γ.  Finite for every finite ``s ≥ 0`` and ``Ŝ ≥ 0``: σ and γ are
    ``m · sqrt(mean((x/m)²))`` with ``m`` a power of two near the largest entry
    (:func:`~sage_torch.common.pow2_floor`; per batch index), so no square overflows, and
    where the plain
    squares are in range the values are the plain formula's (scaling by a power of two is
    exact, through the root too).  With ``dims``, both RMS values are computed at once, on
    ``Ŝ`` and ``s`` stacked (one ``m`` for both; the kernels of one of them): the same
    numbers up to the order of summation, which torch may choose differently for the
    stacked shape when it splits a long reduction over several threads.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1, the EMA damper; Appendix "Instantaneous Stability", the instantaneous
      one).
    """
    use_ema, use_inst = damper in ("both", "ema"), damper in ("both", "instant")
    if not (use_ema or use_inst):
        return torch.ones_like(s)
    if dims is None:  # one σ and one γ over every entry: the plain formula's reductions
        terms = ([_rms_nonneg(s_hat) / (s_hat + eps)] if use_ema else []) + (
            [_rms_nonneg(s) / (s + eps)] if use_inst else [])
        h = terms[0].clamp_max(1)  # min(x, 1), NaN kept as torch.minimum keeps it
        return h if len(terms) == 1 else torch.minimum(h, terms[1])
    srcs = ([s_hat] if use_ema else []) + ([s] if use_inst else [])
    x = torch.stack(srcs) if len(srcs) == 2 else srcs[0].unsqueeze(0)  # (k, *s.shape)
    rd = tuple(d + 1 for d in dims)
    if rd:
        m = pow2_floor(x.amax(dim=(0, *rd), keepdim=True), edges=False)
        r = (x / m).square().mean(dim=rd, keepdim=True).sqrt().mul(m)  # σ and γ
    else:  # one entry per batch index: sqrt(x²) is x
        r = x
    h = (r / (x + eps)).clamp_max(1)  # min(x, 1), NaN kept
    return h.amin(0)  # the smaller term (NaN kept: amin propagates it)


def _broadcast_h(h: Tensor, dim: ReduceDim, shape: Sequence[int], batch: int = 0) -> Tensor:
    """``H`` (the reduced shape) broadcastable against the parameter (``batch`` leading dims)."""
    if isinstance(dim, tuple):  # a group of fan-out dims: broadcast over all of them
        return h.reshape([*h.shape[:batch],
                          *(1 if a in dim else n for a, n in enumerate(shape))])
    if dim is not None:
        return h.unsqueeze(dim + batch)
    return h


def _single_tensor_sage(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                        scale_avgs: list[Tensor], state_steps: list[Tensor], *,
                        reduce_dims: list[ReduceDim], rms_dims: list[tuple[int, ...] | None],
                        lr: float | Tensor,
                        beta1: float, beta2: float, eps: float, weight_decay: float,
                        damper: str) -> None:
    """One SAGE step, tensor by tensor (``state_steps``: already incremented).

    ``reduce_dims[i]``: the fan-out dim(s) of parameter ``i`` (``None``: element-wise);
    ``rms_dims[i]``: the dims of its ``s`` that σ and γ average over (``None``: all).
    """
    updates, new_m = [], []
    for p, g, m, S, t, dim, rdims in zip(params, grads, exp_avgs, scale_avgs, state_steps,
                                         reduce_dims, rms_dims, strict=True):
        w = wide(g.dtype)
        g32, m32 = g.to(w), m.to(w)
        s = g32.abs() if dim is None else _mean_abs(g32, dim)
        S.mul_(beta2).add_(s.to(S.dtype), alpha=1 - beta2)
        s_hat = S.to(s.dtype) / bias_correction(beta2, t, s.dtype)
        h = _broadcast_h(sage_damper(s, s_hat, eps, damper, rdims), dim, p.shape)
        m_new = g32 * (1 - beta2) + m32 * beta2
        # sign(b1·M_{t−1} + (1−b1)·g), read from M_t as sage_optax.lion_direction does
        # (the same rounding in both frameworks).
        arg = (g32 * (1.0 - beta1) + m32 * beta1 if beta2 == 0
               else m_new * beta1 + g32 * (beta2 - beta1))
        updates.append((torch.sign(arg) * h).to(p.dtype))
        new_m.append(m_new)
    # One copy_ per tensor: DTensor has no _foreach_copy_ strategy.
    for m, n in zip(exp_avgs, new_m, strict=True):
        m.copy_(n)
    if params:
        decayed_step(params, updates, lr, weight_decay, False)


def _stack(xs: list[Tensor]) -> Tensor:
    """``xs`` stacked on a new dim 0 (a view for a single tensor: no copy)."""
    return xs[0].unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _dampers(params: list[Tensor], g32: list[Tensor], scale_avgs: list[Tensor],
             state_steps: list[Tensor], *, reduce_dims: list[ReduceDim],
             rms_dims: list[tuple[int, ...] | None], beta2: float, eps: float,
             damper: str) -> list[Tensor]:
    """Update every ``S`` in place and return each parameter's damper ``H`` (broadcastable).

    The reductions of the multi-tensor and fused paths: the parameters are bucketed by
    shape, axes and ``S``'s dtype, each bucket's ``s``, ``Ŝ`` and damper computed once on
    the stacked ``(B, ...)`` tensors; the bias corrections ``1 − b2^t`` come from the step
    tensors (``torch._foreach_pow``), so no host synchronisation.  ``g32``: the gradients
    in the wide dtype.
    """
    w = g32[0].dtype
    # 1 − b2^t per parameter, as bias_correction (float32 steps; cast for float64)
    steps = [t if t.dtype == w else t.to(w) for t in state_steps]
    bias2 = list(torch._foreach_pow(beta2, steps))
    torch._foreach_neg_(bias2)
    torch._foreach_add_(bias2, 1)
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, S) in enumerate(zip(params, scale_avgs, strict=True)):
        key = (tuple(p.shape), reduce_dims[i], rms_dims[i], S.dtype)
        buckets.setdefault(key, []).append(i)
    h_all: list[Tensor] = [g32[0]] * len(params)  # placeholders, all replaced below
    for (shape, dim, rdims, s_dtype), idx in buckets.items():
        gb = _stack([g32[i] for i in idx])
        if dim is None:
            s = gb.abs()
        else:
            s = _mean_abs(gb, tuple(d + 1 for d in dim) if isinstance(dim, tuple) else dim + 1)
        S_list = [scale_avgs[i] for i in idx]
        torch._foreach_mul_(S_list, beta2)
        s_parts = list(s.to(s_dtype).unbind(0))
        torch._foreach_add_(S_list, s_parts, alpha=1 - beta2)
        # (steps on the CPU unless capturable: a non-blocking copy, so that the host does
        # not wait here for the GPU to finish the work queued before it)
        bc = _stack([bias2[i] for i in idx]).to(device=s.device, non_blocking=True)
        bc = bc.view([len(idx)] + [1] * (s.dim() - 1))
        s_hat = _stack(S_list).to(s.dtype) / bc
        dims = (tuple(range(1, s.dim())) if rdims is None
                else tuple(d + 1 for d in rdims))
        h = _broadcast_h(sage_damper(s, s_hat, eps, damper, dims), dim, shape, batch=1)
        for i, hi in zip(idx, h.unbind(0), strict=True):
            h_all[i] = hi
    return h_all


def _multi_tensor_sage(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                       scale_avgs: list[Tensor], state_steps: list[Tensor], *,
                       reduce_dims: list[ReduceDim], rms_dims: list[tuple[int, ...] | None],
                       lr: float | Tensor,
                       beta1: float, beta2: float, eps: float, weight_decay: float,
                       damper: str) -> None:
    """One SAGE step with ``torch._foreach_*`` kernels and batched reductions.

    The parameters are bucketed by device, dtype, shape and axes; each bucket's ``s``,
    ``Ŝ`` and damper are computed once on the stacked ``(B, ...)`` tensors, and the
    element-wise parts (``M``, the sign, ``H``, the decayed step) run as foreach kernels
    over the whole list.  No host synchronisation: the bias corrections are computed from
    the step tensors (``torch._foreach_pow``) as in :func:`_single_tensor_sage`, with the
    same operations, so both paths agree to rounding.  DTensors (FSDP2) take the
    single-tensor path.
    """
    if not params:
        return
    if any(is_dtensor(p) or is_dtensor(g) for p, g in zip(params, grads, strict=True)):
        _single_tensor_sage(params, grads, exp_avgs, scale_avgs, state_steps,
                            reduce_dims=reduce_dims, rms_dims=rms_dims, lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, damper=damper)
        return
    w = wide(grads[0].dtype)  # RuleOptimizer splits a foreach group by device and dtype
    g32 = [g if g.dtype == w else g.to(w) for g in grads]
    in_place = all(m.dtype == w for m in exp_avgs)  # else M is kept in another dtype
    m32 = [m if m.dtype == w else m.to(w) for m in exp_avgs]
    # The sign's argument, as _single_tensor_sage (M_{t−1} for b2 = 0, else M_t), and
    # M_t = g·(1−b2) + M·b2, in place when M has the wide dtype (M·b2 + g·(1−b2), the same
    # number since addition commutes): at most two temporaries of each tensor at once.
    if beta2 == 0:
        arg = list(torch._foreach_mul(g32, 1.0 - beta1))
        torch._foreach_add_(arg, torch._foreach_mul(m32, beta1))
    if in_place:
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, torch._foreach_mul(g32, 1 - beta2))
        m_new = exp_avgs
    else:
        m_new = list(torch._foreach_mul(g32, 1 - beta2))
        torch._foreach_add_(m_new, torch._foreach_mul(m32, beta2))
    if beta2 != 0:
        arg = list(torch._foreach_mul(m_new, beta1))
        torch._foreach_add_(arg, torch._foreach_mul(g32, beta2 - beta1))
    torch._foreach_sign_(arg)
    h_all = _dampers(params, g32, scale_avgs, state_steps, reduce_dims=reduce_dims,
                     rms_dims=rms_dims, beta2=beta2, eps=eps, damper=damper)
    torch._foreach_mul_(arg, h_all)
    updates = [u if u.dtype == p.dtype else u.to(p.dtype)
               for u, p in zip(arg, params, strict=True)]
    if not in_place:
        copy_all(exp_avgs, m_new)
    decayed_step(params, updates, lr, weight_decay, True)


def _fused_sage(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                scale_avgs: list[Tensor], state_steps: list[Tensor], *,
                reduce_dims: list[ReduceDim], rms_dims: list[tuple[int, ...] | None],
                lr: float | Tensor, beta1: float, beta2: float, eps: float,
                weight_decay: float, damper: str, consts: ConstCache | None = None) -> None:
    """One SAGE step whose element-wise part is one Triton kernel per tensor.

    The reductions (``s``, ``S``, ``σ``, ``γ``, the damper ``H``) run as in
    :func:`_multi_tensor_sage` (:func:`_dampers`); then one kernel per parameter reads
    ``g``, ``M``, ``θ`` and ``H`` once and writes ``M ← g·(1−b2) + M·b2`` and
    ``θ ← θ − η·(sign(b1·M + (b2−b1)·g)·H + w·θ)``, the operations of
    :func:`_single_tensor_sage` (:mod:`sage_torch.triton_kernels`; bfloat16 in float32,
    rounded as that function rounds).  Contiguous parameters of at most two dims (or
    element-wise ones of any shape) whose gradient and ``M`` share their dtype take the
    kernel; the others (grouped fan-out dims, batch dims, ``mu_dtype``, non-contiguous)
    take :func:`_multi_tensor_sage`.  Parameters on several devices or of several dtypes
    are stepped one device and dtype at a time (every launch's tensors on its device).
    """
    from sage_torch import triton_kernels as tk

    consts = ConstCache() if consts is None else consts
    hp: dict[str, Any] = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                          "weight_decay": weight_decay, "damper": damper}
    parts = by_device_dtype(params)
    if len(parts) > 1:
        for idx in parts:
            _fused_sage(*([xs[i] for i in idx] for xs in (params, grads, exp_avgs, scale_avgs,
                                                          state_steps)),
                        reduce_dims=[reduce_dims[i] for i in idx],
                        rms_dims=[rms_dims[i] for i in idx], consts=consts, **hp)
        return
    ok: list[int] = []
    rest: list[int] = []
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs, strict=True)):
        dim = reduce_dims[i]
        fits = (dim is None or (p.dim() == 2 and dim in (0, 1))) and rms_dims[i] is None
        same = all(t.dtype == p.dtype and t.shape == p.shape and t.is_contiguous()
                   and not is_dtensor(t) for t in (p, g, m))
        (ok if fits and same else rest).append(i)
    if rest:
        _multi_tensor_sage(*([xs[i] for i in rest] for xs in (params, grads, exp_avgs,
                                                                scale_avgs, state_steps)),
                           reduce_dims=[reduce_dims[i] for i in rest],
                           rms_dims=[rms_dims[i] for i in rest], **hp)
    if not ok:
        return
    ps, gs = [params[i] for i in ok], [grads[i] for i in ok]
    p0 = ps[0]
    w = wide(p0.dtype)
    g32 = [g if g.dtype == w else g.to(w) for g in gs]
    h_all = _dampers(ps, g32, [scale_avgs[i] for i in ok], [state_steps[i] for i in ok],
                     reduce_dims=[reduce_dims[i] for i in ok], rms_dims=[rms_dims[i] for i in ok],
                     beta2=beta2, eps=eps, damper=damper)
    del g32
    hpt = consts.get((1 - beta2, beta2, beta1, beta2 - beta1, 1.0 - beta1, weight_decay), w,
                     p0.device)
    lr_t = lr_tensor(lr, p0)
    for i, p, g, h in zip(ok, ps, gs, h_all, strict=True):
        if p.numel() == 0:
            continue
        if reduce_dims[i] is None:  # H has p's shape: read it flat
            h, strides, cols = h.contiguous(), (0, 1), p.numel()
        else:  # (1, C) or (R, 1): broadcast by a zero stride
            he = h.expand(p.shape)
            strides, cols = (he.stride(0), he.stride(1)), p.shape[1]
        tk.sage_update(p, g, exp_avgs[i], h, strides, cols, hpt, lr_t, beta2 == 0,
                       lr_is_tensor=isinstance(lr, Tensor))


def _chunked_sage(p: Tensor, g: Tensor, m: Tensor, S: Tensor, step: Tensor, *,
                  reduce_dim: int | None, rms_dims: tuple[int, ...] | None, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float, damper: str,
                  threads: int = 1) -> None:
    """One step of one plain CPU parameter, chunk by chunk (:mod:`sage_torch.chunked`).

    Pass 1 reduces ``|g|·c`` over the vocab dim (``s``: a partial sum per chunk, then their
    sum, as ``mean``, then ``/c``; ``c`` of :func:`sage_optim.numerics.mean_scale`, so that the sums
    stay finite); pass 2 updates ``M``, forms ``sign(b1·M_t + (b2−b1)·g)·H`` and
    applies it with the decay, all on one chunk at a time, with the operations (and so the
    rounding) of the whole-tensor path.
    """
    dim = reduce_dim
    c = 1.0 if dim is None else mean_scale(p.shape[dim])  # |g|·c: sums stay finite
    if dim is None:
        s = g.abs()
    elif dim == 0:
        n_chunks = len(chunked.chunks(p))
        partial = torch.empty((n_chunks, *p.shape[1:]), dtype=p.dtype)

        def reduce(k: int, i: int, j: int, a: Tensor, _: Tensor) -> None:
            torch.abs(g[i:j], out=a)
            if c != 1.0:
                a.mul_(c)
            torch.sum(a, dim=0, out=partial[k])

        chunked.for_chunks(p, reduce, threads)
        s = partial.sum(dim=0).div_(p.shape[0])
    else:
        s = torch.empty((*p.shape[:dim], *p.shape[dim + 1:]), dtype=p.dtype)

        def reduce(k: int, i: int, j: int, a: Tensor, _: Tensor) -> None:
            torch.abs(g[i:j], out=a)
            if c != 1.0:
                a.mul_(c)
            torch.mean(a, dim=dim, out=s[i:j])

        chunked.for_chunks(p, reduce, threads)
    if c != 1.0:
        s.div_(c)
    S.mul_(beta2).add_(s.to(S.dtype), alpha=1 - beta2)
    s_hat = S.to(s.dtype) / bias_correction(beta2, step, s.dtype)
    h = _broadcast_h(sage_damper(s, s_hat, eps, damper, rms_dims), dim, p.shape)

    def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
        gi, mi, pi = g[i:j], m[i:j], p[i:j]
        hi = h if h.shape[0] == 1 else h[i:j]
        torch.mul(gi, 1 - beta2, out=t)  # M_t = g·(1−b2) + M·b2
        mi.mul_(beta2).add_(t)
        torch.mul(mi, beta1, out=u)  # b1·M_t + (b2−b1)·g
        torch.mul(gi, beta2 - beta1, out=t)
        u.add_(t).sign_().mul_(hi)
        chunked.decay_and_apply(u, pi, lr, weight_decay)

    chunked.for_chunks(p, update, threads)


@register
class SageRule(UpdateRule):
    """SAGE (Algorithm 1 + instantaneous damper): ``u = sign(b1·M + (1−b1)·g) ⊙ H``."""

    name = "sage"

    complex_why = ("takes the signs of real numbers and a damper of their magnitudes per "
                   "fan-out axis, which have no complex counterpart")

    checked = ("eps", "damper")

    has_fused = True

    def __init__(self) -> None:
        self._consts = ConstCache()  # _fused_sage's hyperparameter tensors

    @classmethod
    def check_fused(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """SAGE's fused path: an H per column, an H per row, and an element-wise vector."""
        ps, gs, ms = fused_check.problem([(24, 40), (16, 24), (40,)], device, dtype, 1)
        w = wide(dtype)
        scales = [torch.full(s, 0.75, dtype=w, device=device) for s in [(40,), (16,), (40,)]]
        kw: dict[str, Any] = {"reduce_dims": [0, 1, None], "rms_dims": [None, None, None],
                              "lr": fused_check.LR, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8,
                              "weight_decay": fused_check.WD, "damper": "both"}
        out: dict[str, tuple[list[Tensor], ...]] = {}
        for path, fn in (("fused", _fused_sage), ("single", _single_tensor_sage)):
            p, m, s = (fused_check.clones(xs) for xs in (ps, ms, scales))
            fn(p, gs, m, s, [torch.tensor(3.0) for _ in ps], **kw)
            out[path] = (p, m, s)
        return fused_check.first_error(ps, out, ("parameter", "exp_avg", "scale_avg"), dtype)

    def validate(self, group: dict[str, Any]) -> None:  # noqa: D102
        super().validate(group)
        mu = group.get("mu_dtype")
        if mu is not None and not (isinstance(mu, torch.dtype) and mu.is_floating_point):
            raise ValueError(f"mu_dtype must be None or a floating torch.dtype, got {mu!r}")

    def _reduce_dim(self, p: Tensor, group: dict[str, Any]) -> ReduceDim:
        """The fan-out dim (or dims) that ``s`` averages over; ``None``: element-wise.

        Element-wise for 0-D/1-D parameters and for groups with ``fan_out_dim=None`` (the
        ``vector`` groups of :func:`sage_torch.param_groups`, whatever the shape).
        """
        if p.dim() < 2 or group.get("fan_out_dim") is None:
            return None
        dims = axis_group(group["fan_out_dim"], p.dim(), "fan_out_dim")
        return dims[0] if len(dims) == 1 else dims

    def _rms_dims(self, p: Tensor, group: dict[str, Any]) -> tuple[int, ...] | None:
        """The dims of ``s`` that σ and γ average over: its fan-in dims, not batch dims.

        ``None`` (every entry) unless the parameter has batch dims (neither fan-in nor
        fan-out), which are averaged separately, as :mod:`sage_optax` does.
        """
        dim = self._reduce_dim(p, group)
        if dim is None:
            return None
        fan_out = dim if isinstance(dim, tuple) else (dim,)
        fan_in = axis_group(group["fan_in_dim"], p.dim(), "fan_in_dim")
        kept = [a for a in range(p.dim()) if a not in fan_out]
        if len(kept) == len(fan_in):
            return None
        return tuple(kept.index(a) for a in fan_in)

    def init_state(self, p: Tensor, group: dict[str, Any], name: str,  # noqa: D102
                   index: int = 0) -> dict[str, Tensor]:
        mu_dtype = group.get("mu_dtype") or p.dtype
        dim = self._reduce_dim(p, group)
        # S is created from the reduction of the parameter itself, so that its layout (and,
        # for a sharded DTensor parameter, its placement) is that of what step() computes.
        reduced = p.detach().to(wide(p.dtype))
        reduced = reduced if dim is None else reduced.mean(dim=dim)
        return {
            "exp_avg": torch.zeros_like(p, dtype=mu_dtype, memory_format=torch.preserve_format),
            "scale_avg": torch.zeros_like(reduced),
        }

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        b1, b2 = group["betas"]
        hp: dict[str, Any] = {"lr": lr_of(group), "beta1": b1, "beta2": b2,
                              "eps": group["eps"], "weight_decay": group["weight_decay"],
                              "damper": group["damper"]}
        if fused:
            _fused_sage(params, grads, [st["exp_avg"] for st in states],
                        [st["scale_avg"] for st in states], [st["step"] for st in states],
                        reduce_dims=[self._reduce_dim(p, group) for p in params],
                        rms_dims=[self._rms_dims(p, group) for p in params],
                        consts=self._consts, **hp)
            return
        rest = []
        for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
            dim = self._reduce_dim(p, group)
            if (b2 != 0 and not isinstance(dim, tuple) and not group.get("capturable", False)
                    and chunked.use_fast_path(p, g, st["exp_avg"])):
                _chunked_sage(p, g, st["exp_avg"], st["scale_avg"], st["step"],
                              reduce_dim=dim, rms_dims=self._rms_dims(p, group),
                              threads=self.cpu_threads, **hp)
            else:
                rest.append(i)
        if len(rest) < len(params):
            params, grads, states = ([xs[i] for i in rest] for xs in (params, grads, states))
        fn = _multi_tensor_sage if foreach else _single_tensor_sage
        fn(params, grads, [st["exp_avg"] for st in states], [st["scale_avg"] for st in states],
           [st["step"] for st in states], reduce_dims=[self._reduce_dim(p, group) for p in params],
           rms_dims=[self._rms_dims(p, group) for p in params], **hp)


@shared_docs
class SAGE(RuleOptimizer):
    """SAGE, Sign-Adaptive GradiEnt (paper Algorithm 1; ``docs/algorithms.md``).

    ``θ ← θ − η·(C ⊙ H + w·θ)`` with ``C = sign(b1·M + (1−b1)·g)`` and the damper
    ``H = min(σ/(Ŝ+ε), γ/(s+ε), 1)``; ``s`` is the mean of ``|g|`` over the fan-out dim
    (dim 0 of ``nn.Embedding.weight`` ``(V, d)``: the vocab axis) for matrices and ``|g|``
    for vectors.  State: ``exp_avg`` (``M``) and ``scale_avg`` (``S``, float32 or wider).

    Args:
      params: parameters or param groups.
      lr: learning rate (paper: 2e-3 with cosine and 10% warmup).
      betas: ``(b1, b2)``; ``b1=0.891`` reproduces the authors' public code.
      eps: ε of the dampers.
      weight_decay: decoupled decay ``w``.
      damper: ``"both"`` (default), ``"ema"``, ``"instant"`` or ``"none"`` (Lion).
      mu_dtype: dtype of ``M`` (default: the parameter's).
      fan_out_dim: dim (or tuple of dims) ``s`` averages over for matrices; ``None``:
        element-wise for every shape.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path (default: on CUDA and under
        ``torch.compile``).
      {fused_doc}
      capturable: keep the step count on the parameters' device and accept a device tensor
        ``lr``, so the step reads nothing back to the host (CUDA graphs), as
        ``torch.optim.Adam``'s option.
      cpu_threads: threads of the chunked CPU path (default 1: none started).
      fallback: the rule for the parameters this one cannot treat (complex parameters):
        {fallback_doc}

    Examples:
      One step on an ``nn.Embedding(2, 2)`` table, the numbers of
      :func:`sage_optax.scale_by_sage`'s example: ``s``, the mean of ``|g|`` over the vocab
      dim, is ``[2, 3]``, so the second column is damped to ``H ≈ 0.85``:

      >>> import torch, sage_torch
      >>> emb = torch.nn.Embedding(2, 2)
      >>> with torch.no_grad():
      ...     _ = emb.weight.zero_()
      >>> opt = sage_torch.SAGE(emb.parameters(), lr=0.1, weight_decay=0.0)
      >>> emb.weight.grad = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
      >>> opt.step()
      >>> print(emb.weight.detach())
      tensor([[-0.1000, -0.0850],
              [-0.1000,  0.0850]])
      >>> print(opt.state[emb.weight]["scale_avg"].shape)
      torch.Size([2])

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1 and Appendix "Instantaneous Stability").

      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023 (Lion, the sign direction).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["sage-hybrid"].learning_rate,
                 betas: tuple[float, float] = (_SAGE["b1"], _SAGE["b2"]),
                 eps: float = _SAGE["eps"], weight_decay: float = _SAGE["weight_decay"], *,
                 damper: str = _SAGE["damper"], mu_dtype: torch.dtype | None = None,
                 fan_out_dim: Axes | None = -2, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, cpu_threads: int = 1,
                 fallback: str | dict[str, Any] | None = None) -> None:
        super().__init__(params, {
            "rule": "sage", "fallback": fallback, "lr": lr, "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay, "damper": damper, "mu_dtype": mu_dtype,
            "fan_out_dim": fan_out_dim, "maximize": maximize, "foreach": foreach,
            "fused": fused, "capturable": capturable,
        }, cpu_threads=cpu_threads)
