#!/usr/bin/env bash
# Training runs on a GPU machine, one process each, in the order a points file gives; each record packed under $OUT
# as soon as its run ends (the call brings back at most 8 files: everything goes into $OUT/points.tgz).
#   POINTS=points.txt OUT=... bash benchmarks/train_points.sh   # a points file: the micro-batch campaign has one
# A points file: one run a line, `LABEL GPUS JSON [K=V ...]`: the label names the record's folder, GPUS is
# CUDA_VISIBLE_DEVICES, JSON a TrainConfig dict without spaces, K=V environment variables of that process only
# (XLA_FLAGS, recorded in the provenance). A line ending in `&` runs in the background (points on other GPUs at
# the same time); a line `wait` waits for them. `#` starts a comment. Carry build/lead_lib (benchmarks/gpu_env.sh).
set -u
: "${OUT:?OUT must name the folder for the results}" "${POINTS:?POINTS must name a points file}"
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=true
LIMIT=${LIMIT:-580}  # the call's seconds; each run gets what is left
root=/tmp/train_points
mkdir -p "$root"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } >"$root/env.txt" 2>&1

point() {  # point LABEL GPUS JSON [K=V ...]
  local label=$1 gpus=$2 cfg=$3
  shift 3
  env "$@" CUDA_VISIBLE_DEVICES="$gpus" timeout $((LIMIT - SECONDS)) python3 benchmarks/train_once.py \
    --out "$root/$label" "$cfg" </dev/null >"$root/$label.log" 2>&1
  echo "$label rc=$? at ${SECONDS}s: $(grep -o '"tgs": [0-9.]*\|"status": "[a-z_]*"' "$root/$label.log" | tr '\n' ' ')"
  tar -C "$root" -czf "$OUT/points.tgz" . 2>/dev/null
}

while read -r line; do
  line=${line%%#*}
  [ -n "${line// }" ] || continue
  [ $((LIMIT - SECONDS)) -gt 20 ] || { echo "no time left for: $line"; break; }
  if [ "$line" = wait ]; then wait; continue; fi
  background=0
  case $line in *'&') background=1; line=${line%&} ;; esac
  read -r -a words <<<"$line"
  if [ "$background" = 1 ]; then point "${words[@]}" & else point "${words[@]}"; fi
done <"$POINTS"
wait
tar -C "$root" -czf "$OUT/points.tgz" .
