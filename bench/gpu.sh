#!/usr/bin/env bash
# bench/gpu.sh - everything the GPU machine has to do, in one call: build with the CUDA backend (build-gpu, all
# cores), the gpu tests, compute-sanitizer memcheck + racecheck on `gpu_fwd --quick`, then compare_torch.py.
# Logs go to $OUT (or build-gpu/logs); a short summary table comes last.
#
#   bench/gpu.sh                  everything, the full benchmark sweep
#   bench/gpu.sh --quick          the reduced benchmark (compare_torch.py --quick)
#   bench/gpu.sh --no-test        build + benchmark only;   --no-sanitize, --no-bench likewise
#   bench/gpu.sh --bwd            also the backward benchmark (compare_torch_bwd.py); --bwd-only: that one alone
#   bench/gpu.sh --lab F.h ...    also build each tile-table variant F.h (lab/tiles/) and time it (flashc only)
#   bench/gpu.sh -- ARGS          extra arguments for compare_torch.py
# Each step has a time limit (GPU_TEST_LIMIT, SANITIZE_LIMIT, BENCH_LIMIT seconds) so that one call ends in time.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
quick=0 test=1 sanitize=1 bench=1 bwd=0
bench_args=()
lab=()
lab_args=(--dtypes bf16 --dims ${LAB_DIMS:-64,128,256} --lens 1024,4096,16384 --no-memory --no-peers --runs 20)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --no-test) test=0 ;;
    --no-sanitize) sanitize=0 ;;
    --no-bench) bench=0 ;;
    --bwd) bwd=1 ;;
    --bwd-only) bwd=1 bench=0 ;;
    --lab) while [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; do lab+=("$2"); shift; done ;;
    --) shift; bench_args=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ $quick = 1 ] && bench_args+=(--quick)

summary=()
status=0
step() { # step NAME LOGFILE LIMIT_S CMD...: runs CMD (killed after LIMIT_S), logs to LOGFILE, records status/time
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s %-6s %5ds  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)) "$(basename "$log")")")
  [ $rc = 0 ] || status=1
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  nvcc --version | tail -2
  git rev-parse --short HEAD 2>/dev/null || echo "no commit"
  git status --short 2>/dev/null | head -20
} >"$LOG/machine.txt" 2>&1

step configure "$LOG/configure.log" 120 cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on \
  -DFLASHC_CUDA_PTXAS_VERBOSE=ON
if step build "$LOG/build.log" 600 cmake --build build-gpu -j "$(nproc)"; then
  grep -E "spill" "$LOG/build.log" | sort | uniq -c >"$LOG/spills.txt"
  gpu_fwd=$(find build-gpu -name gpu_fwd -type f -perm -u+x | head -1)
  gpu_bwd=$(find build-gpu -name gpu_bwd -type f -perm -u+x | head -1)
  if [ $test = 1 ]; then
    step "ctest -L gpu" "$LOG/gpu_tests.log" "${GPU_TEST_LIMIT:-300}" bash -c "cd build-gpu && ctest -L gpu -V"
  fi
  if [ $sanitize = 1 ] && [ -n "$gpu_fwd" ]; then
    step "memcheck gpu_fwd --quick" "$LOG/memcheck.log" "${SANITIZE_LIMIT:-150}" \
      compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 "$gpu_fwd" --quick
    step "racecheck gpu_fwd --quick" "$LOG/racecheck.log" "${SANITIZE_LIMIT:-150}" \
      compute-sanitizer --tool racecheck --error-exitcode 3 "$gpu_fwd" --quick
  fi
  if [ $sanitize = 1 ] && [ -n "$gpu_bwd" ]; then
    step "memcheck gpu_bwd --quick" "$LOG/memcheck_bwd.log" "${SANITIZE_LIMIT:-150}" \
      compute-sanitizer --tool memcheck --error-exitcode 3 "$gpu_bwd" --quick
    step "racecheck gpu_bwd --quick" "$LOG/racecheck_bwd.log" "${SANITIZE_LIMIT:-150}" \
      compute-sanitizer --tool racecheck --error-exitcode 3 "$gpu_bwd" --quick
    # The reduced tables are too small for the Hopper forward (they split the keys or miss its head dims): one
    # forward + backward per Hopper head dim at a shape that takes it, ragged (N 700) and causal.
    for d in 64 96 128 192 256; do
      for tool in memcheck racecheck; do
        step "$tool sm90 d$d" "$LOG/${tool}_sm90_d$d.log" "${SANITIZE_LIMIT:-150}" env FLASHC_CUDA_LOG=1 \
          FLASHC_LIBRARY=build-gpu/libflashc.so compute-sanitizer --tool $tool --error-exitcode 3 \
          python3 bench/run_once.py --d $d --n 700 --b 4 --h 16 --causal --repeat 1
      done
    done
    # g: the generic score step of the Hopper forward (softcap, ALiBi) under a sliding window with both sides;
    # v: varlen on both Hopper kernels (ragged sequences: the tails that read the next sequence's rows), causal.
    # u: seqused_k and sinks (the VARLEN kernels on fixed-length batches, the backward's post step).
    for variant in "g:--window 300,20 --softcap 30 --alibi" "v:--causal --varlen" "u:--causal --used --sinks" "b:--causal --blockmask 96"; do
      for d in 64 128 256; do
        for tool in memcheck racecheck; do
          step "$tool sm90 d$d ${variant#*:}" "$LOG/${tool}_sm90${variant%%:*}_d$d.log" "${SANITIZE_LIMIT:-150}" env \
            FLASHC_CUDA_LOG=1 FLASHC_LIBRARY=build-gpu/libflashc.so compute-sanitizer --tool $tool --error-exitcode 3 \
            python3 bench/run_once.py --d $d --n 700 --b 4 --h 16 ${variant#*:} --repeat 1
        done
      done
    done
  fi
  if [ $bench = 1 ]; then
    step "compare_torch.py" "$LOG/bench.log" "${BENCH_LIMIT:-400}" env PYTHONUNBUFFERED=1 python3 bench/compare_torch.py \
      --lib build-gpu/libflashc.so "${bench_args[@]}"
  fi
  if [ $bwd = 1 ]; then
    step "compare_torch_bwd.py" "$LOG/bench_bwd.log" "${BENCH_LIMIT:-400}" env PYTHONUNBUFFERED=1 \
      FLASHC_LIBRARY=build-gpu/libflashc.so python3 bench/compare_torch_bwd.py ${BWD_ARGS:---dtypes bf16 --lens 1024,4096,16384}
  fi
  for f in ${lab[@]+"${lab[@]}"}; do
    name=$(basename "$f" .h)
    dir=build-gpu-lab-$name
    step "lab $name: build" "$LOG/lab_$name.build.log" 300 bash -c "cmake -S . -B $dir -DCMAKE_BUILD_TYPE=Release \
      -DFLASHC_CUDA=on -DFLASHC_BUILD_TESTS=OFF -DFLASHC_BUILD_TOOLS=OFF -DFLASHC_CUDA_PTXAS_VERBOSE=ON \
      '-DFLASHC_CUDA_HEAD_DIMS=64;128;256' -DFLASHC_CUDA_TILES_FILE=$PWD/$f && cmake --build $dir -j $(nproc)" &&
      step "lab $name: bench" "$LOG/lab_$name.log" 200 env PYTHONUNBUFFERED=1 python3 bench/compare_torch.py \
        --lib $dir/libflashc.so "${lab_args[@]}"
  done
fi

echo "== $(head -1 "$LOG/machine.txt" >/dev/null; sed -n 2p "$LOG/machine.txt")"
echo "== spills:"; cat "$LOG/spills.txt" 2>/dev/null
echo "== gpu tests (failures and extras):"
grep -E ": (FAIL|table|PASSED|FAILED|ok   (splitkv|determinism|n64k|over_2e31))|: +(splitkv|n64k|over)" "$LOG/gpu_tests.log" 2>/dev/null | cut -d' ' -f2- | tail -30
echo "== forward kernels in the gpu tests (test program: path, grid):"
grep -oE "^[0-9]+: flashc: CUDA forward .* on .*" "$LOG/gpu_tests.log" 2>/dev/null | \
  sed -E 's/^([0-9]+): flashc: CUDA forward .* D ([0-9]+) on /test \1: D \2 /; s/ \(.*\)//' | sort | uniq -c
echo "== backward kernels in the gpu tests:"
grep -hoE "CUDA backward .* on .*" "$LOG/gpu_tests.log" 2>/dev/null | sed 's/.* on //' | sort | uniq -c
for f in memcheck racecheck memcheck_bwd racecheck_bwd memcheck_sm90_d{64,96,128,192,256} racecheck_sm90_d{64,96,128,192,256} \
  memcheck_sm90g_d{64,128,256} racecheck_sm90g_d{64,128,256} memcheck_sm90v_d{64,128,256} racecheck_sm90v_d{64,128,256} \
  memcheck_sm90u_d{64,128,256} racecheck_sm90u_d{64,128,256}; do
  [ -f "$LOG/$f.log" ] && echo "== $f: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|on sm90" "$LOG/$f.log" | sort | uniq -c | tr '\n' ' ')"
done
if [ -f "$LOG/bench.log" ]; then
  echo "== benchmark"
  sed -n '/^device:/p; /^peak memory/p; /^| dtype/,$p' "$LOG/bench.log"
  grep -E "Error|error" "$LOG/bench.log" | head -5
fi
if [ -f "$LOG/bench_bwd.log" ]; then
  echo "== backward benchmark"
  sed -n '/^device:/p; /^| dtype/,$p' "$LOG/bench_bwd.log"
fi
for f in ${lab[@]+"${lab[@]}"}; do
  name=$(basename "$f" .h)
  echo "== lab $name ($(grep -h spill "$LOG/lab_$name.build.log" 2>/dev/null | sort | uniq -c | awk '{print $1"x "$2" B stack"}' | tr '\n' ' '))"
  grep -E "^  (bfloat16|float16)" "$LOG/lab_$name.log" 2>/dev/null | sed 's/  max|flashc-flash|.*//; s/flash +nan  cudnn +nan  //'
done
echo "== steps"
printf '%s\n' "${summary[@]}"
exit $status
