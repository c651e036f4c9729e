# lab/gpu_loop.sh - what the Hopper short loops (fwd90_quick.sh, bwd90_ab.sh) share; sourced, not run.
# gpu_loop_start TMPNAME: repository root, logs in $OUT (or build-gpu/logs) and /tmp/TMPNAME, the summary lines.
# gpu_loop_build KERNEL: build build-gpu with every head dim and note the ptxas spills of the sm_90a KERNEL entries.
# note TEXT: print TEXT and keep it for the summary (gpu_loop_summary prints them again).
gpu_loop_start() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
  LOG=${OUT:-$PWD/build-gpu/logs}
  TMP=/tmp/$1
  mkdir -p "$LOG" "$TMP"
  t0=$SECONDS
  sum=()
}
note() { sum+=("$*"); echo "$*"; }
gpu_loop_build() {
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on -DFLASHC_CUDA_PTXAS_VERBOSE=ON \
    >"$TMP/configure.log" 2>&1 || { tail "$TMP/configure.log"; exit 1; }
  cmake --build build-gpu -j "$(nproc)" >"$TMP/build.log" 2>&1 || { grep -E "error" "$TMP/build.log" | head; exit 1; }
  note "build $((SECONDS - t0)) s; $1 spills: $(grep -A2 "$1.*sm_90a" "$TMP/build.log" |
    grep -oE "[0-9]+ bytes spill stores" | sort | uniq -c | tr '\n' ' ')"
}
gpu_loop_summary() {
  echo "== summary"
  printf '%s\n' "${sum[@]}"
}
