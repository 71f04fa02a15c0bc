"""llama.cpp's prefill and decode speed on a GGUF file (runs in .venv-llamacpp).

    .venv-llamacpp/bin/python benchmarks/peers/llamacpp_speed.py MODEL.gguf PROMPT.npy --threads N
        [--decode-tokens 32] [--repeats 3]

PROMPT.npy holds the token ids paperback's bench feeds (one row), so both
engines read the same prompt. Timed as paperback's bench times itself:
prefill = one evaluation of the prompt (last position's logits only); decode
= a timestamp at every greedy token (EOS ignored), time to first token from
the start of the call, tokens/s over the steps after the first. Each is the
median of --repeats runs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama
from llamacpp_params import disable_extra_buffer_types


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompt")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-extra-bufts", action="store_true",
                        help="load without llama.cpp's weight repacking (its AMX path crashes on some CPUs)")
    args = parser.parse_args()
    if args.no_extra_bufts:
        disable_extra_buffer_types()
    prompt = np.load(args.prompt).reshape(-1).tolist()
    context = len(prompt) + args.decode_tokens + 8
    start = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=context, n_batch=len(prompt), n_ubatch=len(prompt),
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - start
    llm.reset()
    llm.eval(prompt[:16])  # warm-up: first-call allocations
    prefill = []
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(time.perf_counter() - t0)
    runs = []
    for _ in range(args.repeats):
        llm.reset()
        stamps = []
        t0 = time.perf_counter()
        for _token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == args.decode_tokens:
                break
        runs.append((stamps[0] - t0, (len(stamps) - 1) / (stamps[-1] - stamps[0])))
    prefill_s = statistics.median(prefill)
    print(json.dumps({"engine": "llama.cpp", "load_s": load_s, "prefill_s": prefill_s,
                      "prefill_tokens_per_s": len(prompt) / prefill_s, "threads": args.threads,
                      "decode": {"1": {"time_to_first_token_s": statistics.median(r[0] for r in runs),
                                       "decode_tokens_per_s": statistics.median(r[1] for r in runs)}},
                      "peak_rss_bytes": peak_rss_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
