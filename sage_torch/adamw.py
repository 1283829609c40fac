"""The AdamW rule, as ``optax.adamw`` (and ``torch.optim.AdamW``): bias-corrected ``m̂/(√v̂+ε)``.

The rule of the ``adamw`` configuration (and of ``vector="adamw"`` overrides), in
``torch.optim``'s shape: :func:`_single_tensor_adamw`, :func:`_multi_tensor_adamw` and
:func:`_chunked_adamw` (the in-place CPU path), all taking keyword hyperparameters.  For a
plain AdamW optimizer use ``torch.optim.AdamW``; this rule exists so that one
:class:`sage_torch.RuleOptimizer` can mix it with the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sage_torch import chunked, fused_check
from sage_torch.common import (
    UpdateRule,
    bias_correction,
    by_device_dtype,
    decayed_step,
    lr_of,
    wide,
)
from sage_torch.registry import register


def _single_tensor_adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                         exp_avg_sqs: list[Tensor], state_steps: list[Tensor], *,
                         lr: float | Tensor, beta1: float, beta2: float, eps: float,
                         weight_decay: float) -> None:
    """One AdamW step, tensor by tensor (``state_steps``: already incremented)."""
    updates = []
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
        c1, c2 = bias_correction(beta1, t, wide(p.dtype)), bias_correction(beta2, t, wide(p.dtype))
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        updates.append((m / c1) / ((v / c2).sqrt() + eps))
    decayed_step(params, updates, lr, weight_decay, False)


def _multi_tensor_adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                        exp_avg_sqs: list[Tensor], state_steps: list[Tensor], *,
                        lr: float | Tensor, beta1: float, beta2: float, eps: float,
                        weight_decay: float) -> None:
    """One AdamW step with ``torch._foreach_*`` kernels (the operations of the single path)."""
    if not params:
        return
    # 1 − b^t per parameter with the operations of bias_correction, one kernel each
    w = wide(params[0].dtype)  # RuleOptimizer splits a foreach group by device and dtype
    steps = [t if t.dtype == w else t.to(w) for t in state_steps]
    bias1, bias2 = list(torch._foreach_pow(beta1, steps)), list(torch._foreach_pow(beta2, steps))
    for bias in (bias1, bias2):
        torch._foreach_neg_(bias)
        torch._foreach_add_(bias, 1)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # (m / c1) / (sqrt(v / c2) + eps) with two temporaries per tensor, computed in place
    # (the same operations, so the same rounding, as the single path)
    updates = list(torch._foreach_div(exp_avgs, bias1))
    denom = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(updates, denom)
    del denom
    decayed_step(params, updates, lr, weight_decay, True)


def _fused_adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                 exp_avg_sqs: list[Tensor], state_steps: list[Tensor], *,
                 lr: float | Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float) -> None:
    """One AdamW step by ``torch._fused_adamw_`` (``torch.optim.AdamW(fused=True)``'s kernel).

    One launch for all the tensors of a device and dtype (torch's multi-tensor kernel); the
    same math as :func:`_single_tensor_adamw` (``θ(1 − ηw) − η·m̂/(√v̂ + ε)``), rounded as
    torch's kernel rounds it.  Step counts kept on the CPU (``capturable=False``) reach the
    device in one non-blocking copy.  bfloat16 parameters take :func:`_multi_tensor_adamw`
    (torch's kernel does not round the update to bfloat16 where the other paths do).
    """
    for idx in by_device_dtype(params):
        ps = [params[i] for i in idx]
        device = ps[0].device
        if ps[0].dtype == torch.bfloat16:
            _multi_tensor_adamw(ps, *([xs[i] for i in idx] for xs in (grads, exp_avgs,
                                                                       exp_avg_sqs, state_steps)),
                                lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay)
            continue
        steps = [state_steps[i] for i in idx]
        if any(t.device != device for t in steps):
            steps = list(torch.stack([t.to(torch.float32) for t in steps]).to(
                device, non_blocking=True).unbind(0))
        torch._fused_adamw_(ps, [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                            [exp_avg_sqs[i] for i in idx], [], steps, amsgrad=False,
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                            eps=eps, maximize=False, grad_scale=None, found_inf=None)


def _chunked_adamw(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float,
                   threads: int = 1) -> None:
    """The single-tensor step on one chunk at a time (:mod:`sage_torch.chunked`)."""
    c1 = bias_correction(beta1, step, p.dtype)
    c2 = bias_correction(beta2, step, p.dtype)

    def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
        gi, mi, vi, pi = g[i:j], m[i:j], v[i:j], p[i:j]
        mi.lerp_(gi, 1 - beta1)
        vi.mul_(beta2).addcmul_(gi, gi, value=1 - beta2)
        torch.div(vi, c2, out=t)  # (m / c1) / ((v / c2).sqrt() + eps)
        t.sqrt_().add_(eps)
        torch.div(mi, c1, out=u)
        u.div_(t)
        chunked.decay_and_apply(u, pi, lr, weight_decay)

    chunked.for_chunks(p, update, threads)


@register
class AdamWRule(UpdateRule):
    """AdamW as ``optax.adamw`` (and ``torch.optim.AdamW``): bias-corrected ``m̂/(√v̂+ε)``."""

    name = "adamw"

    complex_ok = True

    layout_free = True

    checked = ("eps",)

    has_fused = True

    @classmethod
    def check_fused(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """AdamW's fused path (``torch._fused_adamw_``): a vector and a matrix, two steps."""
        ps, gs, _ = fused_check.problem([(1100,), (24, 40)], device, dtype, 4)
        kw: dict[str, Any] = {"lr": fused_check.LR, "beta1": 0.9, "beta2": 0.99,
                              "eps": 1e-8, "weight_decay": fused_check.WD}
        out: dict[str, tuple[list[Tensor], ...]] = {}
        for path, fn in (("fused", _fused_adamw), ("single", _single_tensor_adamw)):
            p = fused_check.clones(ps)
            m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
            for t in (1.0, 2.0):
                steps = [torch.tensor(t, device=device) for _ in p]
                fn(p, gs, m, v, steps, **kw)
            out[path] = (p, m, v)
        return fused_check.first_error(ps, out, ("parameter", "exp_avg", "exp_avg_sq"), dtype)

    def init_state(self, p, group, name, index=0):  # noqa: D102
        return {
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        b1, b2 = group["betas"]
        hp: dict[str, Any] = {"lr": lr_of(group), "beta1": b1, "beta2": b2,
                              "eps": group["eps"], "weight_decay": group["weight_decay"]}
        if fused:
            _fused_adamw(params, grads, [st["exp_avg"] for st in states],
                         [st["exp_avg_sq"] for st in states], [st["step"] for st in states],
                         **hp)
            return
        if not group.get("capturable", False):
            params, grads, states = chunked.split_fast(
                params, grads, states, ("exp_avg", "exp_avg_sq"),
                lambda p, g, st: _chunked_adamw(p, g, st["exp_avg"], st["exp_avg_sq"],
                                                st["step"], threads=self.cpu_threads, **hp))
        fn = _multi_tensor_adamw if foreach else _single_tensor_adamw
        fn(params, grads, [st["exp_avg"] for st in states],
           [st["exp_avg_sq"] for st in states], [st["step"] for st in states], **hp)
