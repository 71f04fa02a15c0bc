#!/usr/bin/env bash
# The peer tools' own environment (.venv-peer): llm-compressor pins a different
# transformers than paperback, so it cannot share .venv. torch comes first,
# pinned to the same CPU build, so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
[ -x .venv-peer/bin/python ] || "$PYTHON" -m venv .venv-peer
pip() { .venv-peer/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install llmcompressor==0.14.0.1 gguf==0.19.0 sentencepiece==0.2.3
echo "peer tools are set up in .venv-peer"
