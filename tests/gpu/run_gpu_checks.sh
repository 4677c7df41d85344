#!/usr/bin/env bash
# One device-machine call: GPU tests, compute-sanitizer memcheck on a small case, then the
# benchmark. Run from the repository root with the built libraries in turbo_moe/_lib:
#   bash tests/gpu/run_gpu_checks.sh [benchmark args...]      (writes logs under $OUT or /tmp)
set -u
OUT_DIR="${OUT:-/tmp/turbo_moe_gpu}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT_DIR/pytest.log" | tail -40
fi
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    python3 tests/gpu/sanitizer_case.py > "$OUT_DIR/sanitizer.log" 2>&1
  echo "compute-sanitizer exit code: $?" | tee -a "$OUT_DIR/sanitizer.log"
  grep -E "ERROR SUMMARY|grouped_gemm|permute|unpermute|router_topk|segment_sum|Invalid|exit code" "$OUT_DIR/sanitizer.log" | head -20
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/grouped_gemm.py --out "$OUT_DIR/kernels.csv" "$@" 2>&1 | tee "$OUT_DIR/bench.log" | tail -80
fi
