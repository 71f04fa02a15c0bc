"""llama.cpp itself loads paperback's GGUF exports: WikiText-2 perplexity within 1% of paperback's (16 windows of
512 tokens; at 4 windows one window's noise alone can pass 1%).

Needs llama.cpp's environment (`bash benchmarks/peers/setup_llamacpp.sh`, about 30 minutes of compiling),
so it is outside the default suite: run it with `.venv/bin/python -m pytest -m llamacpp`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.llamacpp, pytest.mark.slow,
              pytest.mark.skipif(not (ROOT / ".venv-llamacpp" / "bin" / "python").exists(),
                                 reason="llama.cpp's environment is not built (benchmarks/peers/setup_llamacpp.sh)")]


def test_llamacpp_scores_the_q4_0_and_q4_1_exports_as_paperback_does(tmp_path):
    out = tmp_path / "gguf.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gguf_export.py"), "--rows",
                           "rtn-w4a-g64", "rtn-w4s-g32", "--windows", "16", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"rtn-w4a-g64", "rtn-w4s-g32"}
    for row in rows.values():
        assert abs(row["llamacpp"] / row["paperback"] - 1) <= 0.01, row
        # paperback reads its own export back: Q4_1's fp16 offsets are the one rounding
        assert abs(row["paperback_on_export"] / row["paperback"] - 1) <= 2e-3, row
