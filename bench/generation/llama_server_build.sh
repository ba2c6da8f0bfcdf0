#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the peer of bench/generation/vs_llamacpp.py, from the llama-cpp-python sdist
# (which vendors llama.cpp under vendor/llama.cpp) into a bench-only cache outside the repository. Never a zserve
# dependency: nothing but the benchmark reads the binary. Idempotent: an existing binary is kept.
#
#   bench/generation/llama_server_build.sh [PYTHON]     # `make bench-llama-server` runs it with .venv's python
#
# Prints the binary's path on its last line. Environment: LLAMA_CPP_PYTHON_VERSION (default below),
# ZSERVE_LLAMA_CACHE (default ~/.cache/zserve/llama-cpp), LLAMA_BUILD_JOBS (default 2).
set -euo pipefail

PYTHON=${1:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ROOT=${ZSERVE_LLAMA_CACHE:-$HOME/.cache/zserve/llama-cpp}/$VERSION
JOBS=${LLAMA_BUILD_JOBS:-2}
BIN=$ROOT/build/bin/llama-server

if [[ -x $BIN ]]; then
    echo "llama-server already built: $(cat "$ROOT/build-info.txt" 2>/dev/null | head -1)" >&2
    echo "$BIN"
    exit 0
fi

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "installing cmake and g++ from Debian" >&2
    apt-get update -qq && apt-get install -y -qq cmake g++ >&2
fi

mkdir -p "$ROOT"
SDIST=$ROOT/llama_cpp_python-$VERSION.tar.gz
if [[ ! -f $SDIST ]]; then
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$ROOT" >&2
fi
SRC=$ROOT/llama_cpp_python-$VERSION
if [[ ! -f $SRC/vendor/llama.cpp/CMakeLists.txt ]]; then
    tar -xzf "$SDIST" -C "$ROOT" "llama_cpp_python-$VERSION/vendor/llama.cpp" "llama_cpp_python-$VERSION/CHANGELOG.md"
fi
# The sdist has no .git, so llama.cpp's build info would say "unknown": take the commit the binding's changelog
# names for this release.
COMMIT=$(awk -v v="## [$VERSION]" '$0 == v {on = 1; next} on && /^## \[/ {exit} on && match($0, /llama.cpp@[0-9a-f]+/) {
    print substr($0, RSTART + 10, RLENGTH - 10); exit}' "$SRC/CHANGELOG.md")
COMMIT=${COMMIT:-unknown}

# Release, tuned for this CPU (GGML_NATIVE), only the server; no UI download (LLAMA_USE_PREBUILT_UI fetches one at
# build time), no HTTPS, no network code at all.
FLAGS=(
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    "-DLLAMA_BUILD_COMMIT=$COMMIT"
)
echo "building llama-server (llama-cpp-python $VERSION, llama.cpp $COMMIT) in $ROOT/build with -j$JOBS;" \
    "tens of minutes on 2 cores" >&2
cmake -S "$SRC/vendor/llama.cpp" -B "$ROOT/build" "${FLAGS[@]}" >"$ROOT/cmake-configure.log"
cmake --build "$ROOT/build" --target llama-server -j "$JOBS" >"$ROOT/cmake-build.log"
{
    "$BIN" --version 2>&1
    echo "llama-cpp-python $VERSION sdist, llama.cpp commit $COMMIT"
    echo "cmake ${FLAGS[*]}"
    grep -E "GGML_NATIVE|CMAKE_CXX_COMPILER:|CMAKE_BUILD_TYPE" "$ROOT/build/CMakeCache.txt" || true
} >"$ROOT/build-info.txt"
cat "$ROOT/build-info.txt" >&2
echo "$BIN"
