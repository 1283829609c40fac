"""Compile-time memory plan of ``sage-train``'s train step, without running it.

Builds the model and optimizer as shapes only (``nnx.eval_shape``), lowers and compiles the
jitted train step for a batch, and prints XLA's ``memory_analysis()`` (arguments, outputs,
temporaries) per remat policy and loss chunk (``--loss-chunk``: tokens per chunk of the
chunked cross-entropy, 0 unchunked, ``auto`` the trainer's default).  On a machine without
a GPU this is XLA:CPU's plan: the CPU has no flash attention (the score matrix is
materialised) and schedules differently, so the figures are estimates of the GPU plan, not
GPU measurements.

``--attention flash-standin`` compiles the step with attention replaced by a memory stand-in
of flash attention (cuDNN's, which ``jax.nn.dot_product_attention`` uses on a GPU in
bfloat16): a ``jax.custom_vjp`` that keeps what flash attention keeps for its backward pass
(queries, keys, values, the output and the float32 log-sum-exp of every row) and never
forms a ``T x T`` matrix, with cheap elementwise arithmetic in place of attention's.  Its
numbers are meaningless; its plan approximates the GPU's (flash attention's own tiled
workspace, a few MiB, is not counted).

    python benchmarks/train_memory_plan.py --model 270m --batch-size 16 --seq-len 1024 \\
        --dtype bfloat16 --remat none dots full --loss-chunk 0 auto
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import unittest.mock
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sage_optim.models import get_model_config
from sage_train.cli import _loss_chunk
from sage_train.train import TrainConfig, build, loss_chunk_tokens, make_steps

GIB = 1 << 30


@jax.custom_vjp
def _standin(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return _standin_fwd(q, k, v)[0]


def _standin_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
    out = q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2)
    lse = jnp.sum(q.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # (B, H, T) float32
    return out, (q, k, v, out, lse)


def _standin_bwd(res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, out, lse = res
    b, t, h, d = q.shape
    kv = k.shape[2]
    gf = g.astype(jnp.float32) * out.astype(jnp.float32) + lse.transpose(0, 2, 1)[..., None]
    gk = gf.reshape(b, t, kv, h // kv, d).sum(3)
    return ((gf * q.astype(jnp.float32)).astype(q.dtype), (gk * k).astype(k.dtype),
            (gk * v).astype(v.dtype))


_standin.defvjp(_standin_fwd, _standin_bwd)


def flash_standin(query: jax.Array, key: jax.Array, value: jax.Array, *args: Any,
                  **kwargs: Any) -> jax.Array:
    """A memory stand-in of flash attention with ``jax.nn.dot_product_attention``'s call."""
    return _standin(query, key, value)


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
    """Print a markdown table of the plan per remat policy and loss chunk."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="270m")
    p.add_argument("--optimizer", default="sage-hybrid")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", default="scan")
    p.add_argument("--remat", nargs="+", default=["none", "dots", "full"])
    p.add_argument("--attention", default="xla", choices=("xla", "flash-standin"),
                   help="xla: the model's attention as XLA:CPU compiles it (score matrices "
                   "materialised); flash-standin: a memory stand-in of flash attention")
    p.add_argument("--loss-chunk", nargs="+", type=_loss_chunk, default=[0, None],
                   help="tokens per loss chunk, 0 (unchunked) or auto")
    args = p.parse_args()
    base = TrainConfig(model=args.model, optimizer=args.optimizer, batch_size=args.batch_size,
                       seq_len=args.seq_len, dtype=args.dtype, layers=args.layers)
    print(f"{args.model} {args.optimizer}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.dtype}, layers={args.layers}, attention {args.attention}, "
          f"backend {jax.default_backend()} "
          f"(jax {jax.__version__}): XLA compile-time memory plan, GiB")
    print()
    print("| remat | loss chunk | arguments | outputs | aliased | temporaries | total | "
          "compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for remat in args.remat:
        for chunk in args.loss_chunk:
            cfg = dataclasses.replace(base, remat=remat, loss_chunk=chunk)
            tokens = loss_chunk_tokens(cfg)
            label = f"{tokens or 'none'}" + (" (auto)" if chunk is None else "")
            if args.attention == "flash-standin":
                with unittest.mock.patch.object(jax.nn, "dot_product_attention",
                                                flash_standin):
                    r = plan(cfg)
            else:
                r = plan(cfg)
            print(f"| {remat} | {label} | {r['arguments']:.2f} | {r['outputs']:.2f} | "
                  f"{r['aliased']:.2f} | {r['temporaries']:.2f} | {r['total']:.2f} | "
                  f"{r['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
