"""Update rules of :mod:`sage_torch`, one class per rule, shared by every optimizer class.

Each rule works on the parameters of one param group: it creates a parameter's state
lazily (:meth:`Rule.init_state`), validates the group's hyperparameters (raising a
``ValueError`` that names them) and applies one step, either tensor by tensor or with the
``torch._foreach_*`` kernels (``foreach=True``), which fuse the element-wise parts across
parameters.  The math is that of :mod:`sage_optax` (``docs/algorithms.md``), written in the
same order of floating-point operations where it matters, so both frameworks agree to
rounding: every update is ``θ ← θ − η·(u + w·θ)`` with the rule's direction ``u``, except
APOLLO, which decays after the step as its authors' code does.

Layout: PyTorch matrices are ``(out, in)``, so the default axes are ``fan_in_dim=-1`` and
``fan_out_dim=-2``; ``nn.Embedding.weight`` ``(V, d)`` and a head ``nn.Linear(d, V).weight``
``(V, d)`` therefore have the vocab axis as fan-out axis, as in :mod:`sage_optax`.  Either
option may be a tuple of dims, merged into one matrix axis in the order listed: a ``Conv2d``
weight ``(out, in, kh, kw)`` is ``fan_in_dim=(1, 2, 3)``, ``fan_out_dim=0``, the ``(out,
in·kh·kw)`` matrix (:class:`MatrixView`).  SAGE averages over the fan-out group, SinkGD and
APOLLO work on the merged matrix; the other rules are element-wise.  ``fan_out_dim=None``
makes SAGE element-wise for every shape (a ``vector`` group).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from sage_optim import hyperparams
from sage_optim.presets import RULE_DEFAULTS
from sage_optim.routing import as_axis_group

Projection = Callable[[str, int, int, int], Tensor]
"""``projection(name, refresh_index, n, rank) -> P`` of shape ``(n, rank)`` (APOLLO)."""

def _wide(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: float32, or float64 for float64 tensors."""
    return torch.promote_types(dtype, torch.float32)


def _bias_correction(b: float, step: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 − b^t`` as a tensor (no host sync: ``torch.compile`` traces it without a break)."""
    return 1 - b ** step.to(dtype)


def _check_group(group: dict[str, Any], rule: str, keys: Sequence[str]) -> None:
    """Check ``group``'s ``lr``, ``weight_decay``, ``betas`` and ``keys``.

    Against the shared table (:mod:`sage_optim.hyperparams`): the messages are those of
    :mod:`sage_optax`.
    """
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a scalar, got a tensor of shape {tuple(lr.shape)}")
        lr = float(lr)
    hyperparams.check("lr", lr, rule)
    hyperparams.check("weight_decay", group["weight_decay"], rule)
    if "b1" in RULE_DEFAULTS.get(rule, {}):
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        hyperparams.check("b1", betas[0], rule, "betas[0] (b1)")
        hyperparams.check("b2", betas[1], rule, "betas[1] (b2)")
    for key in keys:
        hyperparams.check(key, group[key], rule)


Axes = int | tuple[int, ...]
"""A group option ``fan_in_dim``/``fan_out_dim``: one dim, or a group of dims merged into one
matrix axis in the order listed (``(1, 2, 3)``: a ``Conv2d`` weight's ``in, kh, kw``)."""


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


def _matrix_axes(p: Tensor, group: dict[str, Any], rule: str,
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


def _decayed_step(params: list[Tensor], updates: list[Tensor], lr: float, wd: float,
                  foreach: bool) -> None:
    """θ ← θ − η·(u + w·θ), the Optax chain ``add_decayed_weights`` → ``scale(−η)``."""
    if foreach:
        if wd != 0.0:
            torch._foreach_add_(updates, params, alpha=wd)
        torch._foreach_add_(params, updates, alpha=-lr)
        return
    for p, u in zip(params, updates, strict=True):
        if wd != 0.0:
            u = u.add(p, alpha=wd)
        p.add_(u, alpha=-lr)


FAST_MIN_NUMEL: int = 1 << 16
"""Plain CPU tensors with at least this many elements take the chunked in-place path."""

CHUNK_NUMEL: int = 1 << 18
"""Elements per chunk of the in-place path (a chunk of every tensor stays in the caches)."""

_DTensor: Any
try:  # FSDP2 parameters are DTensors: they keep the whole-tensor path
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch built without torch.distributed
    _DTensor = None

_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(n: int) -> ThreadPoolExecutor:
    """The ``n − 1`` helper threads that, with the calling thread, run ``n`` pieces of work."""
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = ThreadPoolExecutor(n - 1, thread_name_prefix="sage_torch")
    return pool


def _is_dtensor(t: Tensor) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def use_fast_path(p: Tensor, *others: Tensor) -> bool:
    """Whether ``p`` (with its gradient and state ``others``) takes the in-place CPU path.

    The in-place path walks a parameter in chunks of :data:`CHUNK_NUMEL` elements along
    dim 0 (spread over the intra-op threads, see :func:`_parallel`) and, for each chunk,
    runs the whole update on that chunk with two scratch buffers, so every tensor is read
    (and written) about once from memory instead of once per operation, and no temporary
    of the parameter's size is allocated.  It makes the same element-wise operations in
    the same order as the whole-tensor path (only the order of summation in reductions
    differs).  It is taken for plain (not DTensor), contiguous float32/float64 CPU tensors
    of at least :data:`FAST_MIN_NUMEL` elements whose gradient and state have the
    parameter's dtype and layout, outside ``torch.compile``; everything else (CUDA, FSDP2
    DTensors, bfloat16, small tensors) takes the whole-tensor path.
    """
    if (p.device.type != "cpu" or p.dim() == 0 or p.numel() < FAST_MIN_NUMEL
            or p.dtype not in (torch.float32, torch.float64)
            or torch.compiler.is_compiling()):
        return False
    return all(not _is_dtensor(t) and t.dtype == p.dtype and t.shape == p.shape
               and t.device == p.device and t.is_contiguous() for t in (p, *others))


def _chunks(p: Tensor, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of dim 0 with at most ``size`` elements (≥ 1 row)."""
    row = p[0].numel() if p.dim() > 1 else 1
    rows = max(1, size // max(row, 1))
    return [(i, min(i + rows, p.shape[0])) for i in range(0, p.shape[0], rows)]


ChunkWork = Callable[[int, int, int, Tensor, Tensor], None]
"""``work(k, start, stop, u, t)``: chunk ``k`` (rows ``start:stop``), two scratch views."""


def _parallel(work: Callable[[Any], None], pieces: list[Any]) -> None:
    """Run ``work(piece)`` for every piece, on ``torch.get_num_threads()`` threads.

    Thousands of small multi-threaded kernels would each end on a barrier of all the
    intra-op threads (which costs a scheduler time slice whenever another process holds a
    core), so instead the intra-op threads are set to 1 for the duration, the pieces run on
    the calling thread and ``n − 1`` helper Python threads (PyTorch releases the GIL inside
    its kernels), and the thread count is restored.
    """
    threads = torch.get_num_threads()
    n = min(threads, len(pieces))

    def run(batch: list[Any]) -> None:
        with torch.no_grad():  # grad mode is per thread
            for piece in batch:
                work(piece)

    if n <= 1:
        run(pieces)
        return
    per = -(-len(pieces) // n)
    batches = [pieces[w * per:(w + 1) * per] for w in range(n)]
    torch.set_num_threads(1)
    try:
        futures = [_pool(n).submit(run, b) for b in batches[1:] if b]
        run(batches[0])
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(threads)


def _for_chunks(p: Tensor, work: ChunkWork) -> None:
    """Run ``work`` on every chunk of ``p`` (contiguous runs of chunks per thread)."""
    chunks = _chunks(p, CHUNK_NUMEL)
    rows = max(j - i for i, j in chunks)
    scratch: dict[int, Tensor] = {}

    def one(piece: tuple[int, int, int]) -> None:
        k, i, j = piece
        buf = scratch.get(threading.get_ident())
        if buf is None:
            buf = scratch[threading.get_ident()] = torch.empty(
                (2, rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
        work(k, i, j, buf[0, : j - i], buf[1, : j - i])

    _parallel(one, [(k, i, j) for k, (i, j) in enumerate(chunks)])


def _decay_and_apply(u: Tensor, p: Tensor, lr: float, wd: float) -> None:
    """``θ ← θ − η·(u + w·θ)`` in place on a chunk, the ops of :func:`_decayed_step`."""
    if wd != 0.0:
        u.add_(p, alpha=wd)
    p.add_(u, alpha=-lr)


def _split_fast(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
                keys: tuple[str, ...], step_in_place: Callable[..., None],
                group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]:
    """Step every parameter that :func:`use_fast_path` accepts; return the others."""
    rest = []
    for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
        if use_fast_path(p, g, *(st[k] for k in keys)):
            step_in_place(p, g, st, group)
        else:
            rest.append(i)
    if len(rest) == len(params):
        return params, grads, states
    return ([params[i] for i in rest], [grads[i] for i in rest], [states[i] for i in rest])


class Rule:
    """Base class of an update rule: its state, its checks and its step."""

    name: str = ""

    checked: tuple[str, ...] = ()
    """Hyperparameters of the rule validated beyond ``lr``, ``weight_decay`` and ``betas``."""

    def validate(self, group: dict[str, Any]) -> None:
        """Raise a ``ValueError`` naming any invalid hyperparameter of ``group``."""
        _check_group(group, self.name, self.checked)

    def init_state(self, p: Tensor, group: dict[str, Any], name: str) -> dict[str, Tensor]:
        """The state of a parameter before its first step (tensors only, no 'step')."""
        return {}

    def step(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
             names: list[str], group: dict[str, Any], foreach: bool) -> None:
        """Apply one step to ``params`` in place."""
        raise NotImplementedError


class SageRule(Rule):
    """SAGE (Algorithm 1 + instantaneous damper): ``u = sign(b1·M + (1−b1)·g) ⊙ H``."""

    name = "sage"

    checked = ("eps", "damper")

    def _reduce_dim(self, p: Tensor, group: dict[str, Any]) -> int | tuple[int, ...] | None:
        """The fan-out dim (or dims) that ``s`` averages over; ``None``: element-wise.

        Element-wise for 0-D/1-D parameters and for groups with ``fan_out_dim=None`` (the
        ``vector`` groups of :func:`sage_torch.param_groups`, whatever the shape).
        """
        if p.dim() < 2 or group.get("fan_out_dim") is None:
            return None
        dims = axis_group(group["fan_out_dim"], p.dim(), "fan_out_dim")
        return dims[0] if len(dims) == 1 else dims

    def init_state(self, p: Tensor, group: dict[str, Any], name: str) -> dict[str, Tensor]:  # noqa: D102
        mu_dtype = group.get("mu_dtype") or p.dtype
        dim = self._reduce_dim(p, group)
        wide = _wide(p.dtype)
        # S is created from the reduction of the parameter itself, so that its layout (and,
        # for a sharded DTensor parameter, its placement) is that of what step() computes.
        reduced = p.detach().to(wide)
        reduced = reduced if dim is None else reduced.mean(dim=dim)
        return {
            "exp_avg": torch.zeros_like(p, dtype=mu_dtype, memory_format=torch.preserve_format),
            "scale_avg": torch.zeros_like(reduced),
        }

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        b1, b2 = group["betas"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        rest = []
        for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
            if (b2 != 0 and not isinstance(self._reduce_dim(p, group), tuple)
                    and use_fast_path(p, g, st["exp_avg"])):
                self._step_in_place(p, g, st, group)
            else:
                rest.append(i)
        if len(rest) < len(params):
            params, grads, states = ([xs[i] for i in rest] for xs in (params, grads, states))
        updates, new_m = [], []
        for p, g, st in zip(params, grads, states, strict=True):
            wide = _wide(g.dtype)
            g32, m32 = g.to(wide), st["exp_avg"].to(wide)
            dim = self._reduce_dim(p, group)
            s = g32.abs() if dim is None else g32.abs().mean(dim=dim)
            h = self._damper(s, st, group, p)
            if isinstance(dim, tuple):  # a group of fan-out dims: broadcast over all of them
                h = h.reshape([1 if a in dim else n for a, n in enumerate(p.shape)])
            elif dim is not None:
                h = h.unsqueeze(dim)
            m_new = g32 * (1 - b2) + m32 * b2
            # sign(b1·M_{t−1} + (1−b1)·g), read from M_t as sage_optax.lion_direction does
            # (the same rounding in both frameworks).
            arg = g32 * (1.0 - b1) + m32 * b1 if b2 == 0 else m_new * b1 + g32 * (b2 - b1)
            updates.append((torch.sign(arg) * h).to(p.dtype))
            new_m.append(m_new)
        # One copy_ per tensor even with foreach: DTensor has no _foreach_copy_ strategy.
        for st, m in zip(states, new_m, strict=True):
            st["exp_avg"].copy_(m)
        if params:
            _decayed_step(params, updates, lr, wd, foreach)

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

    def _damper(self, s: Tensor, st: dict[str, Any], group: dict[str, Any],
                p: Tensor) -> Tensor:
        """Update the EMA ``S`` with ``s`` and return ``H`` (shaped like ``s``)."""
        b2 = group["betas"][1]
        S = st["scale_avg"]
        S.mul_(b2).add_(s.to(S.dtype), alpha=1 - b2)
        s_hat = S.to(s.dtype) / _bias_correction(b2, st["step"], s.dtype)
        return sage_damper(s, s_hat, group["eps"], group["damper"], self._rms_dims(p, group))

    def _step_in_place(self, p: Tensor, g: Tensor, st: dict[str, Any],
                       group: dict[str, Any]) -> None:
        """One step of one plain CPU parameter, chunk by chunk (see :func:`use_fast_path`).

        Pass 1 reduces ``|g|`` over the vocab dim (``s``: a partial sum per chunk, then
        their sum, as ``mean``); pass 2 updates ``M``, forms ``sign(b1·M_t + (b2−b1)·g)·H``
        and applies it with the decay, all on one chunk at a time, with the operations (and
        so the rounding) of the whole-tensor path.
        """
        b1, b2 = group["betas"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        m = st["exp_avg"]
        dim = self._reduce_dim(p, group)
        assert not isinstance(dim, tuple), "groups of fan-out dims take the whole-tensor path"
        if dim is None:
            s = g.abs()
        elif dim == 0:
            n_chunks = len(_chunks(p, CHUNK_NUMEL))
            partial = torch.empty((n_chunks, *p.shape[1:]), dtype=p.dtype)

            def reduce(k: int, i: int, j: int, a: Tensor, _: Tensor) -> None:
                torch.abs(g[i:j], out=a)
                torch.sum(a, dim=0, out=partial[k])

            _for_chunks(p, reduce)
            s = partial.sum(dim=0).div_(p.shape[0])
        else:
            s = torch.empty((*p.shape[:dim], *p.shape[dim + 1:]), dtype=p.dtype)

            def reduce(k: int, i: int, j: int, a: Tensor, _: Tensor) -> None:
                torch.abs(g[i:j], out=a)
                torch.mean(a, dim=dim, out=s[i:j])

            _for_chunks(p, reduce)
        h = self._damper(s, st, group, p)
        if dim is not None:
            h = h.unsqueeze(dim)

        def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
            gi, mi, pi = g[i:j], m[i:j], p[i:j]
            hi = h if h.shape[0] == 1 else h[i:j]
            torch.mul(gi, 1 - b2, out=t)  # M_t = g·(1−b2) + M·b2
            mi.mul_(b2).add_(t)
            torch.mul(mi, b1, out=u)  # b1·M_t + (b2−b1)·g
            torch.mul(gi, b2 - b1, out=t)
            u.add_(t).sign_().mul_(hi)
            _decay_and_apply(u, pi, lr, wd)

        _for_chunks(p, update)


def sage_damper(s: Tensor, s_hat: Tensor, eps: float, damper: str = "both",
                dims: tuple[int, ...] | None = None) -> Tensor:
    """SAGE's ``H = min(σ/(Ŝ+ε), γ/(s+ε), 1)`` with σ, γ the RMS of ``Ŝ`` and ``s``.

    ``dims``: the dims the RMS averages over (default: every entry); the others are batch
    dims (stacked layers), each with its own σ and γ.
    """
    def rms(x: Tensor) -> Tensor:
        if dims is None:
            return x.square().mean().sqrt()
        return x.square().mean(dim=dims, keepdim=True).sqrt()

    h = torch.ones_like(s)
    if damper in ("both", "ema"):
        h = torch.minimum(h, rms(s_hat) / (s_hat + eps))
    if damper in ("both", "instant"):
        h = torch.minimum(h, rms(s) / (s + eps))
    return h


class LionRule(Rule):
    """Lion (Chen et al. 2023): ``u = sign(b1·m + (1−b1)·g)``, then ``m ← b2·m + (1−b2)·g``."""

    name = "lion"

    def init_state(self, p, group, name):  # noqa: D102
        return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        b1, b2 = group["betas"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        params, grads, states = _split_fast(params, grads, states, ("exp_avg",),
                                            self._step_in_place, group)
        if not params:
            return
        ms = [st["exp_avg"] for st in states]
        if foreach:
            c = torch._foreach_mul(grads, 1.0 - b1)
            torch._foreach_add_(c, torch._foreach_mul(ms, b1))
            updates = list(torch._foreach_sign(c))
            new_m = torch._foreach_mul(grads, 1 - b2)
            torch._foreach_add_(new_m, torch._foreach_mul(ms, b2))
            for m, n in zip(ms, new_m, strict=True):  # DTensor has no _foreach_copy_
                m.copy_(n)
        else:
            updates = []
            for g, m in zip(grads, ms, strict=True):
                updates.append(torch.sign(g * (1.0 - b1) + m * b1))
                m.copy_(g * (1 - b2) + m * b2)
        _decayed_step(params, updates, lr, wd, foreach)

    def _step_in_place(self, p: Tensor, g: Tensor, st: dict[str, Any],
                       group: dict[str, Any]) -> None:
        """The single-tensor step on one chunk at a time (see :func:`use_fast_path`)."""
        b1, b2 = group["betas"]
        lr, wd = float(group["lr"]), group["weight_decay"]
        m = st["exp_avg"]

        def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
            gi, mi, pi = g[i:j], m[i:j], p[i:j]
            torch.mul(gi, 1.0 - b1, out=u)  # sign(g·(1−b1) + m·b1)
            torch.mul(mi, b1, out=t)
            u.add_(t).sign_()
            torch.mul(gi, 1 - b2, out=t)  # m ← g·(1−b2) + m·b2
            mi.mul_(b2).add_(t)
            _decay_and_apply(u, pi, lr, wd)

        _for_chunks(p, update)


class AdamWRule(Rule):
    """AdamW as ``optax.adamw`` (and ``torch.optim.AdamW``): bias-corrected ``m̂/(√v̂+ε)``."""

    name = "adamw"

    checked = ("eps",)

    def init_state(self, p, group, name):  # noqa: D102
        return {
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        b1, b2 = group["betas"]
        eps, lr, wd = group["eps"], float(group["lr"]), group["weight_decay"]
        params, grads, states = _split_fast(params, grads, states, ("exp_avg", "exp_avg_sq"),
                                            self._step_in_place, group)
        if not params:
            return
        ms = [st["exp_avg"] for st in states]
        vs = [st["exp_avg_sq"] for st in states]
        wides = [_wide(p.dtype) for p in params]
        bias1 = [_bias_correction(b1, st["step"], w) for st, w in zip(states, wides, strict=True)]
        bias2 = [_bias_correction(b2, st["step"], w) for st, w in zip(states, wides, strict=True)]
        if foreach:
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, 1 - b2)
            m_hat = torch._foreach_div(ms, bias1)
            v_hat = torch._foreach_div(vs, bias2)
            denom = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(denom, eps)
            updates = list(torch._foreach_div(m_hat, denom))
        else:
            updates = []
            for g, m, v, c1, c2 in zip(grads, ms, vs, bias1, bias2, strict=True):
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                updates.append((m / c1) / ((v / c2).sqrt() + eps))
        _decayed_step(params, updates, lr, wd, foreach)

    def _step_in_place(self, p: Tensor, g: Tensor, st: dict[str, Any],
                       group: dict[str, Any]) -> None:
        """The single-tensor step on one chunk at a time (see :func:`use_fast_path`)."""
        b1, b2 = group["betas"]
        eps, lr, wd = group["eps"], float(group["lr"]), group["weight_decay"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        c1 = _bias_correction(b1, st["step"], p.dtype)
        c2 = _bias_correction(b2, st["step"], p.dtype)

        def update(k: int, i: int, j: int, u: Tensor, t: Tensor) -> None:
            gi, mi, vi, pi = g[i:j], m[i:j], v[i:j], p[i:j]
            mi.lerp_(gi, 1 - b1)
            vi.mul_(b2).addcmul_(gi, gi, value=1 - b2)
            torch.div(vi, c2, out=t)  # (m / c1) / ((v / c2).sqrt() + eps)
            t.sqrt_().add_(eps)
            torch.div(mi, c1, out=u)
            u.div_(t)
            _decay_and_apply(u, pi, lr, wd)

        _for_chunks(p, update)


class SinkGDRule(Rule):
    """SinkGD: ``u = α·X`` with ``X`` the Sinkhorn normalisation of the gradient (stateless)."""

    name = "sinkgd"

    checked = ("num_iters", "eps", "normalization")

    def init_state(self, p, group, name):  # noqa: D102
        _matrix_axes(p, group, "SinkGD", name)
        return {}

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        lr, wd, alpha = float(group["lr"]), group["weight_decay"], group["alpha"]
        updates, rest, fast = [], [], []
        for p, g, name in zip(params, grads, names, strict=True):
            fan_in, fan_out = _matrix_axes(p, group, "SinkGD", name)
            if len(fan_in) == 1 and len(fan_out) == 1:
                (fi,), (fo,) = fan_in, fan_out
                if p.dim() == 2 and use_fast_path(p, g):
                    fast.append((p, g, fi, fo))
                    continue
                x = sinkhorn_normalize(g, fi, fo, group["num_iters"], group["eps"],
                                       group["normalization"])
                updates.append(x.to(p.dtype) * alpha)
                rest.append(p)
                continue
            # grouped axes: the (batch..., OUT, IN) matrix, a view of p where one exists
            mv = MatrixView(p.shape, fan_in, fan_out)
            pv, gv = mv.view(p), mv.view(g)
            if pv is not None and gv is not None and pv.dim() == 2 and use_fast_path(pv, gv):
                fast.append((pv, gv, 1, 0))
                continue
            x = sinkhorn_normalize(mv.to_matrix(g), -1, -2, group["num_iters"], group["eps"],
                                   group["normalization"])
            updates.append(mv.from_matrix(x.to(p.dtype) * alpha))
            rest.append(p)
        if fast:
            self._step_matrices(fast, group)
        if rest:
            _decayed_step(rest, updates, lr, wd, foreach)

    def _step_matrices(self, items: list[tuple[Tensor, Tensor, int, int]],
                       group: dict[str, Any]) -> None:
        """Step plain CPU matrices, whole matrices spread over the intra-op threads.

        A matrix's Sinkhorn loop is ``2L`` products and a few vector operations: split
        over threads, each would end on a barrier.  Instead every matrix runs on one
        thread (:func:`_parallel`), the matrices balanced by size over the threads, each
        thread reusing one buffer for ``K``.
        """
        n = max(1, min(torch.get_num_threads(), len(items)))
        bins: list[list[tuple[Tensor, Tensor, int, int]]] = [[] for _ in range(n)]
        loads = [0] * n
        for item in sorted(items, key=lambda it: -it[0].numel()):
            k = loads.index(min(loads))
            bins[k].append(item)
            loads[k] += item[0].numel()

        def run(batch: list[tuple[Tensor, Tensor, int, int]]) -> None:
            p0 = batch[0][0]  # the largest of the batch
            k_buf = torch.empty(p0.numel(), dtype=p0.dtype, device=p0.device)
            for p, g, fi, fo in batch:
                self._step_in_place(p, g, fi, fo, group, k_buf)

        # one piece per thread: _parallel gives each thread one bin
        _parallel(lambda batch: run(batch), [b for b in bins if b])

    def _step_in_place(self, p: Tensor, g: Tensor, fi: int, fo: int,
                       group: dict[str, Any], k_buf: Tensor | None = None) -> None:
        """One plain CPU matrix: scales from :func:`sinkhorn_scales`, then the update by chunks.

        ``θ ← θ − η·(α·(c·G·r) + w·θ)`` one chunk of rows at a time, with the operations of
        the whole-tensor path (``c·G``, then ``·r``, then ``·α``).
        """
        lr, wd, alpha = float(group["lr"]), group["weight_decay"], group["alpha"]
        c, r = sinkhorn_scales(g, fi, fo, group["num_iters"], group["eps"],
                               group["normalization"], buffer=k_buf)
        # X = c·G·r with c one scale per fan-in index, r one per fan-out index (2-D here)
        rows, cols = (r, c) if fo == 0 else (c, r)
        rows, cols = rows.unsqueeze(1), cols.unsqueeze(0)

        def update(k: int, i: int, j: int, u: Tensor, _: Tensor) -> None:
            if fo == 0:
                torch.mul(cols, g[i:j], out=u).mul_(rows[i:j])
            else:
                torch.mul(rows[i:j], g[i:j], out=u).mul_(cols)
            u.mul_(alpha)
            _decay_and_apply(u, p[i:j], lr, wd)

        _for_chunks(p, update)


def sinkhorn_normalize(g: Tensor, fan_in_dim: Axes, fan_out_dim: Axes, num_iters: int = 5,
                       eps: float = 1e-8, normalization: str = "unit", *,
                       matvec: bool | None = None) -> Tensor:
    """Sinkhorn-normalise ``g``: fan-in norms then fan-out norms, ``num_iters`` times.

    Kept as ``X = c ⊙ G ⊙ r`` with two scale vectors, as in :mod:`sage_optax.sinkhorn`:
    each half-iteration is one reduction of ``G²`` weighted by the other vector: a
    matrix-vector product (:func:`sinkhorn_scales`) when ``matvec`` (default: for a plain
    2-D tensor), else an element-wise product and a sum, which works on any number of dims
    and on FSDP2 DTensors (the two differ only in the order of summation).

    ``fan_in_dim``/``fan_out_dim`` may be groups of dims (tuples): ``g`` is then normalised
    as one matrix per batch index, each group merged into one axis (:class:`MatrixView`);
    the dims of neither group are batch dims.
    """
    if not isinstance(fan_in_dim, int) or not isinstance(fan_out_dim, int):
        fan_in = axis_group(fan_in_dim, g.dim(), "fan_in_dim")
        fan_out = axis_group(fan_out_dim, g.dim(), "fan_out_dim")
        if len(fan_in) > 1 or len(fan_out) > 1:
            mv = MatrixView(g.shape, fan_in, fan_out)
            x = sinkhorn_normalize(mv.to_matrix(g), -1, -2, num_iters, eps, normalization,
                                   matvec=matvec)
            return mv.from_matrix(x)
        fan_in_dim, fan_out_dim = fan_in[0], fan_out[0]
    wide = _wide(g.dtype)
    g = g.to(wide)
    if matvec is None:
        matvec = g.dim() == 2 and not _is_dtensor(g)
    if matvec:
        c, r = sinkhorn_scales(g, fan_in_dim, fan_out_dim, num_iters, eps, normalization)
        return c.unsqueeze(fan_out_dim % 2) * g * r.unsqueeze(fan_in_dim % 2)
    m = range_scale(g, (fan_in_dim, fan_out_dim))
    g2 = (g / m).square()  # g / m is exact: m is a power of two
    c = torch.ones_like(g2.sum(dim=fan_out_dim, keepdim=True))
    r = torch.ones_like(g2.sum(dim=fan_in_dim, keepdim=True))
    t_in, t_out = _sinkhorn_targets(g, fan_in_dim, fan_out_dim, normalization)
    for i in range(int(num_iters)):
        q = (g2 * c.square()).sum(dim=fan_in_dim, keepdim=True).sqrt()
        r = torch.where(q > 0, r * t_in / (r * q + (eps / m if i == 0 else eps)), r)
        q = (g2 * r.square()).sum(dim=fan_out_dim, keepdim=True).sqrt()
        c = torch.where(q > 0, c * t_out / (c * q + eps), c)
    half = _pow2_sqrt_floor(m)
    return (c / half) * g * (r / (m / half))


def range_scale(g: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``m``: a power of two with ``m ≤ max|g| < 2m`` over ``dims`` (kept, size 1).

    As :func:`sage_optax.sinkhorn.range_scale`: 1 for an all-zero, zero-size or non-finite
    matrix, and at least the dtype's smallest normal number.  The Sinkhorn iteration runs
    on ``g / m``, whose squares are in range for any finite ``g``; dividing by a power of
    two is exact, so in-range gradients give bit-for-bit the plain computation's result.
    """
    if g.numel() == 0:
        shape = [1 if d in {x % g.dim() for x in dims} else n for d, n in enumerate(g.shape)]
        return torch.ones(shape, dtype=g.dtype, device=g.device)
    amax = g.abs().amax(dim=dims, keepdim=True)
    mantissa, _ = torch.frexp(amax)  # amax = mantissa · 2^e, mantissa in [0.5, 1)
    ok = (amax > 0) & torch.isfinite(amax)
    # amax / mantissa is exactly 2^e (a correctly rounded division with an exact result)
    m = torch.where(ok, amax / torch.where(ok, 2 * mantissa, 1), 1)
    return m.clamp_min(torch.finfo(g.dtype).tiny)


def _pow2_sqrt_floor(m: Tensor) -> Tensor:
    """For a power of two ``m = 2^k``, the power of two ``2^⌊k/2⌋`` (exact).

    ``X = c·(G/m)·r`` is returned as ``(c/2^⌊k/2⌋)·G·(r/2^⌈k/2⌉)``: both scales and every
    partial product stay in range for any finite ``G``.
    """
    _, e = torch.frexp(m)  # m = 0.5 · 2^e, so k = e − 1
    # sqrt of an even power of two is exact; for odd k take sqrt(m / 2) = 2^((k − 1) / 2)
    return torch.where(e % 2 == 0, (m / 2).sqrt(), m.sqrt())


def _sinkhorn_targets(g: Tensor, fan_in_dim: int, fan_out_dim: int,
                      normalization: str) -> tuple[float, float]:
    if normalization == "unit":
        return 1.0, 1.0
    return math.sqrt(g.shape[fan_in_dim]), math.sqrt(g.shape[fan_out_dim])


def sinkhorn_scales(g: Tensor, fan_in_dim: int, fan_out_dim: int, num_iters: int = 5,
                    eps: float = 1e-8, normalization: str = "unit", *,
                    buffer: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The scale vectors ``(c, r)`` of a plain 2-D ``g``: ``X = c ⊙ G ⊙ r``.

    ``c`` has one entry per fan-in index and ``r`` one per fan-out index (1-D, float32 or
    wider).  ``K = (G/m)²`` is formed once (``m``: :func:`range_scale`, so that the squares
    are in range for any finite ``G``; the first half-iteration then uses ``eps/m``, and
    ``1/m`` is split between ``c`` and ``r``, as in :mod:`sage_optax.sinkhorn`); every
    half-iteration is one ``torch.mv`` of ``K`` with the other vector's square (a layer's
    ``K`` stays in the CPU's last-level cache across the ``2L`` products).  ``buffer``: a
    tensor of ``g``'s wide dtype with at least ``g.numel()`` elements to hold ``K``
    (reused across matrices: no fresh allocation, and so no page faults, per matrix).
    """
    wide = _wide(g.dtype)
    m = range_scale(g.to(wide), (0, 1)).reshape(())
    if buffer is not None and buffer.dtype == wide and buffer.numel() >= g.numel():
        k = torch.div(g.to(wide), m, out=buffer[: g.numel()].view(g.shape)).square_()
    else:
        k = g.to(wide).div(m).square_()
    if fan_out_dim % 2 != 0:  # K as (fan_out, fan_in), a view
        k = k.t()
    t_in, t_out = _sinkhorn_targets(g, fan_in_dim, fan_out_dim, normalization)
    c = torch.ones(k.shape[1], dtype=wide, device=g.device)
    r = torch.ones(k.shape[0], dtype=wide, device=g.device)
    for i in range(int(num_iters)):
        q = torch.mv(k, c.square()).sqrt_()  # one norm per output unit (over the fan-in)
        r = torch.where(q > 0, r * t_in / (r * q + (eps / m if i == 0 else eps)), r)
        q = torch.mv(k.t(), r.square()).sqrt_()
        c = torch.where(q > 0, c * t_out / (c * q + eps), c)
    half = _pow2_sqrt_floor(m)
    return c / half, r / (m / half)


class UnitNormRule(Rule):
    """The stateless step of ``sinkgd-pure`` on vectors: ``u = g / (‖g‖₂ + ε)``."""

    name = "unit_norm"

    checked = ("eps",)

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        if foreach:
            # out of place: a DTensor's norm is a pending (partial) reduction, not writable
            norms = torch._foreach_add(torch._foreach_norm(grads), eps)
            updates = list(torch._foreach_div(grads, norms))
        else:
            updates = [g / (torch.linalg.vector_norm(g) + eps) for g in grads]
        _decayed_step(params, updates, lr, wd, foreach)


def gaussian_projection(seed: int = 0) -> Projection:
    """Default APOLLO projection: entries ``N(0, 1/r)``.

    Drawn from a generator keyed on ``(seed, crc32(name), refresh_index)``, float32 on the
    CPU, like :mod:`sage_optax`'s (the two frameworks' generators differ: inject one
    projection into both for parity).
    """

    def projection(name: str, refresh_index: int, n: int, rank: int) -> Tensor:
        key = (seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_033 + refresh_index
        gen = torch.Generator().manual_seed(key % (2**63))
        return torch.randn(n, rank, generator=gen, dtype=torch.float32) / math.sqrt(rank)

    return projection


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


class ApolloRule(Rule):
    """APOLLO (Zhu et al. 2024, ``docs/algorithms.md``); decay is applied after the step."""

    name = "apollo"

    def __init__(self, projection: Projection | None = None) -> None:
        self.projection = projection

    checked = ("rank", "update_proj_gap", "scale_type", "scale", "limiter_gamma", "eps")

    def _plan(self, p: Tensor, group: dict[str, Any],
              name: str) -> tuple[int, int, int, MatrixView | None]:
        """``(fan_in, fan_out, compressed, view)``: the matrix dims APOLLO works on.

        The dims of ``p``, or, for grouped axes, of its ``(batch..., OUT, IN)`` matrix
        ``view`` (each group flattened in the order it lists its dims: the order in which
        the projection sees the merged axis).
        """
        fan_in, fan_out = _matrix_axes(p, group, "APOLLO", name)
        view, shape = None, tuple(p.shape)
        if len(fan_in) == 1 and len(fan_out) == 1:
            (fi,), (fo,) = fan_in, fan_out
        else:
            view = MatrixView(p.shape, fan_in, fan_out)
            shape = view.shape
            fi, fo = len(shape) - 1, len(shape) - 2
        compressed = fi if shape[fo] >= shape[fi] else fo
        return fi, fo, compressed, view

    def init_state(self, p, group, name):  # noqa: D102
        fi, fo, comp, view = self._plan(p, group, name)
        base = p.detach() if view is None else view.to_matrix(p.detach())
        shape = list(base.shape)
        shape[comp] = int(group["rank"])
        wide = _wide(p.dtype)
        # Zeros shaped like the projected gradient (p with dim `comp` of size rank) and like
        # the limiter's norm (one per batch index), made from reductions of p, as SAGE's S, so
        # that a sharded DTensor parameter gets states with the placements step() computes.
        # With grouped axes they are those of p's matrix view.
        moments = base.sum(dim=comp, keepdim=True).expand(shape)
        return {
            "exp_avg": torch.zeros_like(moments, dtype=wide, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(moments, dtype=wide,
                                           memory_format=torch.contiguous_format),
            "limiter_norm": torch.zeros_like(base.sum(dim=(fi, fo)), dtype=wide),
        }

    def step(self, params, grads, states, names, group, foreach):  # noqa: D102
        b1, b2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        rank, gamma = int(group["rank"]), group["limiter_gamma"]
        projection = self.projection or gaussian_projection(int(group["seed"]))
        for p, g, st, name in zip(params, grads, states, names, strict=True):
            fi, fo, comp, view = self._plan(p, group, name)
            t = float(st["step"])
            refresh = (int(t) - 1) // int(group["update_proj_gap"])
            wide = _wide(g.dtype)
            g32 = g.to(wide) if view is None else view.to_matrix(g).to(wide)
            proj = projection(name, refresh, g32.shape[comp], rank).to(device=g.device,
                                                                       dtype=wide)
            proj = _replicated_like(proj, g)
            r = torch.matmul(g32.movedim(comp, -1), proj).movedim(-1, comp)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.copy_(m * b1 + r * (1 - b1))
            v.copy_(v * b2 + r.square() * (1 - b2))
            r_tilde = m / (v.sqrt() + eps)
            dims = (fi, fo) if group["scale_type"] == "tensor" else (comp,)

            def norm(x: Tensor, dims: tuple[int, ...] = dims) -> Tensor:
                return x.square().sum(dim=dims, keepdim=True).sqrt()

            s = norm(r_tilde) / (norm(r) + 1e-8)
            u = g32 * (s * math.sqrt(group["scale"]))
            norm_u = norm(u, (fi, fo))
            prev = st["limiter_norm"].reshape(norm_u.shape).to(wide)
            bound = gamma * prev
            limit = (prev > 0) & (norm_u > bound)
            factor = torch.where(limit, bound / torch.where(limit, norm_u, 1), 1)
            u = u * factor
            st["limiter_norm"].copy_((norm_u * factor).reshape(st["limiter_norm"].shape))
            step_size = lr * math.sqrt(_one_minus_pow(b2, t)) / _one_minus_pow(b1, t)
            if view is not None:
                u = view.from_matrix(u)
            p.add_(u.to(p.dtype), alpha=-step_size)
            if wd != 0.0:
                p.mul_(1 - lr * wd)


RULES: dict[str, type[Rule]] = {
    r.name: r for r in (SageRule, LionRule, AdamWRule, SinkGDRule, UnitNormRule, ApolloRule)
}
assert set(RULES) == set(RULE_DEFAULTS), "every shared rule has a PyTorch implementation"
