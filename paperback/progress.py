"""Progress on long work: a bar on a terminal, and where stderr is a log, a line when a stage starts, a line every
half minute while it runs, and a line when it ends (a bar there would be silent: tqdm hides itself off a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from tqdm.auto import tqdm

LINE_EVERY_S = 30.0


class StageLines:
    """tqdm's interface (iterate, update, close) printing lines instead of redrawing a bar."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it"):
        self.iterable, self.desc, self.unit, self.n = iterable, desc, unit, 0
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.started = self.said = time.perf_counter()
        self.closed = False
        self._say(f"{self.total if self.total is not None else 'some'} {unit}s")

    def _say(self, what: str) -> None:
        print(f"[paperback] {self.desc}: {what}", file=sys.stderr, flush=True)
        self.said = time.perf_counter()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.perf_counter() - self.said >= LINE_EVERY_S:
            of = f"/{self.total}" if self.total is not None else ""
            self._say(f"{self.n}{of} {self.unit}s, {time.perf_counter() - self.started:.0f} s")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._say(f"done: {self.n} {self.unit}s in {time.perf_counter() - self.started:.1f} s")


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             enabled: bool = True):
    """A tqdm bar on a terminal, StageLines in a log, nothing when not `enabled`."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)
    return StageLines(iterable, total, desc, unit)
