"""The first-use self-check of the fused (Triton) path, once per device and dtype.

``triton`` importing says nothing of whether its kernels compile and compute right with
this driver, GPU and Triton.  So before the first fused step on a device and dtype in a
process, :func:`fused_ready` runs every kernel once on small problems (SAGE with a
fan-out dim of each kind and a vector, Lion over two blocks, SinkGD with a stacked chunk
and a lone matrix) through :func:`~sage_torch.sage._fused_sage`,
:func:`~sage_torch.lion._fused_lion` and :func:`~sage_torch.sinkgd._fused_sinkgd`, and
compares the results with the single-tensor functions of the same modules on the same
device.  On any exception or mismatch it warns once (``RuntimeWarning`` naming the device,
the dtype and the error) and every fused step on that device and dtype takes the path of
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
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sage_torch.common import wide
from sage_torch.lion import _fused_lion, _single_tensor_lion
from sage_torch.sage import _fused_sage, _single_tensor_sage
from sage_torch.sinkgd import _fused_sinkgd, _single_tensor_sinkgd

_VERDICTS: dict[tuple[str, torch.dtype], str | None] = {}
"""``(device, dtype) -> None`` (passed) or the error, for this process."""

ITERS = 5
"""Sinkhorn iterations of the SinkGD check."""

TERMS = 64
"""The most terms any sum of the check problems adds (their largest dimension)."""

BF16_ROUNDINGS = 4
"""bfloat16 roundings of one update the kernels and the reference share (SinkGD: ``X``,
``α·X``, ``u + w·θ``, ``θ``) that a float32 difference between them can flip."""

_LR, _WD = 1e-2, 0.1


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


def _problem(shapes: list[tuple[int, ...]], device: torch.device, dtype: torch.dtype,
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


def _clones(xs: list[Tensor]) -> list[Tensor]:
    return [x.clone() for x in xs]


def _check_sage(device: torch.device, dtype: torch.dtype) -> str | None:
    """SAGE: an H per column, an H per row, and an element-wise vector."""
    ps, gs, ms = _problem([(24, 40), (16, 24), (40,)], device, dtype, 1)
    w = wide(dtype)
    scales = [torch.full(s, 0.75, dtype=w, device=device) for s in [(40,), (16,), (40,)]]
    kw: dict[str, Any] = {"reduce_dims": [0, 1, None], "rms_dims": [None, None, None],
                          "lr": _LR, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8,
                          "weight_decay": _WD, "damper": "both"}
    out: dict[str, tuple[list[Tensor], ...]] = {}
    for path, fn in (("fused", _fused_sage), ("single", _single_tensor_sage)):
        p, m, s = _clones(ps), _clones(ms), _clones(scales)
        fn(p, gs, m, s, [torch.tensor(3.0) for _ in ps], **kw)
        out[path] = (p, m, s)
    return _first_error(ps, out, ("parameter", "exp_avg", "scale_avg"), dtype)


def _check_lion(device: torch.device, dtype: torch.dtype) -> str | None:
    """Lion: a vector over two blocks of the kernel (a masked tail) and a matrix."""
    ps, gs, ms = _problem([(1100,), (24, 40)], device, dtype, 2)
    kw: dict[str, Any] = {"lr": _LR, "beta1": 0.9, "beta2": 0.99, "weight_decay": _WD}
    out: dict[str, tuple[list[Tensor], ...]] = {}
    for path, fn in (("fused", _fused_lion), ("single", _single_tensor_lion)):
        p, m = _clones(ps), _clones(ms)
        fn(p, gs, m, **kw)
        out[path] = (p, m)
    return _first_error(ps, out, ("parameter", "exp_avg"), dtype)


def _check_sinkgd(device: torch.device, dtype: torch.dtype) -> str | None:
    """SinkGD: two same-shape matrices (one stacked chunk) and one alone (in place)."""
    ps, gs, _ = _problem([(24, 40), (24, 40), (17, 9)], device, dtype, 3)
    kw: dict[str, Any] = {"axes": [((1,), (0,))] * 3, "lr": _LR, "alpha": 10.0,
                          "num_iters": ITERS, "eps": 1e-8, "normalization": "unit",
                          "weight_decay": _WD}
    out: dict[str, tuple[list[Tensor], ...]] = {}
    for path, fn in (("fused", _fused_sinkgd), ("single", _single_tensor_sinkgd)):
        p = _clones(ps)
        fn(p, gs, **kw)
        out[path] = (p,)
    return _first_error(ps, out, ("parameter",), dtype)


def _first_error(start: list[Tensor], out: dict[str, tuple[list[Tensor], ...]],
                 names: tuple[str, ...], dtype: torch.dtype) -> str | None:
    """The first difference of the fused results from the single-tensor ones, or ``None``."""
    for k, name in enumerate(names):
        for i, (got, want) in enumerate(zip(out["fused"][k], out["single"][k], strict=True)):
            err = compare(f"{name} {i}", got, want, start[i] if k == 0 else None, dtype)
            if err is not None:
                return err
    return None


CHECKS: dict[str, Callable[[torch.device, torch.dtype], str | None]] = {
    "sage": _check_sage, "lion": _check_lion, "sinkgd": _check_sinkgd}
"""The check of each rule's fused path."""


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run every rule's check on ``device`` and ``dtype``: ``None``, or the first error.

    Never raises: an exception of a check (a kernel that does not compile or launch) is
    its error, as ``"rule: ExceptionType: first line of the message"``.
    """
    for rule, check in CHECKS.items():
        try:
            err = check(device, dtype)
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

