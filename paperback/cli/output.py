"""Human tables (rich) on stdout by default, JSON for scripts; progress goes to stderr."""

from __future__ import annotations

import contextlib
import json
import sys
import time

from rich.console import Console
from rich.table import Table

# Piped output keeps whole tables instead of wrapping them at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[str(c) for c in r])
    console.print(table)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    err_console.print(message, style="dim")


@contextlib.contextmanager
def stage(message: str):
    """A spinner on a terminal; in a log, a line when the stage starts and one when it ends."""
    if console.is_terminal:
        with console.status(message):
            yield
        return
    started = time.perf_counter()
    print(f"[paperback] {message} ...", file=sys.stderr, flush=True)
    yield
    print(f"[paperback] {message}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
