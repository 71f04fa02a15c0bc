"""llama.cpp's own command-line tools (built by benchmarks/peers/setup_llamacpp_tools.sh) as the benchmarks call them.

Each call runs the tool once and parses what it prints. Where llama.cpp's weight repacking kills a tool on this
CPU (its AMX path: an illegal instruction or a segfault on the Sapphire Rapids machines here,
ggml-org/llama.cpp#20824), the call is repeated with `--no-repack` and the result says so.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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


def _run(argv: list, what: str, repack_flag: str | None = None) -> tuple[str, bool]:
    """(combined output, whether repacking stayed on) of one tool run; SystemExit with its tail on failure."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    repack = True
    if proc.returncode in CRASHES and repack_flag:
        proc = subprocess.run([str(a) for a in argv] + repack_flag.split(), capture_output=True, text=True)
        repack = False
    if proc.returncode:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr, repack


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


def speed(model: Path, threads: int, prompt: int = 512, generate: int = 128, repetitions: int = 3) -> dict:
    """llama-bench on `model`: prompt processing of `prompt` tokens and generation of `generate` tokens,
    tokens/s (mean and standard deviation over `repetitions` runs)."""
    import json

    output, repack = _run([tool("llama-bench"), "-m", model, "-p", prompt, "-n", generate, "-t", threads,
                           "-r", repetitions, "-o", "json"], f"llama-bench {Path(model).name}", "--repack 0")
    found = {}
    tests, _ = json.JSONDecoder().raw_decode(output[output.index("["):])  # stdout's JSON, then stderr's log
    for test in tests:
        kind = "prompt" if test["n_prompt"] else "generate"
        found[kind] = {"tokens": test["n_prompt"] or test["n_gen"], "tokens_per_s": test["avg_ts"],
                       "stddev": test["stddev_ts"]}
    return {**found, "threads": threads, "repetitions": repetitions, "repack": repack}
