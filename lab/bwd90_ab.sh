#!/usr/bin/env bash
# lab/bwd90_ab.sh - the Hopper backward's check-and-compare loop on the GPU machine: build, gpu_bwd with the
# kernels named, compute-sanitizer racecheck + memcheck on one Hopper forward + backward per head dim in SAN_DIMS,
# then compare_torch_bwd.py (BWD_ARGS) as built and once more under AB ("NAME=VALUE ..."). Summary last.
set -u
source "$(dirname "$0")/gpu_loop.sh"
gpu_loop_start bwd90ab
gpu_loop_build fc90_bwd
if [ "${TESTS:-1}" = 1 ]; then
  FLASHC_CUDA_LOG=1 timeout ${TEST_LIMIT:-200} build-gpu/tests/gpu_bwd >"$LOG/gpu_bwd.log" 2>&1
  note "gpu_bwd rc $?: $(grep -E "table|^PASSED|^FAILED" "$LOG/gpu_bwd.log" | tr '\n' ' ')"
  while read -r l; do note "  $l"; done < <(grep -E "^FAIL" "$LOG/gpu_bwd.log" | cut -c1-150 | head -10)
  while read -r l; do note "  $l"; done < <(grep -oE "CUDA backward .* on .*" "$LOG/gpu_bwd.log" | sed 's/.* on //' | sort | uniq -c)
  for d in ${SAN_DIMS:-256}; do
    for tool in racecheck memcheck; do
      env FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${SAN_LIMIT:-90} compute-sanitizer --tool $tool \
        --error-exitcode 3 python3 bench/run_once.py --d $d --n 700 --b 2 --h 4 --causal --repeat 1 >"$TMP/san_${tool}_$d.log" 2>&1
      note "$tool d$d rc $?: $(grep -E "SUMMARY|backward.* on" "$TMP/san_${tool}_$d.log" | sed 's/.* on //' | sort | uniq -c | tr '\n' ' ')"
    done
  done
fi
env PYTHONUNBUFFERED=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${BENCH_LIMIT:-240} python3 bench/compare_torch_bwd.py \
  ${BWD_ARGS:---dtypes bf16,fp16 --dims 256 --runs 20 --no-det} >"$LOG/bench_bwd.log" 2>&1
note "backward sweep rc $? at $((SECONDS - t0)) s"
if [ -n "${AB:-}" ]; then
  env $AB PYTHONUNBUFFERED=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${BENCH_LIMIT:-240} python3 \
    bench/compare_torch_bwd.py ${BWD_ARGS:---dtypes bf16,fp16 --dims 256 --runs 20 --no-det} >"$LOG/bench_bwd_ab.log" 2>&1
  note "A/B ($AB) rc $? at $((SECONDS - t0)) s"
fi
gpu_loop_summary
echo "== bwd flashc / torch-flash / cuDNN (as built | with AB)"
paste -d'|' <(sed -n '/^| dtype/,$p' "$LOG/bench_bwd.log" | cut -d'|' -f2-6,8,10,11) \
  <(sed -n '/^| dtype/,$p' "$LOG/bench_bwd_ab.log" 2>/dev/null | cut -d'|' -f6,8,10,11)
