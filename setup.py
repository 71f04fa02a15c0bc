"""Builds the packed-weight and paged-attention CPU kernels; everything else is in pyproject.toml.

The extensions are plain C against the CPython API (no torch headers), so
they build in pip's isolated environment. Both are optional: without a
compiler the install still succeeds, QuantLinear falls back to its PyTorch
reference path (paperback says so once at run time) and decode tokens read
the paged KV pool through PyTorch one sequence at a time.
"""

from setuptools import Extension, setup


def c_kernel(module: str) -> Extension:
    """paperback.x.y from paperback/x/y.c: OpenMP, optional (a failed build leaves the PyTorch path)."""
    return Extension(module, sources=[module.replace(".", "/") + ".c"],
                     extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"],
                     extra_link_args=["-fopenmp"], optional=True)


setup(ext_modules=[c_kernel("paperback.quantization._qkernel"), c_kernel("paperback.engine._paged_kernel")])
