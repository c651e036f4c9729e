#!/usr/bin/env bash
# lab/bwd90_v8.sh - one device call for the next steps of the d 64 Hopper backward (lab/LOG.md, twenty-first
# session): lab/bwd90/v8 (the persistent grid) and the block-mask / dropout check of 128-row steps. Builds, in
# parallel (head dims 64;128;256, sm_90a): main's library (build-gpu), a copy of main with v8's patch and
# lab/tiles/fc90b_persist.h with its tests (build-v8, in /tmp), and with V8_S4=1 main's library with
# lab/tiles/fc90b_s4.h (build-s4: 64-row steps on 4 stages, 48b6694's d 64 kernels). Then on v8: gpu_bwd,
# gpu_dropout, racecheck and memcheck of a d 64 causal forward + backward; lab/bwd_split.py at d 64 for main and v8
# in turns (main kernel us); with V8_S4=1 bench/blocksparse.py --D 64, bench/dropout.py --dims 64 for s4 and main.
# Logs and summary.txt in $OUT (or build-gpu/logs); the summary is printed last.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
S=$LOG/summary.txt
: >"$S"
t0=$SECONDS
note() { echo "$*" >>"$S"; }
cfg=(-DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_ARCHS=90a-real "-DFLASHC_CUDA_HEAD_DIMS=64;128;256"
     -DFLASHC_CUDA_PTXAS_VERBOSE=ON -DFLASHC_BUILD_TOOLS=OFF)
# The patched copy lives outside the checkout: `git apply` inside a repository's subfolder applies only the paths
# under that subfolder and skips the others without an error (the first run of this script timed main twice).
V8=$(mktemp -d /tmp/flashc-v8.XXXX)
mkdir -p "$V8/tree"
tar -cf - --exclude='./build-*' --exclude='./.git' . | tar -xf - -C "$V8/tree"
(cd "$V8/tree" && git apply lab/bwd90/v8_persist_d64.patch && grep -q fc90b_persist src/cuda/bwd_sm90.cu) ||
  { note "v8 patch does not apply"; cat "$S"; exit 1; }
(cmake -S . -B build-gpu "${cfg[@]}" -DFLASHC_BUILD_TESTS=OFF && cmake --build build-gpu -j 8 --target flashc) \
  >"$LOG/build_main.log" 2>&1 &
(cd "$V8/tree" && cmake -S . -B ../b "${cfg[@]}" -DFLASHC_CUDA_TILES_FILE=$PWD/lab/tiles/fc90b_persist.h &&
   cmake --build ../b -j 8) >"$LOG/build_v8.log" 2>&1 &
if [ -n "${V8_S4:-}" ]; then
  (cmake -S . -B build-s4 "${cfg[@]}" -DFLASHC_BUILD_TESTS=OFF -DFLASHC_CUDA_TILES_FILE=$PWD/lab/tiles/fc90b_s4.h &&
     cmake --build build-s4 -j 4 --target flashc) >"$LOG/build_s4.log" 2>&1 &
fi
wait
rm -rf build-v8 && ln -s "$V8" build-v8
note "builds done $((SECONDS - t0))s: $(ls build-gpu/libflashc.so build-v8/b/libflashc.so 2>&1 | tr '\n' ' ')"
note "v8 d 64 spills: $(grep -A2 'fc90_bwd_kernelILi64' "$LOG/build_v8.log" | grep spill | sort | uniq -c | tr '\n' ';')"
ML=build-gpu/libflashc.so VL=build-v8/b/libflashc.so SL=build-s4/libflashc.so
export PYTHONPATH=python PYTHONUNBUFFERED=1
for t in gpu_bwd gpu_dropout; do
  B=$(find build-v8/b -name $t -type f | head -1)
  FLASHC_CUDA_LOG=1 timeout 150 "$B" >"$LOG/v8_$t.log" 2>&1
  note "v8 $t rc $? $((SECONDS - t0))s: $(grep -cE '^ok' "$LOG/v8_$t.log") ok, $(grep -c FAIL "$LOG/v8_$t.log") FAIL"
done
for tool in racecheck memcheck; do
  FLASHC_LIBRARY=$VL FLASHC_CUDA_LOG=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 3 python3 \
    bench/run_once.py --d 64 --n 700 --b 4 --h 16 --causal --repeat 2 >"$LOG/v8_san_$tool.log" 2>&1
  note "v8 $tool rc $?: $(grep -E 'SUMMARY' "$LOG/v8_san_$tool.log" | tr '\n' ' ')"
done
main_us() { # the main kernel's us per call from a lab/bwd_split.py log, one entry per flashc row
  python3 -c 'import re,sys
for l in open(sys.argv[1]):
    m = re.match(r"D (\d+) N (\d+) causal (\d) flashc .*void fc90_bwd_kernel.{28} ([0-9.]+)", l)
    if m: print("N %s c%s %s" % (m[2], m[3], m[4]), end="; ")' "$1"
}
for r in 1 2; do
  for L in $ML $VL; do
    FLASHC_LIBRARY=$L timeout 60 python3 lab/bwd_split.py --dims 64 --lens 1024,4096 --runs 10 >"$LOG/split.log" 2>&1
    note "split $r $L main kernel us: $(main_us "$LOG/split.log")"
    cat "$LOG/split.log" >>"$LOG/split_all.log"
  done
done
[ -n "${V8_S4:-}" ] && for L in $SL $ML; do
  FLASHC_LIBRARY=$L timeout 120 python3 bench/blocksparse.py --D 64 --no-flex --runs 10 >"$LOG/bs_$(basename $(dirname $L)).log" 2>&1
  note "blocksparse d64 $L: $(grep -E '^dense|^\| 0' "$LOG/bs_$(basename $(dirname $L)).log" | tr '\n' ';')"
  FLASHC_LIBRARY=$L timeout 120 python3 bench/dropout.py --dims 64 --lens 1024,4096 >"$LOG/drop_$(basename $(dirname $L)).log" 2>&1
  note "dropout d64 $L: $(grep -E '^\| 64' "$LOG/drop_$(basename $(dirname $L)).log" | tr '\n' ';')"
done
note "done $((SECONDS - t0))s"
cat "$S"
