#!/usr/bin/env bash
# lab/bwd_lab.sh - the backward's tile lab: builds the library (head dims LAB_DIMS, default 64;128) with the
# default tile table and with each variant header given (lab/tiles/*.h, -DFLASHC_CUDA_TILES_FILE), all builds in
# parallel, then times each with compare_torch_bwd.py. Prints the spills and one table per build.
#   lab/bwd_lab.sh lab/tiles/bwd_occ2.h ...      (extra compare_torch_bwd.py arguments in BWD_ARGS)
cd "$(dirname "$0")/.."
dims=${LAB_DIMS:-64;128}
builds=(default "$@")
for f in "${builds[@]}"; do
  name=$(basename "$f" .h)
  extra=()
  [ "$f" != default ] && extra=(-DFLASHC_CUDA_TILES_FILE=$PWD/$f -DFLASHC_BUILD_TESTS=OFF)
  (cmake -S . -B build-lab-$name -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on \
     -DFLASHC_BUILD_TOOLS=OFF -DFLASHC_CUDA_PTXAS_VERBOSE=ON "-DFLASHC_CUDA_HEAD_DIMS=$dims" "${extra[@]}" &&
   cmake --build build-lab-$name -j 16) >build-lab-$name.log 2>&1 &
done
wait
for f in "${builds[@]}"; do
  name=$(basename "$f" .h)
  echo "== $name: $(grep -A2 'fc_bwd' build-lab-$name.log | grep -c 'bytes spill stores' ) kernels, spills:" \
    "$(grep -A2 'fc_bwd' build-lab-$name.log | grep spill | grep -v ' 0 bytes spill stores' | sort | uniq -c | tr '\n' ';')"
  FLASHC_LIBRARY=build-lab-$name/libflashc.so python3 bench/compare_torch_bwd.py --dims ${BWD_DIMS:-64,128} \
    ${BWD_ARGS:-} 2>&1 | grep -v Warn
done
