#!/usr/bin/env bash
# Two processes x one GPU train as one process x two GPUs: `reduced` at expert_parallel=2, the same TrainConfig
# (experiments/configs/reduced.yaml), STEPS steps (default 12) on a machine of two GPUs of one host.
#   1. one process driving GPUs 0 and 1:        turbo-moe train                      -> $OUT/one_process.json
#   2. one process per GPU under jax.distributed: turbo-moe launch --gpus 2          -> $OUT/two_processes.json
#   3. (REPEAT=1, the default) part 1 again: the GPU's own run-to-run spread, the yardstick for part 2's differences
# Each part's summary is printed as soon as it ends, then the step-by-step comparison. Carry build/lead_lib.
#   OUT=/tmp/out bash benchmarks/multiprocess_check.sh
#   STEPS=20 SETS="--set model_overrides.moe_path=ragged" OUT=... bash benchmarks/multiprocess_check.sh
set -u
: "${OUT:?OUT must name the folder for the records}"
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
LIMIT=${LIMIT:-580}  # seconds for the whole script; each part gets what is left
CONFIG=${CONFIG:-experiments/configs/reduced.yaml}
read -r -a sets <<<"--set steps=${STEPS:-12} --set progress=false ${SETS:-}"
left() { echo $((LIMIT - SECONDS)); }
mkdir -p "$OUT/logs"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u; } >"$OUT/env.txt" 2>&1

brief() {  # brief LABEL RECORD: one line as soon as a part ends
  python3 - "$@" <<'PY'
import json, sys
label, path = sys.argv[1:3]
try:
    r = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"{label}: no record ({e})", flush=True); sys.exit()
s, p = r["summary"], r["provenance"]
losses = [round(h["loss"], 5) for h in r["history"]]
print(f"{label}: status {r['status']}, process_count {p.get('process_count')}, {s.get('n_devices')} x "
      f"{p.get('device_kind')}, tgs {s.get('tgs', float('nan')):.0f}, compile {s.get('compile_time_s', 0):.1f} s, "
      f"losses {losses}", flush=True)
if r.get("error"):
    print("  error:", str(r["error"])[:600], flush=True)
PY
}

part() {  # part LABEL RECORD COMMAND...: run with the time left, keep its output, print its summary
  local label=$1 record=$2
  shift 2
  echo "== $label (started at ${SECONDS}s)"
  timeout "$(left)" "$@" >"$OUT/logs/$label.log" 2>&1
  echo "$label: exit code $? at ${SECONDS}s"
  grep -E "Connection refused|Traceback|Error" "$OUT/logs/$label.log" | head -5
  brief "$label" "$record"
}

part one_process "$OUT/one_process.json" env CUDA_VISIBLE_DEVICES=0,1 \
  python3 -m turbo_moe.cli train "$CONFIG" "${sets[@]}" --record "$OUT/one_process.json"
part two_processes "$OUT/two_processes.json" env CUDA_VISIBLE_DEVICES=0,1 \
  python3 -m turbo_moe.cli launch --gpus 2 "$CONFIG" "${sets[@]}" --record "$OUT/two_processes.json" \
  --log-dir "$OUT/logs/two_processes_others"
if [ "${REPEAT:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  part one_process_again "$OUT/one_process_again.json" env CUDA_VISIBLE_DEVICES=0,1 \
    python3 -m turbo_moe.cli train "$CONFIG" "${sets[@]}" --record "$OUT/one_process_again.json"
fi

python3 - "$OUT" <<'PY'
import json, math, pathlib, sys
out = pathlib.Path(sys.argv[1])
def losses(name):
    try:
        return [h["loss"] for h in json.loads((out / f"{name}.json").read_text())["history"]]
    except (OSError, ValueError, KeyError):
        return []
one, two, again = losses("one_process"), losses("two_processes"), losses("one_process_again")
print("step  one process x 2 GPUs  two processes x 1 GPU  difference  one process again (difference)")
for i in range(max(len(one), len(two))):
    a = one[i] if i < len(one) else math.nan
    b = two[i] if i < len(two) else math.nan
    c = f"{again[i]:.6f} ({again[i] - a:+.2e})" if i < len(again) else ""
    print(f"{i:4d}  {a:20.6f}  {b:21.6f}  {b - a:+10.2e}  {c}")
if one and two:
    n = min(len(one), len(two))
    print(f"max |two - one| over {n} steps: {max(abs(x - y) for x, y in zip(one, two)):.2e}; step 0: {abs(one[0] - two[0]):.2e}")
if one and again:
    n = min(len(one), len(again))
    print(f"max |again - one| over {n} steps (run-to-run spread): {max(abs(x - y) for x, y in zip(one, again)):.2e}")
PY
