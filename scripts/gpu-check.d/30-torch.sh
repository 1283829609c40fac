#!/usr/bin/env bash
# Part of scripts/gpu-check: sage_torch on the GPU (issue 13).
#   1. the torch tests whose CUDA cases skip elsewhere (foreach vs single-tensor on CUDA,
#      capturable steps captured and replayed as a CUDA graph);
#   2. the fused (Triton) path on CUDA (tests/test_torch_fused_cuda.py): fused vs foreach vs
#      single-tensor for SAGE, Lion, SinkGD and make_optimizer(..., fused=True), float32 and
#      bfloat16, the first-use self-check, a captured CUDA graph, several devices;
#   3. every other tests/test_torch_*.py;
#   4. parity of the foreach path with sage_optax (CPU, float64; needs jax);
#   5. aten ops per step on the meta device (benchmarks/torch_step.py --op-count);
#   6. one optimizer step of every configuration on the GPU against torch.optim.AdamW
#      foreach and fused (benchmarks/torch_step.py --device cuda), float32, then bfloat16
#      for the configurations with a fused rule: each with a fused-vs-foreach table.
# Sections 2 and 6 are what decides the torch default: fused=True stays opt-in (foreach is
# the CUDA default, as in torch.optim) until a report shows a kernel correct and faster.
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
run() {  # run "title" timeout cmd...: the command's last TAIL (40) lines as a code block
  local title="$1" limit="$2" lines="${TAIL:-40}"; shift 2
  [ "$limit" -ge 30 ] || limit=30
  section "$title"
  echo '```text'
  echo "\$ $*"
  timeout "$limit" "$@" > "$out/30-torch.tmp"
  local rc=$?
  tail -n "$lines" "$out/30-torch.tmp"
  echo '```'
  echo
  echo "exit $rc"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
"$py" -c "import torch; print(f'- torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}')"
echo "- torch default path on CUDA: foreach (fused=True is opt-in until this report shows the kernels correct and faster)"
run "CUDA cases: foreach vs single-tensor, CUDA-graph capture" $((left / 8)) \
  "$py" -m pytest -q -rs tests/test_torch_multi_tensor.py tests/test_torch_capturable.py
TAIL=60 run "fused (Triton) path on CUDA: correctness (fused vs foreach vs single-tensor, float32 and bfloat16; self-check; graph; devices)" $((left / 6)) \
  "$py" -m pytest -v -rs --tb=short -p no:cacheprovider tests/test_torch_fused_cuda.py
run "every tests/test_torch_*.py (the fused CUDA file ran above)" $((left / 5)) \
  "$py" -m pytest -q -x --ignore=tests/test_torch_fused_cuda.py tests/test_torch_*.py
if "$py" -c "import jax" 2>/dev/null; then
  run "parity: sage_torch foreach vs sage_optax (float64)" $((left / 10)) \
    "$py" -m sage_repro.parity --config all --foreach --every 100
else
  section "parity"
  echo "skipped: jax is not installed"
fi
run "aten ops per step (meta device, 270M)" 120 \
  "$py" benchmarks/torch_step.py --model 270m --op-count
TAIL=80 run "one step on the GPU, 270M float32 (vs AdamW; sage_torch foreach = default, fused = opt-in)" $((left / 4)) \
  "$py" benchmarks/torch_step.py --model 270m --device cuda --repeats 11
TAIL=40 run "one step on the GPU, 270M bfloat16, configurations with a fused rule" $((left / 8)) \
  "$py" benchmarks/torch_step.py --model 270m --device cuda --dtype bfloat16 --repeats 7 \
  --no-memory --configs sage-hybrid lion-hybrid sinkgd-hybrid sage-pure sinkgd-pure lion
rm -f "$out/30-torch.tmp"
exit "$((failed > 0))"
