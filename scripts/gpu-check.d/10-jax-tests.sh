#!/usr/bin/env bash
# The whole test suite with JAX on the GPU (CPU devices too: the 8-device sharding tests build
# their meshes from them).  The notebook tests need jupytext, the distributed torch tests
# several processes: both are left to CI.
set -uo pipefail
out="$1"
export JAX_PLATFORMS="cuda,cpu"
# The torch CUDA tests run in the same processes: JAX must not take 75% of the GPU up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export SAGE_TEST_JAX_CACHE="$out/jax-cache"
if ! python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  echo "skipped: JAX sees no GPU (jax.default_backend() is not 'gpu')"
  exit 0
fi
python3 -c "import jax; print(f'- jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}')"
workers=$(( $(nproc) > 8 ? 8 : $(nproc) ))
set -o pipefail
python3 -m pytest -q -p no:cacheprovider -n "$workers" --durations=10 \
  --ignore=tests/test_notebooks.py --ignore=tests/test_torch_distributed.py \
  --junitxml="$out/jax-tests.xml" tests >"$out/jax-tests.txt" 2>&1
rc=$?
echo '```'
grep -E "^(FAILED|ERROR)|passed|failed" "$out/jax-tests.txt" | tail -40
echo '```'
exit $rc
