#!/usr/bin/env bash
# bench/compare_commits.sh BASE.tar [--build-only] - this tree's forward and backward against another commit's, on
# the same GPU in one call, to show that a change left the speed as it was (or by how much it moved it).
#
# BASE.tar is `git archive -o BASE.tar COMMIT`, made where the repository is (the GPU machine gets a working tree
# without .git). Both trees are built with every core (build-gpu here, /tmp/flashc-base/build-gpu for the base);
# then each tree's own bench/compare_torch.py (forward, flashc alone) and bench/compare_torch_bwd.py (backward and
# forward + backward, with the torch peers) run in turns: this tree, the base, this tree again. The summary gives,
# per shape, this tree's TFLOP/s over the base's, and the spread between this tree's two runs as the noise.
# Shapes: COMPARE_ARGS (default bf16, D 64/128/256, N 1k/4k/16k, causal and not). Logs in $OUT (or build-gpu/logs).
set -u
cd "$(dirname "$0")/.."
base_tar=${1:?usage: bench/compare_commits.sh BASE.tar [--build-only]}
build_only=0
[ "${2:-}" = "--build-only" ] && build_only=1
LOG=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$LOG"
BASE=/tmp/flashc-base
ARGS=${COMPARE_ARGS:---dtypes bf16 --dims 64,128,256 --lens 1024,4096,16384 --causal 0,1}

build() { # build TREE: configure and build TREE/build-gpu (kept between calls on a warm machine)
  (cd "$1" && cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=on >/dev/null &&
    cmake --build build-gpu -j "$(nproc)" >build-gpu.log 2>&1) || { tail -20 "$1/build-gpu.log"; exit 1; }
}
if [ ! -f "$BASE/build-gpu/libflashc.so" ]; then
  rm -rf "$BASE" && mkdir -p "$BASE" && tar -xf "$base_tar" -C "$BASE" || exit 1
  t0=$SECONDS; build "$BASE"; echo "base built in $((SECONDS - t0)) s"
fi
# This tree is always (re)built: on a warm machine build-gpu may hold an earlier version of the sources, and an
# incremental build of an unchanged tree takes seconds.
t0=$SECONDS; build "$PWD"; echo "this tree built in $((SECONDS - t0)) s"
[ $build_only = 1 ] && exit 0

run() { # run TREE NAME: that tree's benchmarks on its own library
  local tree=$1 name=$2
  (cd "$tree" && python3 bench/compare_torch.py --lib build-gpu/libflashc.so $ARGS --no-peers --no-memory \
    >"$LOG/fwd_$name.txt" 2>&1 &&
    FLASHC_LIBRARY=$tree/build-gpu/libflashc.so python3 bench/compare_torch_bwd.py $ARGS >"$LOG/bwd_$name.txt" 2>&1) ||
    { echo "== $name failed"; tail -n 20 "$LOG/fwd_$name.txt" "$LOG/bwd_$name.txt"; exit 1; }
}
run "$PWD" new1
run "$BASE" base
run "$PWD" new2

python3 - "$LOG" <<'EOF'
import sys
log = sys.argv[1]

def rows(path, cols):
    """(dtype, D, N, causal) -> the table's numbers in the given columns, from a benchmark's markdown table."""
    out = {}
    for line in open(path):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) > max(cols) and c[1].isdigit():
            try:
                out[tuple(c[:4])] = [float(c[i]) for i in cols]
            except ValueError:
                pass
    return out

for what, file, cols, names in [("forward", "fwd", [4], ["fwd"]), ("backward", "bwd", [4, 10], ["bwd", "f+b"])]:
    a, b, c = (rows(f"{log}/{file}_{n}.txt", cols) for n in ("new1", "base", "new2"))
    print(f"\n{what}: this tree / base (TFLOP/s), and this tree's run-to-run spread")
    print("| dtype | D | N | causal | " + " | ".join(f"{n} new | {n} base | {n} new/base | {n} spread" for n in names) + " |")
    print("|---|---|---|---|" + "---|---|---|---|" * len(names))
    ratios = []
    for k in sorted(b, key=lambda k: (k[0], int(k[1]), int(k[2]), k[3])):
        if k not in a or k not in c:
            continue
        cells = []
        for i in range(len(cols)):
            new = (a[k][i] + c[k][i]) / 2
            r = new / b[k][i] if b[k][i] else float("nan")
            spread = abs(a[k][i] - c[k][i]) / new if new else float("nan")
            ratios.append(r)
            cells.append(f"{new:.1f} | {b[k][i]:.1f} | {r:.3f} | {spread:.3f}")
        print("| " + " | ".join(k) + " | " + " | ".join(cells) + " |")
    if ratios:
        print(f"new/base over all rows: {min(ratios):.3f} - {max(ratios):.3f}, geometric mean "
              f"{__import__('math').prod(ratios) ** (1 / len(ratios)):.3f}")
EOF
