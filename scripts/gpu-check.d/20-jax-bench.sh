#!/usr/bin/env bash
# The sage_optax update against optax.adamw on the GPU: 270M and 1.3B, float32 and bfloat16,
# per-layer and stacked (nnx.scan) trees, as long as the budget lasts.  SinkGD runs what
# kernel="auto" takes (the jnp path until the Pallas kernel is validated on this GPU:
# sage_optim.kernels.VALIDATED_ON); on 270M, sage-hybrid and sinkgd-pure are also timed with
# both, "[pallas]" and "[jnp]" (--compare-kernels): the figures that decide that default.
set -uo pipefail
out="$1"
export JAX_PLATFORMS="cuda"
if ! python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  echo "skipped: JAX sees no GPU"
  exit 0
fi
start=$SECONDS
left() { echo $(( ${GPU_CHECK_SECONDS_LEFT:-540} - (SECONDS - start) )); }
rc=0
for run in "270m float32 per-layer" "270m float32 stacked" "270m bfloat16 per-layer" \
           "270m bfloat16 stacked" "1.3b float32 per-layer" "1.3b float32 stacked" \
           "1.3b bfloat16 stacked"; do
  set -- $run
  if [ "$(left)" -lt 90 ]; then echo "- $run: skipped (budget)"; continue; fi
  echo "### $run"
  log="$out/jax-step-$1-$2-$3.txt"
  compare=()
  if [ "$1" = "270m" ]; then compare=(--compare-kernels sage-hybrid sinkgd-pure); fi
  timeout "$(( $(left) - 30 ))" python3 benchmarks/jax_step.py --model "$1" --dtype "$2" \
    --layout "$3" --repeats 9 --warmup 2 --bw-mib 1024 \
    --configs sage-hybrid lion-hybrid sinkgd-hybrid sinkgd-pure sage-pure ${compare[@]+"${compare[@]}"} \
    >"$log" 2>&1 || rc=1
  sed -n '/^| configuration/,$p' "$log"
  echo
done
exit $rc
