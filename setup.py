"""Builds the packed-weight CPU kernel; everything else is in pyproject.toml.

The extension is plain C against the CPython API (no torch headers), so it
builds in pip's isolated environment. It is optional: without a compiler the
install still succeeds and QuantLinear falls back to its PyTorch reference
path (paperback says so once at run time).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "paperback.quantization._qkernel",
            sources=["paperback/quantization/_qkernel.c"],
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
