#!/usr/bin/env bash
# lab/bwd90_flags.sh - one device call that compares builds of the tree differing only in CUDA compile flags (a lab
# switch of bwd_sm90.cu such as FC90B_EARLY_DV): builds each variant's library in parallel (head dims 64;128;256,
# sm_90a), the variant named by TEST with its tests too; times lab/bwd_split.py's main kernel (flashc's and cuDNN's,
# us per call) for every variant in turns, ROUNDS rounds; then runs gpu_bwd, gpu_dropout, racecheck and memcheck of
# d 64 and d 128 causal forward + backward, and (PYTEST=1, the default) the Python CUDA tests on TEST. Three
# variants with TEST and PYTEST take about 550 s of a 600 s call: PYTEST=0 leaves room. SAN_DIMS: the head dims of
# the sanitizer runs (default "64 128"). Summary (printed last, also
# $OUT/summary.txt) keeps every number; logs in $OUT (or build-flags/logs).
#   VARIANTS="base: e1:-DFC90B_EARLY_DV=1 e2:-DFC90B_EARLY_DV=2" TEST=e2 bash lab/bwd90_flags.sh
# A variant is name:flags, flags comma-separated (no spaces). SPLIT_ARGS: lab/bwd_split.py's arguments.
# DRAM="d n [causal 0/1]": each variant's main kernel at that shape under Nsight Compute (DRAM bytes read and
# written, duration), after the timings.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-flags/logs}
mkdir -p "$LOG"
S=$LOG/summary.txt
: >"$S"
t0=$SECONDS
note() { echo "$*" >>"$S"; }
VARIANTS=${VARIANTS:-"base: e1:-DFC90B_EARLY_DV=1"}
TEST=${TEST:-}
cfg=(-DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_ARCHS=90a-real "-DFLASHC_CUDA_HEAD_DIMS=64;128;256"
     -DFLASHC_CUDA_PTXAS_VERBOSE=ON -DFLASHC_BUILD_TOOLS=OFF)
n=$(echo $VARIANTS | wc -w)
jobs=$(( ( $(nproc) + n - 1 ) / n ))
names=()
for v in $VARIANTS; do
  name=${v%%:*} flags=${v#*:}
  names+=("$name")
  tests=-DFLASHC_BUILD_TESTS=OFF target=(--target flashc)
  [ "$name" = "$TEST" ] && tests=-DFLASHC_BUILD_TESTS=ON target=()
  (cmake -S . -B build-flags/$name "${cfg[@]}" $tests "-DCMAKE_CUDA_FLAGS=${flags//,/ }" &&
     cmake --build build-flags/$name -j $jobs "${target[@]}") >"$LOG/build_$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  note "build $name: $(ls build-flags/$name/libflashc.so 2>&1); C7512 $(grep -c C7512 "$LOG/build_$name.log"), C7519 $(grep -c C7519 "$LOG/build_$name.log");" \
    "fc90_bwd spills: $(grep -A2 'fc90_bwd_kernel' "$LOG/build_$name.log" | grep spill | grep -v ' 0 bytes spill st' |
      sed 's/ *\([0-9]*\) bytes stack.*, \([0-9]*\) bytes spill stores.*/\2/' | sort -n | uniq -c | tr '\n' ' ')"
done
note "builds done $((SECONDS - t0)) s"
export PYTHONPATH=python PYTHONUNBUFFERED=1
main_us() { # the main kernels' us per call from a lab/bwd_split.py log (kernel names cut at 48 characters)
  python3 -c 'import re,sys
for l in open(sys.argv[1]):
    m = re.match(r"D (\d+) N (\d+) causal (\d) (flashc|cuDNN) ", l)
    k = re.search(r"(void fc90_bwd_kernel.{28}|cudnn_generated_fort_native_sdpa_sm90_flash_bpro) ([0-9.]+)", l)
    if m and k: print("d%s N%s c%s %s %s" % (m[1], m[2], m[3], m[4][0], k[2]), end="; ")' "$1"
}
for r in $(seq 1 ${ROUNDS:-2}); do
  for name in "${names[@]}"; do
    FLASHC_LIBRARY=build-flags/$name/libflashc.so timeout 120 python3 lab/bwd_split.py \
      ${SPLIT_ARGS:---dims 64,128 --lens 1024,4096 --runs 10} >"$LOG/split_$name.log" 2>&1
    note "split $r $name: $(main_us "$LOG/split_$name.log")"
  done
done
if [ -n "${DRAM:-}" ]; then # each variant's main kernel under Nsight Compute: DRAM bytes and duration
  set -- $DRAM
  : "${2:?DRAM takes d n [causal]}"
  c=(); [ "${3:-0}" = 1 ] && c=(--causal)
  for name in "${names[@]}"; do
    FLASHC_LIBRARY=build-flags/$name/libflashc.so timeout 60 ncu --clock-control none -k regex:fc90_bwd_kernel \
      --launch-count 1 --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
      python3 bench/run_once.py --d "$1" --n "$2" "${c[@]}" --repeat 1 >"$LOG/dram_$name.log" 2>&1
    note "dram $name d$1 N$2 causal ${3:-0} rc $?: $(grep -E '^ +(dram__bytes_(read|write)|gpu__time_duration)\.sum' \
      "$LOG/dram_$name.log" | awk '{print $1, $(NF-1), $NF}' | tr '\n' ' ')"
  done
fi
if [ -n "$TEST" ]; then
  L=build-flags/$TEST/libflashc.so
  for t in gpu_bwd gpu_dropout; do
    FLASHC_CUDA_LOG=1 timeout 150 build-flags/$TEST/tests/$t >"$LOG/$t.log" 2>&1
    note "$TEST $t rc $? at $((SECONDS - t0)) s: $(grep -cE '^ok' "$LOG/$t.log") ok, $(grep -c '^FAIL' "$LOG/$t.log") FAIL"
    grep '^FAIL' "$LOG/$t.log" | cut -c1-160 | head -5 >>"$S"
  done
  for d in ${SAN_DIMS:-64 128}; do
    for tool in racecheck memcheck; do
      FLASHC_LIBRARY=$L timeout 90 compute-sanitizer --tool $tool --error-exitcode 3 python3 bench/run_once.py --d $d \
        --n 700 --b 2 --h 8 --causal --repeat 1 >"$LOG/san_${tool}_$d.log" 2>&1
      note "$TEST $tool d$d rc $?: $(grep -E 'SUMMARY' "$LOG/san_${tool}_$d.log" | tr '\n' ' ')"
    done
  done
  if [ "${PYTEST:-1}" = 1 ]; then
    FLASHC_LIBRARY=$L timeout 150 python3 -m pytest -q python/tests -k "cuda or gpu" >"$LOG/pytest.log" 2>&1
    note "$TEST pytest cuda rc $?: $(tail -1 "$LOG/pytest.log")"
    grep -E "^FAILED|FLASHC_TEST_SEED" "$LOG/pytest.log" | head -5 >>"$S"
  fi
fi
note "done $((SECONDS - t0)) s"
cat "$S"
