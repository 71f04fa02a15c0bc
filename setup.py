"""Builds the packed-weight, paged-attention and fused-decode CPU kernels; everything else is in pyproject.toml.

The extensions are plain C against the CPython API (no torch headers), so
they build in pip's isolated environment. All are optional: without a
compiler the install still succeeds, QuantLinear falls back to its PyTorch
reference path (paperback says so once at run time), decode tokens read
the paged KV pool through PyTorch one sequence at a time, and decode steps
run layer by layer in PyTorch.
"""

from setuptools import Extension, setup


HEADERS = ["paperback/kernels/_qkernel.h", "paperback/kernels/_paged_kernel.h", "paperback/kernels/_sum16.h"]


def c_kernel(module: str) -> Extension:
    """paperback.x.y from paperback/x/y.c: OpenMP, optional (a failed build leaves the PyTorch path)."""
    return Extension(module, sources=[module.replace(".", "/") + ".c"], depends=HEADERS,
                     extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"],
                     extra_link_args=["-fopenmp"], optional=True)


# _fused_decode calls the other two through their capsules (_qkernel.h, _paged_kernel.h) at run time.
setup(ext_modules=[c_kernel("paperback.kernels._qkernel"), c_kernel("paperback.kernels._paged_kernel"),
                   c_kernel("paperback.kernels._fused_decode")])
