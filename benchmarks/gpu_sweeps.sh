#!/usr/bin/env bash
# Run sweep specs through papermill on a GPU machine that has JAX but neither Jupyter nor internet access
# (how the committed gpu_* sweep results were produced). What it needs, carried from a machine with PyPI:
#   .whl/          papermill + ipykernel wheels for the GPU machine's Python (benchmarks/gpu_notes.md)
#   $LIB_DIR       libturbo_moe_cpu.so + libturbo_moe_cuda.so built for sm_90a (default build/lead_lib)
#   $DATA_DIR      a TURBO_MOE_DATA_DIR holding the Shakespeare cache (default build/data_cache)
# Usage:  TURBO_MOE_GIT_COMMIT=<commit> benchmarks/gpu_sweeps.sh BUDGET_S SPEC.yaml [SPEC.yaml ...]
# Each spec runs with `turbo-moe sweep --budget-s` (what is not started stays pending: run again to
# resume). Results land in experiments/results/; with $OUT set they are also packed into
# $OUT/results.tgz and the sweep log into $OUT/sweeps.log.
set -uo pipefail
budget=${1:?usage: gpu_sweeps.sh BUDGET_S SPEC.yaml [SPEC.yaml ...]}
shift
cd "$(dirname "$0")/.."
LIB_DIR=${LIB_DIR:-$PWD/build/lead_lib}
DATA_DIR=${DATA_DIR:-$PWD/build/data_cache}
PY=${PYTHON:-python3}

if [ -d .whl ] && ! $PY -c "import papermill, ipykernel" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TURBO_MOE_LIB_DIR=$LIB_DIR TURBO_MOE_DATA_DIR=$DATA_DIR PYTHONUNBUFFERED=1
# Let XLA's allocator use most of the GPU (its default is 75%), so the OOM frontier is the device's.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Points of a sweep share most compiled programs (the parameter init of one model takes ~80 s to compile
# on an H200 and is the same for every batch size): JAX's persistent cache compiles each once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_compilation_cache}
$PY -m ipykernel install --user --name turbo-moe --display-name "turbo-moe" >/dev/null || exit 1

log=${OUT:-/tmp}/sweeps.log
start=$(date +%s)
for spec in "$@"; do
    left=$(( budget - ($(date +%s) - start) ))
    if [ "$left" -le 30 ]; then echo "budget spent: $spec not started" | tee -a "$log"; continue; fi
    echo "== $spec (budget ${left}s) $(date -u +%FT%TZ)" | tee -a "$log"
    $PY -m turbo_moe.cli sweep "$spec" --budget-s "$left" --no-progress 2>&1 | tee -a "$log"
done
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/results.tgz" experiments/results
fi
