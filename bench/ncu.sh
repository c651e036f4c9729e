#!/usr/bin/env bash
# bench/ncu.sh - Nsight Compute on flashc's CUDA kernels at one sweep shape (after a build into build-gpu): speed
# of light, occupancy, issue statistics and the warp stall reasons (cycles per issued instruction, by reason).
# NCU_KERNELS: a regex of kernel names (default: the backward's main kernels; "fc90" for the Hopper forward,
# "fc_fwd_kernel" for the mma.sync forward; with --peer cudnn, "sdpa_sm90_flash_bprop" for cuDNN's backward). Args go to
# bench/run_once.py (--d, --n, --causal, --deterministic, --peer). FLASHC_LIBRARY: the library (build-gpu's).
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
out="$LOG/ncu_$(echo "${NCU_KERNELS:-bwd}$*" | tr -c 'a-zA-Z0-9_\n' _).txt"
FLASHC_LIBRARY=${FLASHC_LIBRARY:-build-gpu/libflashc.so} ncu --clock-control none -k regex:"${NCU_KERNELS:-fc_bwd_(kv|q)_kernel}" \
  --launch-count "${NCU_COUNT:-1}" --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section LaunchStats --section ComputeWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 bench/run_once.py --repeat 1 "$@" >"$out" 2>&1
grep -E "  [a-z_0-9]+<|^  void|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc Active|Theoretical Occ|Dynamic Shared Memory Per" "$out" | head -30
echo "stall reasons (cycles per issued instruction, > 0.05):"
grep -E "issue_stalled" "$out" | awk '$NF+0 > 0.05 {sub("smsp__average_warps_issue_stalled_", "", $1); sub("_per_issue_active.ratio", "", $1); print "  " $1, $NF}' | sort -k2 -g -r | head -12
