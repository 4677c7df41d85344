#!/usr/bin/env bash
# One device call on a machine of N >= 2 GPUs of one host, each piece packed under $OUT as it ends.
# PHASES (default "ep2 epN") names what runs, in that order:
#   ep2      EP=2 on GPUs 0,1: benchmarks/ep_dispatch.py (exchange rows of EP_SHAPES, layer rows of
#            EP_LAYER_SHAPES), while GPUs 2 and 3 (if there) each run the one-GPU A/B below.
#   epN      EP=N on every GPU: the same benchmark with the EP-vs-one-device checks (EPN_CHECKS=0 skips them).
#   train:P  the training run of EP_TRAIN (a TrainConfig JSON file) at expert_parallel=P, a process per
#            variant of EP_TRAIN_VARIANTS (default "auto packed"): a bare word is a deepep layout
#            (ModelConfig.ep_layout), "label:K=V,K=V" sets those environment variables (XLA/NCCL flags). Where N >= 2P the
#            variants run side by side on GPUs 0..P-1 and P..2P-1, round-robin, each once on each group;
#            train:1 runs the first variant on every GPU at once (the one-GPU baseline of the same call).
#   breakdown:P  benchmarks/step_breakdown.py collect of EP_TRAIN at expert_parallel=P on GPUs 0..P-1 (a
#            profiler trace; BREAKDOWN_ENV="K=V ..." for its environment).
# The one-GPU A/B beside ep2: AB_A and AB_B are TrainConfig JSON files (unset: none), one pair on each of GPUs 2
# and 3 in opposite orders (AB_TWICE=1: two pairs).
# Carry build/lead_lib (the kernels for sm_90a, see benchmarks/gpu_env.sh).
#   echo '{"model": "reduced", "dataset": "synthetic", "steps": 30}' > /tmp/ep_train.json
#   PHASES="train:1 train:2 train:4 ep2" EP_TRAIN=/tmp/ep_train.json bash benchmarks/multi_gpu_call.sh
set -u
: "${OUT:?OUT must name the folder for the results}"
source benchmarks/gpu_env.sh
# NVLink multicast stays off (the lent machines' rule); no preallocation: each process sees only its GPUs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
n=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u; } >"$OUT/env.txt" 2>&1
echo "GPUs: $n, phases: ${PHASES:=ep2 epN}"
LIMIT=${LIMIT:-590}  # the whole call's seconds; each process gets what is left

pack() {  # pack a finished folder into $OUT (the tool brings back at most 8 files)
  tar -C /tmp/mgc -czf "$OUT/$1.tgz" "$1" 2>/dev/null
}
left() { echo $((LIMIT - SECONDS)); }
mkdir -p /tmp/mgc

ab_pair() {  # ab_pair GPU FIRST SECOND ...: one-GPU runs, each record kept as it ends
  local gpu=$1 i=0
  shift
  mkdir -p "/tmp/mgc/ab$gpu"
  for cfg in "$@"; do
    i=$((i + 1))
    CUDA_VISIBLE_DEVICES=$gpu XLA_PYTHON_CLIENT_PREALLOCATE=true timeout "$(left)" python3 benchmarks/train_once.py \
      --out "/tmp/mgc/ab${gpu}/${i}_$(basename "$cfg" .json)" "$(cat "$cfg")" 2>&1 | grep -E '^\{"config"|Error' | tail -2
    pack "ab$gpu"
  done
}
ab_started=0
start_ab() {  # the one-GPU A/B on the last two GPUs, in the background, once
  if [ "$ab_started" = 0 ] && [ -n "${AB_A:-}" ] && [ "$n" -ge 4 ]; then
    ab_started=1
    local g1=$((n - 2)) g2=$((n - 1))
    ab_pair $g1 "$AB_A" "$AB_B" ${AB_TWICE:+"$AB_A" "$AB_B"} >/tmp/mgc/ab.log.$g1 2>&1 &
    ab_pair $g2 "$AB_B" "$AB_A" ${AB_TWICE:+"$AB_B" "$AB_A"} >/tmp/mgc/ab.log.$g2 2>&1 &
  fi
}
dispatch() {  # dispatch NAME GPUS ARGS...: benchmarks/ep_dispatch.py on those GPUs, its log and CSV packed
  local name=$1 gpus=$2
  shift 2
  mkdir -p "/tmp/mgc/$name"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$(left)" python3 benchmarks/ep_dispatch.py --shapes "${EP_SHAPES-dsv3,reduced}" \
    --layer-shapes "${EP_LAYER_SHAPES-reduced}" --out "/tmp/mgc/$name/ep_dispatch.csv" "$@" >"/tmp/mgc/$name/log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"; pack "$name"
}
variant_env() {  # variant_env WORD: "label:K=V,K=V" -> "K=V K=V"; a bare word (a deepep layout) sets none
  case $1 in
    *:*) echo "${1#*:}" | tr ',' ' ' ;;
    *) echo "" ;;
  esac
}
train_one() {  # train_one P GPUS VARIANT: EP_TRAIN at expert_parallel=P on GPUS, its record kept as it ends
  local p=$1 gpus=$2 variant=$3 cfg
  : "${EP_TRAIN:?train phases need EP_TRAIN=<TrainConfig JSON file>}"
  mkdir -p "/tmp/mgc/train$p"
  cfg=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['expert_parallel'] = $p
if ':' not in sys.argv[2]: c.setdefault('model_overrides', {})['ep_layout'] = sys.argv[2]
print(json.dumps(c))" "$EP_TRAIN" "$variant")
  env $(variant_env "$variant") CUDA_VISIBLE_DEVICES=$gpus XLA_PYTHON_CLIENT_PREALLOCATE=true \
    timeout "$(left)" python3 benchmarks/train_once.py --out "/tmp/mgc/train$p/${variant%%:*}_gpus${gpus//,/}" "$cfg" 2>&1 \
    | grep -E '^\{"config"|Error' | cut -c1-600
  echo "EP=$p training, $variant, GPUs $gpus, done at ${SECONDS}s"
}
train() {  # train P: each variant of EP_TRAIN_VARIANTS at expert_parallel=P; with N >= 2P two groups of P GPUs
  # run side by side, round-robin, so that each variant runs once on each group (two variants: two rounds)
  local p=$1 round i
  local groups=$((n / p)) variants=(${EP_TRAIN_VARIANTS:-auto packed})
  local nv=${#variants[@]}
  if [ "$p" -gt 1 ] && [ "$groups" -ge 2 ] && [ "$nv" -ge 2 ]; then
    for round in $(seq 0 $((nv - 1))); do
      for i in 0 1; do
        train_one "$p" "$(seq -s, $((i * p)) $((i * p + p - 1)))" "${variants[$(((i + round) % nv))]}" &
      done
      wait; pack "train$p"
    done
  elif [ "$p" = 1 ]; then  # the one-GPU baseline on every GPU at once
    for i in $(seq 0 $((n - 1))); do train_one 1 "$i" "${variants[0]}" & done
    wait; pack train1
  else
    for variant in "${variants[@]}"; do train_one "$p" "$(seq -s, 0 $((p - 1)))" "$variant"; pack "train$p"; done
  fi
}
breakdown() {  # breakdown P: benchmarks/step_breakdown.py collect of EP_TRAIN at expert_parallel=P (traced)
  local p=$1 args
  mapfile -t args < <(python3 - "$EP_TRAIN" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
model = c.pop("model"); over = c.pop("model_overrides", {}); path = over.pop("moe_path", None)
print("--per-device-batch"); print(c.pop("per_device_batch", 8)); print("--seq-len"); print(c.pop("seq_len", 2048))
for key in ("dataset", "steps", "warmup_steps", "log_every", "eval_every", "eval_batches", "seed", "progress",
            "expert_parallel"):
    c.pop(key, None)
print("--model"); print(model); print("--model-overrides"); print(json.dumps(over))
print("--train-overrides"); print(json.dumps(c))
if path: print("--moe-path"); print(path)
PY
)
  mkdir -p "/tmp/mgc/breakdown$p"
  env ${BREAKDOWN_ENV:-} CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((p - 1)))" XLA_PYTHON_CLIENT_PREALLOCATE=true \
    timeout "$(left)" python3 benchmarks/step_breakdown.py collect --out "/tmp/mgc/breakdown$p/ep$p" \
    "${args[@]}" --expert-parallel "$p" --warmup "${BREAKDOWN_WARMUP:-10}" --steps 5 \
    >"/tmp/mgc/breakdown$p/log" 2>&1
  echo "breakdown EP=$p rc=$? at ${SECONDS}s"; tail -2 "/tmp/mgc/breakdown$p/log"; pack "breakdown$p"
}

for phase in $PHASES; do
  [ "$(left)" -gt 20 ] || { echo "no time left for $phase"; break; }
  case $phase in
    ep2) start_ab; dispatch ep2 0,1 --skip-checks ;;
    epN) wait; [ "$n" -gt 2 ] && dispatch "ep$n" "$(seq -s, 0 $((n - 1)))" $([ "${EPN_CHECKS:-1}" = 0 ] && echo --skip-checks) ;;
    train:*) wait; train "${phase#train:}" ;;
    breakdown:*) wait; breakdown "${phase#breakdown:}" ;;
    *) echo "unknown phase $phase (expected ep2, epN, train:P or breakdown:P)" ;;
  esac
done
wait
cat /tmp/mgc/ab.log.* 2>/dev/null
for f in /tmp/mgc/*/log; do [ -f "$f" ] && grep -E "x the all_to_all|layer|check|failed" "$f" | cut -c1-150; done
