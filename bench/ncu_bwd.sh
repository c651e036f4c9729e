#!/usr/bin/env bash
# bench/ncu_bwd.sh - Nsight Compute on the CUDA backward's main kernels at one sweep shape (after bench/gpu.sh has
# built build-gpu): speed of light, occupancy, warp stall reasons. Args go to bench/run_once.py (--d, --n, ...).
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
FLASHC_LIBRARY=build-gpu/libflashc.so ncu --clock-control none -k regex:'fc_bwd_(kv|q)_kernel' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section ComputeWorkloadAnalysis python3 bench/run_once.py --repeat 1 "$@" >"$LOG/ncu_bwd.txt" 2>&1
grep -E "fc_bwd|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc|Theoretical Occ|Shared Memory Configuration Size|L1/TEX Hit|One or More" "$LOG/ncu_bwd.txt" | head -60
