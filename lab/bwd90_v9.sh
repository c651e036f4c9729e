#!/usr/bin/env bash
# lab/bwd90_v9.sh - one device call for lab/LOG.md's v9 (twenty-second session): dQ's product before dK's in the
# d 64 / 128 Hopper backward (FC90B_DQ_FIRST), so that dQ's staging and reduction run under dK's product. Builds in
# parallel (head dims 64;128;256, sm_90a): the tree as it is with its tests (build-gpu) and its library with
# -DFC90B_DQ_FIRST=0 (build-base: the order before). Then gpu_bwd, gpu_dropout, racecheck and memcheck of d 64 and
# d 128 causal forward + backward on build-gpu; lab/bwd_split.py (d 64, 128) for both in turns (main kernel us and
# cuDNN's); the fp32 seed probe of the twenty-first session (lab/seed_probe.py) with the mma.sync backward and with
# FLASHC_CUDA_BWD=simt; the Python CUDA tests last. V9_BENCH_ONLY=1: the builds and lab/bwd_split.py only. Logs and
# summary.txt in $OUT (or build-gpu/logs).
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
(cmake -S . -B build-gpu "${cfg[@]}" ${V9_BENCH_ONLY:+-DFLASHC_BUILD_TESTS=OFF} && cmake --build build-gpu -j 10) >"$LOG/build_v9.log" 2>&1 &
(cmake -S . -B build-base "${cfg[@]}" -DFLASHC_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS=-DFC90B_DQ_FIRST=0 &&
   cmake --build build-base -j 6 --target flashc) >"$LOG/build_base.log" 2>&1 &
wait
note "builds done $((SECONDS - t0))s: $(ls build-gpu/libflashc.so build-base/libflashc.so 2>&1 | tr '\n' ' ')"
VL=build-gpu/libflashc.so BL=build-base/libflashc.so
export PYTHONPATH=python PYTHONUNBUFFERED=1
[ -z "${V9_BENCH_ONLY:-}" ] && for t in gpu_bwd gpu_dropout; do
  FLASHC_CUDA_LOG=1 timeout 150 build-gpu/tests/$t >"$LOG/$t.log" 2>&1
  note "$t rc $? $((SECONDS - t0))s: $(grep -cE '^ok' "$LOG/$t.log") ok, $(grep -c '^FAIL' "$LOG/$t.log") FAIL"
  grep '^FAIL' "$LOG/$t.log" | cut -c1-160 | head -5 >>"$S"
done
[ -z "${V9_BENCH_ONLY:-}" ] && for d in 64 128; do
  for tool in racecheck memcheck; do
    FLASHC_LIBRARY=$VL FLASHC_CUDA_LOG=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 3 python3 \
      bench/run_once.py --d $d --n 700 --b 2 --h 8 --causal --repeat 1 >"$LOG/san_${tool}_$d.log" 2>&1
    note "$tool d$d rc $?: $(grep -E 'SUMMARY' "$LOG/san_${tool}_$d.log" | tr '\n' ' ')"
  done
done
main_us() { # the main kernels' us per call from a lab/bwd_split.py log (kernel names cut at 48 characters)
  python3 -c 'import re,sys
for l in open(sys.argv[1]):
    m = re.match(r"D (\d+) N (\d+) causal (\d) (flashc|cuDNN) ", l)
    k = re.search(r"(void fc90_bwd_kernel.{28}|cudnn_generated_fort_native_sdpa_sm90_flash_bpro) ([0-9.]+)", l)
    if m and k: print("d%s N%s c%s %s %s" % (m[1], m[2], m[3], m[4][0], k[2]), end="; ")' "$1"
}
for r in 1 2; do
  for L in $BL $VL; do
    FLASHC_LIBRARY=$L timeout 90 python3 lab/bwd_split.py --dims 64,128 --lens 1024,4096 --runs 10 >"$LOG/split.log" 2>&1
    note "split $r $L: $(main_us "$LOG/split.log")"
    cat "$LOG/split.log" >>"$LOG/split_all.log"
  done
done
[ -z "${V9_BENCH_ONLY:-}" ] && for bwd in default simt; do
  env $([ $bwd = simt ] && echo FLASHC_CUDA_BWD=simt) FLASHC_LIBRARY=$VL timeout 60 python3 lab/seed_probe.py 3157567562 \
    --dtype float32 >"$LOG/seed_$bwd.log" 2>&1
  note "seed probe fp32 ($bwd): $(grep -vi warn "$LOG/seed_$bwd.log" | tail -3 | tr '\n' ' ')"
done
[ -z "${V9_BENCH_ONLY:-}" ] && FLASHC_LIBRARY=$VL timeout 120 python3 -m pytest -q -x python/tests -k "cuda or gpu" >"$LOG/pytest.log" 2>&1
[ -z "${V9_BENCH_ONLY:-}" ] && note "pytest cuda rc $?: $(tail -1 "$LOG/pytest.log")"
note "done $((SECONDS - t0))s"
cat "$S"
