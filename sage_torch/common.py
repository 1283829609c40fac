"""Machinery shared by the algorithm modules of :mod:`sage_torch` (``sage.py``, ``sinkgd.py``, ...).

The :class:`UpdateRule` base class (state, checks, step of one param group), the checks of a
group's hyperparameters against the table shared with :mod:`sage_optax`, the matrix axes
of a parameter (:func:`axis_group`, :class:`MatrixView`) and the decoupled-decay step
``θ ← θ − η·(u + w·θ)`` that every rule but APOLLO ends with.

Layout: PyTorch matrices are ``(out, in)``, so the default axes are ``fan_in_dim=-1`` and
``fan_out_dim=-2``; ``nn.Embedding.weight`` ``(V, d)`` and a head ``nn.Linear(d, V).weight``
``(V, d)`` therefore have the vocab axis as fan-out axis, as in :mod:`sage_optax`.  Either
option may be a tuple of dims, merged into one matrix axis in the order listed: a ``Conv2d``
weight ``(out, in, kh, kw)`` is ``fan_in_dim=(1, 2, 3)``, ``fan_out_dim=0``, the ``(out,
in·kh·kw)`` matrix (:class:`MatrixView`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from sage_optim import hyperparams
from sage_optim.presets import RULE_DEFAULTS
from sage_optim.routing import as_axis_group

Axes = int | tuple[int, ...]
"""A group option ``fan_in_dim``/``fan_out_dim``: one dim, or a group of dims merged into one
matrix axis in the order listed (``(1, 2, 3)``: a ``Conv2d`` weight's ``in, kh, kw``)."""

Projection = Callable[[str, int, int, int], Tensor]
"""``projection(name, refresh_index, n, rank) -> P`` of shape ``(n, rank)`` (APOLLO)."""

_DTensor: Any
try:  # FSDP2 parameters are DTensors: they keep the whole-tensor path
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch built without torch.distributed
    _DTensor = None


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def wide(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: float32, or float64 for float64 tensors.

    ``torch.promote_types(dtype, torch.float32)`` for the floating dtypes, without
    dispatching an op (this is called once per parameter and step).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def bias_correction(b: float, step: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 − b^t`` as a tensor (no host sync: ``torch.compile`` traces it without a break)."""
    return 1 - b ** step.to(dtype)


def pow2_floor(amax: Tensor, edges: bool = True) -> Tensor:
    """Element-wise :func:`sage_optim.numerics.pow2_floor` (``tiny`` of ``amax``'s dtype).

    The power of two ``m ≤ amax < 2m``; 1 where ``amax`` is 0 or not finite; within
    ``[tiny, 1/tiny]``, so ``1/m`` stays a finite normal number (as
    :func:`sage_optax.numerics.pow2_floor`).  The one version of :mod:`sage_torch`: SAGE's
    RMS values and SinkGD's range scale.

    ``edges=False`` leaves out the mapping of 0 and non-finite values to 1 (three fewer
    element-wise ops per call): 0 then gives ``tiny``, ``inf`` gives ``1/tiny`` and NaN stays
    NaN, for a caller whose result is the same either way (SAGE's RMS values: ``x / m`` of an
    all-zero ``x`` is 0 for any ``m``, and a non-finite ``x`` gives a non-finite RMS).
    """
    tiny = torch.finfo(amax.dtype).tiny
    a = amax.clamp(tiny, 1 / tiny)  # NaN stays NaN
    mantissa, _ = torch.frexp(a)  # a = mantissa · 2^e, mantissa in [0.5, 1)
    # a / (2·mantissa) is exactly 2^(e-1) (a correctly rounded division, exact result)
    m = a / (2 * mantissa)
    if not edges:
        return m
    return torch.where((amax > 0) & torch.isfinite(amax), m, 1)


def pow2_sqrt_floor(m: Tensor) -> Tensor:
    """Element-wise :func:`sage_optim.numerics.pow2_sqrt_floor`: ``2^⌊k/2⌋`` of ``m = 2^k``.

    ``X = c·(G/m)·r`` is returned as ``(c/2^⌊k/2⌋)·G·(r/2^⌈k/2⌉)``: both scales and every
    partial product stay in range for any finite ``G``.
    """
    _, e = torch.frexp(m)  # m = 0.5 · 2^e, so k = e − 1
    # sqrt of an even power of two is exact; for odd k take sqrt(m / 2) = 2^((k − 1) / 2)
    return torch.where(e % 2 == 0, (m / 2).sqrt(), m.sqrt())


def check_lr(lr: Any, rule: str | None = None, *, capturable: bool = False) -> None:
    """Raise a ``ValueError`` naming ``lr`` unless it is a valid learning rate.

    A number, or a one-element tensor (floating with ``capturable``), ``>= 0``; a tensor on
    a device (``capturable=True``) is not read back to the host, so only its shape and dtype
    are checked.  :func:`check_group` and :func:`sage_torch.make_optimizer` check it before
    anything else, as ``torch.optim`` checks ``lr`` before ``params``.
    """
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a scalar, got a tensor of shape {tuple(lr.shape)}")
        if capturable and not lr.is_floating_point():
            raise ValueError(f"lr must be a floating tensor with capturable=True, got {lr.dtype}")
        if lr.device.type == "cpu":
            hyperparams.check("lr", float(lr), rule)
    else:
        hyperparams.check("lr", lr, rule)


def check_group(group: dict[str, Any], rule: str, keys: Sequence[str] = ()) -> None:
    """Check ``group``'s ``lr`` and every hyperparameter of ``rule`` against the shared table.

    Every key of :data:`sage_optim.presets.RULE_DEFAULTS` for ``rule`` that the group holds
    (``weight_decay``, ``eps``, ``alpha``, ``seed``, ...; ``betas`` for ``b1``/``b2``) and
    ``keys`` are checked against :mod:`sage_optim.hyperparams` (its ranges and choices), so
    no hyperparameter of a rule goes unchecked: the messages are those of
    :mod:`sage_optax`.  The order is ``torch.optim``'s (``torch.optim.AdamW``): ``lr``,
    ``eps``, ``betas``, then the others, so a group with several invalid values is refused
    for the one torch would name.
    """
    check_lr(group["lr"], rule, capturable=bool(group.get("capturable")))
    defaults = RULE_DEFAULTS.get(rule, {})
    if "eps" in defaults and "eps" in group:  # torch.optim's order: lr, eps, betas, the rest
        hyperparams.check("eps", group["eps"], rule)
    if "b1" in defaults:
        betas = group["betas"]
        if isinstance(betas, str) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        hyperparams.check("b1", betas[0], rule, "betas[0] (b1)")
        hyperparams.check("b2", betas[1], rule, "betas[1] (b2)")
    names = [k for k in defaults if k not in ("b1", "b2", "projection", "eps")]
    for key in dict.fromkeys([*names, *keys]):
        if key in group:
            hyperparams.check(key, group[key], rule)


def axis_group(value: Axes, ndim: int, what: str, name: str = "") -> tuple[int, ...]:
    """``value`` (an int or a tuple of ints) as non-negative dims of an ``ndim``-D tensor.

    Raises:
      ValueError: not ints, empty, out of range or repeated; the message names ``what``.
    """
    group = as_axis_group(value, what)
    if group is None:
        raise ValueError(f"{what} must be an int or a tuple of ints, got None")
    for a in group:
        if not -ndim <= a < ndim:
            raise ValueError(f"{what}={value!r} is out of range for parameter "
                             f"{name or '<unnamed>'} with {ndim} dims")
    out = tuple(a % ndim for a in group)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}={value!r} lists a dim twice for parameter {name or '<unnamed>'}")
    return out


def matrix_axes(p: Tensor, group: dict[str, Any], rule: str,
                name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (fan_in, fan_out) dim groups of a matrix parameter, checked; errors name the size."""
    if p.dim() < 2:
        raise ValueError(
            f"{rule} needs a matrix, but parameter {name or '<unnamed>'} has size "
            f"{tuple(p.shape)}; route 1-D/0-D parameters to another rule "
            "(sage_torch.make_optimizer does this)"
        )
    if group.get("fan_in_dim") is None or group.get("fan_out_dim") is None:
        raise ValueError(
            f"{rule} needs matrix axes, but the group of parameter {name or '<unnamed>'} "
            f"(size {tuple(p.shape)}) has fan_in_dim={group.get('fan_in_dim')!r}, "
            f"fan_out_dim={group.get('fan_out_dim')!r}"
        )
    fi = axis_group(group["fan_in_dim"], p.dim(), "fan_in_dim", name)
    fo = axis_group(group["fan_out_dim"], p.dim(), "fan_out_dim", name)
    if set(fi) & set(fo):
        same = sorted(set(fi) & set(fo))
        dims = f"dim ({same[0]})" if len(same) == 1 else f"dims {same}"
        raise ValueError(f"fan_in_dim and fan_out_dim are the same {dims} for {name}")
    return fi, fo


class MatrixView:
    """A tensor with grouped fan axes as ``(batch..., OUT, IN)`` and back.

    The batch dims (neither fan-in nor fan-out) come first in their order, then the fan-out
    dims merged in the order listed, then the fan-in dims merged in the order listed, so a
    ``Conv2d`` weight ``(out, in, kh, kw)`` with ``fan_in=(1, 2, 3)``, ``fan_out=(0,)`` is the
    ``(out, in·kh·kw)`` matrix of ``w.reshape(out, -1)``: PyTorch's own ``(out, in)`` layout,
    on which the 2-D code paths run with ``fan_in_dim=-1``, ``fan_out_dim=-2``.
    """

    def __init__(self, shape: Sequence[int], fan_in: tuple[int, ...],
                 fan_out: tuple[int, ...]) -> None:
        shape = tuple(int(n) for n in shape)
        batch = tuple(a for a in range(len(shape)) if a not in fan_in and a not in fan_out)
        self.perm = (*batch, *fan_out, *fan_in)
        self.inverse = tuple(self.perm.index(a) for a in range(len(shape)))
        self.moved_shape = tuple(shape[a] for a in self.perm)
        self.shape = (*(shape[a] for a in batch), math.prod(shape[a] for a in fan_out),
                      math.prod(shape[a] for a in fan_in))
        self.identity = self.perm == tuple(range(len(shape)))

    def to_matrix(self, t: Tensor) -> Tensor:
        """``t`` as ``(batch..., OUT, IN)`` (a view where the dims are already in order)."""
        return (t if self.identity else t.permute(self.perm)).reshape(self.shape)

    def view(self, t: Tensor) -> Tensor | None:
        """A view of ``t`` sharing its storage (writes reach ``t``), or ``None`` if none."""
        if not self.identity or not t.is_contiguous():
            return None
        return t.view(self.shape)

    def from_matrix(self, x: Tensor) -> Tensor:
        """Undo :meth:`to_matrix`: ``x`` back in the parameter's layout."""
        x = x.reshape(self.moved_shape)
        return x if self.identity else x.permute(self.inverse)


def lr_of(group: dict[str, Any]) -> float | Tensor:
    """The group's learning rate: a float, or the tensor itself with ``capturable=True``.

    Without ``capturable`` a tensor ``lr`` is read on the host (``float``), as before; with
    it, a tensor ``lr`` (on the parameters' device) is used as is, so the step never reads
    it back (CUDA-graph capture).
    """
    lr = group["lr"]
    if isinstance(lr, Tensor):
        return lr if group.get("capturable", False) else float(lr)
    return float(lr)


def decayed_step(params: list[Tensor], updates: list[Tensor], lr: float | Tensor, wd: float,
                 foreach: bool) -> None:
    """θ ← θ − η·(u + w·θ), the Optax chain ``add_decayed_weights`` → ``scale(−η)``.

    ``updates`` may be overwritten (they are temporaries of the caller).  A tensor ``lr``
    (``capturable=True``) stays on the device: ``θ ← θ − (u + w·θ)·η``.
    """
    if isinstance(lr, Tensor):
        if foreach:
            if wd != 0.0:
                torch._foreach_add_(updates, params, alpha=wd)
            torch._foreach_mul_(updates, lr)
            torch._foreach_sub_(params, updates)
            return
        for p, u in zip(params, updates, strict=True):
            if wd != 0.0:
                u = u.add(p, alpha=wd)
            p.sub_(u * lr)
        return
    if foreach:
        if wd != 0.0:
            torch._foreach_add_(updates, params, alpha=wd)
        torch._foreach_add_(params, updates, alpha=-lr)
        return
    for p, u in zip(params, updates, strict=True):
        if wd != 0.0:
            u = u.add(p, alpha=wd)
        p.add_(u, alpha=-lr)


def copy_all(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])``: one ``_foreach_copy_`` for plain tensors.

    DTensor has no ``_foreach_copy_`` strategy: one ``copy_`` per tensor there.
    """
    if any(is_dtensor(t) for t in dst):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    else:
        torch._foreach_copy_(dst, src)


FUSED_RULES: tuple[str, ...] = ("sage", "sinkgd", "lion", "adamw")
"""The rules with a fused (Triton) path, ``fused=True`` (:mod:`sage_torch.triton_kernels`)."""

FUSED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16)
"""Parameter dtypes the fused kernels support (bfloat16 computed in float32, rounded as
the other paths round it: :mod:`sage_torch.triton_kernels`)."""

FUSED_DOC = """fused: ``True`` runs the rule's Triton kernels (:mod:`sage_torch.triton_kernels`;
        float32, float64 or bfloat16 CUDA parameters, ``triton`` installed).  Opt-in, as
        ``torch.optim``'s ``fused``: the default ``None`` takes foreach on CUDA (and under
        ``torch.compile``) and the single-tensor path elsewhere.  On an H100 (2026-11-26,
        ``benchmarks/RESULTS.md``) the kernels were faster than foreach for 6 of 8 float32
        configurations but slower for ``sinkgd-pure`` and the bfloat16 SinkGD hybrids, so none
        is a default; a kernel becomes one only where ``scripts/gpu-check`` shows it correct
        and faster.  ``fused=True`` with ``foreach=True``, or on a parameter the kernels cannot
        take, raises a ``ValueError`` naming it.  Before the first fused step on a device and
        dtype the kernels are checked against the single-tensor path
        (:mod:`sage_torch.fused_check`; on a failure, one warning and the foreach path), and
        ``SAGE_KERNELS=off`` in the environment turns them off (:mod:`sage_optim.kernels`)."""
"""The ``fused`` paragraph of the optimizer classes' docstrings (``{fused_doc}`` there),
one text for all of them, as ``torch.optim``'s ``_fused_doc``."""

FALLBACK_DOC = """a rule name (``"adamw"``, ``"lion"``, ...) or a dict of group options with a
        ``"rule"``; they go to a param group of their own with the group's ``lr`` and
        ``weight_decay`` and the fallback rule's defaults, as Muon-style optimizers hand them
        to AdamW.  Default ``None``: such a parameter raises a ``ValueError`` naming it."""
"""The end of the ``fallback`` paragraph (``{fallback_doc}``), one text for every class."""


def shared_docs(cls: type) -> type:
    """Class decorator: ``{fused_doc}``/``{fallback_doc}`` in the docstring, shared texts.

    They become :data:`FUSED_DOC` and :data:`FALLBACK_DOC`.
    """
    if cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("{fused_doc}", FUSED_DOC).replace(
            "{fallback_doc}", FALLBACK_DOC)
    return cls


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (it ships with CUDA builds of torch on Linux).

    Only that: whether its kernels compile and compute right on a device is checked before
    the first fused step there (:func:`sage_torch.fused_check.fused_ready`).
    """
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (read at every step, not at import).

    Fused steps of CPU tensors then run under Triton's interpreter (the CPU tests).
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def fused_unsupported(t: Tensor, name: str) -> str | None:
    """Why parameter ``name`` (tensor ``t``) cannot take the fused path, or ``None`` if it can.

    It can when ``triton`` is installed, ``t`` is a float32/float64/bfloat16 tensor (not a
    DTensor) on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.
    """
    if not triton_available():
        return (f"fused=True needs the triton package (it ships with CUDA builds of torch), "
                f"which is not installed (parameter {name})")
    if is_dtensor(t):
        return f"fused=True does not take DTensor (FSDP2) parameters: parameter {name} is one"
    if not (t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting())):
        return (f"fused=True needs CUDA tensors, but parameter {name} is on {t.device} (on "
                "the CPU the kernels run only under TRITON_INTERPRET=1, Triton's interpreter)")
    if t.dtype not in FUSED_DTYPES:
        return (f"fused=True supports float32, float64 and bfloat16 parameters, but "
                f"parameter {name} is {t.dtype} (use foreach=True for it)")
    return None


class ConstCache:
    """Small constant tensors of the fused kernels, made once per device, dtype and values.

    A fused kernel reads its hyperparameters from a tensor of its arithmetic dtype (the
    parameters' :func:`wide` dtype, so that float64 keeps them exact), on the parameters'
    device; making it on the first step only keeps later steps free of host-to-device
    copies (CUDA graph capture forbids them).  Under ``torch.compile`` the tensor is a
    constant of the graph and is not kept (storing it would make the next step recompile).
    """

    def __init__(self) -> None:
        self._tensors: dict[Any, Tensor] = {}

    def anchor(self, like: Tensor) -> Tensor:
        """A one-element tensor of ``like``'s dtype and device, made once.

        The base pointer from which the SinkGD sweep kernel reaches every matrix by
        element offsets (a tensor of the optimizer's own, so its tables hold no gradient).
        """
        key = ("anchor", like.dtype, str(like.device))
        t = self._tensors.get(key)
        if t is None:
            t = torch.zeros(1, dtype=like.dtype, device=like.device)
            if not torch.compiler.is_compiling():
                self._tensors[key] = t
        return t

    def get(self, values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
        """The 1-D tensor of ``values`` (rounded to ``dtype`` as torch rounds a scalar)."""
        key = (tuple(float(v) for v in values), dtype, str(device))
        t = self._tensors.get(key)
        if t is None:
            t = torch.tensor(key[0], dtype=dtype, device=device)
            if not torch.compiler.is_compiling():  # a traced store: a recompile next step
                self._tensors[key] = t
        return t


def lr_tensor(lr: float | Tensor, like: Tensor) -> Tensor:
    """The learning rate as a one-element tensor on ``like``'s device (for a fused kernel).

    A tensor ``lr`` (``capturable=True``) is used as is when on that device (else copied
    there); a float becomes a 0-D tensor of ``like``'s arithmetic dtype (:func:`wide`:
    float32 for bfloat16, as the CUDA kernels of ``add(..., alpha=-lr)`` use it), made by
    ``torch.full`` (a fill on the device: no host-to-device copy).
    """
    if isinstance(lr, Tensor):
        return lr if lr.device == like.device else lr.to(like.device)
    return torch.full((), lr, dtype=wide(like.dtype), device=like.device)


def by_device_dtype(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by device and dtype, groups in order of first use."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


class UpdateRule:
    """Base class of an update rule: its state, its checks and its step.

    ``cpu_threads``: helper threads of the chunked in-place CPU path
    (:mod:`sage_torch.chunked`); 1, the default, runs it on the calling thread only and
    leaves ``torch.set_num_threads`` alone.
    """

    name: str = ""

    checked: tuple[str, ...] = ()
    """Hyperparameters of the rule validated beyond ``lr``, ``weight_decay`` and ``betas``."""

    cpu_threads: int = 1

    has_fused: bool = False
    """Whether the rule has a fused (Triton) path (:data:`FUSED_RULES`)."""

    layout_free: bool = False
    """Whether the update reads no matrix axes (element-wise, or one norm over the tensor):
    every layout of a parameter then gets the same update."""

    host_keys: tuple[str, ...] = ()
    """State entries that are host bookkeeping, like ``step`` (APOLLO's ``proj_seed``): not
    counted in the state bytes of :func:`sage_torch.routing_table`, as in
    :mod:`sage_optax`, which keys its projections on the host."""

    complex_ok: bool = False
    """Whether the rule trains complex parameters (element-wise rules: as
    ``torch.view_as_real`` pairs of reals, as ``torch.optim``)."""

    needs_matrix: bool = False
    """Whether the rule treats matrices only (SinkGD, APOLLO)."""

    complex_why: str = "is defined for real tensors only"
    """Why the rule cannot train a complex parameter (the error says it)."""

    largest_param_bytes: int = 0
    """Bytes of the optimizer's largest parameter, over all param groups (set by
    :class:`~sage_torch.RuleOptimizer` before each step): the multi-tensor steps hold a few
    temporaries of that size, a scale a rule's batching can use (SinkGD's ``group_bytes``)."""

    @classmethod
    def create(cls, projection: Projection | None = None) -> UpdateRule:
        """A fresh instance for one optimizer (``projection``: APOLLO's; others ignore it)."""
        return cls()

    @classmethod
    def check_fused(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """The first-use check of the fused path on ``device`` and ``dtype``.

        ``None`` when its kernels agree with the single-tensor path, else what differs
        (:mod:`sage_torch.fused_check` runs it for every rule with :attr:`has_fused`).
        """
        return None

    def unsupported(self, p: Tensor, name: str) -> str | None:
        """Why this rule cannot treat parameter ``p`` (named ``name``), or ``None`` if it can.

        A complex parameter unless :attr:`complex_ok`; one with fewer than two dims when
        :attr:`needs_matrix`.
        """
        if p.is_complex() and not self.complex_ok:
            return (f"parameter {name or '<unnamed>'} of shape {tuple(p.shape)} is complex "
                    f"({p.dtype}): the {self.name} rule {self.complex_why}; the element-wise "
                    "rules (adamw, lion) train complex parameters, as pairs of reals")
        if self.needs_matrix and p.dim() < 2:
            return (f"{self.name} needs a matrix, but parameter {name or '<unnamed>'} has size "
                    f"{tuple(p.shape)}")
        return None

    def validate(self, group: dict[str, Any]) -> None:
        """Raise a ``ValueError`` naming any invalid hyperparameter of ``group``."""
        check_group(group, self.name, self.checked)

    def init_state(self, p: Tensor, group: dict[str, Any], name: str,
                   index: int = 0) -> dict[str, Tensor]:
        """The state of a parameter before its first step (tensors only, no ``'step'``).

        ``index``: the parameter's position in the optimizer, over all its param
        groups (what ``state_dict`` numbers it by), never its name: the state must not
        depend on whether the optimizer was built on ``parameters()`` or
        ``named_parameters()``.
        """
        return {}

    def step(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
             names: list[str], group: dict[str, Any], foreach: bool,
             fused: bool = False) -> None:
        """Apply one step to ``params`` in place (``fused``: the Triton path, where it has one)."""
        raise NotImplementedError
