#!/usr/bin/env bash
# Run sweep specs through papermill on a GPU machine that has JAX but neither Jupyter nor internet access
# (how the committed gpu_* sweep results were produced). What it needs, carried from a machine with PyPI:
#   .whl/          papermill + ipykernel wheels for the GPU machine's Python (3.12), made on a machine with PyPI by
#                  pip download --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 papermill ipykernel
#                  then deleting the wheels of packages the GPU image already has and pandas / orbax rely on
#                  (python_dateutil, typing_extensions, packaging, tzdata, pyyaml): 43 wheels, 17 MB (2026-11-27).
#   $LIB_DIR       libturbo_moe_cpu.so + libturbo_moe_cuda.so built for sm_90a (default build/lead_lib)
#   $DATA_DIR      a TURBO_MOE_DATA_DIR holding the Shakespeare cache (default build/data_cache)
# Usage:  TURBO_MOE_GIT_COMMIT=<commit> benchmarks/gpu_sweeps.sh BUDGET_S SPEC.yaml[:GLOB] [...]
# Each spec runs with `turbo-moe sweep --budget-s` (no point starts after BUDGET_S; what is not started
# stays pending: run again to resume), optionally only its points matching GLOB. At HARD_STOP_S
# (default BUDGET_S + 120) a running point is interrupted so that the finished ones are always saved.
# Results land in experiments/results/; with $OUT set they are packed into $OUT/results.tgz after every
# spec, and the sweep log goes to $OUT/sweeps.log.
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
# Library and data paths, allocator fraction (the OOM frontier is the device's), persistent compilation
# cache (points of a sweep share most compiled programs): one place, benchmarks/gpu_env.sh.
export TURBO_MOE_LIB_DIR=$LIB_DIR TURBO_MOE_DATA_DIR=$DATA_DIR
source benchmarks/gpu_env.sh || exit 1
$PY -m ipykernel install --user --name turbo-moe --display-name "turbo-moe" >/dev/null || exit 1

log=${OUT:-/tmp}/sweeps.log
hard_stop=${HARD_STOP_S:-$((budget + 120))}
start=$(date +%s)
for arg in "$@"; do
    spec=${arg%%:*}
    only=(); [ "$arg" != "$spec" ] && only=(--only "${arg#*:}")
    elapsed=$(( $(date +%s) - start ))
    left=$(( budget - elapsed ))
    if [ "$left" -le 30 ]; then echo "budget spent: $arg not started" | tee -a "$log"; continue; fi
    echo "== $arg (budget ${left}s) $(date -u +%FT%TZ)" | tee -a "$log"
    timeout -s INT -k 20 $(( hard_stop - elapsed )) \
        $PY -m turbo_moe.cli sweep "$spec" "${only[@]}" --budget-s "$left" --no-progress 2>&1 \
        | grep --line-buffered -v "IPKernelApp\|TqdmWarning\|autonotebook" | tee -a "$log"
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" experiments/results
done
exit 0
