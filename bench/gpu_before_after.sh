#!/usr/bin/env bash
# The engine benchmark on two trees in one device call, on one machine: an earlier commit's
# files (BEFORE_DIR, e.g. from `git archive COMMIT | tar -x -C build/before`, carried to the
# device) and this tree, alternately, each with the same arguments. From the repo root:
#   bash bench/gpu_before_after.sh BEFORE_DIR OUT_DIR [gpu_engine.py arguments...]
# writes OUT_DIR/before/ and OUT_DIR/after/ (gpu_engine.json, gpu_engine.log each).
set -uo pipefail
before="${1:?BEFORE_DIR}"
mkdir -p "${2:?OUT_DIR}"
out="$(cd "$2" && pwd)"
shift 2
here="$(pwd)"
export PYTHONUNBUFFERED=1
for side in before after; do
  dir="$here"
  [ "$side" = before ] && dir="$(cd "$before" && pwd)"
  mkdir -p "$out/$side"
  echo "$ $side: $dir $(date -u +%T)"
  (cd "$dir" && PYTHONPATH="$dir" timeout "${SIDE_TIMEOUT:-290}" python3 bench/gpu_engine.py \
    --out "$out/$side" "$@" > "$out/$side/gpu_engine.log" 2>&1)
  echo "  rc $? $(date -u +%T)"
  tail -25 "$out/$side/gpu_engine.log"
done
