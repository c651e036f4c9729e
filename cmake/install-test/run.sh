#!/usr/bin/env bash
# Installs a built flashc into a fresh prefix and links main.c against it the ways README.md shows, the way a
# project outside the tree would: the shared library through pkg-config (rpath), the static library through
# `pkg-config --static`, and both through find_package(flashc) in a CMake project. Each program runs one CPU
# attention (no GPU needed); the static ones must not need libflashc.so or libcudart.so at run time.
#   usage: cmake/install-test/run.sh BUILD_DIR [PREFIX]      (make test-install BUILD=...)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run.sh BUILD_DIR [PREFIX]}
work=$(mktemp -d "${TMPDIR:-/tmp}/flashc-install-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=${2:-$work/prefix} # removed at the end unless given
CC=${CC:-cc}

cmake --install "$build" --prefix "$prefix" > "$work/install.log"
libdir=$(ls -d "$prefix"/lib*/pkgconfig | head -n 1)
libdir=${libdir%/pkgconfig}
export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
echo "== installed into $prefix; pkg-config --static --libs flashc: $(pkg-config --static --libs flashc)"

# A static program must not load libflashc.so or the CUDA runtime's shared library.
static_ok() {
  if ldd "$1" | grep -E 'libflashc\.so|libcudart\.so'; then echo "$1: still needs the shared libraries above"; exit 1; fi
}

echo "== pkg-config, shared (rpath)"
# shellcheck disable=SC2046
"$CC" "$here/main.c" -o "$work/pc_shared" $(pkg-config --cflags --libs flashc) -lm \
  -Wl,-rpath,"$(pkg-config --variable=libdir flashc)"
"$work/pc_shared"

echo "== pkg-config --static"
# -l:libflashc.a picks the archive where libflashc.so lies beside it.
# shellcheck disable=SC2046
"$CC" "$here/main.c" -o "$work/pc_static" $(pkg-config --cflags flashc) \
  $(pkg-config --static --libs flashc | sed 's/-lflashc\b/-l:libflashc.a/') -lm
static_ok "$work/pc_static"
"$work/pc_static"

echo "== find_package(flashc): flashc::flashc and flashc::flashc_static"
cmake -S "$here" -B "$work/cm" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release > "$work/cm.log" ||
  { cat "$work/cm.log"; exit 1; }
cmake --build "$work/cm" > "$work/cm-build.log" 2>&1 || { cat "$work/cm-build.log"; exit 1; }
"$work/cm/consumer_shared"
static_ok "$work/cm/consumer_static"
"$work/cm/consumer_static"
echo "== all linked and ran"
