#!/usr/bin/env bash
# Compiled Triton kernels and the graph runner's tuned choices (specdec/graph_tuning.py), carried
# from one device call to the next. A fresh machine compiles and tunes everything again: on
# 2026-12-01 the first cost-curve size took 134 s on a fresh H200 against about 14 s on a warm
# one (bench/results/gpu_engine_h200_20261201_cold.log, _b1.log).
#
#   On the device, first in the command:  source bench/device_cache.sh use
#   On the device, last in the command:   bash bench/device_cache.sh pack "$OUT"
#   Here, after the call:                 bash bench/device_cache.sh keep /work/.device/N
#   and name build/device_cache in the next call's carry.
#
# A device call sends the checkout's tracked files, at most 64 MiB with what it carries; the
# shipped EAGLE heads' weights (specdec/heads/*/model.safetensors, 72 MB) leave no room for the
# cache, and no GPU benchmark reads them. Around a call, here:
#   bash bench/device_cache.sh slim     (untracks them in the index and ignores them locally)
#   bash bench/device_cache.sh unslim   (tracks them again; commit nothing in between)
#
# The caches travel as parts of one gzipped tar (dc.tgz.0, .1, ...: at most 4 of 15 MiB, within
# what comes back from $OUT and what a call carries); Triton and specdec key every entry on its
# sources, versions and GPU, so a stale entry is never used, only left unread.
DC_DIR="${DC_DIR:-/tmp/specdec_device_cache}"
DC_KEEP="${DC_KEEP:-build/device_cache}"

dc_use() {
  mkdir -p "$DC_DIR"
  if compgen -G "$DC_KEEP/dc.tgz.*" > /dev/null; then
    cat "$DC_KEEP"/dc.tgz.* | tar xzf - -C "$DC_DIR" || echo "device_cache: unreadable parts, starting cold"
  fi
  mkdir -p "$DC_DIR/triton" "$DC_DIR/specdec"
  export TRITON_CACHE_DIR="$DC_DIR/triton" SPECDEC_CACHE="$DC_DIR/specdec"
  echo "device_cache: $(find "$DC_DIR" -type f | wc -l) files in $DC_DIR"
}

dc_pack() {
  local out="$1"
  rm -f "$out"/dc.tgz.*
  tar czf - -C "$DC_DIR" triton specdec | split -b 15m -d -a 1 - "$out/dc.tgz."
  local n
  n=$(find "$out" -maxdepth 1 -name 'dc.tgz.*' | wc -l)
  if [ "$n" -gt 4 ]; then
    rm -f "$out"/dc.tgz.*
    echo "device_cache: over 60 MiB packed, not kept"
  else
    echo "device_cache: $n part(s), $(du -ch "$out"/dc.tgz.* | tail -1 | cut -f1)"
  fi
}

dc_keep() {
  local from="$1"
  if ! compgen -G "$from/dc.tgz.*" > /dev/null; then
    echo "device_cache: no parts in $from" >&2
    return 1
  fi
  mkdir -p "$DC_KEEP"
  rm -f "$DC_KEEP"/dc.tgz.*
  cp "$from"/dc.tgz.* "$DC_KEEP"/
  echo "device_cache: kept $(ls "$DC_KEEP" | wc -l) part(s) in $DC_KEEP"
}

HEADS='specdec/heads/*/model.safetensors'

dc_slim() {
  local exclude
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  git rm -q --cached -- $HEADS
  grep -qxF "$HEADS" "$exclude" 2>/dev/null || echo "$HEADS" >> "$exclude"
  echo "device_cache: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked"
}

dc_unslim() {
  local exclude
  exclude="$(git rev-parse --git-path info/exclude)"
  git reset -q -- specdec/heads
  if [ -f "$exclude" ]; then
    grep -vxF "$HEADS" "$exclude" > "$exclude.tmp" || true
    mv "$exclude.tmp" "$exclude"
  fi
  git status --short -- specdec/heads
}

case "${1:-}" in
  use) dc_use ;;
  pack) dc_pack "${2:?pack OUT_DIR}" ;;
  keep) dc_keep "${2:?keep DIR_WITH_PARTS}" ;;
  slim) dc_slim ;;
  unslim) dc_unslim ;;
  *) echo "usage: source bench/device_cache.sh use | bash bench/device_cache.sh pack OUT | keep DIR | slim | unslim" >&2 ;;
esac
