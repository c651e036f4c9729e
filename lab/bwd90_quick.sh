#!/usr/bin/env bash
# lab/bwd90_quick.sh - the Hopper backward's short loop on the GPU machine: build (head dims 64, 128, 256),
# gpu_bwd's full table with the kernels named, compute-sanitizer on one Hopper forward + backward per head dim,
# then the backward sweep at d 64 and 128 (BWD_ARGS to change it). Logs in $OUT (or build-gpu/logs).
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_PTXAS_VERBOSE=ON \
  '-DFLASHC_CUDA_HEAD_DIMS=64;128;256' >"$LOG/configure.log" 2>&1 || { tail "$LOG/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" >"$LOG/build.log" 2>&1 || { grep -E "error" "$LOG/build.log" | head; exit 1; }
grep -A2 "fc90_bwd.*sm_90a" "$LOG/build.log" | grep -E "spill|Used" | sort | uniq -c
FLASHC_CUDA_LOG=1 timeout 200 build-gpu/tests/gpu_bwd >"$LOG/gpu_bwd.log" 2>&1
echo "gpu_bwd rc $?"; grep -E "^FAIL|passed|determinism|: FAIL" "$LOG/gpu_bwd.log" | head -30
grep -hoE "CUDA backward .* on .*" "$LOG/gpu_bwd.log" | sed 's/.* on //' | sort | uniq -c
for d in ${SAN_DIMS:-128}; do
  env FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout 120 compute-sanitizer --tool ${SAN_TOOL:-racecheck} \
    --error-exitcode 3 python3 bench/run_once.py --d $d --n 700 --b 2 --h 4 --causal --repeat 1 >"$LOG/san_$d.log" 2>&1
  echo "sanitizer d$d rc $?: $(grep -E "SUMMARY|backward.* on" "$LOG/san_$d.log" | sort | uniq -c | tr '\n' ' ')"
done
env PYTHONUNBUFFERED=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${BENCH_LIMIT:-240} python3 bench/compare_torch_bwd.py \
  ${BWD_ARGS:---dtypes bf16 --dims 64,128 --lens 1024,4096,16384 --runs 5} >"$LOG/bench_bwd.log" 2>&1
sed -n '/^device:/p; /^| dtype/,$p' "$LOG/bench_bwd.log"; grep -iE "error|Traceback" "$LOG/bench_bwd.log" | head -5
# AB="ENV=VALUE ...": the same sweep once more with those variables set (flashc columns only change).
if [ -n "${AB:-}" ]; then
  env $AB PYTHONUNBUFFERED=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${BENCH_LIMIT:-240} python3 \
    bench/compare_torch_bwd.py ${BWD_ARGS:---dtypes bf16 --dims 64,128 --lens 1024,4096,16384 --runs 5} --no-det \
    >"$LOG/bench_bwd_ab.log" 2>&1
  echo "== with $AB"; sed -n '/^| dtype/,$p' "$LOG/bench_bwd_ab.log" | cut -d'|' -f2-6,10
fi
