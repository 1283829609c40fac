"""Cold ``torch.compile`` of a full training step: sage_torch's optimizers vs ``torch.optim.AdamW``.

The step is ``opt.zero_grad() → forward → loss.backward() → opt.step()`` in one
``torch.compile``d function (Inductor, default options), on a ``transformers``
``LlamaForCausalLM`` from a tiny config (``--layers`` 2, ``--hidden`` 64, vocabulary 256,
tied embeddings: 20 parameter tensors), batch 4 × 32 tokens.  Each optimizer is
``sage_torch.make_optimizer(name, model, lr=1e-3)`` (``--foreach``: passed to both) or
``torch.optim.AdamW(lr=1e-3)``.

Every measurement runs in a fresh Python process with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
(no FX-graph, AOTAutograd or Inductor code cache is read or written, no compiled kernel is
reused), so each compile is cold.  In it, the wall time of step 1 (its compile, plus one
tiny step) is the cold compile; steps 2 and 3 are timed too, and Dynamo's counters give
the graphs and frames compiled during them (recompiles: ``0`` expected).  The optimizers
run interleaved: each round runs every optimizer once, in an order rotated from round to
round, and each one's time is its median over ``--repeats`` rounds.

Prints a markdown table and whether the target holds: ``sage-hybrid``'s cold compile within
1.5x ``torch.optim.AdamW``'s, and no recompile at steps 2 and 3.

    python benchmarks/torch_compile.py [--repeats 3] [--configs sage-hybrid] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

BASELINE = "torch.optim.AdamW"
TARGET = 1.5  # sage-hybrid's cold compile at most this many times AdamW's


def child(name: str, layers: int, hidden: int, foreach: bool | None, threads: int
          ) -> dict[str, Any]:
    """Compile and run three steps of ``name`` in this (fresh) process; the counts and times."""
    import torch
    import transformers
    from torch._dynamo.utils import counters

    import sage_torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach) if name == BASELINE
           else sage_torch.make_optimizer(name, model, lr=1e-3, foreach=foreach))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    @torch.compile
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return loss

    times, graphs, frames = [], [], []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        graphs.append(counters["stats"]["unique_graphs"])
        frames.append(counters["frames"]["total"])
    return {"name": name, "params": len(list(model.parameters())), "times": times,
            "graphs": graphs, "frames": frames}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`child` in a fresh process with Inductor's caches off."""
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    cmd = [sys.executable, __file__, "--child", name, "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--foreach", args.foreach,
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the measurements and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--configs", nargs="+", default=["sage-hybrid"],
                    help="sage_torch configurations (default sage-hybrid)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    ap.add_argument("--foreach", default="default", choices=("default", "true", "false"),
                    help="foreach= of every optimizer (default: its default, single-tensor "
                         "on the CPU)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    foreach = {"default": None, "true": True, "false": False}[args.foreach]
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.hidden, foreach, args.threads)))
        return []

    import torch

    names = [BASELINE, *args.configs]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            result = measure(name, args)
            runs[name].append(result)
            t = result["times"]
            print(f"  round {r + 1}: {name}: step 1 {t[0]:.1f} s, steps 2-3 {t[1]:.2f} / "
                  f"{t[2]:.2f} s, graphs {result['graphs']}", flush=True)
    base = statistics.median(x["times"][0] for x in runs[BASELINE])
    print()
    print(f"torch {torch.__version__}, {args.threads} thread(s), LlamaForCausalLM "
          f"{args.layers} layers, hidden {args.hidden} ({runs[BASELINE][0]['params']} "
          f"tensors), foreach={args.foreach}, TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, median "
          f"of {args.repeats} fresh processes each")
    print()
    print("| optimizer | cold compile, step 1 (s) | vs AdamW | graphs at step 1 "
          "| graphs / frames compiled at steps 2-3 | steps 2-3 (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name in names:
        xs = runs[name]
        cold = statistics.median(x["times"][0] for x in xs)
        later = max(x["graphs"][2] - x["graphs"][0] for x in xs)
        later_frames = max(x["frames"][2] - x["frames"][0] for x in xs)
        warm = statistics.median(x["times"][1] + x["times"][2] for x in xs)
        rows.append({"name": name, "cold": cold, "ratio": cold / base, "recompiles": later})
        print(f"| {name} | {cold:.1f} | {cold / base:.2f}x | {xs[0]['graphs'][0]} "
              f"| {later} / {later_frames} | {warm:.2f} |")
    print()
    for row in rows[1:]:
        ok = row["ratio"] <= TARGET and row["recompiles"] == 0
        print(f"target ({row['name']} within {TARGET}x of AdamW, no recompile): "
              f"{'met' if ok else 'NOT met'} ({row['ratio']:.2f}x, {row['recompiles']} "
              "graphs after step 1)")
    return rows


if __name__ == "__main__":
    main()
