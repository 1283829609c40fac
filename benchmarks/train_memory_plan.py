"""Compile-time memory plan of ``sage-train``'s train step, without running it.

Builds the model and optimizer as shapes only (``nnx.eval_shape``), lowers and compiles the
jitted train step for a batch, and prints XLA's ``memory_analysis()`` (arguments, outputs,
temporaries) per attention implementation, remat policy and loss chunk (``--loss-chunk``:
tokens per chunk of the chunked cross-entropy, 0 unchunked, ``auto`` the trainer's default).
On a machine without a GPU this is XLA:CPU's plan, which schedules differently from the
GPU's: the figures are estimates of the GPU plan, not GPU measurements.

``--attention`` takes the model's implementations (``sage-train --attention``), one or both:

* ``xla``: XLA's attention, which materialises the float32 ``T x T`` scores of every head
  (``jax.nn.dot_product_attention``'s default, on a GPU too);
* ``cudnn``: cuDNN's fused flash attention.  Where it can run (a CUDA GPU with cuDNN) the
  real one is compiled; elsewhere a memory stand-in of it, and the output says which.  The
  stand-in is a ``jax.custom_vjp`` that keeps what flash attention keeps for its backward
  pass (queries, keys, values, the output and the float32 log-sum-exp of every row) and
  never forms a ``T x T`` matrix, with cheap elementwise arithmetic in place of attention's:
  its numbers are meaningless, its plan approximates the GPU's (flash attention's own tiled
  workspace, a few MiB, is not counted).  Settings cuDNN cannot run on any GPU (float32, a
  head dim it does not take) are skipped with the reason.

The output also says which implementation ``--attention auto`` (the trainer's default) takes
for these settings on a CUDA GPU (:func:`sage_train.model.llama.attention_choice`: XLA's until
``scripts/gpu-check`` has validated cuDNN's on that GPU) and whether ``--attention cudnn``
(the opt-in) can run them.

    python benchmarks/train_memory_plan.py --model 270m --batch-size 16 --seq-len 1024 \\
        --dtype bfloat16 --remat none dots full --loss-chunk 0 auto --attention xla cudnn
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

from sage_optax import placement
from sage_train.model import llama as model_lib
from sage_train.model.shapes import get_model_config
from sage_train.run.config import TrainConfig, compute_dtype, loss_chunk_tokens, parse_loss_chunk
from sage_train.run.steps import build, make_steps

GIB = 1 << 30
UNITS = {"GiB": GIB, "MiB": 1 << 20}


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


def cudnn_plan_mode(cfg: TrainConfig) -> tuple[str, str]:
    """How ``--attention cudnn`` is planned for ``cfg`` here: ``(mode, what the output says)``.

    ``mode`` is ``"real"`` (cuDNN's attention compiles here), ``"standin"`` (it would run on
    a CUDA GPU, but not here) or ``"skip"`` (no GPU runs it for these settings).
    """
    dtype = jnp.dtype(compute_dtype(cfg))
    head_dim = get_model_config(cfg.model).head_dim
    on_gpu = model_lib.cudnn_problem("cuda", dtype, head_dim)
    if on_gpu is not None:
        return "skip", f"cudnn skipped: {on_gpu}"
    platform = placement.concrete_platform(jnp.zeros(())) or jax.default_backend()
    here = model_lib.cudnn_problem(platform, dtype, head_dim,
                                   cudnn=platform in ("cuda", "gpu") and model_lib.cudnn_present())
    if here is None:
        return "real", "cudnn: cuDNN's fused attention, compiled here"
    return "standin", f"cudnn: a memory stand-in of cuDNN's flash attention ({here})"


def auto_line(cfg: TrainConfig, device_kind: str | None = None) -> str:
    """Which implementation ``--attention auto`` takes for ``cfg`` on a CUDA GPU, and why.

    ``device_kind``: the GPU's name (``None``: one on which cuDNN's attention has not been
    validated by ``scripts/gpu-check``, as every GPU today); the line also says whether
    ``--attention cudnn`` can run these settings there.
    """
    dtype, head_dim = jnp.dtype(compute_dtype(cfg)), get_model_config(cfg.model).head_dim
    impl, why = model_lib.attention_choice("auto", "cuda", dtype, head_dim,
                                           device_kind=device_kind)
    line = f"--attention auto on a CUDA GPU (with cuDNN) takes {impl} ({why})"
    problem = model_lib.cudnn_problem("cuda", dtype, head_dim)
    return line + ("; --attention cudnn runs cuDNN flash attention there" if problem is None
                   else f"; --attention cudnn cannot ({problem})")


def plan(cfg: TrainConfig, unit: int = GIB) -> dict[str, float]:
    """``memory_analysis()`` of the train step of ``cfg`` in ``unit`` bytes, and compile seconds."""
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
        "arguments": m.argument_size_in_bytes / unit,
        "outputs": m.output_size_in_bytes / unit,
        "aliased": m.alias_size_in_bytes / unit,
        "temporaries": m.temp_size_in_bytes / unit,
        "compile_s": seconds,
    }
    # live at the peak: arguments (donated into the outputs) plus temporaries
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def main(argv: list[str] | None = None) -> None:
    """Print a markdown table of the plan per attention, remat policy and loss chunk."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="270m")
    p.add_argument("--optimizer", default="sage-hybrid")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", default="scan")
    p.add_argument("--remat", nargs="+", default=["none", "dots", "full"])
    p.add_argument("--attention", nargs="+", default=["xla", "cudnn"], choices=("xla", "cudnn"),
                   help="xla: XLA's attention (score matrices materialised); cudnn: cuDNN's "
                   "flash attention (compiled where cuDNN runs, else a memory stand-in)")
    p.add_argument("--loss-chunk", nargs="+", type=parse_loss_chunk, default=[0, None],
                   help="tokens per loss chunk, 0 (unchunked) or auto")
    p.add_argument("--unit", default="GiB", choices=tuple(UNITS), help="unit of the table")
    args = p.parse_args(argv)
    base = TrainConfig(model=args.model, optimizer=args.optimizer, batch_size=args.batch_size,
                       seq_len=args.seq_len, dtype=args.dtype, layers=args.layers)
    print(f"{args.model} {args.optimizer}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.dtype}, layers={args.layers}, backend {jax.default_backend()} "
          f"(jax {jax.__version__}): XLA compile-time memory plan, {args.unit}")
    print(auto_line(base))
    attentions = []
    for name in dict.fromkeys(args.attention):
        if name == "xla":
            print("xla: XLA's attention, compiled here")
            attentions.append(("xla", "xla"))
            continue
        mode, note = cudnn_plan_mode(base)
        print(note)
        if mode != "skip":
            attentions.append(("cudnn" if mode == "real" else "cudnn (stand-in)", mode))
    print()
    print("| attention | remat | loss chunk | arguments | outputs | aliased | temporaries | "
          "total | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label_att, mode in attentions:
        for remat in args.remat:
            for chunk in args.loss_chunk:
                cfg = dataclasses.replace(base, remat=remat, loss_chunk=chunk,
                                          attention="cudnn" if mode == "real" else "xla")
                tokens = loss_chunk_tokens(cfg)
                label = f"{tokens or 'none'}" + (" (auto)" if chunk is None else "")
                if mode == "standin":  # the model's XLA attention replaced by the stand-in
                    with unittest.mock.patch.object(model_lib, "xla_attention", flash_standin):
                        r = plan(cfg, UNITS[args.unit])
                else:
                    r = plan(cfg, UNITS[args.unit])
                print(f"| {label_att} | {remat} | {label} | {r['arguments']:.2f} | "
                      f"{r['outputs']:.2f} | {r['aliased']:.2f} | {r['temporaries']:.2f} | "
                      f"{r['total']:.2f} | {r['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
