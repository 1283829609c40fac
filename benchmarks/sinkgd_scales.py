"""SinkGD's scales with ``K`` whole against by blocks of rows, on the CPU (issue 41).

Three measurements, each interleaved in one process (the first call of each path is warm-up
and not counted; the figure is the median over ``--rounds``):

- ``matrices``: the 91 matrices of the 270M model (26 of 1024 x 128, 26 of 1024 x 1024, 26
  of 1024 x 2816, 13 of 2816 x 1024), ``sage_optax.sinkgd(impl=...)`` against
  ``optax.adamw``, jitted and donated: time per update, the ratio to AdamW's, the compiled
  temporaries and the cold lower + compile seconds.
- ``jax``: the scales of ``--count`` matrices of one shape in one jitted program,
  ``checked_sinkhorn_scales`` per matrix (``K``) against ``blocked_sinkhorn_scales`` at each
  ``--blocks`` exponent, and with ``--sequence`` ``sequenced_sinkhorn_scales`` (the ``K``
  path the CPU's ``auto`` runs), with ``--native`` the native kernel
  (``sage_optax.sinkgd_native``).
- ``torch``: one matrix's scales, ``sage_torch.sinkgd.sinkhorn_scales`` with ``K`` whole
  (``BLOCK_ELEMENTS = None``, the default) against blocks of ``2**b`` elements.

Usage (from the checkout, ``PYTHONPATH=$PWD``)::

    python benchmarks/sinkgd_scales.py matrices --impls jnp blocked --rounds 7
    python benchmarks/sinkgd_scales.py jax --shape 1024x2816 --blocks 16 18 19 --rounds 11
    python benchmarks/sinkgd_scales.py jax --shape 1024x2816 --count 26 --blocks \
        --sequence --native --rounds 7
    python benchmarks/sinkgd_scales.py torch --shape 2816x1024 --blocks 16 18 19 --rounds 9
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable

import numpy as np

SHAPES_270M = [(1024, 128)] * 26 + [(1024, 1024)] * 26 + [(1024, 2816)] * 26 + [(2816, 1024)] * 13
"""The dense matrices of the 270M model, per layer (embedding and vectors left out)."""


def interleaved(paths: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each path, the paths taking turns round by round."""
    for f in paths.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for k, f in paths.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _matrices(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    import sage_optax

    rng = np.random.default_rng(0)

    def tree() -> dict[str, jax.Array]:
        return {f"w{i}": jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02)
                for i, s in enumerate(SHAPES_270M)}

    grads = tree()
    paths = {}
    for name in ["adamw", *args.impls]:
        tx = (optax.adamw(1e-4, b1=0.9, b2=0.99, weight_decay=0.01) if name == "adamw"
              else sage_optax.sinkgd(1e-3, impl=name))
        params = tree()
        state = tx.init(params)

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{name}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, "
              f"temporaries {temp:.1f} MiB", flush=True)
        box = [params, state]

        def run(compiled=compiled, box=box):
            box[0], box[1] = compiled(box[0], box[1], grads)
            jax.block_until_ready(box[0])

        paths[name] = run
    medians = interleaved(paths, args.rounds)
    for name, t in medians.items():
        print(f"{name}: {t * 1e3:.1f} ms, {t / medians['adamw']:.2f}x optax.adamw")


def _jax(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from sage_optax import Route

    sinkgd = importlib.import_module("sage_optax.sinkgd")  # the module, not the alias
    shape = _shape(args.shape)
    rng = np.random.default_rng(0)
    gs = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for _ in range(args.count)]
    res = Route("dense", -2, -1).resolve(shape, "w")

    def each(scales: Callable[..., object]) -> Callable[..., object]:
        return jax.jit(lambda gs: [scales(g) for g in gs])

    fns = {"K": each(lambda g: sinkgd.checked_sinkhorn_scales([g], res, 5, 1e-8, "unit"))}
    for b in args.blocks:
        fns[f"blocks 2^{b}"] = each(lambda g, b=b: sinkgd.blocked_sinkhorn_scales(
            [g], res, 5, 1e-8, "unit", block=2**b))
    if args.sequence:
        fns["sequence"] = jax.jit(lambda gs: sinkgd.sequenced_sinkhorn_scales(
            gs, res, 5, 1e-8, "unit") if len(gs) > 1 else
            sinkgd.checked_sinkhorn_scales(gs, res, 5, 1e-8, "unit"))
    if args.native:
        from sage_optax import sinkgd_native

        fns["native"] = each(lambda g: sinkgd_native.native_scales(g, res, 5, 1e-8, "unit"))
    medians = interleaved({k: (lambda f=f: jax.block_until_ready(f(gs))) for k, f in fns.items()},
                          args.rounds)
    print(f"{args.count} matrices of {shape[0]} x {shape[1]} in one program; per matrix:")
    _print(shape, {k: t / args.count for k, t in medians.items()})


def _torch(args: argparse.Namespace) -> None:
    import torch

    from sage_torch import sinkgd

    torch.set_num_threads(args.threads)
    shape = _shape(args.shape)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    buf = torch.empty(g.numel())

    def scales(block: int | None) -> Callable[[], object]:
        def run() -> object:
            sinkgd.BLOCK_ELEMENTS = block
            try:
                return sinkgd.sinkhorn_scales(g, 1, 0, buffer=buf)
            finally:
                sinkgd.BLOCK_ELEMENTS = None
        return run

    paths = {"K": scales(None), **{f"blocks 2^{b}": scales(2**b) for b in args.blocks}}
    _print(shape, interleaved(paths, args.rounds))


def _shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    return int(rows), int(cols)


def _print(shape: tuple[int, int], medians: dict[str, float]) -> None:
    base = medians["K"]
    for k, t in medians.items():
        print(f"{shape[0]} x {shape[1]} {k}: {t * 1e3:.1f} ms ({t / base:.2f}x K)")


def main() -> None:
    """Parse the command line and run one measurement."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("matrices", "jax", "torch"))
    p.add_argument("--impls", nargs="+", default=["jnp", "blocked"],
                   help="matrices: SinkGD's impl= values to time against optax.adamw")
    p.add_argument("--shape", default="1024x2816", help="jax, torch: ROWSxCOLS")
    p.add_argument("--blocks", nargs="*", type=int, default=[16, 18, 19],
                   help="jax, torch: block sizes as exponents of two (elements)")
    p.add_argument("--count", type=int, default=1, help="jax: matrices in one program")
    p.add_argument("--sequence", action="store_true", help="jax: also the CPU's K sequence")
    p.add_argument("--native", action="store_true", help="jax: also the native kernel")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch: torch.set_num_threads")
    args = p.parse_args()
    {"matrices": _matrices, "jax": _jax, "torch": _torch}[args.what](args)


if __name__ == "__main__":
    main()
