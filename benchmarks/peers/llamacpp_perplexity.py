"""llama.cpp's perplexity of a GGUF file on token windows paperback cut (runs in .venv-llamacpp).

    .venv-llamacpp/bin/python benchmarks/peers/llamacpp_perplexity.py MODEL.gguf WINDOWS.npy [--threads N]

WINDOWS.npy holds (windows, context) token ids exactly as paperback feeds them
(BOS already in place); every position but the last predicts the next id, as
paperback's non-overlapping windows score them. The same ids reach both
engines, so the tokenizers cannot differ. Prints one JSON line: the summed
NLL, the tokens scored, the perplexity, and the seconds spent in llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from llama_cpp import Llama
from llamacpp_params import disable_extra_buffer_types


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("windows")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-extra-bufts", action="store_true",
                        help="load without llama.cpp's weight repacking (its AMX path crashes on some CPUs)")
    args = parser.parse_args()
    if args.no_extra_bufts:
        disable_extra_buffer_types()
    windows = np.load(args.windows)
    context = windows.shape[1]
    llm = Llama(model_path=args.model, n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    nll_sum, scored, seconds = 0.0, 0, 0.0
    for ids in windows:
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids.tolist())
        seconds += time.perf_counter() - start
        logp = log_softmax(llm.scores[:context - 1])
        nll_sum += -logp[np.arange(context - 1), ids[1:]].sum()
        scored += context - 1
    print(json.dumps({"nll_sum": nll_sum, "tokens_scored": scored, "perplexity": math.exp(nll_sum / scored),
                      "seconds": seconds, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
