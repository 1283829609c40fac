"""Lion (Chen et al. 2023): ``θ ← θ − η·(sign(b1·m + (1−b1)·g) + w·θ)``, as ``optax.lion``.

The :class:`Lion` optimizer, its rule (:class:`LionRule`) and the step functions in
``torch.optim``'s shape: :func:`_single_tensor_lion`, :func:`_multi_tensor_lion`
(``torch._foreach_*`` over the whole group) and :func:`_chunked_lion` (the in-place CPU
path of :mod:`sage_torch.chunked`), all taking keyword hyperparameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sage_optim.presets import PRESETS, RULE_DEFAULTS
from sage_torch import chunked, fused_check
from sage_torch.common import (
    ConstCache,
    UpdateRule,
    by_device_dtype,
    copy_all,
    decayed_step,
    is_dtensor,
    lr_of,
    lr_tensor,
    shared_docs,
    wide,
)
from sage_torch.optimizer import ParamsT, RuleOptimizer
from sage_torch.registry import register

_LION = RULE_DEFAULTS["lion"]


def _single_tensor_lion(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *,
                        lr: float | Tensor,
                        beta1: float, beta2: float, weight_decay: float) -> None:
    """One Lion step, tensor by tensor."""
    updates = []
    for g, m in zip(grads, exp_avgs, strict=True):
        updates.append(torch.sign(g * (1.0 - beta1) + m * beta1))
        m.copy_(g * (1 - beta2) + m * beta2)
    decayed_step(params, updates, lr, weight_decay, False)


def _multi_tensor_lion(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *,
                       lr: float | Tensor, beta1: float, beta2: float, weight_decay: float) -> None:
    """One Lion step with ``torch._foreach_*`` kernels (the operations of the single path)."""
    if not params:
        return
    # Memory: at most two temporaries of each tensor alive at once (the sign's argument,
    # turned into the update in place, and one product); the same operations and rounding
    # as the single path (M·b2 + g·(1−b2) is g·(1−b2) + M·b2: addition commutes).
    updates = list(torch._foreach_mul(grads, 1.0 - beta1))
    torch._foreach_add_(updates, torch._foreach_mul(exp_avgs, beta1))
    torch._foreach_sign_(updates)
    # In place only in float32/float64: an in-place product of a bfloat16 M with β2 rounds
    # β2 to bfloat16 first (0.98828125 for 0.99), the out-of-place one does not.
    if all(m.dtype == g.dtype and m.dtype in (torch.float32, torch.float64)
           for m, g in zip(exp_avgs, grads, strict=True)):
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta2))
    else:  # form M_t out of place, then store it (in M's dtype)
        new_m = torch._foreach_mul(grads, 1 - beta2)
        torch._foreach_add_(new_m, torch._foreach_mul(exp_avgs, beta2))
        copy_all(exp_avgs, list(new_m))
        del new_m
    decayed_step(params, updates, lr, weight_decay, True)


def _fused_lion(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *,
                lr: float | Tensor, beta1: float, beta2: float, weight_decay: float,
                consts: ConstCache | None = None) -> None:
    """One Lion step, one Triton kernel per tensor (:mod:`sage_torch.triton_kernels`).

    The kernel reads ``g``, ``m`` and ``θ`` once and writes ``m ← g·(1−b2) + m·b2`` and
    ``θ ← θ − η·(sign(g·(1−b1) + m·b1) + w·θ)``, the operations of
    :func:`_single_tensor_lion` (bfloat16: computed in float32 and rounded after every
    operation, as that function's bfloat16 tensor operations round).  Tensors that are
    not contiguous, or whose gradient or ``m`` has another dtype or shape, take
    :func:`_multi_tensor_lion`.  Each device and dtype has its own constants.
    """
    from sage_torch import triton_kernels as tk

    consts = ConstCache() if consts is None else consts
    ok: list[int] = []
    rest: list[int] = []
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs, strict=True)):
        same = all(t.dtype == p.dtype and t.shape == p.shape and t.is_contiguous()
                   and not is_dtensor(t) for t in (p, g, m))
        (ok if same else rest).append(i)
    if rest:
        _multi_tensor_lion([params[i] for i in rest], [grads[i] for i in rest],
                           [exp_avgs[i] for i in rest], lr=lr, beta1=beta1, beta2=beta2,
                           weight_decay=weight_decay)
    for part in by_device_dtype([params[i] for i in ok]):
        p0 = params[ok[part[0]]]
        hpt = consts.get((1.0 - beta1, beta1, 1 - beta2, beta2, weight_decay), wide(p0.dtype),
                         p0.device)
        lr_t = lr_tensor(lr, p0)
        for i in (ok[k] for k in part):
            if params[i].numel():
                tk.lion_update(params[i], grads[i], exp_avgs[i], hpt, lr_t,
                               lr_is_tensor=isinstance(lr, Tensor))


def _chunked_lion(p: Tensor, g: Tensor, m: Tensor, *, lr: float, beta1: float, beta2: float,
                  weight_decay: float, threads: int = 1) -> None:
    """The single-tensor step on one chunk at a time (:mod:`sage_torch.chunked`)."""

    def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
        gi, mi, pi = g[i:j], m[i:j], p[i:j]
        torch.mul(gi, 1.0 - beta1, out=u)  # sign(g·(1−b1) + m·b1)
        torch.mul(mi, beta1, out=t)
        u.add_(t).sign_()
        torch.mul(gi, 1 - beta2, out=t)  # m ← g·(1−b2) + m·b2
        mi.mul_(beta2).add_(t)
        chunked.decay_and_apply(u, pi, lr, weight_decay)

    chunked.for_chunks(p, update, threads)


@register
class LionRule(UpdateRule):
    """Lion: ``u = sign(b1·m + (1−b1)·g)``, then ``m ← b2·m + (1−b2)·g``."""

    name = "lion"

    complex_ok = True

    layout_free = True

    has_fused = True

    def __init__(self) -> None:
        self._consts = ConstCache()  # _fused_lion's hyperparameter tensors

    @classmethod
    def check_fused(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Lion's fused path: a vector over two blocks of the kernel (a masked tail), a matrix."""
        ps, gs, ms = fused_check.problem([(1100,), (24, 40)], device, dtype, 2)
        kw: dict[str, Any] = {"lr": fused_check.LR, "beta1": 0.9, "beta2": 0.99,
                              "weight_decay": fused_check.WD}
        out: dict[str, tuple[list[Tensor], ...]] = {}
        for path, fn in (("fused", _fused_lion), ("single", _single_tensor_lion)):
            p, m = fused_check.clones(ps), fused_check.clones(ms)
            fn(p, gs, m, **kw)
            out[path] = (p, m)
        return fused_check.first_error(ps, out, ("parameter", "exp_avg"), dtype)

    def init_state(self, p, group, name, index=0):  # noqa: D102
        return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        b1, b2 = group["betas"]
        hp: dict[str, Any] = {"lr": lr_of(group), "beta1": b1, "beta2": b2,
                              "weight_decay": group["weight_decay"]}
        if fused:
            _fused_lion(params, grads, [st["exp_avg"] for st in states], consts=self._consts,
                        **hp)
            return
        if not group.get("capturable", False):
            params, grads, states = chunked.split_fast(
                params, grads, states, ("exp_avg",),
                lambda p, g, st: _chunked_lion(p, g, st["exp_avg"], threads=self.cpu_threads,
                                               **hp))
        fn = _multi_tensor_lion if foreach else _single_tensor_lion
        fn(params, grads, [st["exp_avg"] for st in states], **hp)


@shared_docs
class Lion(RuleOptimizer):
    """Lion (Chen et al. 2023): ``θ ← θ − η·(sign(b1·m + (1−b1)·g) + w·θ)``, as ``optax.lion``.

    Args:
      params: parameters or param groups.
      lr: learning rate.
      betas: ``(b1, b2)``.
      weight_decay: decoupled decay.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path (default: on CUDA and under
        ``torch.compile``).
      {fused_doc}
      capturable: keep the step count on the parameters' device and accept a device tensor
        ``lr``, so the step reads nothing back to the host (CUDA graphs), as
        ``torch.optim.Adam``'s option.
      cpu_threads: threads of the chunked CPU path (default 1: none started).
      fallback: the rule for the parameters this one cannot treat (none: Lion treats every
        real or complex tensor; accepted for uniformity):
        {fallback_doc}

    Examples:
      The steps of :func:`sage_optax.lion`'s example (and ``optax.lion``'s):

      >>> import torch, sage_torch
      >>> w = torch.nn.Parameter(torch.tensor([0.0, 2.0, 0.5]))
      >>> opt = sage_torch.Lion([w], lr=0.1)
      >>> for _ in range(3):
      ...     opt.zero_grad()
      ...     ((w - 1.0) ** 2).sum().backward()
      ...     opt.step()
      >>> print(" ".join(f"{x:.3f}" for x in w.detach()))
      0.300 1.694 0.798

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023.

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["lion"].learning_rate,
                 betas: tuple[float, float] = (_LION["b1"], _LION["b2"]),
                 weight_decay: float = _LION["weight_decay"], *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, cpu_threads: int = 1,
                 fallback: str | dict[str, Any] | None = None) -> None:
        super().__init__(params, {
            "rule": "lion", "fallback": fallback, "lr": lr, "betas": tuple(betas),
            "weight_decay": weight_decay,
            "maximize": maximize, "foreach": foreach, "fused": fused, "capturable": capturable,
        }, cpu_threads=cpu_threads)
