"""What benchmark scripts share: their parser, where they write their JSON, and how they run a configuration in a
fresh worker process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from paperback.cli.common import HelpWithDefaults
from paperback.system import code_version, cpu_facts
from paperback.system import provenance as measured_on

RESULTS = Path(__file__).parent / "results"

# The code a benchmark measures is the tree it started from: a run hours long may see commits land, and its own
# result files change as it writes them.
CODE_AT_START = code_version()


# What a result file kept from before provenance was recorded says about its measurement.
UNRECORDED = {"commit": "unrecorded", "note": "measured before results recorded their provenance"}


def write_results(filename: str | Path, payload: dict, kept_from: dict | None = None, announce: bool = True) -> Path:
    """Write payload as indented JSON under benchmarks/results/ and say where; every result records what it ran
    on (`provenance`: command, commit, CPU, threads, kernel path, date), added here where the script did not.
    A Path is written where it points (a script's --output); a name, under benchmarks/results/.

    kept_from: the earlier file's payload, for a run that keeps some of its parts (cells not re-measured, parts
    not run): this run becomes the file's `provenance`, and the runs the kept parts came from are listed under
    `earlier_runs` (an old file without provenance as UNRECORDED), so no figure is credited to a run that did
    not measure it.
    """
    if kept_from:
        earlier = [*kept_from.get("earlier_runs", []), kept_from.get("provenance", UNRECORDED)]
        payload = {k: v for k, v in payload.items() if k not in ("provenance", "earlier_runs")}
        payload["earlier_runs"] = [run for i, run in enumerate(earlier) if run not in earlier[:i]]
    if "provenance" not in payload:
        threads = payload.get("threads")
        payload = {"provenance": provenance(threads if isinstance(threads, int) else None), **payload}
    out = filename if isinstance(filename, Path) else RESULTS / filename
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    if announce:
        print(f"wrote {out}")
    return out


def read_results(filename: str) -> dict:
    """The payload of an earlier result file under benchmarks/results/ ({} when there is none): what a run that
    extends it passes back to write_results as `kept_from`."""
    path = RESULTS / filename
    return json.loads(path.read_text()) if path.is_file() else {}


class BenchmarkHelp(argparse.RawDescriptionHelpFormatter, HelpWithDefaults):
    """A benchmark's --help: its docstring as written, and every option's default, as paperback's commands show."""


def benchmark_parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=BenchmarkHelp)


def add_tag_arg(parser) -> None:
    parser.add_argument("--tag", default="", help="suffix of the JSON's name: one machine's results kept beside "
                                                  "another's")


def results_name(stem: str, tag: str) -> str:
    """`stem`.json, or `stem`_`tag`.json."""
    return f"{stem}_{tag}.json" if tag else f"{stem}.json"


def run_worker(argv: list[str], what: str) -> dict:
    """Run `python argv...` in a fresh process and return the JSON object its last stdout line holds.

    A worker that fails stops the benchmark with the end of its stderr: a half-measured table is worse than none.
    """
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"worker {what} failed")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
SIGSEGV = -11


def run_llamacpp_peer(script: str, args: list[str]) -> dict:
    """Run benchmarks/peers/<script> in llama.cpp's environment; the JSON object its last stdout line holds.

    Where llama.cpp's own weight repacking crashes it (its AMX matmul on Sapphire Rapids:
    ggml-org/llama.cpp#20824), the run is repeated without it, and the result says so
    ("extra_bufts": False); a failure of any other kind stops the benchmark with llama.cpp's stderr.
    """
    command = [str(LLAMACPP_PYTHON), str(ROOT / "benchmarks" / "peers" / script), *args]
    proc = subprocess.run(command, capture_output=True, text=True)
    extra_bufts = True
    if proc.returncode == SIGSEGV:
        print(f"llama.cpp crashed with its weight repacking on ({script}); rerunning with --no-extra-bufts",
              file=sys.stderr)
        proc = subprocess.run(command + ["--no-extra-bufts"], capture_output=True, text=True)
        extra_bufts = False
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"llama.cpp failed: {' '.join(args[:1])} (its stderr is above)")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "extra_bufts": extra_bufts}


def warn_if_busy(own_threads: int = 0) -> float:
    """Warn on stderr when other work shares the machine; returns the 1-minute load average.

    Call it before the measurements (own_threads=0) and again before printing
    the table (own_threads: the threads this benchmark keeps busy, which the
    average then includes). Timings and even ratios drift on a shared host
    (OpenMP peers collapse when oversubscribed), so a table measured under
    load says so.
    """
    import os

    load = os.getloadavg()[0]
    if load > own_threads + 0.5:
        mine = f"this benchmark keeps {own_threads} busy" if own_threads else "before this benchmark starts"
        print(f"warning: load average {load:.2f} on {os.cpu_count()} cores ({mine}); other work is running and "
              "the timings are disturbed", file=sys.stderr)
    return load


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else the platform's processor string, or "unknown")."""
    return cpu_facts()["model"]


def provenance(threads: int | None) -> dict:
    """What a result was measured on: command line, git commit (as the run began), CPU, threads, kernel path,
    date (UTC)."""
    return measured_on(threads, commit=CODE_AT_START)