#!/usr/bin/env bash
# lab/fwd90_quick.sh - the Hopper forward's short loop on the GPU machine: build (every head dim), gpu_fwd with
# the persistent grid and once more a block per tile (kernels named), compute-sanitizer racecheck and memcheck on
# one Hopper forward per head dim (64, 96, 128, 192, 256; N 700, causal), then the forward sweep (FWD_ARGS) with
# torch-flash and cuDNN, flashc alone under each AB setting ("NAME=VALUE ...;NAME=VALUE ...", AB_ARGS), and the
# backward sweep when BWD_ARGS is set. Logs in $OUT (a few) and /tmp/fwd90 (the rest); the summary comes last.
set -u
source "$(dirname "$0")/gpu_loop.sh"
gpu_loop_start fwd90
gpu_loop_build fc90_fwd
if [ "${TESTS:-1}" = 1 ]; then
  for grid in persistent blocks; do
    FLASHC_CUDA_SM90_GRID=$grid FLASHC_CUDA_LOG=1 timeout ${TEST_LIMIT:-150} build-gpu/tests/gpu_fwd >"$LOG/gpu_fwd_$grid.log" 2>&1
    note "gpu_fwd ($grid) rc $?: $(grep -E "^table|^PASSED|^FAILED" "$LOG/gpu_fwd_$grid.log" | tr '\n' ' ')"
    while read -r l; do note "  $l"; done < <(grep -E "^FAIL|^(ok  |FAIL) (d96_|d192_|persistent|determinism_(persistent|d192))" "$LOG/gpu_fwd_$grid.log" | cut -c1-150)
    while read -r l; do note "  $l"; done < <(grep -oE "CUDA forward .* D [0-9]+ on sm90.*" "$LOG/gpu_fwd_$grid.log" |
      sed -E 's/.* D ([0-9]+) on /D \1 /; s/ \(.*\)//' | sort | uniq -c)
  done
  for d in ${SAN_DIMS:-64 96 128 192 256}; do
    for tool in racecheck memcheck; do
      env FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${SAN_LIMIT:-60} compute-sanitizer --tool $tool \
        --error-exitcode 3 python3 bench/run_once.py --d $d --n 700 --b 4 --h 16 --causal --repeat 1 --no-bwd \
        >"$TMP/san_${tool}_$d.log" 2>&1
      note "$tool d$d rc $?: $(grep -E "SUMMARY|forward.* on" "$TMP/san_${tool}_$d.log" | sed 's/.* on //' | sort | uniq -c | tr '\n' ' ')"
    done
  done
  note "tests done at $((SECONDS - t0)) s"
fi
if [ "${FWD_ARGS:-}" != none ]; then
  env PYTHONUNBUFFERED=1 timeout ${BENCH_LIMIT:-240} python3 bench/compare_torch.py --lib build-gpu/libflashc.so \
    ${FWD_ARGS:---dtypes bf16 --no-memory --runs 10} >"$LOG/bench.log" 2>&1
  note "forward sweep rc $? at $((SECONDS - t0)) s"
fi
IFS=';' read -ra abs <<<"${AB:-}"
i=0
for ab in ${abs[@]+"${abs[@]}"}; do
  i=$((i + 1))
  env $ab PYTHONUNBUFFERED=1 timeout ${BENCH_LIMIT:-240} python3 bench/compare_torch.py --lib build-gpu/libflashc.so \
    ${AB_ARGS:-${FWD_ARGS:---dtypes bf16 --no-memory --runs 10}} >"$LOG/bench_ab$i.log" 2>&1
  note "A/B $i ($ab) rc $? at $((SECONDS - t0)) s"
done
if [ -n "${BWD_ARGS:-}" ]; then
  env PYTHONUNBUFFERED=1 FLASHC_LIBRARY=build-gpu/libflashc.so timeout ${BWD_LIMIT:-300} python3 bench/compare_torch_bwd.py \
    $BWD_ARGS >"$LOG/bench_bwd.log" 2>&1
  note "backward sweep rc $? at $((SECONDS - t0)) s"
fi
gpu_loop_summary
