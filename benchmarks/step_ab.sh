#!/usr/bin/env bash
# Side-by-side step timings of one training config under several settings that need a process each (XLA flags,
# or another copy of the package), run in the order given, so that alternating A B A B lands in one call:
#   bash benchmarks/step_ab.sh OUT_DIR CONFIG_JSON LABEL=SETTING [LABEL=SETTING ...]
# SETTING is "xla:<XLA_FLAGS>" (this tree, those flags), "tree:<DIR>" (the package and kernel libraries in
# DIR/turbo_moe and DIR/lib, e.g. the commit before a change, named in DIR/COMMIT for the records) or "default". Each run's record goes to
# OUT_DIR/<n>_<LABEL>/ (benchmarks/train_once.py) as soon as it ends; a failed run is a record, not the end.
set -u
out=$1 config=$2
shift 2
n=0
for spec in "$@"; do
  label=${spec%%=*} setting=${spec#*=}
  dir="$out/${n}_${label}"
  mkdir -p "$dir"
  case $setting in
    xla:*) env XLA_FLAGS="${setting#xla:}" python3 benchmarks/train_once.py --out "$dir" "$config" ;;
    tree:*) root=${setting#tree:}
            env PYTHONPATH="$root:$PYTHONPATH" TURBO_MOE_LIB_DIR="$root/lib" \
              TURBO_MOE_GIT_COMMIT="$(cat "$root/COMMIT" 2>/dev/null || echo "${TURBO_MOE_GIT_COMMIT:-}")" \
              python3 benchmarks/train_once.py --out "$dir" "$config" ;;
    default) python3 benchmarks/train_once.py --out "$dir" "$config" ;;
    *) echo "step_ab: unknown setting '$setting' (expected xla:FLAGS, tree:DIR or default)" >&2 ;;
  esac 2>&1 | grep -E '^\{"config"|Error|error' | tail -3
  echo "$label ($setting) -> $dir"
  n=$((n + 1))
done
