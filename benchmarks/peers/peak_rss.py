"""A child process's own peak RSS.

Linux carries a process's high-water mark across execve: the peak that wait4 reports for a child
(ru_maxrss) starts from its parent's, since the child began as a copy of (or a borrower of) the parent's
memory. A benchmark that has built a 1B model in memory would read its own peak as every server's. The
memory a child maps after exec has its own mark (VmHWM in /proc/PID/status), which this samples until
the child exits; where wait4's figure is above the parent's peak it is the child's own, and exact.
"""

from __future__ import annotations

import resource
import threading
from pathlib import Path

SAMPLE_EVERY_S = 0.05


def high_water_mark(pid: int) -> int | None:
    """The process's VmHWM in bytes (None once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRSS:
    """Samples a started child's VmHWM until `result` is asked for (after the child has exited)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.sampled = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name=f"peak-rss-{pid}")
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            value = high_water_mark(self.pid)
            if value is None:
                return
            self.sampled = max(self.sampled, value)
            self._done.wait(SAMPLE_EVERY_S)

    def result(self, usage=None) -> int:
        """The child's own peak in bytes: wait4's `usage` where it exceeds what the parent had reached when
        the child started (then it cannot be the parent's), else the highest VmHWM sampled."""
        self._done.set()
        self._thread.join()
        reported = usage.ru_maxrss * 1024 if usage is not None else 0
        return reported if reported > self.parent_peak else self.sampled
