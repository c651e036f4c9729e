#!/usr/bin/env bash
# lab/features_ab.sh - one device call that compares two builds of the tree differing only in CUDA compile flags on
# bench/features.py's cases (every mask and score option through flash_attn_func, flashc alone): builds both libraries
# in parallel (sm_90a, HEAD_DIMS), then runs the cases with each in turns, ROUNDS rounds, printing the tables' rows.
#   A="-DFC90B_STSM=0" B="" FEATURES="--D 128 --no-flex --runs 10" HEAD_DIMS=128 bash lab/features_ab.sh
set -u
cd "$(dirname "$0")/.."
t0=$SECONDS
cfg=(-DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_ARCHS=90a-real "-DFLASHC_CUDA_HEAD_DIMS=${HEAD_DIMS:-64;128;256}"
     -DFLASHC_BUILD_TESTS=OFF -DFLASHC_BUILD_TOOLS=OFF)
jobs=$(( ( $(nproc) + 1 ) / 2 ))
for v in A B; do
  (cmake -S . -B build-ab/$v "${cfg[@]}" "-DCMAKE_CUDA_FLAGS=${!v:-}" >/dev/null &&
     cmake --build build-ab/$v -j $jobs --target flashc >/dev/null 2>&1) &
done
wait
echo "built $((SECONDS - t0)) s: $(ls build-ab/A/libflashc.so build-ab/B/libflashc.so 2>&1 | tr '\n' ' ')"
for r in $(seq 1 ${ROUNDS:-2}); do
  for v in A B; do
    echo "== $v (${!v:-no flags}) round $r"
    FLASHC_LIBRARY=build-ab/$v/libflashc.so PYTHONPATH=python timeout 150 python3 bench/features.py \
      ${FEATURES:---D 128 --no-flex --runs 10} 2>&1 | grep -E "^\|" | cut -c1-80
  done
done
echo "done $((SECONDS - t0)) s"
