"""What runs on this machine: the C kernels built or not (and why), the SIMD path they take, threads, torch's build.

paperback's speed rests on three C extensions built at install (setup.py). Each is optional, so an install without
a compiler still works, but far slower: this module names what is missing, once, on stderr, and `paperback info
--system` prints the whole picture (`--json` too). Benchmarks record `kernel_summary()` beside their results.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch  # first: the extensions share torch's OpenMP runtime


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str
    without: str  # what runs in its place


KERNELS = (
    Kernel("packed weights", "paperback.kernels._qkernel",
           "quantized layers dequantize through the PyTorch reference path on every call"),
    Kernel("paged attention", "paperback.kernels._paged_kernel",
           "decode reads the paged KV pool through PyTorch one sequence at a time"),
    Kernel("fused decode", "paperback.kernels._fused_decode",
           "decode steps run layer by layer in PyTorch"),
)
FIX = "reinstall with a C compiler (gcc) on PATH: bash scripts/setup.sh, or pip install -e ."
# CPU features the kernels' wider paths use (from /proc/cpuinfo's flags)
SIMD_FLAGS = ("avx2", "f16c", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi",
              "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

_warned = False


@dataclass
class KernelStatus:
    name: str
    module: str
    built: bool
    error: str | None  # why it does not import
    without: str

    def to_dict(self) -> dict:
        return asdict(self)


def kernel_status() -> list[KernelStatus]:
    statuses = []
    for kernel in KERNELS:
        try:
            importlib.import_module(kernel.module)
            built, error = True, None
        except ImportError as exc:
            built, error = False, str(exc)
        statuses.append(KernelStatus(kernel.name, kernel.module, built, error, kernel.without))
    return statuses


def missing_kernels() -> list[KernelStatus]:
    return [k for k in kernel_status() if not k.built]


def simd_level() -> str:
    """The code path of the packed-weight kernel: 'amx', 'avx512vnni', 'avx512', 'avxvnni', 'avx2', 'portable', or
    'unavailable' (not built)."""
    from paperback.kernels.packed import kernel_simd

    return kernel_simd()


def read_cpuinfo() -> tuple[str, str]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("unknown", "") where it cannot be read."""
    model, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return model, flags


def cpu_facts() -> dict:
    model, flags = read_cpuinfo()
    present = set(flags.split())
    return {"model": model if model != "unknown" else platform.processor() or model, "cores": os.cpu_count(),
            "simd_flags": [f for f in SIMD_FLAGS if f in present]}


def kernel_settings() -> dict:
    from paperback.kernels.settings import settings

    return settings.to_dict()


def kernel_summary() -> dict:
    """What a results JSON records of the kernels: the SIMD path, which extensions were built, their settings."""
    return {"simd": simd_level(), "simd_cap": kernel_settings()["simd"],
            "built": {k.name: k.built for k in kernel_status()}, "settings": kernel_settings()}


def system_report() -> dict:
    import paperback

    return {"paperback": paperback.__version__, "python": sys.version.split()[0],
            "torch": {"version": torch.__version__,
                      "build": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only",
                      "cuda_available": torch.cuda.is_available()},
            "cpu": cpu_facts(), "threads": torch.get_num_threads(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "simd": simd_level(), "simd_cap": kernel_settings()["simd"],
            "kernels": [k.to_dict() for k in kernel_status()], "kernel_settings": kernel_settings()}


def warn_missing_kernels() -> None:
    """Once per process, on stderr: each kernel not built, the slower path taken instead, and the fix."""
    global _warned
    if _warned:
        return
    _warned = True
    for kernel in missing_kernels():
        print(f"paperback: warning: the {kernel.name} kernel is not built ({kernel.error}): {kernel.without}, "
              f"far slower; {FIX}", file=sys.stderr)


def require_kernels() -> None:
    """Exit non-zero naming every kernel that does not import (scripts/setup.sh calls it after installing)."""
    missing = missing_kernels()
    for kernel in missing:
        print(f"error: paperback's {kernel.name} kernel ({kernel.module}) does not import: {kernel.error}",
              file=sys.stderr)
    if missing:
        raise SystemExit(f"paperback installed without {len(missing)} of its C kernels: without them "
                         f"{missing[0].without}. Install gcc (and the Python headers), then {FIX}")


# Files that do not change what is measured: the results a run writes (and their plots), and the pages that
# describe them. Changed there, the measured code is not dirty.
NOT_CODE = (":(exclude)benchmarks/results", ":(exclude)*.md")


def code_version(root: Path | None = None) -> str:
    """The git commit of paperback's tree (or the checkout at `root`), with "+dirty" where tracked code (results
    and pages aside) differs from it; "unknown" outside a checkout."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                     *NOT_CODE], cwd=root, capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def provenance(threads: int | None = None, argv: list[str] | None = None, commit: str | None = None) -> dict:
    """What a measured result ran on: its command line, the code's commit (`code_version()`, or `commit` as read
    when the run began: a long run's code is what it started with), the CPU, cores, threads, the kernels' path,
    and the date (UTC)."""
    import datetime

    argv = sys.argv if argv is None else argv
    return {"command": " ".join([Path(argv[0]).name, *argv[1:]]), "commit": commit or code_version(),
            "cpu": cpu_facts()["model"], "cores": os.cpu_count(),
            "threads": threads if threads is not None else torch.get_num_threads(), "kernels": kernel_summary(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
