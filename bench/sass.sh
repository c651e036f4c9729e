#!/usr/bin/env bash
# bench/sass.sh [REV] - the machine code of every CUDA kernel, and whether a change altered it.
#
# Compiles each kernel translation unit (the Hopper forward and backward, the CUDA-core backward, and the
# mma.sync forward and backward at the head dims in DIMS) to sm_80 and sm_90a cubins with the library's flags,
# disassembles them (cuobjdump -sass), and prints one line per kernel: registers, spill bytes and a hash of its
# instructions and their scheduling words. With REV (a commit), does the same for that commit
# (git archive into a temporary folder) and prints only the kernels whose code differs.
# Identical machine code runs at identical speed, so a refactoring that leaves every line alone needs no GPU run;
# a kernel listed here does. No GPU needed; about 5 minutes per tree on 2 cores (JOBS=n to change).
#   bash bench/sass.sh              # this tree's table
#   bash bench/sass.sh HEAD         # what the working tree changed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
DIMS=${DIMS:-"64 128 256"}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-nvcc}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13/bin/cuobjdump"))' 2>/dev/null || true)}
if [[ -z "$CUOBJDUMP" || ! -x "$CUOBJDUMP" ]]; then
    echo "bench/sass.sh: needs cuobjdump (the CUDA toolkit's, or: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)" >&2
    exit 2
fi
export PATH="$(dirname "$CUOBJDUMP"):$PATH" # its nvdisasm

# compile TREE OUT: every TU to OUT/<tu>.<arch>.cubin, then OUT/table (kernel regs spill hash)
compile() {
    local tree=$1 out=$2
    mkdir -p "$out/gen"
    local tus=("$tree/src/cuda/fwd_sm90.cu" "$tree/src/cuda/bwd_sm90.cu" "$tree/src/cuda/bwd_simt.cu")
    for d in $DIMS; do
        printf '#include "cuda/fwd_sm80.cuh"\nFLASHC_FWD_INSTANTIATE(%s)\n' "$d" >"$out/gen/fwd_sm80_d$d.cu"
        printf '#include "cuda/bwd_sm80.cuh"\nFLASHC_BWD_INSTANTIATE(%s)\n' "$d" >"$out/gen/bwd_sm80_d$d.cu"
        tus+=("$out/gen/fwd_sm80_d$d.cu" "$out/gen/bwd_sm80_d$d.cu")
    done
    local jobs=()
    for tu in "${tus[@]}"; do
        for arch in sm_80 sm_90a; do
            local name
            name=$(basename "$tu" .cu).$arch
            jobs+=("$NVCC -cubin -O3 -DNDEBUG -std=c++17 -DFLASHC_BUILDING -DFLASHC_WITH_CUDA -arch=$arch \
                -I$tree/include -I$tree/src -o $out/$name.cubin $tu")
        done
    done
    printf '%s\n' "${jobs[@]}" | xargs -P "$JOBS" -I{} bash -c '{}'
    : >"$out/table"
    for cubin in "$out"/*.cubin; do
        local arch=${cubin%.cubin}; arch=${arch##*.}
        "$CUOBJDUMP" -res-usage "$cubin" 2>/dev/null | awk -v arch="$arch" '
            /Function/ { fn = $2; sub(":$", "", fn) }
            /REG:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^REG:/) r = substr($i, 5); if ($i ~ /^STACK:/) s = substr($i, 7) }
                     print arch, fn, r, s }' >"$cubin.res"
        "$CUOBJDUMP" -sass "$cubin" | awk -v out="$cubin" '
            /Function :/ { fn = $3; next }
            fn != "" && /\/\*/ { print > (out "." fn ".sass") }'
        while read -r a fn r s; do
            local h=none
            [[ -f "$cubin.$fn.sass" ]] && h=$(tr -s " " <"$cubin.$fn.sass" | md5sum | cut -c1-12)
            printf '%-6s %-4s %-6s %s %s\n' "$a" "$r" "$s" "$h" "$fn" >>"$out/table"
        done <"$cubin.res"
    done
    sort -k5 -k1 -o "$out/table" "$out/table"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
compile "$root" "$work/now"
if [[ $# -eq 0 ]]; then
    echo "arch   regs stack  sass-hash    kernel"
    cat "$work/now/table"
    exit 0
fi
rev=$(git -C "$root" rev-parse "$1")
cache=${TMPDIR:-/tmp}/flashc-sass/$rev-$(echo "$DIMS" | tr ' ' _) # a commit's table is kept for the next comparison
if [[ ! -f "$cache/table" ]]; then
    mkdir -p "$work/base-tree" "$cache"
    git -C "$root" archive "$rev" | tar -x -C "$work/base-tree"
    compile "$work/base-tree" "$work/base"
    cp "$work/base/table" "$cache/table"
fi
mkdir -p "$work/base" && cp "$cache/table" "$work/base/table"
echo "kernels whose machine code differs from $1 (arch, regs, stack bytes; then / this tree):"
join -j1 <(awk '{print $1"/"$5, $2, $3, $4}' "$work/base/table" | sort) \
         <(awk '{print $1"/"$5, $2, $3, $4}' "$work/now/table" | sort) |
    awk '$4 != $7 { n++; printf "  %s  regs %s -> %s, stack %s -> %s\n", $1, $2, $5, $3, $6 }
         END { if (!n) print "  none: every kernel compiles to the same instructions"; printf "%d kernels compared\n", NR }'
