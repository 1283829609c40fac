"""``sage-train``: pretrain a LLaMA with one or several of the paper's configurations."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from sage_optim.models import MODELS
from sage_optim.presets import CONFIG_NAMES
from sage_optim.table import format_bytes, format_table
from sage_train.sharding import MODES
from sage_train.train import SCHEDULES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: ``small`` with ``sage-hybrid`` on the embedded corpus)."""
    p = argparse.ArgumentParser(prog="sage-train", description=__doc__)
    p.add_argument("--model", default="small", choices=list(MODELS))
    p.add_argument("--optimizer", nargs="+", default=["sage-hybrid"], choices=CONFIG_NAMES,
                   help="one or more configurations, trained one after the other")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the configuration's paper value)")
    p.add_argument("--schedule", default="cosine", choices=SCHEDULES,
                   help="after the linear warmup (default cosine, as the paper)")
    p.add_argument("--warmup-frac", type=float, default=0.1)
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--data", default=None,
                   help="text file/folder or .u16/.u32/.npy tokens (default: stdlib corpus)")
    p.add_argument("--run-dir", default="runs", help="runs go to RUN_DIR/MODEL-OPTIMIZER")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--sharding", default="dp", choices=MODES)
    p.add_argument("--record-h-every", type=int, default=10)
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train, print a summary table and save the loss-curve PNG; non-zero on a NaN stop."""
    args = parse_args(argv)
    import jax

    if args.distributed:
        jax.distributed.initialize()
    from sage_train.train import TrainConfig, save_loss_curve, train

    results = []
    for name in args.optimizer:
        cfg = TrainConfig(
            model=args.model, optimizer=name, learning_rate=args.lr, schedule=args.schedule,
            warmup_frac=args.warmup_frac, final_lr_frac=args.final_lr_frac,
            batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
            seed=args.seed, clip=args.clip, eval_every=args.eval_every,
            eval_batches=args.eval_batches, data=args.data,
            run_dir=str(pathlib.Path(args.run_dir) / f"{args.model}-{name}"),
            checkpoint_every=args.checkpoint_every, sharding=args.sharding,
            record_h_every=args.record_h_every, progress=not args.no_progress,
        )
        print(f"training {args.model} with {name}: {dataclasses.asdict(cfg)}", flush=True)
        results.append(train(cfg))
    rows = [(r.config.optimizer, r.steps_done,
             "-" if r.final_test_ppl is None else f"{r.final_test_ppl:.2f}",
             format_bytes(r.opt_state_bytes), f"{r.tokens_per_s:,.0f}") for r in results]
    print(format_table(("optimizer", "steps", "test ppl", "optimizer state", "tokens/s"), rows))
    png = pathlib.Path(args.run_dir) / f"{args.model}-loss.png"
    save_loss_curve(results, png)
    print(f"loss curve: {png}")
    stopped = [r for r in results if r.stopped_reason]
    for r in stopped:
        print(f"{r.config.optimizer}: {r.stopped_reason}", file=sys.stderr)
    return 1 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
