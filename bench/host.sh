#!/usr/bin/env bash
# bench/host.sh - the GPU machine's other work, in one call: build (CUDA on, all cores, build-gpu), the Python
# tests there (torch on CPU and CUDA), then the CPU backend against torch's CPU attention on the host's cores
# (compare_torch_cpu.py at 16 and 2 threads). Logs go to $OUT (or build-gpu/logs); summaries come last.
#
#   bench/host.sh [--no-build] [--no-pytest] [--no-cpu] [--cpu-only] [--ns16 1024,2048,4096] [--ns2 1024,2048]
# --cpu-only builds without the CUDA backend (faster; the Python CUDA tests then skip).
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
build=1 pytest=1 cpu=1 cuda=on ns16=1024,2048,4096 ns2=1024,2048
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    --no-pytest) pytest=0 ;;
    --no-cpu) cpu=0 ;;
    --cpu-only) cuda=off ;;
    --ns16) ns16=$2; shift ;;
    --ns2) ns2=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
{ lscpu; nvidia-smi -L; git rev-parse --short HEAD; } >"$LOG/host.txt" 2>&1
if [ $build = 1 ]; then
  t0=$SECONDS
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=$cuda >"$LOG/configure.log" 2>&1 &&
    cmake --build build-gpu -j "$(nproc)" >"$LOG/build.log" 2>&1 || { echo "build failed"; tail -30 "$LOG/build.log"; exit 1; }
  echo "build: $((SECONDS - t0)) s"
fi
export FLASHC_LIBRARY=$PWD/build-gpu/libflashc.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
if [ $pytest = 1 ]; then
  timeout 300 python3 -m pytest -q -rs python/tests >"$LOG/pytest.log" 2>&1
  echo "pytest (exit $?): $(tail -1 "$LOG/pytest.log")"
  grep -E "FAILED|SKIPPED" "$LOG/pytest.log" | head -20
fi
if [ $cpu = 1 ]; then
  build-gpu/tests/test_cpu_kernels | tail -4
  build-gpu/bench/cpu_speed --kernels
  timeout 420 python3 bench/compare_torch_cpu.py --threads 16 --ns "$ns16" >"$LOG/cpu16.txt" 2>/dev/null
  timeout 300 python3 bench/compare_torch_cpu.py --threads 2 --ns "$ns2" >"$LOG/cpu2.txt" 2>/dev/null
  cat "$LOG/cpu16.txt" "$LOG/cpu2.txt"
fi
