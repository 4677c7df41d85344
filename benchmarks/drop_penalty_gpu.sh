#!/usr/bin/env bash
# The drop-penalty runs (benchmarks/convergence_gpu.py) on the GPU machine, one run per GPU. Idempotent: each call
# resumes every run from its checkpoint under build/conv_ckpt (kept while the machine stays warm) and ends before
# --max-seconds; repeat the same call until $OUT/summary.md lists every run as ok. A failed run is recorded in the
# summary and the log; the others go on.
#   carry: build/cuda/lib (the CUDA and CPU kernel libraries of this commit; another folder: set TURBO_MOE_LIB_DIR)
#   and build/gpu_data (the pd_english_xl tokens, from
#   `TURBO_MOE_DATA_DIR=build/gpu_data python benchmarks/convergence_gpu.py --prepare-data` here, ~21 MB)
#   usage: bash benchmarks/drop_penalty_gpu.sh OUT_DIR [convergence_gpu.py options, e.g. --max-seconds 530]
set -u
OUT=${1:?usage: bash benchmarks/drop_penalty_gpu.sh OUT_DIR [options]}
shift
export TURBO_MOE_DATA_DIR=$PWD/build/gpu_data
export TURBO_MOE_LIB_DIR=${TURBO_MOE_LIB_DIR:-$PWD/build/cuda/lib}
source benchmarks/gpu_env.sh || exit 1
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -lt 1 ]; then echo "no GPU found (nvidia-smi -L)"; exit 1; fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
df -h "$PWD/build" | tail -1
mkdir -p "$OUT" build/conv_ckpt
python3 benchmarks/convergence_gpu.py --out "$OUT" --state build/conv_ckpt --gpus "$GPUS" --max-seconds 530 "$@"
status=$?
cat "$OUT/summary.md"
exit $status
