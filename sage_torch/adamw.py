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

from sage_torch import chunked
from sage_torch.common import UpdateRule, bias_correction, decayed_step, lr_of, wide
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

    def init_state(self, p, group, name, index=0):  # noqa: D102
        return {
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        b1, b2 = group["betas"]
        hp: dict[str, Any] = {"lr": lr_of(group), "beta1": b1, "beta2": b2,
                              "eps": group["eps"], "weight_decay": group["weight_decay"]}
        if not group.get("capturable", False):
            params, grads, states = chunked.split_fast(
                params, grads, states, ("exp_avg", "exp_avg_sq"),
                lambda p, g, st: _chunked_adamw(p, g, st["exp_avg"], st["exp_avg_sq"],
                                                st["step"], threads=self.cpu_threads, **hp))
        fn = _multi_tensor_adamw if foreach else _single_tensor_adamw
        fn(params, grads, [st["exp_avg"] for st in states],
           [st["exp_avg_sq"] for st in states], [st["step"] for st in states], **hp)
