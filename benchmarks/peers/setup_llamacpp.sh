#!/usr/bin/env bash
# llama.cpp's own environment (.venv-llamacpp): llama-cpp-python compiles llama.cpp
# from source (about 30 minutes on 2 cores), so it lives apart from .venv and is used
# only by benchmarks/bench_gguf_export.py and the tests marked `llamacpp`.
# numpy is all the checker needs beside it; paperback itself runs in .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
[ -x .venv-llamacpp/bin/python ] || "$PYTHON" -m venv .venv-llamacpp
pip() { .venv-llamacpp/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Native build: llama.cpp picks the widest SIMD this CPU has (AVX2, AVX-512, VNNI).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"}
pip install numpy==2.4.6
pip install --no-cache-dir llama-cpp-python==0.3.36
echo "llama.cpp is set up in .venv-llamacpp ($(.venv-llamacpp/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)'))"
