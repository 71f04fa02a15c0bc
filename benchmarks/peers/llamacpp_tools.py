"""llama.cpp's own command-line tools (built by benchmarks/peers/setup_llamacpp_tools.sh) as the benchmarks call them.

Each call runs the tool once and parses what it prints. Where llama.cpp's weight repacking kills a tool on this
CPU (its AMX path: an illegal instruction or a segfault on the Sapphire Rapids machines here,
ggml-org/llama.cpp#20824), the call is repeated with `--no-repack` and the result says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from peak_rss import PeakRSS

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".llamacpp-tools" / "bin"
CRASHES = (-4, -11)  # SIGILL, SIGSEGV


def tool(name: str) -> Path:
    path = TOOLS / name
    if not path.is_file():
        raise SystemExit(f"{path} is not built: run `bash benchmarks/peers/setup_llamacpp_tools.sh` (about 15 "
                         "minutes on 2 cores)")
    return path


def built_for() -> str:
    marker = TOOLS / "BUILT_FOR_CPU"
    return marker.read_text().strip() if marker.is_file() else "unknown"


def _measured(argv: list[str]) -> tuple[int, str, int]:
    """(exit status, stdout + stderr, the process's own peak RSS in bytes) of one run."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        rss = PeakRSS(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), rss.result(usage)


def _run(argv: list, what: str, repack_flag: str | None = None, with_rss: bool = False):
    """(combined output, whether repacking stayed on[, peak RSS bytes]) of one tool run; SystemExit with its
    tail on failure."""
    code, output, rss = _measured([str(a) for a in argv])
    repack = True
    if code in CRASHES and repack_flag:
        code, output, rss = _measured([str(a) for a in argv] + repack_flag.split())
        repack = False
    if code:
        raise SystemExit(f"{what} failed ({code}):\n{output[-3000:]}")
    return (output, repack, rss) if with_rss else (output, repack)


def quantize(source: Path, out: Path, recipe: str, imatrix: Path | None = None, threads: int = 2) -> None:
    argv = [tool("llama-quantize")] + (["--imatrix", imatrix] if imatrix else []) + [source, out, recipe, threads]
    _run(argv, f"llama-quantize {recipe}")


def importance_matrix(model: Path, text: Path, out: Path, context: int, threads: int) -> None:
    _run([tool("llama-imatrix"), "-m", model, "-f", text, "-c", context, "-t", threads, "-o", out],
         "llama-imatrix", "-nr")


def kld_base(model: Path, text: Path, base: Path, context: int, chunks: int, threads: int) -> dict:
    """Saves the reference's logits on `text` to `base`; returns its perplexity."""
    output, repack = _run([tool("llama-perplexity"), "-m", model, "-f", text, "-c", context, "--chunks", chunks,
                           "-t", threads, "--kl-divergence-base", base], "llama-perplexity (base)", "-nr")
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    return {"perplexity": float(found.group(1)), "repack": repack}


def kld(model: Path, text: Path, base: Path, context: int, chunks: int, threads: int) -> dict:
    """llama-perplexity --kl-divergence of `model` against the logits in `base`: mean KLD, perplexity,
    same-top-token rate."""
    output, repack = _run([tool("llama-perplexity"), "-m", model, "-f", text, "-c", context, "--chunks", chunks,
                           "-t", threads, "--kl-divergence-base", base, "--kl-divergence"],
                          f"llama-perplexity --kl-divergence {Path(model).name}", "-nr")

    def number(label: str) -> float:
        found = re.search(rf"^{re.escape(label)}\s*:\s*([-0-9.]+)", output, re.MULTILINE)
        if found is None:
            raise SystemExit(f"llama-perplexity printed no '{label}' for {model}")
        return float(found.group(1))

    return {"kld": number("Mean    KLD"), "perplexity": number("Mean PPL(Q)"),
            "same_top_p": number("Same top p") / 100, "repack": repack}


def speed(model: Path, threads: int, prompt: int = 512, generate: int = 128, repetitions: int = 3,
          depth: int = 0) -> dict:
    """llama-bench on `model`: prompt processing of `prompt` tokens (from an empty cache) and generation of
    `generate` tokens after `depth` tokens of context, tokens/s (mean and standard deviation over `repetitions`
    runs), and the tool's peak RSS."""
    found, repacks, rss = {}, [], 0
    tests = [("prompt", ["-p", prompt, "-n", 0]), ("generate", ["-p", 0, "-n", generate, "-d", depth])]
    if not depth:  # one call runs both
        tests = [("both", ["-p", prompt, "-n", generate])]
    for _, flags in tests:
        output, repack, peak = _run([tool("llama-bench"), "-m", model, *flags, "-t", threads, "-r", repetitions,
                                     "-o", "json"], f"llama-bench {Path(model).name}", "--repack 0", with_rss=True)
        repacks.append(repack)
        rss = max(rss, peak)
        results, _ = json.JSONDecoder().raw_decode(output[output.index("["):])  # stdout's JSON, then the log
        for test in results:
            kind = "prompt" if test["n_prompt"] else "generate"
            found[kind] = {"tokens": test["n_prompt"] or test["n_gen"], "tokens_per_s": test["avg_ts"],
                           "stddev": test["stddev_ts"], "depth": test.get("n_depth", 0)}
    return {**found, "threads": threads, "repetitions": repetitions, "repack": all(repacks),
            "peak_rss_bytes": rss}


def batched_speed(model: Path, threads: int, prompt: int, generate: int, parallel: tuple[int, ...]) -> dict:
    """llama-batched-bench on `model`: `p` sequences of `prompt` tokens each then `generate` tokens each, for
    each p in `parallel`; {p: decode tokens/s summed over the sequences}."""
    context = max(parallel) * (prompt + generate) + 16
    output, _ = _run([tool("llama-batched-bench"), "-m", model, "-c", context, "-b", 2048, "-ub", 512,
                      "-npp", prompt, "-ntg", generate, "-npl", ",".join(map(str, parallel)), "-t", threads,
                      "--output-format", "jsonl"], f"llama-batched-bench {Path(model).name}")
    found = {}
    for line in output.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            found[str(row["pl"])] = {"decode_tokens_per_s": row["speed_tg"], "prefill_tokens_per_s": row["speed_pp"]}
    return found
