"""The stateless unit-norm step of ``sinkgd-pure`` on vectors: ``u = g / (‖g‖₂ + ε)``.

Rule ``"unit_norm"`` (``docs/algorithms.md``, "Unit-norm step"), with
:func:`_single_tensor_unit_norm` and :func:`_multi_tensor_unit_norm`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sage_torch.common import UpdateRule, decayed_step, lr_of
from sage_torch.registry import register


def _single_tensor_unit_norm(params: list[Tensor], grads: list[Tensor], *, lr: float | Tensor,
                             eps: float, weight_decay: float) -> None:
    """``θ ← θ − η·(g/(‖g‖₂ + ε) + w·θ)``, tensor by tensor."""
    updates = [g / (torch.linalg.vector_norm(g) + eps) for g in grads]
    decayed_step(params, updates, lr, weight_decay, False)


def _multi_tensor_unit_norm(params: list[Tensor], grads: list[Tensor], *, lr: float | Tensor,
                            eps: float, weight_decay: float) -> None:
    """The same step with ``torch._foreach_norm`` and friends."""
    if not params:
        return
    # out of place: a DTensor's norm is a pending (partial) reduction, not writable
    norms = torch._foreach_add(torch._foreach_norm(grads), eps)
    updates = list(torch._foreach_div(grads, norms))
    decayed_step(params, updates, lr, weight_decay, True)


@register
class UnitNormRule(UpdateRule):
    """The stateless step of ``sinkgd-pure`` on vectors: ``u = g / (‖g‖₂ + ε)``."""

    name = "unit_norm"

    complex_ok = True

    layout_free = True

    checked = ("eps",)

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        fn = _multi_tensor_unit_norm if foreach else _single_tensor_unit_norm
        fn(params, grads, lr=lr_of(group), eps=group["eps"],
           weight_decay=group["weight_decay"])
