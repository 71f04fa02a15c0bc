"""paperback's INT4 and KIVI-2 caches beside transformers' quantized cache (quanto and HQQ backends), one run.

    .venv/bin/python benchmarks/bench_kv_peer.py [--context 2048] [--windows 2] [--decode-context 2048]

Needs the bench extra (`pip install -e '.[bench]'`: optimum-quanto, hqq).
Quality: the same WikiText-2 windows, fed 32 tokens at a time through each
cache, KL to the same model with exact attention (each tool against its own
exact run; the two fp32 models give identical logits). transformers'
QuantizedCache keeps `residual_length` (128) recent tokens exact and, when
they fill, re-quantizes its whole cache together with them, in groups of
`q_group_size` (64) along the head dimension for keys and values alike;
paperback's INT4 groups 32 channels per token, and KIVI-2 quantizes keys per
channel over 32 tokens. Speed: decode tokens/s at batch 1 after a prompt of
--decode-context tokens, each configuration in its own process. Writes
benchmarks/results/kv_peer_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import torch

from results_io import benchmark_parser, warn_if_busy, write_results
CONFIGS = [  # (tool, setting)
    ("paperback", "fp16"), ("paperback", "int4"), ("paperback", "kivi2"),
    ("transformers", "dynamic"), ("transformers", "quanto-4"), ("transformers", "quanto-2"),
    ("transformers", "hqq-4"), ("transformers", "hqq-2"),
]
CHUNK = 32


def hf_model(lm):
    from transformers import AutoModelForCausalLM

    path = lm.source.path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_cache(model, setting: str):
    from transformers import DynamicCache, QuantizedCache

    if setting == "dynamic":
        return DynamicCache(config=model.config)
    backend, bits = setting.split("-")
    return QuantizedCache(backend, model.config, nbits=int(bits), axis_key=0, axis_value=0, q_group_size=64,
                          residual_length=128)


@torch.inference_mode()
def hf_quality(model, windows: list[torch.Tensor], setting: str) -> dict:
    nll = ref_nll = kl = 0.0
    count = 0
    for ids in windows:
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)[:-1]
        cache = hf_cache(model, setting)
        logits = torch.cat([model(ids[:, lo:lo + CHUNK], past_key_values=cache, use_cache=True).logits[0]
                            for lo in range(0, ids.shape[1], CHUNK)])
        logp = torch.log_softmax(logits.float(), -1)[:-1]
        targets = ids[0, 1:, None]
        nll -= logp.gather(1, targets).sum().item()
        ref_nll -= ref.gather(1, targets).sum().item()
        kl += (ref.exp() * (ref - logp)).sum().item()
        count += targets.shape[0]
    return {"perplexity": math.exp(nll / count), "reference_perplexity": math.exp(ref_nll / count), "kl": kl / count}


def worker(args) -> int:
    """Decode speed of one configuration, printed as one JSON line."""
    from paperback.evaluation import load_text
    from paperback.kv import QuantizedKVCache, build_policy
    from paperback.loading import load_model

    lm = load_model(args.model, "fp32")
    ids = torch.tensor([lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)[:args.decode_context]])
    steps = args.decode_tokens
    with torch.inference_mode():
        if args.tool == "paperback":
            model = lm.model
            cache = QuantizedKVCache.factory(model, build_policy(model.config, args.setting))(ids.shape[1] + steps)
            step = lambda x, pos: model(x, pos, cache, last_only=True)[:, -1]
        else:
            model = hf_model(lm)
            cache = hf_cache(model, args.setting)
            step = lambda x, pos: model(x, past_key_values=cache, use_cache=True).logits[:, -1]
        start = time.perf_counter()
        for lo in range(0, ids.shape[1], 256):
            logits = step(ids[:, lo:lo + 256], lo)
        prefill = time.perf_counter() - start
        token = logits.argmax(-1, keepdim=True)
        start = time.perf_counter()
        for i in range(steps):
            token = step(token, ids.shape[1] + i).argmax(-1, keepdim=True)
        decode = time.perf_counter() - start
    print(json.dumps({"prefill_tokens_per_s": ids.shape[1] / prefill, "decode_tokens_per_s": steps / decode}))
    return 0


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.worker:
        args.tool, args.setting = args.worker
        return worker(args)

    from paperback.cli.output import print_table
    from paperback.evaluation import evaluate, load_text
    from paperback.kv import QuantizedKVCache, build_policy
    from paperback.loading import load_model

    lm = load_model(args.model, "fp32")
    tokens = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
    windows = []
    for w in range(args.windows):
        ids = torch.tensor([tokens[w * args.context:(w + 1) * args.context]])
        if bos is not None:
            ids[0, 0] = bos
        windows.append(ids)
    hf = None
    rows, cache = [], {}
    for tool, setting in CONFIGS:
        start = time.perf_counter()
        try:
            if tool == "paperback":
                policy = build_policy(lm.config, setting)
                r = evaluate(lm.model, tokens, args.context, None, None, args.windows, dataset="wikitext2",
                             bos_token_id=bos, reference_cache=cache, chunk=CHUNK,
                             kv_cache=QuantizedKVCache.factory(lm.model, policy))
                quality = {"perplexity": r.perplexity, "reference_perplexity": r.reference_perplexity,
                           "kl": r.kl_divergence, "bits_at_context": policy.bits_at(lm.config, args.context)}
            else:
                hf = hf or hf_model(lm)
                quality = hf_quality(hf, windows, setting)
        except Exception as e:  # a peer backend that does not run here is reported, not fatal
            quality = {"error": f"{type(e).__name__}: {e}"}
        quality["quality_seconds"] = time.perf_counter() - start
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--decode-context",
                               str(args.decode_context), "--decode-tokens", str(args.decode_tokens),
                               "--worker", tool, setting], capture_output=True, text=True)
        speed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
        rows.append({"tool": tool, "setting": setting, **quality, **{f"speed_{k}": v for k, v in speed.items()}})
        print(json.dumps(rows[-1]), flush=True)
    base = {r["tool"]: r.get("speed_decode_tokens_per_s") for r in rows if r["setting"] in ("fp16", "dynamic")}
    print_table(f"{args.model}: quantized KV caches, WikiText-2 {args.windows} x {args.context} tokens fed {CHUNK} at "
                f"a time; decode at {args.decode_context} tokens of context",
                ["tool", "cache", "perplexity", "KL", "decode tok/s", "vs own exact cache"],
                [[r["tool"], r["setting"], f"{r['perplexity']:.3f}" if "perplexity" in r else r.get("error", "")[:40],
                  f"{r['kl']:.4f}" if "kl" in r else "-",
                  f"{r['speed_decode_tokens_per_s']:.1f}" if "speed_decode_tokens_per_s" in r else "-",
                  f"{r['speed_decode_tokens_per_s'] / base[r['tool']]:.2f}x"
                  if "speed_decode_tokens_per_s" in r and base.get(r["tool"]) else "-"] for r in rows])
    write_results(f"kv_peer_{args.model}.json",
                  {"model": args.model, "context": args.context, "windows": args.windows, "chunk": CHUNK,
                   "decode_context": args.decode_context, "threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
