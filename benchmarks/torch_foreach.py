"""Single-tensor vs foreach step time of sage_torch's optimizers (and torch.optim.AdamW).

Two models: many small parameters (an embedding and ``--small-layers`` Linear(64, 64),
i.e. that many (64, 64) matrices plus as many (64,) biases) and a few large ones
(``--large-layers`` Linear(1024, 1024)).  Each optimizer is built twice, ``foreach=False``
and ``foreach=True``, over its own copy of the parameters with fixed gradients; steps of
all variants are interleaved and each variant's time is the median over ``--repeats``
timings.  Prints a markdown table of ms/step and the foreach speedup.

    python benchmarks/torch_foreach.py [--repeats 25] [--threads 1] [--device cpu]

On CPU the ``torch._foreach_*`` kernels are loops over per-tensor kernels, so the gain
comes only from fewer Python-level ops; on CUDA they are fused (fewer kernel launches).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import sage_torch


class ManySmall(nn.Module):
    def __init__(self, layers: int, width: int = 64, vocab: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


class FewLarge(nn.Module):
    def __init__(self, layers: int, width: int = 1024, vocab: int = 2048):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


def matrices(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.dim() >= 2]


# name -> builder(model, foreach) -> optimizer (over that model's parameters)
OPTIMIZERS: dict[str, Callable[[nn.Module, bool], torch.optim.Optimizer]] = {
    "SAGE": lambda m, fe: sage_torch.SAGE(m.parameters(), lr=1e-3, foreach=fe),
    "Lion": lambda m, fe: sage_torch.Lion(m.parameters(), lr=1e-4, foreach=fe),
    "SinkGD (matrices)": lambda m, fe: sage_torch.SinkGD(matrices(m), lr=1e-3, foreach=fe),
    "adamw rule": lambda m, fe: sage_torch.RuleOptimizer(
        m.parameters(), {"rule": "adamw", "lr": 1e-4, "foreach": fe}),
    'make_optimizer("sage-hybrid")': lambda m, fe: sage_torch.make_optimizer(
        "sage-hybrid", m, foreach=fe),
    "torch.optim.AdamW (baseline)": lambda m, fe: torch.optim.AdamW(
        m.parameters(), lr=1e-4, betas=(0.9, 0.99), foreach=fe),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(label: str, model: nn.Module, args: argparse.Namespace,
                device: torch.device) -> list[tuple[str, str, float, float]]:
    model = model.to(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in model.parameters()]
    variants = []  # (optimizer name, foreach, optimizer)
    for name, build in OPTIMIZERS.items():
        for foreach in (False, True):
            twin = copy.deepcopy(model)
            for p, g in zip(twin.parameters(), grads, strict=True):
                p.grad = g.clone()
            variants.append((name, foreach, build(twin, foreach)))
    for _, _, opt in variants:  # warm-up: state creation, allocator, caches
        for _ in range(args.warmup):
            opt.step()
    times: dict[tuple[str, bool], list[float]] = {(n, f): [] for n, f, _ in variants}
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]  # interleaved, both directions
        for name, foreach, opt in order:
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            sync(device)
            times[name, foreach].append((time.perf_counter() - start) / args.steps)
    rows = []
    for name in OPTIMIZERS:
        single = statistics.median(times[name, False]) * 1e3
        multi = statistics.median(times[name, True]) * 1e3
        rows.append((label, name, single, multi))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="timings per variant (median)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per timing")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--small-layers", type=int, default=200,
                        help="Linear(64, 64) layers of the many-small model")
    parser.add_argument("--large-layers", type=int, default=4,
                        help="Linear(1024, 1024) layers of the few-large model")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    small = ManySmall(args.small_layers)
    large = FewLarge(args.large_layers)
    describe = [
        (f"many small ({sum(1 for _ in small.parameters())} params)", small),
        (f"few large ({sum(1 for _ in large.parameters())} params)", large),
    ]
    rows = []
    for label, model in describe:
        rows += bench_model(label, model, args, device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} interleaved timings of {args.steps} step(s)")
    for label, model in describe:
        shapes = sorted({tuple(p.shape) for p in model.parameters()})
        print(f"- {label}: {sum(p.numel() for p in model.parameters()):,} numbers, shapes "
              f"{', '.join('x'.join(map(str, s)) for s in shapes)}")
    print()
    print("| model | optimizer | single-tensor ms/step | foreach ms/step | foreach speedup |")
    print("|---|---|---:|---:|---:|")
    for label, name, single, multi in rows:
        print(f"| {label} | {name} | {single:.3f} | {multi:.3f} | {single / multi:.2f}x |")


if __name__ == "__main__":
    main()
