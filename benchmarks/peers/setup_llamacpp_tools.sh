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
cmake -S "$SRC" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF > "$DEST/cmake.log"
cmake --build "$DEST/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" --target "${TOOLS[@]}"
for tool in "${TOOLS[@]}"; do
  cp "$DEST/build/bin/$tool" "$DEST/bin/$tool"
done
# The CPU the build is native to: a later session on another CPU rebuilds (benchmarks check it).
grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //' > "$DEST/bin/BUILT_FOR_CPU"
echo "$VERSION" > "$DEST/bin/VERSION"
"$DEST/bin/llama-quantize" --help 2>&1 | head -1 || true
echo "llama.cpp's tools are in $DEST/bin (llama-cpp-python $VERSION's llama.cpp, built for $(cat "$DEST/bin/BUILT_FOR_CPU"))"
