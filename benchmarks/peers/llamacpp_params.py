"""llama.cpp's model parameters as the peer scripts need them (runs in .venv-llamacpp).

`--no-extra-bufts` loads the weights without llama.cpp's extra buffer types
(its weight repacking: the AMX buffer on Sapphire Rapids, the interleaved
CPU layouts elsewhere). llama.cpp's AMX matmul crashes on the Sapphire Rapids
machines here (ggml-org/llama.cpp#20824: segfault in ggml_backend_amx_mul_mat,
open), so the benchmarks fall back to its plain AVX-512 VNNI kernels there and
say so. llama-cpp-python's Llama() does not expose the field, hence the patch
of its default parameters.
"""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama


def disable_extra_buffer_types() -> None:
    """Every Llama() from now on loads with use_extra_bufts = False."""
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params
