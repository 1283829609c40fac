#!/usr/bin/env bash
# Part of scripts/gpu-check: sage_torch on the GPU (issue 13).
#   1. the torch tests whose CUDA cases skip elsewhere (foreach vs single-tensor on CUDA,
#      capturable steps captured and replayed as a CUDA graph), then every tests/test_torch_*.py;
#   2. parity of the foreach path with sage_optax (CPU, float64; needs jax);
#   3. aten ops per step on the meta device (benchmarks/torch_step.py --op-count);
#   4. one optimizer step of every configuration on the GPU against torch.optim.AdamW
#      foreach and fused (benchmarks/torch_step.py --device cuda).
# Prints markdown on stdout, logs on stderr; skips (exit 0) without torch or a CUDA device.
#   bash scripts/gpu-check.d/30-torch.sh OUT_DIR      (PYTHON: the interpreter, default python3)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-check-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
left="${GPU_CHECK_SECONDS_LEFT:-540}"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "skipped: torch is not installed for $py"
  exit 0
fi
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "skipped: torch $("$py" -c 'import torch; print(torch.__version__)') sees no CUDA device"
  exit 0
fi
failed=0
section() { printf '\n### %s\n\n' "$1"; }
run() {  # run "title" timeout cmd...: the command's last lines as a code block
  local title="$1" limit="$2"; shift 2
  [ "$limit" -ge 30 ] || limit=30
  section "$title"
  echo '```text'
  echo "\$ $*"
  timeout "$limit" "$@" > "$out/30-torch.tmp"
  local rc=$?
  tail -n 40 "$out/30-torch.tmp"
  echo '```'
  echo
  echo "exit $rc"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
"$py" -c "import torch; print(f'- torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}')"
run "CUDA cases: foreach vs single-tensor, CUDA-graph capture" $((left / 5)) \
  "$py" -m pytest -q -rs tests/test_torch_multi_tensor.py tests/test_torch_capturable.py
run "every tests/test_torch_*.py" $((left / 4)) "$py" -m pytest -q -x tests/test_torch_*.py
if "$py" -c "import jax" 2>/dev/null; then
  run "parity: sage_torch foreach vs sage_optax (float64)" $((left / 8)) \
    "$py" -m sage_repro.parity --config all --foreach --every 100
else
  section "parity"
  echo "skipped: jax is not installed"
fi
run "aten ops per step (meta device, 270M)" 120 \
  "$py" benchmarks/torch_step.py --model 270m --op-count
run "one step on the GPU, 270M float32 (vs AdamW foreach and fused)" $((left / 3)) \
  "$py" benchmarks/torch_step.py --model 270m --device cuda --repeats 11
rm -f "$out/30-torch.tmp"
exit "$((failed > 0))"
