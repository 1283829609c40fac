"""The chunked in-place CPU path of :mod:`sage_torch` (SAGE, Lion, AdamW rule, SinkGD).

A plain CPU parameter is walked in chunks of :data:`CHUNK_NUMEL` elements along dim 0 and,
for each chunk, the whole update runs on that chunk with two scratch buffers: every tensor
is read (and written) about once from memory instead of once per operation, and no
temporary of the parameter's size is allocated.  It makes the same element-wise operations
in the same order as the whole-tensor path (only the order of summation in reductions
differs).

By default the chunks run on the calling thread: no thread is started and no global state
(``torch.set_num_threads``) is touched.  ``cpu_threads=N > 1`` (an option of
:class:`sage_torch.RuleOptimizer` and :func:`sage_torch.make_optimizer`) opts in to
spreading them over ``N`` threads: the calling one and ``N − 1`` helper Python threads
(PyTorch releases the GIL inside its kernels).  Thousands of small multi-threaded kernels
would each end on a barrier of all the intra-op threads, so while such a step runs the
process's intra-op thread count is set to 1 and restored afterwards: torch work on *other*
threads during that ``opt.step()`` runs single-threaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from sage_torch.common import is_dtensor

FAST_MIN_NUMEL: int = 1 << 16
"""Plain CPU tensors with at least this many elements take the chunked in-place path."""

CHUNK_NUMEL: int = 1 << 18
"""Elements per chunk of the in-place path (a chunk of every tensor stays in the caches)."""

_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(n: int) -> ThreadPoolExecutor:
    """The ``n − 1`` helper threads that, with the calling thread, run ``n`` pieces of work."""
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = ThreadPoolExecutor(n - 1, thread_name_prefix="sage_torch")
    return pool


def _is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (a module attribute so that tests can force either path)."""
    return is_dtensor(t)


def use_fast_path(p: Tensor, *others: Tensor) -> bool:
    """Whether ``p`` (with its gradient and state ``others``) takes the in-place CPU path.

    Plain (not DTensor), contiguous float32/float64 CPU tensors of at least
    :data:`FAST_MIN_NUMEL` elements whose gradient and state have the parameter's dtype and
    layout, outside ``torch.compile``; everything else (CUDA, FSDP2 DTensors, bfloat16,
    small tensors) takes the whole-tensor or multi-tensor path.
    """
    if (p.device.type != "cpu" or p.dim() == 0 or p.numel() < FAST_MIN_NUMEL
            or p.dtype not in (torch.float32, torch.float64)
            or torch.compiler.is_compiling()):
        return False
    return all(not _is_dtensor(t) and t.dtype == p.dtype and t.shape == p.shape
               and t.device == p.device and t.is_contiguous() for t in (p, *others))


def chunks(p: Tensor, size: int | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of dim 0 with at most ``size`` elements (≥ 1 row)."""
    size = CHUNK_NUMEL if size is None else size
    row = p[0].numel() if p.dim() > 1 else 1
    rows = max(1, size // max(row, 1))
    return [(i, min(i + rows, p.shape[0])) for i in range(0, p.shape[0], rows)]


ChunkWork = Callable[[int, int, int, Tensor, Tensor], None]
"""``work(k, start, stop, u, t)``: chunk ``k`` (rows ``start:stop``), two scratch views."""


def parallel(work: Callable[[Any], None], pieces: list[Any], threads: int = 1) -> None:
    """Run ``work(piece)`` for every piece, on the calling thread or ``threads`` threads.

    ``threads <= 1``: in turn on the calling thread (no thread, no global state).  Else
    (opt-in, see the module docstring) on the calling thread and ``threads − 1`` helper
    threads, with the intra-op thread count set to 1 for the duration and restored.
    """
    n = min(max(int(threads), 1), len(pieces))

    def run(batch: list[Any]) -> None:
        with torch.no_grad():  # grad mode is per thread
            for piece in batch:
                work(piece)

    if n <= 1:
        run(pieces)
        return
    per = -(-len(pieces) // n)
    batches = [pieces[w * per:(w + 1) * per] for w in range(n)]
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        futures = [_pool(n).submit(run, b) for b in batches[1:] if b]
        run(batches[0])
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(intra_op)


def for_chunks(p: Tensor, work: ChunkWork, threads: int = 1) -> None:
    """Run ``work`` on every chunk of ``p`` (contiguous runs of chunks per thread)."""
    spans = chunks(p)
    rows = max(j - i for i, j in spans)
    scratch: dict[int, Tensor] = {}

    def one(piece: tuple[int, int, int]) -> None:
        k, i, j = piece
        buf = scratch.get(threading.get_ident())
        if buf is None:
            buf = scratch[threading.get_ident()] = torch.empty(
                (2, rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
        work(k, i, j, buf[0, : j - i], buf[1, : j - i])

    parallel(one, [(k, i, j) for k, (i, j) in enumerate(spans)], threads)


def decay_and_apply(u: Tensor, p: Tensor, lr: float, wd: float) -> None:
    """``θ ← θ − η·(u + w·θ)`` in place on a chunk, the ops of :func:`common.decayed_step`."""
    if wd != 0.0:
        u.add_(p, alpha=wd)
    p.add_(u, alpha=-lr)


def split_fast(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]],
               keys: tuple[str, ...], step_in_place: Callable[[Tensor, Tensor, dict[str, Any]],
                                                              None]
               ) -> tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]:
    """Step every parameter that :func:`use_fast_path` accepts; return the others."""
    rest = []
    for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
        if use_fast_path(p, g, *(st[k] for k in keys)):
            step_in_place(p, g, st)
        else:
            rest.append(i)
    if len(rest) == len(params):
        return params, grads, states
    return ([params[i] for i in rest], [grads[i] for i in rest], [states[i] for i in rest])
