#!/usr/bin/env bash
# amx_ab.sh - A/B of the CPU bf16 forward on the "amx" kernel set (AMX-BF16 tiles) between two library builds, on a
# Xeon with AMX (the GPU machine's host). Each side is a git commit (built here from `git archive`, the checkout is
# not touched: CPU only, -DFLASHC_CUDA=off, about a minute on 16 cores) or a build directory holding libflashc.so
# (and bench/cpu_speed). The two run in turns, ROUNDS times: bench/compare_torch_cpu.py (this tree's, with this
# tree's python binding for both libraries) with FLASHC_CPU_KERNELS=amx, forward only unless --bwd; torch's SDPA is
# timed in the same call, so flashc / torch is comparable across calls where the raw rates drift (this host's do).
# Then `cpu_speed --kernels` of each side (one thread: the products and, where built, the forward tile's phases).
#
#   lab/amx_ab.sh BEFORE AFTER [--rounds 3] [--threads 16] [--dims 64,128] [--ns 1024,4096] [--bwd]
#   e.g. lab/amx_ab.sh 804c163 HEAD          lab/amx_ab.sh /path/build-old build-amx --rounds 5
#
# Prints per (D, causal, N): each side's forward GFLOP/s and ratio to torch (medians over the rounds), and
# after / before as the median over rounds of the two ratios' quotient (same round, same torch run-to-run state).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 2 ] || { sed -n 2,14p "$0"; exit 2; }
before=$1 after=$2
shift 2
rounds=3 threads=16 dims=64,128 ns=1024,4096 bwd=--no-bwd
while [ $# -gt 0 ]; do
    case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --dims) dims=$2; shift 2 ;;
    --ns) ns=$2; shift 2 ;;
    --bwd) bwd=; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
work=${AMX_AB_DIR:-/tmp/amx_ab}
mkdir -p "$work"

# build_of SIDE NAME: prints the build directory of SIDE (a directory as it is, a commit built under $work/NAME)
build_of() {
    if [ -d "$1" ]; then (cd "$1" && pwd); return; fi
    local sha src bld
    sha=$(git -C "$root" rev-parse --verify "$1^{commit}")
    src=$work/$2-$sha/src bld=$work/$2-$sha/build
    if [ ! -f "$bld/libflashc.so" ]; then
        rm -rf "$src" && mkdir -p "$src"
        git -C "$root" archive "$sha" | tar -x -C "$src"
        cmake -S "$src" -B "$bld" -DCMAKE_BUILD_TYPE=Release -DFLASHC_CUDA=off >"$bld.log" 2>&1 &&
            cmake --build "$bld" -j"$(nproc)" >>"$bld.log" 2>&1 || { echo "build of $1 failed: $bld.log" >&2; exit 1; }
    fi
    echo "$bld"
}
B=$(build_of "$before" before) A=$(build_of "$after" after)
for d in "$B" "$A"; do [ -f "$d/libflashc.so" ] || { echo "no libflashc.so in $d" >&2; exit 1; }; done
echo "before: $before ($B)"
echo "after:  $after ($A)"
lscpu | grep -E "^Model name|^CPU\(s\)|^Thread" || true

out=$work/runs.$$
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
    for side in before after; do
        lib=$B; [ $side = after ] && lib=$A
        echo "round $r: $side" >&2
        FLASHC_CPU_KERNELS=amx FLASHC_LIBRARY=$lib/libflashc.so PYTHONPATH=$root/python \
            python3 "$root/bench/compare_torch_cpu.py" --threads "$threads" --dtypes bfloat16 --dims "$dims" \
            --ns "$ns" $bwd >"$out/$side.$r" 2>/dev/null
    done
done

python3 - "$out" "$rounds" <<'PY'
import statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):
    res = {}
    for line in open(path):
        f = line.split()
        if len(f) > 9 and f[1] == "bfloat16" and f[5] == "|":
            key = (int(f[2]), int(f[3]), int(f[4]))
            res[key] = (float(f[6]), float(f[7]), float(f[8].rstrip("x")), f[12] if len(f) > 14 else None,
                        float(f[14].rstrip("x")) if len(f) > 14 and f[14] != "nanx" else float("nan"))
    return res
runs = {s: [rows("%s/%s.%d" % (out, s, r)) for r in range(1, rounds + 1)] for s in ("before", "after")}
for line in open("%s/after.1" % out):
    if line.startswith("flashc") or line.startswith("threads"):
        print(line.rstrip())
print("\n%4s %6s %6s | %9s %7s | %9s %7s | %12s | %s" % ("D", "causal", "N", "before", "/torch", "after", "/torch",
                                                         "after/before", "f+b /torch before, after"))
med = statistics.median
for key in sorted(runs["after"][0]):
    b = [r[key] for r in runs["before"] if key in r]
    a = [r[key] for r in runs["after"] if key in r]
    gain = med([x[2] / y[2] for x, y in zip(a, b)])
    fb = "%.2f, %.2f" % (med([y[4] for y in b]), med([x[4] for x in a])) if a[0][3] is not None else "-"
    print("%4d %6d %6d | %9.1f %6.2fx | %9.1f %6.2fx | %11.3fx | %s" % (key + (med([y[0] for y in b]),
          med([y[2] for y in b]), med([x[0] for x in a]), med([x[2] for x in a]), gain, fb)))
print("(GFLOP/s of the forward, medians of %d rounds; /torch: flashc / torch SDPA in the same call)" % rounds)
PY

for side in before after; do
    lib=$B; [ $side = after ] && lib=$A
    if [ -x "$lib/bench/cpu_speed" ]; then
        echo; echo "$side: cpu_speed --kernels (FLASHC_CPU_KERNELS=amx)"
        FLASHC_CPU_KERNELS=amx "$lib/bench/cpu_speed" --kernels 2>&1 | grep -E "microkernel|bf16" || true
    fi
done
rm -rf "$out"
