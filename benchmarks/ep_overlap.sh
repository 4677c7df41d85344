#!/usr/bin/env bash
# The expert-parallel exchange overlapped with compute (ModelConfig.ep_micro_batches), side by side in one call on a
# machine of two GPUs of one host: whole `reduced` training steps (turbo, deepep), the same batch a GPU, one process
# a point (benchmarks/train_once.py), in this order:
#   ep1      EP=1 on GPU 0 and on GPU 1 at once: the one-GPU yardstick, twice
#   ep2_mb1  EP=2, one micro-batch: the program as it was
#   ep2_mb2  EP=2, two micro-batches (the field also turns on XLA's latency-hiding scheduler)
#   ep2_lhs  EP=2, one micro-batch, the latency-hiding scheduler alone (set through XLA_FLAGS: a diagnostic, not a
#            setting; the record's provenance holds the flag), while time is left
# ep2_mb1 and ep2_mb2 dump their compiled train step (XLA_FLAGS --xla_dump_to: it does not change the program);
# benchmarks/hlo_schedule.py then lists the kernels inside each exchange collective's window -> $OUT/schedule.txt.
# As each point ends: its line in $OUT/points.jsonl, its record (summary, provenance, history) in $OUT/records.tgz.
# At the end the table, each point's TGS a GPU against the mean of the two one-GPU runs. Carry build/lead_lib.
#   OUT=/tmp/out bash benchmarks/ep_overlap.sh            # STEPS=30 BATCH=8 SEQ=2048 LIMIT=450 (seconds, in all)
# EP=4 on a four-GPU machine runs the same points at expert parallelism 4 (the one-GPU runs on each of the four).
# A dry run on CPU host devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 MODEL=tiny BATCH=2 SEQ=64 ...
set -u
: "${OUT:?OUT must name the folder for the results}"
source benchmarks/gpu_env.sh
unset JAX_COMPILATION_CACHE_DIR  # cold compiles: every point writes its dump, and compile times compare
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
LIMIT=${LIMIT:-450}
W=/tmp/ep_overlap
rm -rf "$W" && mkdir -p "$W/records" "$W/dump"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u; } >"$OUT/env.txt" 2>&1
left() { local l=$((LIMIT - SECONDS)); echo $((l > 1 ? l : 1)); }  # never 0: `timeout 0` would not stop anything

config() {  # config EP MICRO_BATCHES: the TrainConfig JSON of a point
  echo "{\"model\": \"${MODEL:-reduced}\", \"dataset\": \"synthetic\", \"per_device_batch\": ${BATCH:-8}, \"seq_len\": ${SEQ:-2048},
\"steps\": ${STEPS:-30}, \"warmup_steps\": 5, \"eval_batches\": 0, \"expert_parallel\": $1, \"model_overrides\": {\"ep_micro_batches\": $2}}"
}

point() {  # point NAME GPUS EP MICRO_BATCHES [XLA_FLAGS]: one training process, its line and record kept as it ends
  local name=$1 gpus=$2 ep=$3 mb=$4 envs=()
  [ -n "${5:-}" ] && envs=("XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }$5")
  if [ "$(left)" -lt 30 ]; then echo "$name: skipped, $(left) s left"; return; fi
  echo "== $name on GPUs $gpus (started at ${SECONDS}s)"
  env "${envs[@]}" CUDA_VISIBLE_DEVICES=$gpus XLA_PYTHON_CLIENT_PREALLOCATE=true \
    timeout "$(left)" python3 benchmarks/train_once.py --out "$W/records/$name" "$(config "$ep" "$mb")" \
    >"$W/$name.log" 2>&1
  echo "$name: exit code $? at ${SECONDS}s"
  grep -E '^\{"config"' "$W/$name.log" | python3 -c "import json, sys
for line in sys.stdin:
    r = json.loads(line); r['point'] = '$name'; r['gpus'] = '$gpus'; print(json.dumps(r))" | tee -a "$OUT/points.jsonl"
  grep -E "Error|error:" "$W/$name.log" | head -3
}
pack() { tar -C "$W" -czf "$OUT/records.tgz" records $(cd "$W" && ls ./*.log 2>/dev/null) 2>/dev/null; }

schedule() {  # schedule NAME: the kernels inside each exchange collective's window in NAME's dumped train step
  local file
  file=$(ls -S "$W/dump/$1"/*train_step*after_optimizations.txt 2>/dev/null | head -1)
  if [ -z "$file" ]; then echo "$1: no train step dump" | tee -a "$OUT/schedule.txt"; return; fi
  python3 benchmarks/hlo_schedule.py "$file" --all --out "$OUT/schedule.txt" >/dev/null
  grep -E "^(MoE exchange|other collectives):" "$OUT/schedule.txt" | tail -2 | sed "s/^/$1 /"
  tar -C "$(dirname "$file")" -czf "$OUT/hlo_$1.tgz" "$(basename "$file")"
}

dump_flags() { echo "--xla_dump_to=$W/dump/$1 --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"; }

P=${EP:-2}
gpus=$(seq -s, 0 $((P - 1)))
for g in $(seq 0 $((P - 1))); do point "ep1_gpu$g" "$g" 1 1 & done
wait; pack
point "ep${P}_mb1" "$gpus" "$P" 1 "$(dump_flags "ep${P}_mb1")"; pack
point "ep${P}_mb2" "$gpus" "$P" 2 "$(dump_flags "ep${P}_mb2")"; pack
schedule "ep${P}_mb2"
schedule "ep${P}_mb1"
if [ "$(left)" -gt 100 ]; then
  point "ep${P}_lhs" "$gpus" "$P" 1 "--xla_gpu_enable_latency_hiding_scheduler=true"; pack
else
  echo "ep${P}_lhs: skipped, $(left) s left"
fi

touch "$OUT/points.jsonl"
python3 - "$OUT/points.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
one = [r["tgs"] for r in rows if r["point"].startswith("ep1") and r.get("status") == "ok" and r.get("tgs")]
base = sum(one) / len(one) if one else float("nan")
print(f"{'point':10s} {'status':7s} {'TGS a GPU':>10s} {'x one GPU':>9s} {'step s':>7s} {'compile s':>9s} {'peak GB':>8s}")
for r in rows:
    tgs = r.get("tgs") or float("nan")
    print(f"{r['point']:10s} {r.get('status', '?'):7s} {tgs:10.0f} {tgs / base:9.3f} {r.get('step_time_s') or float('nan'):7.4f} "
          f"{r.get('compile_time_s') or float('nan'):9.1f} {(r.get('peak_memory_bytes') or float('nan')) / 1e9:8.2f}")
PY
