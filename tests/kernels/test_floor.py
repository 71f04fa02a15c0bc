"""The kernel floor: the C extensions' bindings and settings import nothing of paperback above them, the models
import nothing above the floor, and the kernels' switches are one object read from the environment once."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from paperback.errors import PaperbackError
from paperback.kernels.settings import ENVIRONMENT, KernelSettings

PACKAGE = Path(__file__).resolve().parents[2] / "paperback"


def paperback_imports(path: Path) -> set[str]:
    """Every paperback module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paperback"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("paperback"))
    return found


@pytest.mark.parametrize("package, allowed", [
    ("kernels", ("paperback.kernels", "paperback.errors")),
    ("models", ("paperback.models", "paperback.kernels", "paperback.errors")),
])
def test_nothing_below_imports_upward(package, allowed):
    for path in sorted((PACKAGE / package).glob("*.py")):
        upward = {m for m in paperback_imports(path) if not m.startswith(allowed)}
        assert not upward, f"{path.name} imports {sorted(upward)}"


def test_the_extensions_live_in_the_floor():
    sources = {p.name for p in PACKAGE.rglob("*.[ch]")}
    assert {"_qkernel.c", "_paged_kernel.c", "_fused_decode.c", "_sum16.h"} <= sources
    assert all(p.parent.name == "kernels" for p in PACKAGE.rglob("*.[ch]"))


def test_settings_come_from_the_environment_and_bad_values_are_named():
    assert KernelSettings.from_environ({}) == KernelSettings()
    env = {"PAPERBACK_QKERNEL": "0", "PAPERBACK_FUSED_DECODE": "0", "PAPERBACK_SIMD": "avx2",
           "PAPERBACK_DECODE_ACTIVATIONS": "int8", "PAPERBACK_PREFILL_MATMUL": "bf16", "PAPERBACK_KV_SCORES": "int8"}
    assert KernelSettings.from_environ(env) == KernelSettings(False, False, "avx2", "int8", "bf16", "int8")
    assert set(ENVIRONMENT.values()) == set(env)  # one variable per field, each read here
    with pytest.raises(PaperbackError, match="PAPERBACK_PREFILL_MATMUL must be one of fp32, bf16, got 'fp16'"):
        KernelSettings.from_environ({"PAPERBACK_PREFILL_MATMUL": "fp16"})


def test_the_process_settings_are_what_its_environment_said():
    code = "from paperback.kernels.settings import settings; print(settings.fused_decode, settings.prefill_matmul)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PAPERBACK_FUSED_DECODE": "0",
                              "PAPERBACK_PREFILL_MATMUL": "bf16"}).stdout
    assert out.split() == ["False", "bf16"]
