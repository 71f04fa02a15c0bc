"""A child's peak RSS is its own, not the high-water mark it inherits from a large parent."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))
from peak_rss import PeakRSS  # noqa: E402

MIB = 2 ** 20


def test_a_small_child_of_a_large_parent_reads_as_small():
    ballast = bytearray(b"x") * (400 * MIB)  # written, so resident: the parent's mark is above 400 MiB
    child = [sys.executable, "-c", "import time; x = bytearray(b'y') * (64 << 20); time.sleep(0.5)"]
    proc = subprocess.Popen(child)
    rss = PeakRSS(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert usage.ru_maxrss * 1024 > 400 * MIB  # what wait4 says: the parent's mark, carried across exec
    own = rss.result(usage)
    assert 64 * MIB < own < 200 * MIB
    del ballast


def test_a_child_larger_than_its_parent_is_read_from_wait4():
    """Above the parent's mark wait4's figure is the child's own and exact, a peak at its very end included
    (after the last sample). The parent here is small: forked from a fresh interpreter (a forked process's
    mark starts from its own pages, not from the marks its ancestors carried across exec)."""
    parent = f"""
import os, subprocess, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers")!r})
from peak_rss import PeakRSS
if os.fork() == 0:
    proc = subprocess.Popen([sys.executable, "-c", "x = bytearray(b'y') * (256 << 20)"])
    rss = PeakRSS(proc.pid)
    _, _, usage = os.wait4(proc.pid, 0)
    print(rss.result(usage), usage.ru_maxrss * 1024, rss.parent_peak, flush=True)
    os._exit(0)
os.wait()
"""
    own, reported, parent_peak = map(int, subprocess.check_output([sys.executable, "-c", parent]).split())
    assert parent_peak < 128 * MIB and own == reported > 256 * MIB
