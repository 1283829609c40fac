"""Compile-time memory plan of ``sage-train``'s train step, without running it.

Builds the model and optimizer as shapes only (``nnx.eval_shape``), lowers and compiles the
jitted train step for a batch, and prints XLA's ``memory_analysis()`` (arguments, outputs,
temporaries) per remat policy.  On a machine without a GPU this is XLA:CPU's plan: the
CPU has no flash attention (the score matrix is materialised) and schedules differently, so
the figures are estimates of the GPU plan, not GPU measurements.

    python benchmarks/train_memory_plan.py --model 270m --batch-size 16 --seq-len 1024 \\
        --dtype bfloat16 --remat none dots full
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from sage_optim.models import get_model_config
from sage_train.train import TrainConfig, build, make_steps

GIB = 1 << 30


def plan(cfg: TrainConfig) -> dict[str, float]:
    """``memory_analysis()`` of the train step of ``cfg`` in GiB, and the compile seconds."""
    vocab = get_model_config(cfg.model).vocab_size
    model, optimizer = nnx.eval_shape(lambda: build(cfg, vocab))
    graphdef, state = nnx.split((model, optimizer))
    train_step, _ = make_steps(graphdef, record_h=False)
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
    t = time.perf_counter()
    compiled = train_step.lower(state, batch, batch).compile()
    seconds = time.perf_counter() - t
    m = compiled.memory_analysis()
    out = {
        "arguments": m.argument_size_in_bytes / GIB,
        "outputs": m.output_size_in_bytes / GIB,
        "aliased": m.alias_size_in_bytes / GIB,
        "temporaries": m.temp_size_in_bytes / GIB,
        "compile_s": seconds,
    }
    # live at the peak: arguments (donated into the outputs) plus temporaries
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def main() -> None:
    """Print a markdown table of the plan per remat policy."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="270m")
    p.add_argument("--optimizer", default="sage-hybrid")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", default="scan")
    p.add_argument("--remat", nargs="+", default=["none", "dots", "full"])
    args = p.parse_args()
    base = TrainConfig(model=args.model, optimizer=args.optimizer, batch_size=args.batch_size,
                       seq_len=args.seq_len, dtype=args.dtype, layers=args.layers)
    print(f"{args.model} {args.optimizer}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.dtype}, layers={args.layers}, backend {jax.default_backend()} "
          f"(jax {jax.__version__}): XLA compile-time memory plan, GiB")
    print()
    print("| remat | arguments | outputs | aliased | temporaries | total | compile s |")
    print("|---|---|---|---|---|---|---|")
    for remat in args.remat:
        r = plan(dataclasses.replace(base, remat=remat))
        print(f"| {remat} | {r['arguments']:.2f} | {r['outputs']:.2f} | {r['aliased']:.2f} | "
              f"{r['temporaries']:.2f} | {r['total']:.2f} | {r['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
