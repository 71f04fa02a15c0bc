#!/usr/bin/env bash
# llama.cpp's own command-line tools (.llamacpp-tools/bin): llama-quantize, llama-imatrix,
# llama-perplexity, llama-bench, llama-batched-bench and llama-server, compiled natively for this CPU from the
# llama.cpp tree vendored in the llama-cpp-python==0.3.36 source package (the pin
# setup_llamacpp.sh uses). Benchmarks and tests marked `llamacpp` use them; the default
# tests never do. About 10 minutes on 2 cores. Rerun after a change of CPU: the build is native.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VERSION=0.3.36
DEST=$PWD/.llamacpp-tools
TOOLS=(llama-quantize llama-imatrix llama-perplexity llama-bench llama-batched-bench llama-server)
SRC=$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir -p "$DEST/src" "$DEST/bin"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  "$PYTHON" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$DEST/src"
  tar xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
fi
# Native SIMD (AVX2, AVX-512, VNNI, AMX: what this CPU has); static so the tools need no
# library path; no network features (no curl, no TLS, no web UI fetched at build time).
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF)
build() {  # build DIR CMAKE-ARGS...: the tools into DIR/bin
  local dir=$1; shift
  cmake -S "$SRC" -B "$dir" "${COMMON[@]}" "$@" > "$dir.cmake.log"
  cmake --build "$dir" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" --target "${TOOLS[@]}"
}
# A 64-token prompt through llama-bench on the bundled SmolLM2 file (Q4_1: a type ggml's AMX path takes).
smoke() {
  local model
  model=$("$PYTHON" -c "from paperback.loading import resolve_model; print(resolve_model('smollm2').path)") || return 0
  "$1/bin/llama-bench" -m "$model" -p 64 -n 0 -r 1 -t 2 > /dev/null 2>&1
}
build "$DEST/build" -DGGML_NATIVE=ON
BUILT="$DEST/build"
NOTE=""
if ! smoke "$DEST/build" && grep -qw amx_int8 /proc/cpuinfo; then
  # On some virtual machines that report AMX, ggml's AMX matmul dies with SIGILL at its first tile load
  # (its tile configuration is set once per thread and found gone). Such a machine's llama.cpp users build
  # without AMX: every other SIMD level of this CPU, listed, since -march=native would bring AMX back.
  echo "llama.cpp's native build dies on this CPU (its AMX path); building it again without AMX" >&2
  build "$DEST/build-noamx" -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  smoke "$DEST/build-noamx" || { echo "llama.cpp's tools fail on this CPU even without AMX" >&2; exit 1; }
  BUILT="$DEST/build-noamx"
  NOTE=" (AMX off: ggml's AMX path dies with SIGILL here)"
fi
for tool in "${TOOLS[@]}"; do
  cp "$BUILT/bin/$tool" "$DEST/bin/$tool"
done
# The CPU the build is native to: a later session on another CPU rebuilds (benchmarks check it).
echo "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')$NOTE" > "$DEST/bin/BUILT_FOR_CPU"
echo "$VERSION" > "$DEST/bin/VERSION"
"$DEST/bin/llama-quantize" --help 2>&1 | head -1 || true
echo "llama.cpp's tools are in $DEST/bin (llama-cpp-python $VERSION's llama.cpp, built for $(cat "$DEST/bin/BUILT_FOR_CPU"))"
