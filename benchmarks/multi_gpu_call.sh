#!/usr/bin/env bash
# One device call on a machine of N >= 2 GPUs of one host (issue 14), each piece packed under $OUT as it ends:
#   1. EP=2 on GPUs 0,1: benchmarks/ep_dispatch.py (exchanges at both shapes, `reduced` layer rows), while
#      GPUs 2 and 3 (if there) each run one A/B pair of a one-GPU training config (benchmarks/train_once.py),
#      in opposite orders: AB_A and AB_B are TrainConfig JSON files (unset: no A/B).
#   2. EP=N on every GPU: the same benchmark with the EP-vs-one-device checks.
#   3. With EP_TRAIN=<TrainConfig JSON file>: that training run at expert_parallel=N on every GPU, once with the
#      default deepep layout and once packed (TURBO_MOE_DEEPEP_LAYOUT), a process each (prepared 2026-11-26, not run yet).
# Carry build/lead_lib (the kernels for sm_90a, see benchmarks/gpu_env.sh).
#   bash benchmarks/multi_gpu_call.sh        (OUT set by the device tool)
set -u
: "${OUT:?OUT must name the folder for the results}"
source benchmarks/gpu_env.sh
# NVLink multicast stays off (the lent machines' rule); no preallocation: each process sees only its GPUs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
n=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u; } >"$OUT/env.txt" 2>&1
echo "GPUs: $n"

pack() {  # pack a finished folder into $OUT (the tool brings back at most 8 files)
  tar -C /tmp/mgc -czf "$OUT/$1.tgz" "$1" 2>/dev/null
}
mkdir -p /tmp/mgc/ep2 /tmp/mgc/epN /tmp/mgc/ab2 /tmp/mgc/ab3

ab_pair() {  # ab_pair GPU FIRST SECOND: one pair of runs on one GPU, each record kept as it ends
  local gpu=$1 i=0
  shift
  for cfg in "$@"; do
    i=$((i + 1))
    CUDA_VISIBLE_DEVICES=$gpu XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 150 python3 benchmarks/train_once.py \
      --out "/tmp/mgc/ab${gpu}/${i}_$(basename "$cfg" .json)" "$(cat "$cfg")" 2>&1 | grep -E '^\{"config"|Error' | tail -2
    pack "ab$gpu"
  done
}

if [ "$n" -ge 4 ] && [ -n "${AB_A:-}" ]; then
  ab_pair 2 "$AB_A" "$AB_B" ${AB_TWICE:+"$AB_A" "$AB_B"} >/tmp/mgc/ab2/log 2>&1 &
  ab_pair 3 "$AB_B" "$AB_A" ${AB_TWICE:+"$AB_B" "$AB_A"} >/tmp/mgc/ab3/log 2>&1 &
fi
CUDA_VISIBLE_DEVICES=0,1 timeout "${EP2_LIMIT:-240}" python3 benchmarks/ep_dispatch.py --skip-checks \
  --layer-shapes reduced --out /tmp/mgc/ep2/ep_dispatch.csv >/tmp/mgc/ep2/log 2>&1
echo "EP=2 rc=$? at ${SECONDS}s"; pack ep2
wait
echo "A/B done at ${SECONDS}s"
cat /tmp/mgc/ab2/log /tmp/mgc/ab3/log 2>/dev/null
if [ "$n" -gt 2 ]; then
  timeout "${EPN_LIMIT:-$((585 - SECONDS))}" python3 benchmarks/ep_dispatch.py --layer-shapes reduced \
    --out /tmp/mgc/epN/ep_dispatch.csv >/tmp/mgc/epN/log 2>&1
  echo "EP=$n rc=$? at ${SECONDS}s"; pack epN
fi
if [ -n "${EP_TRAIN:-}" ] && [ "$n" -ge 2 ]; then
  mkdir -p /tmp/mgc/epT
  for layout in auto packed; do
    cfg=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['expert_parallel'] = $n; print(json.dumps(c))" "$EP_TRAIN")
    TURBO_MOE_DEEPEP_LAYOUT=$layout XLA_PYTHON_CLIENT_PREALLOCATE=true timeout "$((590 - SECONDS))" \
      python3 benchmarks/train_once.py --out "/tmp/mgc/epT/$layout" "$cfg" 2>&1 | grep -E '^\{"config"|Error' | cut -c1-600
    echo "EP=$n training, layout $layout, done at ${SECONDS}s"; pack epT
  done
fi
grep -E "x the all_to_all|layer|check|failed" /tmp/mgc/ep2/log /tmp/mgc/epN/log | cut -c1-150
