"""APOLLO (Zhu et al. 2024) as ``docs/algorithms.md`` states it; defaults are APOLLO-Mini.

The :class:`APOLLO` optimizer, its rule (:class:`ApolloRule`), the default projection
(:func:`gaussian_projection`) and the step functions (keyword hyperparameters)
:func:`_single_tensor_apollo` (matrix by matrix) and :func:`_multi_tensor_apollo`
(same-shape matrices at once: one batched product with their stacked projections, foreach
kernels for the moments and the step).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sage_optim.presets import PRESETS, RULE_DEFAULTS
from sage_torch.common import (
    Axes,
    MatrixView,
    Projection,
    UpdateRule,
    is_dtensor,
    matrix_axes,
    shared_docs,
    wide,
)
from sage_torch.optimizer import ParamsT, RuleOptimizer
from sage_torch.registry import register

_APOLLO = RULE_DEFAULTS["apollo"]

Plan = tuple[int, int, int, MatrixView | None]
"""``(fan_in, fan_out, compressed, view)``: the matrix dims APOLLO works on."""

def projection_seed(seed: int, index: int) -> int:
    """The seed of parameter number ``index``'s default projection (kept in its state).

    ``index`` is the parameter's position in the optimizer over all param groups (the
    number ``state_dict`` gives it), so the seed, and with it every projection, does not
    depend on the parameter's name: an optimizer built on ``model.parameters()`` and one
    built on ``model.named_parameters()`` draw the same projections, and a state dict of
    one resumes the other exactly.  Stored as ``state["proj_seed"]``, it is saved and
    restored with the state.
    """
    return (int(seed) * 1_000_003 + int(index)) % (2**62)


def seeded_projection(proj_seed: int, refresh_index: int, n: int, rank: int) -> Tensor:
    """The default projection of a parameter with seed ``proj_seed``: entries ``N(0, 1/r)``.

    Drawn from a CPU generator keyed on ``(proj_seed, refresh_index)``, float32 (the two
    frameworks' generators differ: inject one projection into both for parity).
    """
    key = (int(proj_seed) * 1_000_033 + int(refresh_index)) % (2**63)
    gen = torch.Generator().manual_seed(key)
    return torch.randn(n, rank, generator=gen, dtype=torch.float32) / math.sqrt(rank)


def gaussian_projection(seed: int = 0) -> Projection:
    """A projection keyed on parameter names: ``projection(name, refresh_index, n, rank)``.

    Entries ``N(0, 1/r)`` from a generator keyed on ``(seed, crc32(name), refresh_index)``,
    float32 on the CPU, like :mod:`sage_optax`'s default (which keys on the leaf's path).
    To inject as ``projection=``; :class:`APOLLO`'s own default is keyed on the
    parameter's position instead (:func:`projection_seed`), so that names never matter.

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.
    """

    def projection(name: str, refresh_index: int, n: int, rank: int) -> Tensor:
        key = (seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_033 + refresh_index
        gen = torch.Generator().manual_seed(key % (2**63))
        return torch.randn(n, rank, generator=gen, dtype=torch.float32) / math.sqrt(rank)

    return projection


def _projector(projection: Projection | None, seeds: list[int]) -> Callable[..., Tensor]:
    """``get(i, name, refresh_index, n, rank)``: parameter ``i``'s projection.

    The injected ``projection`` (keyed on names, as :mod:`sage_optax`'s) when given, else
    the default one of the seed kept in the parameter's state (:func:`seeded_projection`).
    """
    if projection is not None:
        return lambda i, name, k, n, rank: projection(name, k, n, rank)
    return lambda i, name, k, n, rank: seeded_projection(seeds[i], k, n, rank)


def _replicated_like(x: Tensor, ref: Tensor) -> Tensor:
    """``x`` (the same on every rank) as a replicated DTensor on ``ref``'s mesh, if any.

    The one special case for distributed tensors in this module: APOLLO's projection comes
    from a plain callable, and a DTensor gradient (FSDP2) cannot be multiplied by a plain
    tensor.  Everything else works on DTensors as written.
    """
    mesh = getattr(ref, "device_mesh", None)
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _one_minus_pow(b: float, t: float) -> float:
    """``1 − b^t`` without cancellation (as :mod:`sage_optax.apollo`)."""
    return -math.expm1(t * math.log1p(-(1 - b)))


@register
class ApolloRule(UpdateRule):
    """APOLLO (Zhu et al. 2024, ``docs/algorithms.md``); decay is applied after the step."""

    name = "apollo"

    needs_matrix = True

    host_keys = ("proj_seed",)

    complex_why = "projects real matrices with a real random projection"

    def __init__(self, projection: Projection | None = None) -> None:
        self.projection = projection

    @classmethod
    def create(cls, projection: Projection | None = None) -> ApolloRule:  # noqa: D102
        return cls(projection)

    checked = ("rank", "update_proj_gap", "scale_type", "scale", "limiter_gamma", "eps")

    def validate(self, group: dict[str, Any]) -> None:  # noqa: D102
        super().validate(group)
        if group.get("capturable", False):
            raise ValueError("APOLLO does not support capturable=True: its projection and "
                             "bias corrections are chosen by the step count on the host")

    def _plan(self, p: Tensor, group: dict[str, Any], name: str) -> Plan:
        """``(fan_in, fan_out, compressed, view)``: the matrix dims APOLLO works on.

        The dims of ``p``, or, for grouped axes, of its ``(batch..., OUT, IN)`` matrix
        ``view`` (each group flattened in the order it lists its dims: the order in which
        the projection sees the merged axis).
        """
        fan_in, fan_out = matrix_axes(p, group, "APOLLO", name)
        view, shape = None, tuple(p.shape)
        if len(fan_in) == 1 and len(fan_out) == 1:
            (fi,), (fo,) = fan_in, fan_out
        else:
            view = MatrixView(p.shape, fan_in, fan_out)
            shape = view.shape
            fi, fo = len(shape) - 1, len(shape) - 2
        compressed = fi if shape[fo] >= shape[fi] else fo
        return fi, fo, compressed, view

    def init_state(self, p, group, name, index=0):  # noqa: D102
        fi, fo, comp, view = self._plan(p, group, name)
        base = p.detach() if view is None else view.to_matrix(p.detach())
        shape = list(base.shape)
        shape[comp] = int(group["rank"])
        dt = wide(p.dtype)
        # Zeros shaped like the projected gradient (p with dim `comp` of size rank) and like
        # the limiter's norm (one per batch index), made from reductions of p, as SAGE's S, so
        # that a sharded DTensor parameter gets states with the placements step() computes.
        # With grouped axes they are those of p's matrix view.
        moments = base.sum(dim=comp, keepdim=True).expand(shape)
        return {
            "exp_avg": torch.zeros_like(moments, dtype=dt, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(moments, dtype=dt,
                                           memory_format=torch.contiguous_format),
            "limiter_norm": torch.zeros_like(base.sum(dim=(fi, fo)), dtype=dt),
            # on the host, where the projection is drawn (int64: exact for every seed)
            "proj_seed": torch.tensor(projection_seed(group["seed"], index), dtype=torch.int64),
        }

    def step(self, params, grads, states, names, group, foreach, fused=False):  # noqa: D102
        b1, b2 = group["betas"]
        fn = _multi_tensor_apollo if foreach else _single_tensor_apollo
        fn(params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
           [st["limiter_norm"] for st in states], [st["step"] for st in states],
           plans=[self._plan(p, group, name) for p, name in zip(params, names, strict=True)],
           names=names, projection=self.projection,
           proj_seeds=[int(st["proj_seed"]) for st in states],
           lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
           weight_decay=group["weight_decay"], rank=int(group["rank"]),
           update_proj_gap=int(group["update_proj_gap"]), scale_type=group["scale_type"],
           scale=group["scale"], limiter_gamma=group["limiter_gamma"])


def _single_tensor_apollo(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                          exp_avg_sqs: list[Tensor], limiter_norms: list[Tensor],
                          state_steps: list[Tensor], *, plans: list[Plan], names: list[str],
                          projection: Projection | None, lr: float, beta1: float, beta2: float,
                          eps: float, weight_decay: float, rank: int, update_proj_gap: int,
                          scale_type: str, scale: float, limiter_gamma: float,
                          proj_seeds: list[int] | None = None) -> None:
    """One APOLLO step, matrix by matrix; decay after the step, as the authors' code.

    ``plans[i]``: ``(fan_in, fan_out, compressed, view)`` of parameter ``i``
    (:meth:`ApolloRule._plan`).  ``projection``: the injected projection, or ``None`` for
    the default one of each parameter's seed ``proj_seeds[i]`` (:func:`seeded_projection`).
    The step count is read on the host (a CPU tensor) to pick
    the projection and the bias corrections.
    """
    b1, b2, wd, gamma = beta1, beta2, weight_decay, limiter_gamma
    get = _projector(projection, proj_seeds or [0] * len(params))
    for i, (p, g, m, v, lim, step, (fi, fo, comp, view), name) in enumerate(zip(
            params, grads, exp_avgs, exp_avg_sqs, limiter_norms, state_steps, plans, names,
            strict=True)):
        t = float(step)
        refresh = (int(t) - 1) // update_proj_gap
        w = wide(g.dtype)
        g32 = g.to(w) if view is None else view.to_matrix(g).to(w)
        proj = get(i, name, refresh, g32.shape[comp], rank).to(device=g.device, dtype=w)
        proj = _replicated_like(proj, g)
        # contiguous: the norms below then sum in the order of the multi-tensor path's
        r = torch.matmul(g32.movedim(comp, -1), proj).movedim(-1, comp).contiguous()
        m.copy_(m * b1 + r * (1 - b1))
        v.copy_(v * b2 + r.square() * (1 - b2))
        r_tilde = m / (v.sqrt() + eps)
        dims = (fi, fo) if scale_type == "tensor" else (comp,)

        def norm(x: Tensor, dims: tuple[int, ...] = dims) -> Tensor:
            return x.square().sum(dim=dims, keepdim=True).sqrt()

        s = norm(r_tilde) / (norm(r) + 1e-8)
        u = g32 * (s * math.sqrt(scale))
        norm_u = norm(u, (fi, fo))
        prev = lim.reshape(norm_u.shape).to(w)
        bound = gamma * prev
        limit = (prev > 0) & (norm_u > bound)
        factor = torch.where(limit, bound / torch.where(limit, norm_u, 1), 1)
        u = u * factor
        lim.copy_((norm_u * factor).reshape(lim.shape))
        step_size = lr * math.sqrt(_one_minus_pow(b2, t)) / _one_minus_pow(b1, t)
        if view is not None:
            u = view.from_matrix(u)
        p.add_(u.to(p.dtype), alpha=-step_size)
        if wd != 0.0:
            p.mul_(1 - lr * wd)


def _multi_tensor_apollo(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                         exp_avg_sqs: list[Tensor], limiter_norms: list[Tensor],
                         state_steps: list[Tensor], *, plans: list[Plan], names: list[str],
                         projection: Projection | None, lr: float, beta1: float, beta2: float,
                         eps: float, weight_decay: float, rank: int, update_proj_gap: int,
                         scale_type: str, scale: float, limiter_gamma: float,
                         proj_seeds: list[int] | None = None) -> None:
    """One APOLLO step, same-shape matrices at once (``proj_seeds``: as the single path's).

    Matrices of one shape and plan are stacked: one ``torch.bmm`` with their stacked
    projections, the moments updated by ``torch._foreach_*`` kernels, the scaling factors
    and the norm-growth limiter computed on the stacked tensors, the step and the decay
    applied by foreach kernels.  The operations of :func:`_single_tensor_apollo`, in the
    same order.  The step counts are read on
    the host (CPU tensors), as in the single-tensor path; grouped axes (a matrix view) and
    DTensors take the single-tensor path.
    """
    kw: dict[str, Any] = {
        "projection": projection, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
        "weight_decay": weight_decay, "rank": rank, "update_proj_gap": update_proj_gap,
        "scale_type": scale_type, "scale": scale, "limiter_gamma": limiter_gamma}
    seeds = proj_seeds or [0] * len(params)
    get = _projector(projection, seeds)
    single = [i for i, (p, g, plan) in enumerate(zip(params, grads, plans, strict=True))
              if plan[3] is not None or is_dtensor(p) or is_dtensor(g)]
    if single:
        _single_tensor_apollo(*([xs[i] for i in single] for xs in (
            params, grads, exp_avgs, exp_avg_sqs, limiter_norms, state_steps)),
            plans=[plans[i] for i in single], names=[names[i] for i in single],
            proj_seeds=[seeds[i] for i in single], **kw)
    buckets = _buckets(params, plans, set(single))
    b1, b2, gamma = beta1, beta2, limiter_gamma
    for (shape, _, (fi, fo, comp)), idx in buckets.items():
        w = wide(grads[idx[0]].dtype)
        device = grads[idx[0]].device
        ts = [float(state_steps[i]) for i in idx]
        g32 = torch.stack([grads[i] for i in idx]).to(w)  # (B, *shape)
        n = shape[comp]
        proj = torch.stack([get(i, names[i], (int(t) - 1) // update_proj_gap, n, rank)
                            for i, t in zip(idx, ts, strict=True)]).to(device=device, dtype=w)
        # One matmul per matrix, as the single-tensor path: a batched matmul may block (and
        # so round) differently from the unbatched one (seen with MKL on AVX-512 CPUs).
        r = torch.stack([torch.matmul(g32[k].movedim(comp, -1), proj[k]).movedim(-1, comp)
                         for k in range(len(idx))])
        rs = list(r.unbind(0))
        ms, vs = [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        torch._foreach_mul_(ms, b1)  # m·b1 + r·(1−b1)
        torch._foreach_add_(ms, torch._foreach_mul(rs, 1 - b1))
        torch._foreach_mul_(vs, b2)  # v·b2 + r²·(1−b2)
        torch._foreach_add_(vs, torch._foreach_mul(torch._foreach_mul(rs, rs), 1 - b2))
        m, v = torch.stack(ms), torch.stack(vs)
        r_tilde = m / (v.sqrt() + eps)
        dims = (fi, fo) if scale_type == "tensor" else (comp,)

        def norm(x: Tensor, dims: tuple[int, ...] = dims) -> Tensor:
            # Matrix by matrix, exactly the single path's reduction: a reduction over the
            # trailing axes of a stack may sum in another order (seen on AVX-512 CPUs).
            return torch.stack([xk.square().sum(dim=dims, keepdim=True).sqrt()
                                for xk in x.unbind(0)])

        s = norm(r_tilde) / (norm(r) + 1e-8)
        u = g32 * (s * math.sqrt(scale))
        norm_u = norm(u, (fi, fo))
        lims = [limiter_norms[i] for i in idx]
        prev = torch.stack(lims).reshape(norm_u.shape).to(w)
        bound = gamma * prev
        limit = (prev > 0) & (norm_u > bound)
        factor = torch.where(limit, bound / torch.where(limit, norm_u, 1), 1)
        u = (u * factor).to(params[idx[0]].dtype)
        new_lim = (norm_u * factor).reshape(len(idx), *lims[0].shape)
        torch._foreach_copy_(lims, list(new_lim.unbind(0)))
        us = list(u.unbind(0))
        ps = [params[i] for i in idx]
        by_size: dict[float, list[int]] = {}  # one foreach kernel per step size (usually one)
        for k, t in enumerate(ts):
            size = lr * math.sqrt(_one_minus_pow(b2, t)) / _one_minus_pow(b1, t)
            by_size.setdefault(size, []).append(k)
        for size, ks in by_size.items():
            torch._foreach_add_([ps[k] for k in ks], [us[k] for k in ks], alpha=-size)
        if weight_decay != 0.0:
            if w == ps[0].dtype:
                torch._foreach_mul_(ps, 1 - lr * weight_decay)
            else:  # a CPU foreach kernel rounds the scalar to bfloat16: one mul_ each
                for q in ps:
                    q.mul_(1 - lr * weight_decay)


def _buckets(params: list[Tensor], plans: list[Plan], skip: set[int]
             ) -> dict[tuple[Any, ...], list[int]]:
    """The stacks of :func:`_multi_tensor_apollo`: positions not in ``skip`` by shape and plan.

    Only this bookkeeping leaves that function: the step's floats stay in its own frame
    (passed to a helper, ``torch.compile`` specializes on them and compiles every step).
    """
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, plan) in enumerate(zip(params, plans, strict=True)):
        if i not in skip:
            buckets.setdefault((tuple(p.shape), p.dtype, plan[:3]), []).append(i)
    return buckets


@shared_docs
class APOLLO(RuleOptimizer):
    """APOLLO (Zhu et al. 2024) as ``docs/algorithms.md`` states it; defaults are APOLLO-Mini.

    A rank-``r`` random projection of the smaller axis carries AdamW moments whose ratio
    scales the raw gradient (``"tensor"``: one factor; ``"channel"``: one per channel),
    times ``√scale``, through a norm-growth limiter (γ); the projection is regenerated every
    ``update_proj_gap`` steps (or taken from ``projection``) and not stored; decay is applied
    after the step.  The default projection of a parameter is drawn from its own seed,
    ``state["proj_seed"]`` (:func:`projection_seed`: ``seed`` and the parameter's position
    in the optimizer, never its name), saved and restored with the state: an optimizer
    built on ``model.parameters()`` resumes one built on ``model.named_parameters()``
    exactly.

    Args:
      params: parameters or param groups (matrices only).
      lr: learning rate.
      rank: projection rank ``r``.
      scale_type: ``"tensor"`` or ``"channel"``.
      scale: gradient scale (its square root multiplies the update).
      update_proj_gap: steps between projection refreshes ``T``.
      betas: Adam ``(b1, b2)`` on the projected gradient.
      eps: Adam ε.
      weight_decay: decoupled decay, applied after the step.
      limiter_gamma: norm-growth limit γ.
      seed: seed of the default projections (an integer >= 0).
      projection: ``projection(name, refresh_index, n, rank) -> P`` to inject ``P`` (keyed
        on names, as :mod:`sage_optax`'s; not saved with the state).
      fan_in_dim: dim (or tuple of dims, merged in that order) of the fan-in axis.
      fan_out_dim: dim (or tuple of dims, merged in that order) of the fan-out axis.
      maximize: ascend instead of descend.
      foreach: the multi-tensor path (default: on CUDA and under ``torch.compile``):
        same-shape matrices stacked, one batched projection product, foreach kernels for
        the moments and the step.
      cpu_threads: threads of the chunked CPU path (default 1: none started).
      fallback: the rule for the parameters this one cannot treat (vectors and 0-D
        parameters, complex parameters):
        {fallback_doc}

    Examples:
      APOLLO-Mini (the defaults) on an ``nn.Linear(4, 3)`` weight ``(out, in)``: the
      smaller dim, fan-out, is projected to rank 1, so the moments hold 4 numbers, not 12,
      and the step is the gradient times one positive factor (``"tensor"`` scaling):

      >>> import torch, sage_torch
      >>> w = torch.nn.Parameter(torch.zeros(3, 4))
      >>> opt = sage_torch.APOLLO([w], lr=0.01, weight_decay=0.0)
      >>> w.grad = torch.arange(1.0, 13.0).reshape(3, 4)
      >>> opt.step()
      >>> state = opt.state[w]
      >>> print(tuple(state["exp_avg"].shape), tuple(state["exp_avg_sq"].shape))
      (1, 4) (1, 4)
      >>> ratio = -w.detach() / w.grad
      >>> print(bool(torch.allclose(ratio, ratio[0, 0])), bool(ratio[0, 0] > 0))
      True True

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["apollo"].learning_rate,
                 rank: int = _APOLLO["rank"], scale_type: str = _APOLLO["scale_type"],
                 scale: float = _APOLLO["scale"],
                 update_proj_gap: int = _APOLLO["update_proj_gap"],
                 betas: tuple[float, float] = (_APOLLO["b1"], _APOLLO["b2"]),
                 eps: float = _APOLLO["eps"], weight_decay: float = _APOLLO["weight_decay"],
                 limiter_gamma: float = _APOLLO["limiter_gamma"], seed: int = _APOLLO["seed"],
                 *, projection: Projection | None = None, fan_in_dim: Axes = -1,
                 fan_out_dim: Axes = -2, maximize: bool = False,
                 foreach: bool | None = None, cpu_threads: int = 1,
                 fallback: str | dict[str, Any] | None = None) -> None:
        super().__init__(params, {
            "rule": "apollo", "fallback": fallback, "lr": lr, "rank": rank,
            "scale_type": scale_type, "scale": scale,
            "update_proj_gap": update_proj_gap, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay, "limiter_gamma": limiter_gamma, "seed": seed,
            "fan_in_dim": fan_in_dim, "fan_out_dim": fan_out_dim, "maximize": maximize,
            "foreach": foreach,
        }, projection=projection, cpu_threads=cpu_threads)
