"""The first-use self-check of the fused (Triton) path, once per device and dtype.

``triton`` importing says nothing of whether its kernels compile and compute right with
this driver, GPU and Triton.  So before the first fused step on a device and dtype in a
process, :func:`fused_ready` runs every kernel once on small problems: the
:meth:`~sage_torch.common.UpdateRule.check_fused` of each rule with a fused path, found in
:mod:`sage_torch.registry` (SAGE with a fan-out dim of each kind and a vector, Lion over two
blocks, SinkGD with a stacked chunk and a lone matrix), runs
:func:`~sage_torch.sage._fused_sage`, :func:`~sage_torch.lion._fused_lion` and
:func:`~sage_torch.sinkgd._fused_sinkgd` and compares their results
(:func:`first_error`) with the single-tensor functions of the same modules on the same
device; this module imports no algorithm module (they import it).  On any exception or
mismatch it warns once (``RuntimeWarning`` naming the device, the dtype and the error) and
every fused step on that device and dtype takes the path of
``fused=None`` instead, foreach on CUDA (:class:`~sage_torch.RuleOptimizer`): a failing
kernel never stops training half-way.  The verdict is kept for the process.

While the current CUDA stream is capturing a graph nothing is checked (and nothing is
cached): capture needs warm-up steps first, which ran the check; a step captured without
one runs the fused path unchecked.

Tolerances come from the arithmetic, not from trials (:func:`tolerance`): the two paths
run the same element-wise operations in the same order, and differ only in the order of
the sums of the reductions (SinkGD's ``2L`` half-iterations, SAGE's means and RMS), in
CUDA's own contractions of torch's ``add(alpha=)`` into an FMA, and for bfloat16 in the
bfloat16 roundings that a float32 difference can flip.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from sage_torch import registry
from sage_torch.common import FUSED_RULES, wide

_VERDICTS: dict[tuple[str, torch.dtype], str | None] = {}
"""``(device, dtype) -> None`` (passed) or the error, for this process."""

ITERS = 5
"""Sinkhorn iterations of the SinkGD check."""

TERMS = 64
"""The most terms any sum of the check problems adds (their largest dimension)."""

BF16_ROUNDINGS = 4
"""bfloat16 roundings of one update the kernels and the reference share (SinkGD: ``X``,
``α·X``, ``u + w·θ``, ``θ``) that a float32 difference between them can flip."""

LR, WD = 1e-2, 0.1
"""Learning rate and weight decay of the check problems."""


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a step (``max|Δθ|``) and of the state, for ``dtype`` parameters.

    The sums of the check problems have at most :data:`TERMS` non-negative terms, so a
    different order changes each by at most ``TERMS·ε`` relative (``ε`` of the arithmetic
    dtype, float32 for bfloat16); SinkGD chains ``2·ITERS`` of them, each scale feeding the
    next: ``2·ITERS·TERMS·ε`` bounds the relative difference of the updates to first
    order, and SAGE's three reductions stay below it.  For bfloat16, each of
    :data:`BF16_ROUNDINGS` roundings a float32 difference flips adds one bfloat16 unit
    (``2⁻⁷`` relative at most).  The caller adds one unit in the last place of the
    compared value itself (its final rounding).
    """
    rtol = 2 * ITERS * TERMS * torch.finfo(wide(dtype)).eps
    if dtype == torch.bfloat16:
        rtol += BF16_ROUNDINGS * torch.finfo(torch.bfloat16).eps
    return rtol


def ulp(x: Tensor) -> Tensor:
    """One unit in the last place of each entry of ``x`` in ``x``'s dtype (float64 result).

    The spacing of ``x``'s dtype at ``|x|``: ``ε·2^(e−1)`` for ``|x| = f·2^e``,
    ``f ∈ [0.5, 1)``, and the subnormal spacing ``tiny·ε`` below the smallest normal.
    """
    xd = x.double().abs()
    fi = torch.finfo(x.dtype)
    _, e = torch.frexp(xd)
    units = torch.ldexp(torch.full_like(xd, fi.eps), e - 1)
    return torch.where(xd < fi.tiny, fi.tiny * fi.eps, units)


def compare(name: str, got: Tensor, want: Tensor, start: Tensor | None, dtype: torch.dtype
            ) -> str | None:
    """``None`` if ``got`` is within :func:`tolerance` of ``want``, else what differs.

    ``start``: the parameter before the step (the scale is then the step ``want − start``),
    or ``None`` for a state tensor (the scale is ``want`` itself).
    """
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return f"{name} is not finite"
    scale = (w - start.double()) if start is not None else w
    bound = tolerance(dtype) * scale.abs().max() + ulp(want)
    err = (g - w).abs()
    if bool((err > bound).any()):
        worst = int(torch.argmax(err - bound))
        return (f"{name} differs from the single-tensor path by {float(err.flatten()[worst]):.3g}"
                f" (bound {float(bound.flatten()[worst]):.3g}) at flat index {worst}")
    return None


def problem(shapes: list[tuple[int, ...]], device: torch.device, dtype: torch.dtype,
             seed: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Parameters, gradients and momenta of ``shapes``, drawn in float64 on the CPU.

    ``g`` and ``M`` share their sign and stay at least 0.5 from zero, so no sign the rules
    take is a near-tie.
    """
    gen = torch.Generator().manual_seed(seed)
    ps, gs, ms = [], [], []
    for shape in shapes:
        sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1
        ps.append(torch.randn(shape, generator=gen, dtype=torch.float64))
        gs.append(sign * (0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)))
        ms.append(sign * (0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)))
    return _to(ps, device, dtype), _to(gs, device, dtype), _to(ms, device, dtype)


def _to(xs: list[Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    return [x.to(device=device, dtype=dtype) for x in xs]


def clones(xs: list[Tensor]) -> list[Tensor]:
    """A copy of each tensor (every path of a check steps its own)."""
    return [x.clone() for x in xs]


def first_error(start: list[Tensor], out: dict[str, tuple[list[Tensor], ...]],
                 names: tuple[str, ...], dtype: torch.dtype) -> str | None:
    """The first difference of the fused results from the single-tensor ones, or ``None``."""
    for k, name in enumerate(names):
        for i, (got, want) in enumerate(zip(out["fused"][k], out["single"][k], strict=True)):
            err = compare(f"{name} {i}", got, want, start[i] if k == 0 else None, dtype)
            if err is not None:
                return err
    return None


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run every rule's check on ``device`` and ``dtype``: ``None``, or the first error.

    Never raises: an exception of a check (a kernel that does not compile or launch) is
    its error, as ``"rule: ExceptionType: first line of the message"``.
    """
    rules = registry.rule_classes()
    for rule in FUSED_RULES:
        try:
            err = rules[rule].check_fused(device, dtype)
        except Exception as e:  # noqa: BLE001 - any failure of the kernels is a verdict
            lines = str(e).strip().splitlines()
            err = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        if err is not None:
            return f"{rule}: {err}"
    return None


def fused_ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fused steps on ``device`` and ``dtype`` may run: the check's cached verdict.

    The first call for a device and dtype runs :func:`self_check` (not while a CUDA graph
    is captured: then ``True``, nothing cached) and, on a failure, warns once.
    """
    key = (str(device), dtype)
    if key in _VERDICTS:
        return _VERDICTS[key] is None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True
    with torch.no_grad():
        err = self_check(device, dtype)
    _VERDICTS[key] = err
    if err is not None:
        warnings.warn(
            f"sage_torch fused=True: the Triton kernels failed their first-use check on "
            f"{device} {dtype} ({err}); every fused step on {device} {dtype} takes the "
            "path of fused=None instead (foreach on CUDA: the same math) for the rest of "
            "this process; SAGE_KERNELS=off turns the kernels off without this check",
            RuntimeWarning, stacklevel=3)
    return err is None

