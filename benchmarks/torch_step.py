"""One optimizer step of every ``sage_torch`` configuration vs ``torch.optim.AdamW``, in PyTorch.

For the chosen LLaMA shape (``--model``, default the paper's ``270m``) the script builds an
``nn.Module`` with the model's exact parameter shapes in PyTorch layout (``nn.Embedding``
``(V, d)``, tied head, ``nn.Linear`` ``(out, in)`` projections without bias, 1-D norm
weights), so that :func:`sage_torch.make_optimizer` routes them as it would a real LLaMA.
Parameters are float32 ``0.02 * normal``; one fixed gradient per parameter
(``0.02 * normal``) is shared by every optimizer.  All optimizers step the same parameter
tensors (each has its own state), which keeps memory at one copy of the model; the values
drift by a few learning-rate steps, which does not change the cost of any operation.

For every configuration of :data:`sage_optim.CONFIG_NAMES` (``--configs``) the script builds
``make_optimizer(name, model, lr, foreach=False)`` (the single-tensor path) and
``foreach=True``, and times them against the baseline
``torch.optim.AdamW(lr, betas=(0.9, 0.99), weight_decay=0.01, foreach=True)``: ``--warmup``
untimed rounds (the first creates the state), then ``--repeats`` rounds; in each round the
baseline, both paths and the bandwidth kernel below each run once, in an order rotated from
round to round.  Each configuration is interleaved with the baseline in its own rounds
(pairwise, so only one configuration's state is alive at a time) and its ratio is its
median over the baseline's median of the same rounds.

Bytes moved per step: the analytic model of :mod:`sage_repro.traffic`, shared with
``benchmarks/jax_step.py`` (``|S|`` counted from the optimizer's ``state`` after the warmup,
without the ``step`` counters).

Memory bandwidth is measured in the same rounds: an in-place ``x.mul_(1.0001).add_(1)`` over
``--bw-mib`` (512) MiB of float32, counted as two reads and two writes of ``x`` (two
kernels).  Each configuration's ``bytes / median time`` is reported as a fraction of it.

Peak extra memory of a step: one extra (untimed) step of each optimizer runs under a
``TorchDispatchMode`` that records every tensor an operation returns whose storage is not
already alive (not a parameter, gradient, state or earlier output), and the bytes of those
storages alive at once, at their peak (the CPU allocator has no statistics of its own;
``tracemalloc`` does not see torch's allocations).  Dispatch modes are per thread: the
scratch buffers of ``sage_torch``'s chunked path on its helper threads (two chunks of
at most 31·1024 elements per extra thread) are not counted.

Prints a markdown table and whether the target holds: ``sage-hybrid``'s step no slower than
AdamW's (ratio ≤ 1) in each path.

``--threads N`` also passes ``cpu_threads=N`` to ``sage_torch.make_optimizer`` (the chunked
CPU path on ``N`` threads, as before issue 13; the library default is 1).

``--device cuda`` times on the GPU (``torch.cuda.synchronize`` around each timing) and adds
the baseline ``torch.optim.AdamW(fused=True)`` and, where ``triton`` is installed, a third
row per configuration for sage_torch's fused (Triton) path (``make_optimizer(...,
fused=True)``, opt-in) next to its foreach path (the CUDA default, as in ``torch.optim``),
then a table of fused against foreach per configuration: the timings that decide whether
a kernel becomes a default.  ``--device cpu`` (default) is the CPU run.  ``--dtype
bfloat16`` runs the same with bfloat16 parameters and gradients (default float32).

Aten op count (any machine, no memory): ``--op-count`` steps the model on the ``meta``
device under a ``TorchDispatchMode`` that counts every aten op of one ``opt.step()`` (the
second; the first creates the state) and another that measures its peak extra memory (the
storages the step creates, alive at once, as ``peak extra`` above but of ``meta`` tensors:
the bytes the same ops would allocate on a GPU), and, where ``triton`` is installed, the
fused path of every configuration that has one with its kernel launches counted instead of
run (:func:`count_fused`), for every configuration's single-tensor and foreach
paths and ``torch.optim.AdamW`` single-tensor, foreach (and fused where the meta device
allows it), prints that table and exits.  On a GPU every op is at least one kernel launch;
a step that completes on ``meta`` reads no device value on the host.

    python benchmarks/torch_step.py [--model 270m] [--repeats 7] [--configs sage-hybrid]
        [--threads 2] [--device cpu|cuda] [--dtype float32|bfloat16] [--op-count]
        [--sinkgd-blocks N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sage_torch
from sage_optim.presets import CONFIG_NAMES, resolve_preset
from sage_repro import traffic
from sage_train.model.shapes import LlamaConfig, get_model_config

BASELINE = "torch.optim.AdamW (baseline)"
FUSED = "torch.optim.AdamW(fused=True)"
GIB = 2.0**30
MIB = 2.0**20


class RMSNorm(nn.Module):
    """A norm weight ``(d,)`` (only its parameter matters here)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))


class Block(nn.Module):
    """One LLaMA decoder layer's parameters, HuggingFace names and PyTorch layout."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        d, f = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(d, q, bias=False), "k_proj": nn.Linear(d, kv, bias=False),
            "v_proj": nn.Linear(d, kv, bias=False), "o_proj": nn.Linear(q, d, bias=False),
        })
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(d, f, bias=False), "up_proj": nn.Linear(d, f, bias=False),
            "down_proj": nn.Linear(f, d, bias=False),
        })
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)


class LlamaShapes(nn.Module):
    """The parameters of a LLaMA model (no forward): embedding, layers, final norm, head."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)


def build_model(config: LlamaConfig, seed: int = 0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """``LlamaShapes(config)`` with ``0.02·normal`` parameters and fixed gradients.

    Drawn in float32 on the CPU (the same values on every device), then rounded to
    ``dtype`` and moved to ``device``.
    """
    with torch.device("meta"):
        model = LlamaShapes(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
            p.grad = torch.empty_like(p).normal_(0.0, 0.02, generator=gen)
    if device != "cpu" or dtype != torch.float32:
        grads = [p.grad.to(device, dtype) for p in model.parameters()]
        model = model.to(device, dtype)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
    n = sum(p.numel() for p in model.parameters())
    assert n == config.param_count(), (n, config.param_count())
    return model


def make(name: str, model: nn.Module, lr: float, foreach: bool,
         cpu_threads: int = 1, fused: bool = False) -> torch.optim.Optimizer:
    """The baseline AdamW (``foreach``, or ``fused`` for :data:`FUSED`) or
    ``sage_torch.make_optimizer(name, model, lr, foreach=..., cpu_threads=...)``.

    ``fused``: sage_torch's fused (Triton) path, ``make_optimizer(..., fused=True)``: the
    SAGE, Lion and SinkGD groups run the kernels, the others their default (CUDA: foreach)
    path.
    """
    if name in (BASELINE, FUSED):
        opts = {"fused": True} if name == FUSED else {"foreach": foreach}
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99),
                                 weight_decay=0.01, **opts)
    if fused:
        return sage_torch.make_optimizer(name, model, lr, fused=True, cpu_threads=cpu_threads)
    return sage_torch.make_optimizer(name, model, lr, foreach=foreach, cpu_threads=cpu_threads)


def sage_paths(device: str) -> tuple[str, ...]:
    """The sage_torch paths timed on ``device``: the fused one on CUDA when triton is there."""
    from sage_torch.common import triton_available

    if device != "cpu" and triton_available():
        return ("single-tensor", "foreach", "fused")
    return ("single-tensor", "foreach")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (``counts``: op name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        key = str(func)
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """All ops counted."""
        return sum(self.counts.values())


def meta_model(config: LlamaConfig) -> nn.Module:
    """``LlamaShapes(config)`` on the ``meta`` device, with ``meta`` gradients."""
    with torch.device("meta"):
        model = LlamaShapes(config)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    return model


def count_ops(name: str, model: nn.Module, foreach: bool) -> tuple[int, int] | None:
    """Aten ops and peak extra bytes of the second ``opt.step()`` of ``make(name, model, ...)``.

    ``model`` is a :func:`meta_model`: nothing is computed, and any host read of a device
    value raises.  The bytes are those of :func:`peak_extra_bytes` (storages the step
    creates, alive at once), counted on ``meta`` tensors: what the same ops would allocate
    on a GPU, before the caching allocator's rounding.  ``None`` where the optimizer
    refuses the ``meta`` device (fused AdamW).
    """
    try:
        opt = make(name, model, 1e-4, foreach)
        opt.step()  # creates the state
    except (RuntimeError, NotImplementedError):
        if name == FUSED:
            return None
        raise
    counter, peak = OpCounter(), _peak_mode(opt, model)
    with counter, peak:
        opt.step()
    return counter.total, peak.peak  # meta tensors: no memory for a gc.collect() to free


def count_fused(name: str, model: nn.Module) -> tuple[int, int, int] | None:
    """Aten ops, peak extra bytes and Triton launches of a fused step, on the ``meta`` device.

    The step of ``make(name, model, 1e-4, False, fused=True)`` (its groups without a fused
    rule on the foreach path, as on CUDA) with the kernel launches counted, not run, and
    the fused path's device check and first-use check lifted for ``meta`` tensors: every
    other operation of the step (reductions, stacking, the hyperparameter tensors) runs as
    on a GPU.  ``None``
    without ``triton`` or when no group of ``name`` has a fused rule.
    """
    from unittest import mock

    from sage_torch import optimizer as optimizer_mod
    from sage_torch.common import FUSED_RULES, triton_available

    if not triton_available():
        return None
    from sage_torch import triton_kernels

    launches = [0]

    def launch(*args: Any, **kwargs: Any) -> None:
        launches[0] += 1

    with (mock.patch.object(triton_kernels, "_launch", launch),
          mock.patch.object(optimizer_mod, "fused_unsupported", lambda t, n: None),
          mock.patch.object(optimizer_mod.RuleOptimizer, "_fused_ready",
                            staticmethod(lambda p: True))):
        opt = make(name, model, 1e-4, False, fused=True)
        if not any(g["rule"] in FUSED_RULES for g in opt.param_groups):
            return None
        for group in opt.param_groups:
            if group["rule"] not in FUSED_RULES:
                group["foreach"] = True
        opt.step()  # creates the state
        launches[0] = 0
        counter, peak = OpCounter(), _peak_mode(opt, model)
        with counter, peak:
            opt.step()
    return counter.total, peak.peak, launches[0]


def op_count_rows(model_name: str, configs: list[str]) -> list[dict[str, Any]]:
    """:func:`count_ops` for every configuration and path, then the AdamW baselines."""
    model = meta_model(get_model_config(model_name))
    rows = []
    for name in configs:
        for fe in (False, True):
            rows.append({"config": name, "path": "foreach" if fe else "single-tensor",
                         "ops": count_ops(name, model, fe)})
        fused = count_fused(name, model)
        if fused is not None:
            rows.append({"config": name, "path": "fused", "ops": fused[:2],
                         "launches": fused[2]})
    for fe in (False, True):
        rows.append({"config": "torch.optim.AdamW", "path": "foreach" if fe else "single-tensor",
                     "ops": count_ops(BASELINE, model, fe)})
    rows.append({"config": "torch.optim.AdamW", "path": "fused",
                 "ops": count_ops(FUSED, model, False)})
    return rows


def print_op_counts(model_name: str, rows: list[dict[str, Any]]) -> None:
    """The op-count table as markdown."""
    n = sum(1 for _ in meta_model(get_model_config(model_name)).parameters())
    print(f"aten ops per opt.step() on the meta device, model {model_name} ({n} tensors), "
          f"torch {torch.__version__}")
    print()
    print("| configuration | path | aten ops per step | Triton launches | peak extra (MiB) |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        if row["ops"] is None:
            print(f"| {row['config']} | {row['path']} | n/a (refused on meta) | | n/a |")
            continue
        ops, peak = row["ops"]
        launches = f"{row['launches']:,}" if "launches" in row else ""
        print(f"| {row['config']} | {row['path']} | {ops:,} | {launches} | {peak / MIB:.1f} |")


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor of ``opt`` but the ``step`` counters and a rule's host
    bookkeeping (APOLLO's ``proj_seed``: :attr:`sage_torch.common.UpdateRule.host_keys`)."""
    total = 0
    for group in opt.param_groups:
        rule_of = getattr(opt, "rule_of", None)
        skip = {"step", *(rule_of(group).host_keys if rule_of is not None else ())}
        total += sum(v.numel() * v.element_size() for p in group["params"]
                     for k, v in opt.state.get(p, {}).items()
                     if isinstance(v, torch.Tensor) and k not in skip)
    return total


def bytes_moved(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The analytic byte count of :mod:`sage_repro.traffic`."""
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    leaves = []
    if name != BASELINE:
        leaves = [(group["rule"], group, p.dim(), p.numel() * p.element_size())
                  for group in opt.param_groups for p in group["params"]]
    return traffic.step_bytes(p_bytes, state_bytes(opt), leaves)


def _storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, the same for every view of it (also on ``meta``,
    where every storage's ``data_ptr`` is 0)."""
    return int(t.untyped_storage()._cdata)


class _PeakMemory(TorchDispatchMode):
    """Peak bytes of storages created by the operations run under this mode."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = set(known)
        self.live = 0
        self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.known.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            key, nbytes = _storage_key(t), t.untyped_storage().nbytes()
            if key in self.known or nbytes == 0:
                continue
            self.known.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key, nbytes)
        return out


def _peak_mode(opt: torch.optim.Optimizer, model: nn.Module) -> _PeakMemory:
    """A :class:`_PeakMemory` that knows the parameters, gradients and state of ``opt``."""
    known = {_storage_key(p) for p in model.parameters()}
    known |= {_storage_key(p.grad) for p in model.parameters() if p.grad is not None}
    known |= {_storage_key(v) for st in opt.state.values()
              for v in st.values() if isinstance(v, torch.Tensor)}
    return _PeakMemory(known)


def peak_extra_bytes(opt: torch.optim.Optimizer, model: nn.Module) -> int:
    """Peak bytes of new storages alive at once during one ``opt.step()`` (see docstring)."""
    mode = _peak_mode(opt, model)
    with mode:
        opt.step()
    # (no gc.collect() here: a full collection takes 0.5-1 s in a process holding torch, and
    # main() collects once per configuration, right after this configuration's calls)
    return mode.peak


def bandwidth_kernel(mib: int, device: str = "cpu") -> tuple[Callable[[], None], int]:
    """An in-place ``x.mul_(1.0001).add_(1)`` over ``mib`` MiB and the bytes it moves."""
    x = torch.ones(mib * 2**20 // 4, device=device)

    def run() -> None:
        x.mul_(1.0001).add_(1.0)

    return run, 4 * x.numel() * x.element_size()


_SYNC: Callable[[], None] = lambda: None  # noqa: E731  # torch.cuda.synchronize on CUDA


def timed(fn: Callable[[], Any]) -> float:
    _SYNC()
    t0 = time.perf_counter()
    fn()
    _SYNC()
    return time.perf_counter() - t0


def run_rounds(runners: dict[str, Callable[[], Any]], warmup: int, repeats: int
               ) -> dict[str, list[float]]:
    """Time every runner once per round, in an order rotated from round to round."""
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            dt = timed(runners[n])
            if r >= warmup:
                times[n].append(dt)
    return times


def print_fused_vs_foreach(rows: list[dict[str, Any]]) -> None:
    """Fused against foreach per configuration (nothing without fused rows): the timings
    that decide whether the fused path may become the CUDA default."""
    pairs = [(r, f) for r in rows if r["path"] == "foreach"
             for f in rows if f["config"] == r["config"] and f["path"] == "fused"]
    if not pairs:
        return
    print()
    print("fused (opt-in) against foreach (the CUDA default), same rounds:")
    print()
    print("| configuration | foreach ms | fused ms | fused / foreach | foreach peak (MiB) "
          "| fused peak (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r, f in pairs:
        peaks = ["n/a" if x["peak"] is None else f"{x['peak'] / MIB:.1f}" for x in (r, f)]
        print(f"| {r['config']} | {r['ms']:.2f} | {f['ms']:.2f} | {f['ms'] / r['ms']:.2f}x "
              f"| {peaks[0]} | {peaks[1]} |")
    faster = sum(f["ms"] < r["ms"] for r, f in pairs)
    print()
    print(f"fused faster than foreach in {faster} of {len(pairs)} configuration(s)")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, parsed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="270m", help="a sage_optim model name (default 270m)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed rounds (default 7 for models over 100M parameters, else 41)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES),
                    help="configurations to time (default: all eight)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate of every optimizer")
    ap.add_argument("--bw-mib", type=int, default=512, help="bandwidth array size (MiB)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the parameters and gradients (default float32)")
    ap.add_argument("--sinkgd-blocks", type=int, default=None, metavar="N",
                    help="SinkGD's Sinkhorn iterations by blocks of at most N elements (no "
                         "K; sage_torch.sinkgd.BLOCK_ELEMENTS; default: K whole)")
    ap.add_argument("--op-count", action="store_true",
                    help="print the aten op count per step on the meta device and exit")
    return ap.parse_args(argv)


def _set_block_elements(n: int) -> None:
    """Apply ``--sinkgd-blocks``: SinkGD's Sinkhorn iterations by blocks of at most n elements."""
    if n < 1:
        raise SystemExit(f"--sinkgd-blocks must be a positive element count, got {n}")
    sage_torch.sinkgd.BLOCK_ELEMENTS = n


def _use_device(device: str) -> None:
    """Check ``--device`` and, on CUDA, synchronize the device around each timed call."""
    global _SYNC
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {device}: torch {torch.__version__} sees no CUDA device")
        _SYNC = torch.cuda.synchronize
    elif device != "cpu":
        raise SystemExit(f"--device must be cpu or cuda, got {device!r}")


def print_rows(rows: list[dict[str, Any]], bw: float) -> None:
    """Print the table of ``rows``, the fused/foreach comparison and the target line."""
    print()
    print("| configuration | path | ms/step | vs AdamW | bytes moved (GiB) | achieved GiB/s "
          "| fraction of bandwidth | peak extra (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        gibs = row["bytes"] / (row["ms"] / 1e3) / GIB
        peak = "n/a" if row["peak"] is None else f"{row['peak'] / MIB:.1f}"
        print(f"| {row['config']} | {row['path']} | {row['ms']:.1f} | {row['ratio']:.2f}x "
              f"| {row['bytes'] / GIB:.2f} | {gibs:.2f} | {gibs / bw:.2f} | {peak} |")
    print()
    print("path: single-tensor (foreach=False), foreach (foreach=True: the default on CUDA, "
          "as torch.optim), fused (fused=True: opt-in, the Triton kernels)")
    print_fused_vs_foreach(rows)
    hybrid = {r["path"]: r["ratio"] for r in rows if r["config"] == "sage-hybrid"}
    if hybrid:
        print()
        verdict = all(r <= 1.0 for r in hybrid.values())
        detail = ", ".join(f"{p} {r:.2f}x" for p, r in hybrid.items())
        print(f"target (sage-hybrid step no slower than torch.optim.AdamW(foreach=True) in "
              f"each path): {detail} -> {'MET' if verdict else 'NOT MET'}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print the table and return its rows (one dict per row)."""
    args = _parse_args(argv)
    if args.sinkgd_blocks is not None:
        _set_block_elements(args.sinkgd_blocks)
    for name in args.configs:
        resolve_preset(name, {})  # an unknown name fails before any allocation
    if args.op_count:
        counts = op_count_rows(args.model, args.configs)
        print_op_counts(args.model, counts)
        return counts
    device = args.device
    _use_device(device)
    torch.set_num_threads(args.threads)

    config = get_model_config(args.model)
    repeats = args.repeats or (7 if config.param_count() > 100e6 else 41)
    dtype = getattr(torch, args.dtype)
    model = build_model(config, device=device, dtype=dtype)
    params = list(model.parameters())
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
          f"(torch.set_num_threads({args.threads})), {args.dtype}, "
          f"{torch.cuda.get_device_name() if device != 'cpu' else 'CPU'}")
    print(f"model {args.model}: {config.param_count():,} params in {len(params)} tensors, "
          f"{p_bytes / GIB:.3f} GiB, largest {largest / MIB:.1f} MiB")
    bw_run, bw_bytes = bandwidth_kernel(args.bw_mib, device)

    baseline = make(BASELINE, model, args.lr, True)
    fused = make(FUSED, model, args.lr, False) if device != "cpu" else None
    rows: list[dict[str, Any]] = []
    base_all: list[float] = []
    fused_all: list[float] = []
    bw_all: list[float] = []
    for name in args.configs:
        opts = {(name, path): make(name, model, args.lr, path == "foreach", args.threads,
                                   fused=path == "fused")
                for path in sage_paths(device)}
        runners: dict[str, Callable[[], Any]] = {BASELINE: baseline.step, "bandwidth": bw_run}
        if fused is not None:
            runners[FUSED] = fused.step
        runners.update({f"{n}/{path}": o.step for (n, path), o in opts.items()})
        times = run_rounds(runners, args.warmup, repeats)
        base_med = statistics.median(times[BASELINE])
        base_all += times[BASELINE]
        fused_all += times.get(FUSED, [])
        bw_all += times["bandwidth"]
        for (n, path), opt in opts.items():
            med = statistics.median(times[f"{n}/{path}"])
            rows.append({
                "config": n, "path": path, "ms": med * 1e3,
                "ratio": med / base_med, "bytes": bytes_moved(n, model, opt),
                "peak": None if args.no_memory else peak_extra_bytes(opt, model),
            })
            print(f"  {n} {rows[-1]['path']}: {med * 1e3:.1f} ms vs baseline "
                  f"{base_med * 1e3:.1f} ms ({rows[-1]['ratio']:.2f}x)", flush=True)
        del opts, runners
        gc.collect()
    base_med = statistics.median(base_all)
    rows.append({
        "config": BASELINE, "path": "foreach", "ms": base_med * 1e3, "ratio": 1.0,
        "bytes": bytes_moved(BASELINE, model, baseline),
        "peak": None if args.no_memory else peak_extra_bytes(baseline, model),
    })
    if fused is not None:
        med = statistics.median(fused_all)
        rows.append({
            "config": FUSED, "path": "fused", "ms": med * 1e3, "ratio": med / base_med,
            "bytes": bytes_moved(BASELINE, model, fused),
            "peak": None if args.no_memory else peak_extra_bytes(fused, model),
        })
    bw = bw_bytes / statistics.median(bw_all) / GIB

    print()
    print(f"model {args.model}, {torch.get_num_threads()} thread(s), each configuration "
          f"interleaved with the baseline (rotated order), median of {repeats} timed rounds "
          f"after {args.warmup} warmup; bandwidth {bw:.2f} GiB/s (in-place "
          f"x.mul_(1.0001).add_(1) over {args.bw_mib} MiB, 2 reads + 2 writes, same rounds)")
    print_rows(rows, bw)
    return rows


if __name__ == "__main__":
    main()
