#!/usr/bin/env bash
# sage-train on the GPU (issue 14): a short 270M run of AdamW and SAGE-Hybrid, batch 16x1024,
# bfloat16, scanned layers; reports tokens/s, MFU and peak memory from each run's
# metrics.jsonl (compilation, evaluation and checkpoints excluded), as markdown.
set -uo pipefail
out="$1"
python3 - <<'PY' || { echo "skipped: no JAX with a GPU backend on this machine"; exit 0; }
import jax
raise SystemExit(0 if jax.default_backend() == "gpu" else 1)
PY
left="${GPU_CHECK_SECONDS_LEFT:-540}"
steps="${TRAIN_CHECK_STEPS:-60}"
if [ "$left" -lt 120 ]; then
  echo "skipped: ${left} s left of the budget, too little for two 270M runs"
  exit 0
fi
run_dir="$out/train-runs"
rm -rf "$run_dir"
echo "sage-train --model 270m --optimizer adamw sage-hybrid --batch-size 16 --seq-len 1024" \
  "--steps $steps (bfloat16, --layers scan, --remat none)" >&2
rc=0
for opt in adamw sage-hybrid; do  # one process each: the device's peak memory is per process
  timeout "$(((left - 20) / 2))" python3 -m sage_train --model 270m --optimizer "$opt" \
    --batch-size 16 --seq-len 1024 --steps "$steps" --eval-every "$steps" --eval-batches 2 \
    --checkpoint-every "$steps" --log-every 10 --no-progress --sharding none \
    --run-dir "$run_dir" >&2 || rc=$?
done
python3 - "$run_dir" "$steps" "$rc" <<'PY'
import json, pathlib, sys

import jax

run_dir, steps, rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(f"270M, batch 16x1024, bfloat16, scanned layers, {steps} steps on "
      f"{jax.devices()[0].device_kind} (sage-train exit {rc}); tokens/s and MFU over the "
      "timed steps (compilation, evaluation, checkpoints excluded)\n")
print("| optimizer | steps | last loss | tokens/s | MFU | peak memory GiB |")
print("|---|---|---|---|---|---|")
tps = {}
for name in ("adamw", "sage-hybrid"):
    path = run_dir / f"270m-{name}" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        print(f"| {name} | 0 | - | - | - | - |")
        continue
    r = rows[-1]
    tps[name] = r["tokens_per_s"]
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    peak = f"{r['peak_memory_bytes'] / 2**30:.1f}" if "peak_memory_bytes" in r else "-"
    print(f"| {name} | {r['step']} | {r['loss']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | {peak} |")
if len(tps) == 2:
    print(f"\nSAGE-Hybrid / AdamW tokens/s: {tps['sage-hybrid'] / tps['adamw']:.3f} "
          "(target >= 0.98)")
sys.exit(rc)
PY
