"""Decode speed of the paged engine by KV format, at long contexts: does reading fewer bytes pay?

    .venv/bin/python benchmarks/bench_kv_speed.py [--model smollm2] [--contexts 2048 8192] [--batch 4]
        [--kv-cache-dtype fp16 fp8 int8 int4 kivi2] [--decode-tokens 32] [--threads 2] [--paths kernel python]
        [--kv-scores fp32 int8]

One WikiText-2 prompt of (context - decode tokens) tokens is prefilled once
and forked into `batch` sampled sequences (`n`), which then decode together,
so every decode step attends over `batch` sequences of about `context`
tokens. Only decode steps are timed (steps that add one token per running
sequence); prefill is left out. Paths: "kernel", the C decode kernel reading
every format's blocks in place (encoded blocks decoded inside its attention
loop); "python", quantized layers decoding through `paged_attention`, their
blocks decoded by PyTorch a few at a time per sequence, as the engine did
before the kernel read them. --kv-scores: how the kernel scores encoded
integer keys (fp32: decoded, the exact reference; int8: the query rounded to
int8 against the codes, paperback.kernels.attention.set_kv_scores); each
integer format gets a row per choice, recorded as "scores" (fp16 and FP8
always score in fp32). Each configuration runs in its own process.
Writes benchmarks/results/kv_speed_<model>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from results_io import (
    add_tag_arg, benchmark_parser, read_results, results_name, run_worker, warn_if_busy, write_results,
)


def worker(args) -> dict:
    import torch

    from paperback.engine.llm import LLMEngine
    from paperback.evaluation import load_text
    from paperback.kernels.attention import kv_scores_in_effect, set_kv_scores
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model

    torch.set_num_threads(args.threads)
    set_kv_scores(args.kv_scores[0])
    lm = load_model(args.model, "fp32")
    prompt = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)[:args.context - args.decode_tokens]
    engine = LLMEngine(lm, kv=args.kv, kv_memory=args.kv_memory << 20)
    if args.path == "python":  # quantized layers back on the per-sequence PyTorch path
        engine.pool.kernel_decodes = [k and layer.native for k, layer in zip(engine.pool.kernel_decodes,
                                                                              engine.pool.layers)]
    engine.add_request(prompt, SamplingParams(n=args.batch, max_tokens=args.decode_tokens, temperature=0.8, seed=0,
                                              ignore_eos=True))
    decode_seconds, decode_tokens, steps = 0.0, 0, 0
    while engine.has_unfinished:
        before, running = engine.positions_computed, engine.num_running
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        added = engine.positions_computed - before
        if running == args.batch and added == args.batch:  # every sequence added one token: a decode step
            decode_seconds += elapsed
            decode_tokens += added
            steps += 1
    scores = kv_scores_in_effect() if _integer_keys(args.kv) and args.path == "kernel" else "fp32"
    return {"kv": args.kv, "path": args.path, "scores": scores, "context": args.context, "batch": args.batch,
            "decode_steps": steps, "decode_tokens_per_s": decode_tokens / decode_seconds, "ms_per_step": 1e3 * decode_seconds / steps,
            "pool_bytes": engine.pool.nbytes}


def _integer_keys(kv: str) -> bool:
    """Whether this format's keys are integer codes, which --kv-scores int8 reads (fp16 and FP8 score in fp32)."""
    from paperback.kv.codecs import ChannelIntCodec, TokenIntCodec
    from paperback.kv.schemes import parse_kv_scheme

    scheme = parse_kv_scheme(kv)
    return not scheme.is_native and isinstance(scheme.codecs()[0], (TokenIntCodec, ChannelIntCodec))


def _variants(formats: list[str], scores: list[str]) -> list[tuple[str, str]]:
    """(format, scores) pairs to run: every --kv-scores choice for integer keys, fp32 alone for the rest."""
    return [(kv, s) for kv in formats for s in (scores if _integer_keys(kv) else ["fp32"])]


def attention_worker(args) -> dict:
    """One layer's decode attention alone, the kernel over a pool of `batch` sequences of each context: per format,
    the median of `repeats` calls, formats in rotation (so drift hits each alike)."""
    import statistics

    import torch

    from paperback.kernels.attention import (ExactStaging, kv_scores_in_effect, native_source, paged_decode_attention,
                                             set_kv_scores)
    from paperback.kv.schemes import parse_kv_scheme
    from paperback.loading import load_model

    torch.set_num_threads(args.threads)
    config = load_model(args.model, "fp32", with_tokenizer=False).model.config
    heads, kv_heads, dim, bs = config.num_heads, config.num_kv_heads, config.head_dim, 32
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for context in args.contexts:
        need = -(-context // bs)
        raw = torch.randn(args.batch * need, kv_heads, bs, dim, generator=gen)
        tables = torch.randperm(args.batch * need, generator=gen).view(args.batch, need)
        lengths = torch.full((args.batch,), context)
        q = torch.randn(args.batch, heads, dim, generator=gen)
        calls = {}
        for kv in args.kv:  # the stored blocks: one per format, read by each scores choice
            scheme = parse_kv_scheme(kv)
            if scheme.is_native:
                stored = raw.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[scheme.dtype])
                sources, staging, nbytes = (native_source(stored), native_source(stored)), None, 2 * stored.nbytes
                keep = [stored]
            else:
                key_codec, value_codec = scheme.codecs()
                key_fields = {n: t.contiguous() for n, t in key_codec.encode(raw).items()}
                value_fields = {n: t.contiguous() for n, t in value_codec.encode(raw).items()}
                recent = -(-scheme.residual // bs) + 1  # the recent window and the block being filled, exact
                stage = raw[:args.batch * recent].half()
                stage_tables = torch.full((args.batch, need), -1)
                stage_tables[:, need - recent:] = torch.arange(args.batch * recent).view(args.batch, recent)
                staging = ExactStaging(stage, stage, stage_tables)
                sources = (key_codec.kernel_source(key_fields), value_codec.kernel_source(value_fields))
                encoded = sum(t.nbytes for t in (*key_fields.values(), *value_fields.values()))
                nbytes = encoded * (need - recent) // need + 2 * args.batch * recent * stage[0].nbytes
                keep = [key_fields, value_fields, stage, key_codec, value_codec]  # FP8 sources point at the scale
            calls[kv] = (sources, staging, nbytes, keep)
        variants = _variants(args.kv, args.kv_scores)
        times = {variant: [] for variant in variants}
        for _ in range(args.repeats):
            for kv, scores in variants:
                sources, staging, _, _ = calls[kv]
                set_kv_scores(scores)
                start = time.perf_counter()
                paged_decode_attention(q, *sources, tables, lengths, dim ** -0.5, None, 0, staging,
                                       num_kv_heads=kv_heads, block_size=bs)
                times[kv, scores].append(time.perf_counter() - start)
        for kv, scores in variants:
            set_kv_scores(scores)
            ms = statistics.median(times[kv, scores]) * 1e3
            nbytes = calls[kv][2]
            rows[f"{kv}/{scores}@{context}"] = {"kv": kv, "scores": kv_scores_in_effect() if _integer_keys(kv)
                                                else "fp32", "context": context, "ms_per_layer": ms,
                                                "mib_read": nbytes / 2**20, "gb_per_s": nbytes / ms / 1e6}
    return {"rows": list(rows.values())}


def quality_worker(args) -> dict:
    """What int8 query scores cost: WikiText-2 windows fed one token a step through the engine, so every position
    is a decode step of the paged kernel reading the cache as stored; per format, KL of its fp32-score path to the
    full model (exact attention), and KL of its int8-score path to its own fp32-score path."""
    import torch

    from paperback.engine.llm import LLMEngine
    from paperback.kernels.attention import kv_scores_in_effect, set_kv_scores
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.evaluation import load_text
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, "fp32")
    ids = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    length = args.quality_tokens
    windows = [ids[i * length:(i + 1) * length] for i in range(args.quality_windows)]
    with torch.inference_mode():
        exact = [torch.log_softmax(lm.model.logits(lm.model.hidden_states(torch.tensor([w]))[0]).float(), -1)
                 for w in windows]

    def decoded(kv: str, scores: str) -> list:
        """Each window's log-probabilities, every position a one-token engine step."""
        set_kv_scores(scores)
        engine = LLMEngine(lm, kv=kv, kv_memory=args.kv_memory << 20, prefix_caching=False,
                           scheduler=SchedulerConfig(max_num_seqs=1, max_step_tokens=1))
        hidden = []
        engine._score_prompt = lambda seq, rows: hidden.append(rows.clone())  # each step's final hidden state
        out = []
        for window in windows:
            hidden.clear()
            engine.add_request(window, SamplingParams(max_tokens=1, prompt_logprobs=0))
            while engine.has_unfinished:
                engine.step()
            with torch.inference_mode():
                out.append(torch.log_softmax(lm.model.logits(torch.cat(hidden)).float(), -1))
        return out

    def kl(p: list, q: list) -> float:
        """Mean KL(p || q) per position, nats (in float64: fp32 sums over the vocabulary leave noise of 1e-7)."""
        total = sum((a.double().exp() * (a.double() - b.double())).sum().item() for a, b in zip(p, q))
        return total / sum(a.shape[0] for a in p)

    rows = []
    for kv in args.kv:
        if not _integer_keys(kv):
            continue
        reference = decoded(kv, "fp32")
        rounded = decoded(kv, "int8")
        set_kv_scores("int8")
        rows.append({"kv": kv, "scores": kv_scores_in_effect(), "kl_fp32_scores_to_full": kl(exact, reference),
                     "kl_int8_scores_to_fp32_scores": kl(reference, rounded),
                     "kl_int8_scores_to_full": kl(exact, rounded)})
    return {"rows": rows, "windows": len(windows), "tokens": length}


def write_merged(name: str, payload: dict) -> None:
    """The JSON with these keys replaced and the other parts' kept (the quality part runs on its own)."""
    previous = read_results(name)
    write_results(name, {**previous, **payload}, kept_from=previous)


def main() -> None:
    p = benchmark_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--kv-cache-dtype", "--kv", dest="kv", nargs="+", default=["fp16", "fp8", "int8", "int4", "kivi2"])
    p.add_argument("--kv-scores", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"],
                   help="how the kernel scores integer keys; each choice its own row")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=["kernel", "python"], choices=["kernel", "python"])
    p.add_argument("--kv-memory", type=int, default=2048, help="MiB of KV pool")
    p.add_argument("--part", choices=["engine", "attention", "both", "quality"], default="both",
                   help="engine: decode steps of the whole model; attention: one layer's decode attention alone; "
                        "quality: KL that int8 query scores cost, beside each format's own (the JSON keeps the "
                        "other parts)")
    p.add_argument("--quality-windows", type=int, default=2, help="quality part: WikiText-2 windows")
    p.add_argument("--quality-tokens", type=int, default=1024, help="quality part: tokens per window")
    p.add_argument("--repeats", type=int, default=30, help="attention part: calls per format")
    add_tag_arg(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--attention-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quality-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.kv = args.kv[0]
        print(json.dumps(worker(args)))
        return
    if args.attention_worker:
        print(json.dumps(attention_worker(args)))
        return
    if args.quality_worker:
        print(json.dumps(quality_worker(args)))
        return
    warn_if_busy()
    if args.part == "quality":
        quality = run_worker([__file__, "--quality-worker", "--model", args.model, "--threads", str(args.threads),
                              "--kv-cache-dtype", *args.kv, "--quality-windows", str(args.quality_windows),
                              "--quality-tokens", str(args.quality_tokens), "--kv-memory", str(args.kv_memory)],
                             "quality")
        print(f"\nKL to the full model, {quality['windows']} WikiText-2 windows of {quality['tokens']} tokens fed "
              f"one token a step through the engine (nats per token)")
        print(f"{'KV':>8} {'fp32 scores':>12} {'int8 scores':>12} {'int8 vs fp32 scores':>20} {'share':>6}")
        for r in quality["rows"]:
            r["share_of_format_kl"] = r["kl_int8_scores_to_fp32_scores"] / r["kl_fp32_scores_to_full"]
            print(f"{r['kv']:>8} {r['kl_fp32_scores_to_full']:>12.5f} {r['kl_int8_scores_to_full']:>12.5f} "
                  f"{r['kl_int8_scores_to_fp32_scores']:>20.6f} {r['share_of_format_kl']:>5.1%}")
        write_merged(results_name(f"kv_speed_{args.model}", args.tag), {"quality": quality})
        return
    payload = {"model": args.model, "batch": args.batch, "threads": args.threads, "decode_tokens": args.decode_tokens}
    if args.part in ("attention", "both"):
        attention = run_worker([__file__, "--attention-worker", "--model", args.model, "--batch", str(args.batch),
                                "--threads", str(args.threads), "--repeats", str(args.repeats), "--contexts",
                                *map(str, args.contexts), "--kv-cache-dtype", *args.kv, "--kv-scores", *args.kv_scores],
                               "attention")["rows"]
        base = {r["context"]: r["ms_per_layer"] for r in attention if r["kv"] == "fp16"}
        print(f"\none layer's decode attention, {args.batch} sequences, {args.threads} threads")
        print(f"{'context':>8} {'KV':>8} {'scores':>6} {'ms':>8} {'vs fp16':>8} {'MiB read':>9} {'GB/s':>6}")
        for r in attention:
            r["speed_vs_fp16"] = base[r["context"]] / r["ms_per_layer"] if r["context"] in base else None
            print(f"{r['context']:>8} {r['kv']:>8} {r['scores']:>6} {r['ms_per_layer']:>8.3f} "
                  f"{r['speed_vs_fp16'] or 0:>7.2f}x "
                  f"{r['mib_read']:>9.1f} {r['gb_per_s']:>6.1f}")
        payload["attention"] = attention
    if args.part == "attention":
        payload["load_average"] = warn_if_busy(own_threads=args.threads)
        write_merged(results_name(f"kv_speed_{args.model}", args.tag), payload)
        return
    rows = []
    for context in args.contexts:
        for kv, scores in _variants(args.kv, args.kv_scores):
            for path in args.paths:
                if path == "python" and (kv in ("fp16", "fp32", "bf16") or scores != "fp32"):
                    continue  # native layers take the kernel either way; PyTorch's path has no int8 scores
                rows.append(run_worker([__file__, "--worker", "--model", args.model, "--kv-cache-dtype", kv,
                                        "--context", str(context), "--batch", str(args.batch), "--decode-tokens",
                                        str(args.decode_tokens), "--threads", str(args.threads), "--path", path,
                                        "--kv-memory", str(args.kv_memory), "--kv-scores", scores],
                                       f"{kv} {path} ({scores} scores) at {context}"))
    load = warn_if_busy(own_threads=args.threads)
    base = {r["context"]: r["decode_tokens_per_s"] for r in rows if r["kv"] == "fp16"}
    print(f"\ndecode tokens/s, {args.batch} sequences of each context together, {args.threads} threads "
          f"(load average {load:.2f})")
    print(f"{'context':>8} {'KV':>8} {'path':>7} {'scores':>6} {'tok/s':>8} {'ms/step':>8} {'vs fp16':>8} "
          f"{'pool MiB':>9}")
    for r in rows:
        ratio = r["decode_tokens_per_s"] / base[r["context"]] if r["context"] in base else float("nan")
        r["vs_fp16"] = ratio
        print(f"{r['context']:>8} {r['kv']:>8} {r['path']:>7} {r['scores']:>6} {r['decode_tokens_per_s']:>8.1f} "
              f"{r['ms_per_step']:>8.1f} {ratio:>7.2f}x {r['pool_bytes'] / 2**20:>9.0f}")
    payload.update(load_average=load, rows=rows)
    write_merged(results_name(f"kv_speed_{args.model}", args.tag), payload)


if __name__ == "__main__":
    sys.exit(main())
