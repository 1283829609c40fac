"""Cold compile time of the jitted train step and of the optimizer update, against optax.adamw.

For the chosen LLaMA shape (``--model``, default ``270m``) and each configuration
(``--configs``, default ``sage-hybrid``) the script compiles, from shapes only (nothing is
allocated, nothing runs), in each of ``--repeats`` rounds and in turn with the baseline:

* ``train``: ``sage-train``'s train step (forward, backward and update of the Flax model;
  ``--batch-size`` x ``--seq-len`` tokens, the trainer's defaults otherwise), what a user
  waits for before the first step;
* ``update``: the optimizer update alone on the model's per-layer parameters
  (``tx.update`` then ``optax.apply_updates``, donated), as ``benchmarks/jax_step.py``
  times it.

Every compile is cold: JAX's persistent compilation cache is off and its in-memory caches
are cleared before each one.  For each it records the wall seconds of tracing and lowering,
of XLA's compilation, and the CPU seconds of the whole process (all of XLA's threads) over
both: on a shared machine the CPU seconds move less with the other processes than the wall
seconds do.  The table gives the medians over the rounds and each configuration's ratio to
``optax.adamw``'s (the median of the per-round ratios: both compiled in the same round).

    python benchmarks/compile_time.py [--model 270m] [--configs sage-hybrid sinkgd-pure]
                                      [--what train update] [--repeats 3]
                                      [--cpu-grouping leaf|stack|sequence]
                                      [--cpu-native on|off] [--impl native]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import sage_optax
from sage_repro.llama_shapes import llama_param_shapes
from sage_train.model.shapes import get_model_config
from sage_train.run.config import TrainConfig
from sage_train.run.steps import build, make_steps

BASELINE = "adamw"
"""The baseline: ``optax.adamw`` (the trainer's ``--optimizer adamw`` for the train step)."""

_sinkgd: Any = importlib.import_module("sage_optax.sinkgd")  # the module, not the alias


def _timed(lower: Callable[[], Any]) -> tuple[float, float, float]:
    """``(trace and lower s, compile s, process CPU s)`` of ``lower().compile()``, cold."""
    jax.clear_caches()
    cpu0, t0 = time.process_time(), time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, time.process_time() - cpu0


def train_step_seconds(name: str, model: str, batch_size: int, seq_len: int,
                       impl: str = "auto") -> tuple[float, float, float]:
    """The cold compile of ``sage-train``'s train step with optimizer ``name``."""
    cfg = TrainConfig(model=model, optimizer=name, batch_size=batch_size, seq_len=seq_len,
                      sinkgd_kernel=impl)
    vocab = get_model_config(model).vocab_size

    def lower() -> Any:
        built = nnx.eval_shape(lambda: build(cfg, vocab))
        graphdef, state = nnx.split(built)
        train_step: Any = make_steps(graphdef, record_h=False)[0]
        batch = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        return train_step.lower(state, batch, batch)

    return _timed(lower)


def update_seconds(name: str, model: str, impl: str = "auto") -> tuple[float, float, float]:
    """The cold compile of the donated update of optimizer ``name`` (per-layer float32)."""
    shapes = llama_param_shapes(get_model_config(model), jnp.float32, stacked=False)

    def lower() -> Any:
        tx = (optax.adamw(1e-4, b1=0.9, b2=0.99, weight_decay=0.01) if name == BASELINE
              else sage_optax.make_optimizer(name, impl=impl))

        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s2 = tx.update(g, s, p)
            return optax.apply_updates(p, u), s2

        state = jax.eval_shape(tx.init, shapes)
        return jax.jit(step, donate_argnums=(0, 1)).lower(shapes, state, shapes)

    return _timed(lower)


def measure(args: argparse.Namespace, what: str) -> dict[str, list[tuple[float, float, float]]]:
    """Each configuration's (and the baseline's) timings over the rounds, in turn."""
    names = [BASELINE, *[c for c in args.configs if c != BASELINE]]
    runs: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            if what == "train":
                t = train_step_seconds(name, args.model, args.batch_size, args.seq_len,
                                       args.impl)
            else:
                t = update_seconds(name, args.model, args.impl)
            runs[name].append(t)
            print(f"  round {r + 1}, {what} {name}: trace+lower {t[0]:.2f} s, compile "
                  f"{t[1]:.2f} s, CPU {t[2]:.2f} s", flush=True)
    return runs


def report(what: str, runs: dict[str, list[tuple[float, float, float]]]) -> None:
    """The markdown table of ``measure``'s timings."""
    base = runs[BASELINE]
    print(f"\n{what}: cold compile, medians over {len(base)} round(s)")
    print("| configuration | trace + lower (s) | compile (s) | wall vs adamw | CPU (s) | "
          "CPU vs adamw |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ts in runs.items():
        pairs = list(zip(ts, base, strict=True))
        wall = statistics.median([(t[0] + t[1]) / (b[0] + b[1]) for t, b in pairs])
        cpu = statistics.median([t[2] / b[2] for t, b in pairs])
        label = "optax.adamw (baseline)" if name == BASELINE else name
        print(f"| {label} | {statistics.median(t[0] for t in ts):.2f} | "
              f"{statistics.median(t[1] for t in ts):.2f} | {wall:.2f}x | "
              f"{statistics.median(t[2] for t in ts):.2f} | {cpu:.2f}x |", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="270m", help="a sage_train model name (default 270m)")
    parser.add_argument("--configs", nargs="+", default=["sage-hybrid"],
                        help="configurations to compile against adamw (default sage-hybrid)")
    parser.add_argument("--what", nargs="+", choices=("train", "update"),
                        default=["train", "update"], help="what to compile (default both)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="train step batch (default 16)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="train step sequence length (default 1024)")
    parser.add_argument("--cpu-grouping", choices=("leaf", "stack", "sequence"),
                        default=None, help="what SinkGD's grouping='auto' is on the CPU "
                        "for this run (default: the library's CPU_GROUPING)")
    parser.add_argument("--impl", choices=_sinkgd.IMPLS, default="auto",
                        help="SinkGD's impl for every configuration (default auto)")
    parser.add_argument("--cpu-native", choices=("on", "off"), default=None,
                        help="whether SinkGD's impl='auto' takes the native kernel on the "
                        "CPU for this run (default: the library's CPU_NATIVE; off: XLA's "
                        "path, grouped by --cpu-grouping)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # every compile cold
    if args.cpu_grouping is not None:
        _sinkgd.CPU_GROUPING = args.cpu_grouping
    if args.cpu_native is not None:
        _sinkgd.CPU_NATIVE = args.cpu_native == "on"
    print(f"jax {jax.__version__}, optax {optax.__version__}, devices {jax.devices()}, "
          f"model {args.model}, SinkGD on the CPU: "
          f"{_sinkgd.resolved_impl(args.impl, 'cpu', 1)} (grouping {_sinkgd.CPU_GROUPING})")
    for what in args.what:
        report(what, measure(args, what))


if __name__ == "__main__":
    main()
