#!/usr/bin/env bash
# bench/api.sh - one device call for the sweep as users call it (bench/api_sweep.py: flash_attn_func against SDPA's
# cuDNN and flash backends) and the Python CUDA tests of the accuracy rule: builds the library (build-api, all
# cores, every head dim, sm_90a), compiles flashc's C++ autograd function beside what follows, then
#   SEEDS="15 1 2"     test_torch.py's CUDA flash_attn_func cases at each FLASHC_TEST_SEED (TEST_K picks them;
#                      default the fp32 ones)
#   PYTEST_ALL=1       python/tests -k cuda once, at a fresh seed (printed)
#   SWEEP="--dtypes bf16 ..."   bench/api_sweep.py with these arguments ("-" skips it)
#   SPLIT="--dims 128 ..."     lab/api_split.py with these arguments (a backward call's kernels as users call it)
#   NCU="d n causal"   Nsight Compute on the Hopper backward's main kernel there (bench/ncu.sh's sections), and
#                      on cuDNN's (bench/run_once.py --peer cudnn) when NCU_PEER=1
# A build-api kept from the previous call of a warm machine is reused. Logs in $OUT (or build-api/logs); every
# step's one-line result is printed last.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-api/logs}
mkdir -p "$LOG"
t0=$SECONDS
S=()
note() { S+=("$(printf '%4ds %s' $((SECONDS - t0)) "$*")"); }
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 FLASHC_LIBRARY=$PWD/build-api/libflashc.so
export FLASHC_CACHE_DIR=${FLASHC_CACHE_DIR:-$PWD/build-api/cache}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cmake -S . -B build-api -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_ARCHS=90a-real \
  -DFLASHC_BUILD_TESTS=OFF -DFLASHC_BUILD_TOOLS=OFF >"$LOG/build.log" 2>&1 &&
  cmake --build build-api -j "$(nproc)" --target flashc >>"$LOG/build.log" 2>&1
note "build rc $? ($(ls build-api/libflashc.so 2>&1))"
# the module imports flashc, which loads the library: after the build, beside the tests
(python3 -m flashc.cpp_autograd >"$LOG/cpp_autograd.log" 2>&1; echo "rc $?" >>"$LOG/cpp_autograd.log") &
for s in ${SEEDS:-}; do
  FLASHC_TEST_SEED=$s timeout 120 python3 -m pytest -q -p no:cacheprovider python/tests/test_torch.py \
    -k "${TEST_K:-flash_attn_func_cuda and float32}" >"$LOG/seed_$s.log" 2>&1
  note "seed $s rc $?: $(tail -1 "$LOG/seed_$s.log") $(grep -E '^E .*(error|Error)' "$LOG/seed_$s.log" | head -2 | tr '\n' ' ')"
done
if [ "${PYTEST_ALL:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider python/tests -k cuda >"$LOG/pytest_cuda.log" 2>&1
  note "pytest -k cuda rc $?: $(tail -1 "$LOG/pytest_cuda.log"); $(grep -m1 -o 'FLASHC_TEST_SEED=[0-9]*' "$LOG/pytest_cuda.log")"
  grep -E "^(FAILED|ERROR)" "$LOG/pytest_cuda.log" | head -5
fi
if [ "${SWEEP:--}" != "-" ]; then
  wait
  note "cpp_autograd: $(tail -1 "$LOG/cpp_autograd.log")"
  FLASHC_CPP_AUTOGRAD=${FLASHC_CPP_AUTOGRAD:-1} timeout 400 python3 bench/api_sweep.py $SWEEP >"$LOG/api_sweep.log" 2>&1
  note "api_sweep rc $?"
  sed -n '/^device/p;/^TFLOP/,$p' "$LOG/api_sweep.log"
  grep -iE "error|refuse" "$LOG/api_sweep.log" | head -3
fi
if [ -n "${SPLIT:-}" ]; then
  wait
  FLASHC_CPP_AUTOGRAD=${FLASHC_CPP_AUTOGRAD:-1} timeout 300 python3 lab/api_split.py $SPLIT >"$LOG/api_split.log" 2>&1
  note "api_split rc $?"
  cat "$LOG/api_split.log"
fi
if [ -n "${NCU:-}" ]; then
  set -- $NCU
  c=(); [ "$3" = 1 ] && c=(--causal)
  echo "== ncu flashc d $1 N $2 causal $3"
  OUT=$LOG NCU_KERNELS=fc90_bwd_kernel timeout 150 bash bench/ncu.sh --d "$1" --n "$2" "${c[@]}"
  note "ncu flashc rc $?"
  if [ "${NCU_PEER:-0}" = 1 ]; then
    echo "== ncu cuDNN d $1 N $2 causal $3"
    OUT=$LOG NCU_KERNELS=sdpa_sm90_flash_bprop timeout 150 bash bench/ncu.sh --d "$1" --n "$2" "${c[@]}" --peer cudnn
    note "ncu cuDNN rc $?"
  fi
fi
printf '%s\n' "${S[@]}"
