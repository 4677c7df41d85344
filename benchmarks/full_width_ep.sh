#!/usr/bin/env bash
# DeepSeek-V3 at its exact widths with all 256 routed experts, split over the GPUs of one host (expert parallelism):
# 1 dense + 1 MoE layer, float32 master weights (split on GPUs), the decided defaults, synthetic tokens, 4096 a
# sequence (the preset's max_seq_len). One process a point (benchmarks/train_once.py), in order of priority; a point that does not fit is an
# `oom` record. As each point ends: its line in $OUT/points.jsonl, every record so far in $OUT/records.tgz.
#   OUT=/tmp/out bash benchmarks/full_width_ep.sh        # EP=2 (GPUs 0,1); STEPS=10 LIMIT=560 (seconds, in all)
#   POINTS="turbo:deepep:0:4 dense_cf:deepep:0:4" ...    # path:exchange:mtp_depth:per_device_batch[:memory[:remat]]
# memory: TrainConfig.optimizer_state_memory, "device" (default) or "host" (the moments and the split masters' low bits
# in pinned host memory between steps), e.g. POINTS="turbo:deepep:1:4:host turbo:deepep:1:1:host turbo:deepep:1:8:host";
# remat: ModelConfig.remat_policy, default dots_experts_attention: at this slice it beat the preset's "full" (which
# recomputes 12% of the step) with no more memory (docs/expert-parallel.md), e.g. POINTS="turbo:deepep:0:8:device:full"
set -u
: "${OUT:?OUT must name the folder for the results}"
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
LIMIT=${LIMIT:-560}
P=${EP:-2}
W=/tmp/full_width_ep
rm -rf "$W" && mkdir -p "$W/records"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; date -u; } >"$OUT/env.txt" 2>&1
left() { local l=$((LIMIT - SECONDS)); echo $((l > 1 ? l : 1)); }
POINTS=${POINTS:-"turbo:deepep:0:4 turbo:deepep:1:4 turbo:deepep:1:1 dense_cf:deepep:0:4 turbo:ragged_all_to_all:0:4 \
turbo:deepep:0:8 turbo:deepep:0:12 turbo:deepep:0:16 ragged:deepep:0:1"}

config() {  # config PATH EXCHANGE MTP BATCH MEMORY [REMAT]
  echo "{\"model\": \"deepseek_v3_671b\", \"dataset\": \"synthetic\", \"per_device_batch\": $4, \"optimizer_state_memory\": \"$5\",
\"remat_policy\": \"${6:-dots_experts_attention}\",
\"steps\": ${STEPS:-10}, \"warmup_steps\": 1, \"learning_rate\": 0.00022, \"eval_batches\": 0, \"expert_parallel\": $P,
\"model_overrides\": {\"n_layers\": 2, \"n_dense_layers\": 1, \"mtp_depth\": $3, \"moe_path\": \"$1\",
\"capacity_factor\": 1.25, \"ep_exchange\": \"$2\"}}"
}

for spec in $POINTS; do
  IFS=: read -r path exchange mtp batch memory remat <<<"$spec"
  memory=${memory:-device}
  name="${path}_${exchange}_mtp${mtp}_b${batch}$([ "$memory" = device ] || echo "_$memory")${remat:+_$remat}"
  if [ "$(left)" -lt 60 ]; then echo "$name: skipped, $(left) s left" | tee -a "$OUT/skipped.txt"; continue; fi
  echo "== $name (started at ${SECONDS}s)"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((P - 1))) XLA_PYTHON_CLIENT_PREALLOCATE=true \
    timeout "$(left)" python3 benchmarks/train_once.py --out "$W/records/$name" "$(config "$path" "$exchange" "$mtp" "$batch" "$memory" "$remat")" \
    >"$W/$name.log" 2>&1
  rc=$?
  echo "$name: exit code $rc at ${SECONDS}s"
  # A process that dies before writing its record (a crash in XLA, a timeout) is still a row: status failed.
  grep -E '^\{"config"' "$W/$name.log" | python3 -c "import json, sys
rows = [json.loads(line) for line in sys.stdin]
if not rows:
    tail = [l.strip() for l in open('$W/$name.log', errors='replace') if l.strip()][-2:]
    rows = [{'config': json.loads(sys.argv[1]), 'status': 'failed',
             'error': f'process exit code $rc without a record; log tail: ' + ' | '.join(tail)[-400:]}]
for r in rows:
    r['point'] = '$name'; print(json.dumps(r))" "$(config "$path" "$exchange" "$mtp" "$batch" "$memory" "$remat")" | tee -a "$OUT/points.jsonl"
  grep -E "Error|error:" "$W/$name.log" | head -3
  tar -C "$W" -czf "$OUT/records.tgz" records $(cd "$W" && ls ./*.log 2>/dev/null)
done
