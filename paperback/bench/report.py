"""Run each engine in its own process and put them side by side with the roofline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from paperback.bench.engines import BenchConfig
from paperback.bench.roofline import DecodeRoofline, measure_read_bandwidth
from paperback.errors import PaperbackError

RESULT_PREFIX = "PAPERBACK_RESULT "
BANDWIDTH_PROBES = 2


def run_in_worker(engine: str, cfg: BenchConfig) -> dict:
    cmd = [sys.executable, "-m", "paperback.bench.worker", engine, json.dumps(cfg.to_dict())]
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise PaperbackError(f"the {engine} bench worker failed: {tail}")


def fresh_process_bandwidth(threads: int | None = None) -> float:
    """Read bandwidth measured in a new process: a long-lived one's fragmented heap
    (no transparent huge pages) reads measurably slower than the machine can. `threads`:
    read with that many threads (one core cannot pull what the machine can); default all."""
    code = "from paperback.bench.roofline import measure_read_bandwidth as m; print(m())"
    if threads is not None:
        code = f"import torch; torch.set_num_threads({int(threads)}); " + code
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return float(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return measure_read_bandwidth()


def run_bench(cfg: BenchConfig, peers: tuple[str, ...] = ("transformers",),
              on_step: Callable[[str], None] | None = None) -> dict:
    """Run paperback and each peer in turn; `on_step` hears what is starting."""
    if on_step:
        on_step("measuring memory bandwidth")
    # Measured in fresh processes before and after the workers: readings here are bimodal
    # (about 45 or 70 GB/s from one process to the next), and the best is the physical limit.
    bandwidth = max(fresh_process_bandwidth() for _ in range(BANDWIDTH_PROBES))
    results = {}
    for engine in ("paperback", *peers):
        if on_step:
            on_step(f"running the {engine} worker")
        results[engine] = run_in_worker(engine, cfg)
    bandwidth = max(bandwidth, *(fresh_process_bandwidth() for _ in range(BANDWIDTH_PROBES)))
    facts = results["paperback"]["model"]
    rooflines = {}
    for batch in cfg.batches:
        weights = facts.get("weight_bytes_read_per_step_by_batch", {}).get(str(batch),
                                                                          facts["weight_bytes_read_per_step"])
        roof = DecodeRoofline(batch, facts["decode_context"], weights,
                              facts["kv_bytes_read_per_step"], bandwidth)
        rooflines[str(batch)] = roof.to_dict()
    from paperback.system import cpu_facts, kernel_summary, provenance

    return {"provenance": provenance(results["paperback"]["threads"]),
            "config": cfg.to_dict(), "engines": results, "bandwidth_bytes_per_s": bandwidth,
            "roofline": rooflines, "cpu": cpu_facts(), "kernels": kernel_summary()}


def bench_rows(report: dict) -> list[list[str]]:
    """Rows: metric, each engine, ratio paperback / first peer, roofline."""
    engines = report["engines"]
    names = list(engines)
    peer = names[1] if len(names) > 1 else None

    def row(label, values, fmt, higher_is_better=True, roof=""):
        cells = [label] + [fmt.format(v) for v in values]
        if peer is not None:
            ratio = values[0] / values[1] if higher_is_better else values[1] / values[0]
            cells.append(f"{ratio:.2f}x")
        return cells + [roof]

    rows = [row("prefill tokens/s", [engines[n]["prefill_tokens_per_s"] for n in names], "{:.1f}")]
    for batch in report["config"]["batches"]:
        key = str(batch)
        roof = report["roofline"][key]["max_tokens_per_s"]
        rows.append(row(f"decode tokens/s, batch {batch}",
                        [engines[n]["decode"][key]["decode_tokens_per_s"] for n in names], "{:.1f}",
                        roof=f"{roof:.1f}"))
    first = str(min(report["config"]["batches"]))  # the smallest batch run (batch 1 unless --batch left it out)
    rows.append(row(f"time to first token (s), batch {first}",
                    [engines[n]["decode"][first]["time_to_first_token_s"] for n in names], "{:.3f}",
                    higher_is_better=False))
    rows.append(row("peak RSS (MiB)", [engines[n]["peak_rss_bytes"] / 2**20 for n in names], "{:.0f}",
                    higher_is_better=False))
    rows.append(row("load time (s)", [engines[n]["load_s"] for n in names], "{:.1f}", higher_is_better=False))
    return rows


def bench_columns(report: dict) -> list[str]:
    names = list(report["engines"])
    cols = ["metric"] + names
    if len(names) > 1:
        cols.append(f"paperback vs {names[1]}")
    return cols + ["roofline bound"]
