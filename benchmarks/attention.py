"""The trainer's attention, forward and backward, with each implementation: error, time, memory.

Runs :func:`sage_train.model.llama.causal_attention` (what ``sage-train``'s model calls: causal,
grouped-query heads, float32 softmax) at the given shapes with every implementation this
machine can run (``--attention xla cudnn``; ``cudnn`` is cuDNN's fused flash attention, on a
CUDA GPU only, and prints a one-line skip reason elsewhere) and reports, per implementation:

* the largest absolute difference of the output and of the gradients of ``q``, ``k``, ``v``
  (for a random output cotangent) from a float32 XLA reference at the highest matmul
  precision, next to the reference's largest magnitude;
* the median wall time of one forward + backward (the jitted ``jax.vjp``), the
  implementations interleaved repeat by repeat in the same process (after a warm-up call);
* the compiled program's temporary memory (``memory_analysis().temp_size_in_bytes``): XLA's
  materialises the float32 ``T x T`` scores of every head, cuDNN's does not.

Defaults: the 270m model's heads (``sage_train.model.shapes``), batch 16 x 1024 tokens, bfloat16::

    python benchmarks/attention.py
    python benchmarks/attention.py --batch-size 2 --seq-len 64 --repeats 3   # CPU: xla only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sage_optax import placement
from sage_train.model.llama import causal_attention, cudnn_present, cudnn_problem
from sage_train.model.shapes import get_model_config

MIB = 1 << 20
IMPLEMENTATIONS = ("xla", "cudnn")


def inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: Any,
           seed: int = 0) -> tuple[jax.Array, ...]:
    """Random ``q`` ``(B, T, H, D)``, ``k``/``v`` ``(B, T, K, D)`` and an output cotangent."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
    g = jax.random.normal(keys[3], (batch, seq, heads, head_dim), dtype)
    return q, k, v, g


def forward_backward(implementation: str) -> Any:
    """``(q, k, v, g) -> (out, (dq, dk, dv))`` of ``causal_attention`` with ``implementation``."""

    def run(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, implementation), q, k, v)
        return out, vjp(g)

    return jax.jit(run)


def skip_reason(implementation: str, platform: str, dtype: Any, head_dim: int) -> str | None:
    """Why ``implementation`` cannot run on ``platform`` here (``None``: it can)."""
    if implementation == "xla":
        return None
    return cudnn_problem(platform, dtype, head_dim,
                         cudnn=platform in ("cuda", "gpu") and cudnn_present())


def max_diff(a: Any, b: Any) -> float:
    """The largest ``|a - b|`` over every leaf, in float32."""
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(argv: list[str] | None = None) -> int:
    """Print the comparison as a markdown table (skipped implementations as one line each)."""
    default = get_model_config("270m")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=default.num_heads)
    p.add_argument("--kv-heads", type=int, default=default.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=default.head_dim)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--attention", nargs="+", default=list(IMPLEMENTATIONS),
                   choices=IMPLEMENTATIONS, help="implementations to compare")
    p.add_argument("--repeats", type=int, default=20,
                   help="timed calls of each implementation, interleaved")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    q, k, v, g = inputs(args.batch_size, args.seq_len, args.heads, args.kv_heads,
                        args.head_dim, dtype)
    platform = placement.concrete_platform(q) or jax.default_backend()
    device = jax.devices()[0].device_kind
    print(f"attention forward + backward: batch {args.batch_size} x {args.seq_len}, "
          f"{args.heads} query / {args.kv_heads} kv heads, head dim {args.head_dim}, "
          f"{dtype.name}, on {device} ({platform}, jax {jax.__version__})")
    print()
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v, g)]
        ref = jax.block_until_ready(forward_backward("xla")(*f32))
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref))
    runs: dict[str, Callable[..., Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    skipped = []
    for name in args.attention:
        reason = skip_reason(name, platform, dtype, args.head_dim)
        if reason is not None:
            skipped.append(f"{name}: skipped: {reason}")
            continue
        compiled = forward_backward(name).lower(q, k, v, g).compile()
        out = jax.block_until_ready(compiled(q, k, v, g))  # warm-up, and the values
        memory = compiled.memory_analysis()
        temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
        runs[name] = compiled
        rows[name] = {"out": max_diff(out[0], ref[0]), "grads": [max_diff(a, b) for a, b in
                                                                 zip(out[1], ref[1],
                                                                     strict=True)],
                      "temp": temp, "times": []}
    for _ in range(args.repeats):  # interleaved: drifts in clock or load hit all alike
        for name, compiled in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, g))
            rows[name]["times"].append(time.perf_counter() - t)
    print(f"max |difference| from a float32 XLA reference (its max |value|: {scale:.3g}); "
          f"median of {args.repeats} interleaved calls; compiled temporary memory")
    print()
    print("| implementation | out | dq | dk | dv | median ms | temporaries MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ms = f"{1e3 * statistics.median(r['times']):.2f}" if r["times"] else "-"
        temp = "-" if r["temp"] is None else f"{r['temp'] / MIB:,.2f}"
        dq, dk, dv = r["grads"]
        print(f"| {name} | {r['out']:.2e} | {dq:.2e} | {dk:.2e} | {dv:.2e} | {ms} | {temp} |")
    for line in skipped:
        print(line)
    if len(rows) == 2 and all(r["times"] for r in rows.values()):
        speed = statistics.median(rows["xla"]["times"]) / statistics.median(rows["cudnn"]["times"])
        print(f"\ncudnn is {speed:.2f}x the speed of xla here")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
