"""sage_torch's fused SinkGD step against ``torch.optim.AdamW(fused=True)``, the A/B of issue 41.

For the chosen LLaMA shape (``--model``, default ``270m``; the module of
``benchmarks/torch_step.py``: ``nn.Embedding`` tied head, ``nn.Linear`` ``(out, in)``
projections, 1-D norms) one fixed gradient per parameter is stepped by:

* ``torch.optim.AdamW(fused=True)`` (the baseline) and ``AdamW(foreach=True)``;
* ``make_optimizer(config)`` on its foreach path (the CUDA default) and on its fused path
  (``fused=True``) with SinkGD's sweep kernel (one launch per iteration for a group of
  matrices, ``G`` read from L2 between them), at each ``--group-mib`` (the sweep groups'
  size) and with the two-launch-per-iteration kernels of before (``[two-launch]``);
* with ``--graph``, the fused step captured once in a CUDA graph (``capturable=True``) and
  replayed: the step without its host-side launch cost.

Timing: ``--warmup`` untimed rounds, then ``--repeats`` rounds in which every entry runs once
(order rotated per round), each call synchronised; the median per entry and its ratio to
the baseline's median of the same rounds.  ``host ms``: the time the step call takes on the
host with the GPU idle before it (launches, Python): a step whose host time exceeds its GPU
time is launch-bound.  ``launches``: the kernel launches of one step (``torch.profiler``'s
device kernels).  Correctness comes first: before timing, one fused step of each entry is
compared with the single-tensor path from the same parameters (``max |Δθ| / max |θ step|``).

    python benchmarks/torch_fused_step.py [--model 270m] [--configs sage-hybrid sinkgd-hybrid]
                                          [--group-mib 8 24 64] [--graph]

On a CPU (``--device cpu``, tiny model) the kernels run under Triton's interpreter: a smoke
test of the plumbing, not a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch_step import build_model  # noqa: E402

import sage_torch  # noqa: E402
from sage_torch import sinkgd  # noqa: E402
from sage_train.model.shapes import get_model_config  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="270m")
    ap.add_argument("--configs", nargs="+", default=["sage-hybrid"])
    ap.add_argument("--group-mib", nargs="*", type=float, default=[24.0],
                    help="sweep group sizes (MiB of gradients) to time")
    ap.add_argument("--two-launch", action="store_true",
                    help="also time the fused path with the kernels of before")
    ap.add_argument("--graph", action="store_true", help="also time a CUDA-graph replay")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    return ap.parse_args(argv)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def fused_setting(sweep: bool, group_bytes: int | None) -> Any:
    """The fused SinkGD path of this entry: the sweep kernel at ``group_bytes``, or not."""
    old = sinkgd.FUSED_SWEEP, sinkgd.SWEEP_GROUP_BYTES
    sinkgd.FUSED_SWEEP = sweep
    if group_bytes is not None:
        sinkgd.SWEEP_GROUP_BYTES = group_bytes
    try:
        yield
    finally:
        sinkgd.FUSED_SWEEP, sinkgd.SWEEP_GROUP_BYTES = old


def kernel_launches(step: Callable[[], Any], device: str) -> int | None:
    """Device kernels launched by one call of ``step`` (``torch.profiler``), CUDA only."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def single_reference(name: str, model: torch.nn.Module, lr: float) -> dict[str, torch.Tensor]:
    """Each parameter's change after one single-tensor step (parameters restored after)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = sage_torch.make_optimizer(name, model, lr=lr, foreach=False)
    opt.step()
    out = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return out


def step_error(make: Callable[[], torch.optim.Optimizer], model: torch.nn.Module,
               ref: dict[str, torch.Tensor]) -> float:
    """``max |Δθ − Δθ_ref| / max |Δθ_ref|`` of one step of ``make()`` (parameters restored)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    make().step()
    worst = 0.0
    for n, p in model.named_parameters():
        delta = p.detach() - before[n]
        scale = ref[n].abs().max().item()
        if scale > 0:
            worst = max(worst, (delta - ref[n]).abs().max().item() / scale)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return worst


def graphed(opt: torch.optim.Optimizer, device: str) -> Callable[[], None]:
    """``opt.step`` captured in a CUDA graph (after warm-up steps on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay


def _entries(args: argparse.Namespace, model: torch.nn.Module
             ) -> dict[str, tuple[Callable[[], torch.optim.Optimizer], Any]]:
    """The optimizers timed, by label: ``(make, fused setting or None)``."""
    entries: dict[str, tuple[Callable[[], torch.optim.Optimizer], Any]] = {
        "AdamW(fused=True)": (lambda: torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01, fused=True),
            None),
        "AdamW(foreach=True)": (lambda: torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01,
            foreach=True), None),
    }
    for name in args.configs:
        entries[f"{name} foreach"] = (lambda name=name: sage_torch.make_optimizer(
            name, model, lr=args.lr, foreach=True), None)
        for mib in args.group_mib:
            entries[f"{name} fused sweep {mib:g} MiB"] = (
                lambda name=name: sage_torch.make_optimizer(name, model, lr=args.lr,
                                                            fused=True),
                (True, int(mib * MIB)))
        if args.two_launch:
            entries[f"{name} fused two-launch"] = (
                lambda name=name: sage_torch.make_optimizer(name, model, lr=args.lr,
                                                            fused=True), (False, None))
    return entries


def _time_rounds(args: argparse.Namespace, runners: dict[str, Callable[[], None]]
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each runner's step times and host times (seconds) over the rounds after warm-up.

    The order rotates by one each round.
    """
    times: dict[str, list[float]] = {k: [] for k in runners}
    hosts: dict[str, list[float]] = {k: [] for k in runners}
    order = list(runners)
    for rnd in range(args.warmup + args.repeats):
        for k in order[rnd % len(order):] + order[:rnd % len(order)]:
            sync(args.device)
            t0 = time.perf_counter()
            runners[k]()
            t1 = time.perf_counter()
            sync(args.device)
            t2 = time.perf_counter()
            if rnd >= args.warmup:
                times[k].append(t2 - t0)
                hosts[k].append(t1 - t0)
    return times, hosts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype)
    config = get_model_config(args.model)
    model = build_model(config, device=args.device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {dev_name}, model {args.model}: {n_params:,} params, "
          f"{args.dtype}")
    entries = _entries(args, model)
    refs = {name: single_reference(name, model, args.lr) for name in args.configs}
    runners: dict[str, Callable[[], None]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for label, (make, setting) in entries.items():
        ctx = fused_setting(*setting) if setting is not None else contextlib.nullcontext()
        with ctx:
            name = label.split(" ")[0]
            err = step_error(make, model, refs[name]) if name in refs else None
            opt = make()
            opt.step()  # the state
            sync(args.device)
            launches = kernel_launches(opt.step, args.device)
        rows[label] = {"err": err, "launches": launches}

        def run(opt: torch.optim.Optimizer = opt, setting: Any = setting) -> None:
            with fused_setting(*setting) if setting is not None else contextlib.nullcontext():
                opt.step()

        runners[label] = run
        if args.graph and args.device == "cuda" and setting is not None and setting[0]:
            with fused_setting(*setting):
                g_opt = sage_torch.make_optimizer(name, model, lr=torch.tensor(
                    args.lr, device=args.device), fused=True, capturable=True)
                runners[f"{label} [graph]"] = graphed(g_opt, args.device)
                rows[f"{label} [graph]"] = {"err": None, "launches": None}
    times, hosts = _time_rounds(args, runners)
    base = statistics.median(times["AdamW(fused=True)"])
    print(f"\nmedian of {args.repeats} rounds after {args.warmup} warm-up, order rotated\n")
    print("| step | ms | vs AdamW(fused=True) | host ms | launches | step error vs "
          "single-tensor |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in runners:
        med = statistics.median(times[k])
        err = rows[k]["err"]
        print(f"| {k} | {med * 1e3:.2f} | {med / base:.2f}x | "
              f"{statistics.median(hosts[k]) * 1e3:.2f} | {rows[k]['launches'] or '-'} | "
              f"{'-' if err is None else f'{err:.1e}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
