#!/usr/bin/env bash
# MaxText against MaxText + turbo on one GPU machine with no internet: installs the carried wheels, then runs
# MaxText's MoE layer (benchmarks/maxtext_moe.py) and, if asked, MaxText's own training loop
# (benchmarks/maxtext_train.py), each row written under $OUT as it ends.
#   OUT=/tmp/out WHEELS=.whl bash benchmarks/maxtext_gpu.sh            # layer at EP=1, then EP=2 when 2+ GPUs
#   PHASES="layer_ep2 train_ep2" ... bash benchmarks/maxtext_gpu.sh     # choose the phases, in order
# Phases: layer_ep1 | layer_ep2 (maxtext_moe.py at --ep 1 / 2, SHAPES, CONTENDERS), train_ep1 | train_ep2
# (maxtext_train.py, MaxText's synthetic data, TRAIN_SHAPE, --gemms maxtext,turbo, ici_expert_parallelism 1 / 2).
# WHEELS: a folder with peers/ and maxtext/ (plus maxtext_train/ for the train phases), made from
# benchmarks/maxtext_wheels.txt (its header says how); empty: use the installed packages. SMOKE=1: the tiny shapes
# (the CPU check). Kernels: TURBO_MOE_LIB_DIR as in gpu_env.sh. train_ep1 on a machine of N GPUs is MaxText's FSDP
# over all N (CUDA_VISIBLE_DEVICES=0,1 compares it with train_ep2 on the same two).
set -u
: "${OUT:?OUT must name the folder for the results}"
PY=${PY:-python3}
WHEELS=${WHEELS-.whl}
SITE=${SITE:-/tmp/maxtext_site}
LIMIT=${LIMIT:-560}  # the whole call's seconds
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
  sets=("$WHEELS"/peers/*.whl "$WHEELS"/maxtext/*.whl)
  case " ${PHASES:-} " in *" train_"*) sets+=("$WHEELS"/maxtext_train/*.whl) ;; esac
  for w in "${sets[@]}"; do
    [ -e "$w" ] || { echo "WHEELS=$WHEELS: no $w (benchmarks/maxtext_wheels.txt says how to download the sets)"; exit 2; }
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${sets[@]}" \
    >"$OUT/pip.log" 2>&1 || { echo "pip install of the carried wheels failed:"; tail -5 "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=$PWD:$SITE:$PWD/benchmarks/shims${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_compilation_cache}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
n=$(nvidia-smi -L 2>/dev/null | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; date -u; } >"$OUT/env.txt"
[ "$n" -ge 2 ] && default="layer_ep1 layer_ep2" || default="layer_ep1"
left() { local l=$((LIMIT - SECONDS)); echo $((l > 1 ? l : 1)); }
smoke_layer=$([ "${SMOKE:-0}" = 1 ] && echo --smoke)
shape_train=$([ "${SMOKE:-0}" = 1 ] && echo smoke || echo "${TRAIN_SHAPE:-reduced}")
status=0
for phase in ${PHASES:-$default}; do
  if [ "$(left)" -lt 30 ]; then echo "$phase: skipped, $(left) s left" | tee -a "$OUT/skipped.txt"; continue; fi
  echo "== $phase (at ${SECONDS}s)"
  case $phase in
    layer_ep1|layer_ep2)
      ep=${phase#layer_ep}
      timeout "$(left)" "$PY" benchmarks/maxtext_moe.py --ep "$ep" $smoke_layer --budget-s $(( $(left) - 20 )) \
        ${SHAPES:+--shapes "$SHAPES"} ${CONTENDERS:+--contenders "$CONTENDERS"} \
        --out "$OUT/maxtext_moe_ep$ep" >"$OUT/$phase.log" 2>&1 || status=1 ;;
    train_ep1|train_ep2)
      ep=${phase#train_ep}
      timeout "$(left)" "$PY" benchmarks/maxtext_train.py --shape "$shape_train" --gemms maxtext,turbo \
        --steps "${STEPS:-$([ "${SMOKE:-0}" = 1 ] && echo 3 || echo 20)}" $([ "${SMOKE:-0}" = 1 ] && echo --skip 1) --set ici_expert_parallelism="$ep" \
        --timeout-s $(( $(left) / 2 )) --out "$OUT/maxtext_train_ep$ep" >"$OUT/$phase.log" 2>&1 || status=1 ;;
    *) echo "unknown phase $phase (layer_ep1, layer_ep2, train_ep1, train_ep2)"; exit 2 ;;
  esac
  grep -E "^(shape=|reduced|deepseek|smoke)" "$OUT/$phase.log" | tail -12
done
exit $status
