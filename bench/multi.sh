#!/usr/bin/env bash
# bench/multi.sh - the multi-GPU machine's call: build the library with the CUDA backend (build-gpu, all cores), run
# python/tests/ring_worker.py with NCCL on every GPU (the CI ring test's case table, one process per GPU), then
# bench/ring.py under torchrun on every GPU with the arguments given. Logs go to $OUT (or build-gpu/logs); the
# worker's verdicts and the ring table come last.
#
#   bench/multi.sh [--no-check] [--no-ring] [-- ring.py arguments]   e.g. bench/multi.sh -- --ns 524288 --causal 1
# Keep NCCL's NVLink multicast off (NCCL_NVLS_ENABLE=0, as the machine presets it).
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
check=1 ring=1
ring_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-check) check=0 ;;
    --no-ring) ring=0 ;;
    --) shift; ring_args=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
nvidia-smi topo -m | head -$((W + 1))
t0=$SECONDS
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_BUILD_TESTS=OFF >"$LOG/cmake.log" 2>&1 &&
  cmake --build build-gpu -j "$(nproc)" --target flashc >"$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
export FLASHC_LIBRARY=$PWD/build-gpu/libflashc.so PYTHONPATH=$PWD/python
status=0
if [ $check = 1 ]; then
  t0=$SECONDS
  store=$(mktemp -u /tmp/ring_store.XXXXXX)
  pids=()
  for r in $(seq 0 $((W - 1))); do
    timeout 300 python3 python/tests/ring_worker.py "$r" "$W" "$store" 20261126 "$LOG/worker$r.json" \
      --backend nccl --device cuda >"$LOG/worker$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  python3 - "$LOG" "$W" <<'PY' || status=1
import json, sys
log, w = sys.argv[1], int(sys.argv[2])
bad = 0
for r in range(w):
    rec = json.load(open("%s/worker%d.json" % (log, r)))
    bad += len(rec["errors"]) + len(rec["failures"])
    print("rank %d: %d checks, %d errors, %d failures%s" % (r, len(rec["checked"]), len(rec["errors"]),
          len(rec["failures"]), "".join("\n  " + e[:400] for e in rec["errors"] + rec["failures"])))
sys.exit(1 if bad else 0)
PY
  echo "worker: $((SECONDS - t0)) s"
fi
[ $ring = 1 ] && { torchrun --standalone --nproc_per_node "$W" bench/ring.py "${ring_args[@]}" 2>&1 | tee "$LOG/ring.log" | grep -v "^\[\|UserWarning\|return func" || status=1; }
exit $status
