"""Serving: the paged engine beside transformers batched generation at the same KV memory, plus memory use.

    .venv/bin/python benchmarks/bench_serving.py [--model smollm2] [--requests 200] [--kv-memory-mib 256]
        [--part throughput sharing capacity]

throughput: N requests whose prompts are WikiText-2 paragraphs and whose
  output lengths are the lengths of the paragraphs that follow them (so both
  vary the way real text does), all arriving at once, greedy, EOS ignored so
  both tools produce exactly the same tokens per request. paperback runs them
  through the paged engine (continuous batching, chunked prefill, fp32 cache)
  with a KV pool of --kv-memory-mib; transformers runs them in first-come
  static batches, each as large as fits in the same memory when it reserves
  (longest prompt + longest output in the batch) per request, left-padded,
  through `generate`. Reported: requests/s, output tokens/s, time to first
  token p50/p99 (from the common arrival), and the share of reserved KV memory
  that holds real token states, averaged over steps: for the paged engine
  (blocks in use), for transformers' padded batches, and for a contiguous
  allocator that reserves each request's prompt + max_tokens (or the model's
  full context) at admission, simulated on the same workload and budget.
  Each tool runs in its own process.
sharing: blocks held at peak for n = 4 parallel samples of one prompt (forked
  blocks) against the same 4 completions as separate requests, and for
  requests that share a system prompt with and without prefix caching.
capacity: per KV format and sequence length, how many concurrent sequences
  the engine's pool holds in a fixed budget (the engine's own sizing, bf16
  model, staging for the exact recent windows included).
Writes benchmarks/results/serving_<model>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time

import torch

from paperback.memory import dense_kv_bytes_per_token
from results_io import (
    add_tag_arg, benchmark_parser, read_results, results_name, run_worker, warn_if_busy, write_results,
)

SHARING_KV_BYTES = 2 ** 30  # every sharing case runs all its sequences at once in it, shared or not


def workload(tokenizer, requests: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: a paragraph, and the token length of the paragraph after it."""
    from paperback.evaluation import load_text

    paragraphs = [p.strip() for p in load_text("wikitext2").split("\n")]
    paragraphs = [p for p in paragraphs if len(p) > 80 and not p.startswith("=")]
    picks = random.Random(seed).sample(range(len(paragraphs) - 1), requests)
    out = []
    for i in picks:
        prompt = tokenizer.encode(paragraphs[i], add_special_tokens=False)[:max_prompt]
        follow = len(tokenizer.encode(paragraphs[i + 1], add_special_tokens=False))
        out.append((prompt, max(8, min(follow, max_output))))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(tool: str, work, seconds: float, ttfts: list[float], utilization: float, extra: dict) -> dict:
    return {"tool": tool, "requests": len(work), "seconds": seconds, "requests_per_s": len(work) / seconds,
            "output_tokens_per_s": sum(n for _, n in work) / seconds, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": percentile(ttfts, 0.99), "kv_utilization": utilization, **extra}


class LinearTimer:
    """Seconds spent inside torch.nn.functional.linear (every nn.Linear and tied head of both tools) while active;
    the packed kernel's own calls (paperback's W4 decode rows) are not in it.

    The linears are the same PyTorch GEMMs in both tools, so their time bounds what scheduling can win.
    """

    def __init__(self):
        self.seconds = 0.0
        self._real = torch.nn.functional.linear

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        torch.nn.functional.linear = timed
        return self

    def __exit__(self, *exc):
        torch.nn.functional.linear = self._real


def paged_worker(args) -> dict:
    """The paged engine: the fp32 model and cache ("paged"), or what a user runs ("paged-user": the W4
    checkpoint and the quantized KV format, in the same KV memory)."""
    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model

    from paperback.kernels.attention import kv_scores_in_effect, set_kv_scores
    from paperback.kernels.packed import set_decode_activations, set_prefill_matmul

    user = args.worker == "paged-user"
    if user:  # many-row steps (prefill chunks, batched decode) through bf16 tiles, as `--prefill-matmul bf16`;
        # decode rows with int8 activations and integer KV keys against int8 queries where chosen
        set_prefill_matmul(args.user_prefill_matmul)
        set_decode_activations(args.user_decode_activations)
        set_kv_scores(args.user_kv_scores)
    lm = load_model(args.user_checkpoint if user else args.model, "fp32")
    work = workload(lm.tokenizer, args.requests, args.seed, args.max_prompt, args.max_output)
    engine = LLMEngine(lm, kv=args.user_kv if user else "fp32", kv_memory=args.kv_memory_mib * 2 ** 20,
                       scheduler=SchedulerConfig(args.max_num_seqs, args.max_step_tokens))
    start = time.perf_counter()
    for prompt, n in work:
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    held = reserved = 0
    outputs, peak_running = [], 0
    with LinearTimer() as linears:
        while engine.scheduler.has_work:
            outputs += engine.step()
            running = engine.scheduler.running
            peak_running = max(peak_running, len(running))
            held += sum(s.num_computed for s in running)
            reserved += engine.blocks.num_used * engine.blocks.block_size
    seconds = time.perf_counter() - start
    assert sorted(len(o.outputs[0].token_ids) for o in outputs) == sorted(n for _, n in work)
    return summary(TOOL_NAMES[args.worker], work, seconds, [o.timings["time_to_first_token_s"] for o in outputs],
                   held / reserved, {"kv_pool_bytes": engine.pool.nbytes, "peak_running": peak_running,
                                     "preemptions": sum(o.timings["preemptions"] for o in outputs),
                                     "positions_computed": engine.positions_computed,
                                     "linear_seconds": linears.seconds,
                                     "kv_scores": kv_scores_in_effect() if user else "fp32"})


def static_batches(work, budget_tokens: int) -> list[list[int]]:
    """First come first served; a batch grows while batch x (longest prompt + longest output) fits."""
    batches, current = [], []
    for i, (prompt, n) in enumerate(work):
        trial = current + [i]
        need = len(trial) * (max(len(work[j][0]) for j in trial) + max(work[j][1] for j in trial))
        if current and need > budget_tokens:
            batches.append(current)
            trial = [i]
        current = trial
    return batches + [current]


def transformers_worker(args) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    from paperback.bench.engines import BenchConfig, TransformersEngine

    engine = TransformersEngine(BenchConfig(model=args.model, dtype="fp32"))
    model = engine.model
    work = workload(engine.tokenizer, args.requests, args.seed, args.max_prompt, args.max_output)
    batches = static_batches(work, args.budget_tokens)  # fp32 token states the KV budget holds
    pad = engine.tokenizer.hf.pad_token_id or 0
    stamps: list[float] = []

    class FirstToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ttfts, held, reserved, positions = [], 0, 0, 0
    start = time.perf_counter()
    with torch.inference_mode(), LinearTimer() as linears:
        for batch in batches:
            prompts = [work[i][0] for i in batch]
            width, new = max(map(len, prompts)), max(work[i][1] for i in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            stamps.clear()
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, logits_processor=LogitsProcessorList([FirstToken()]))
            ttfts += [stamps[0] - start] * len(batch)
            positions += len(batch) * (width + new - 1)  # padded prompts, then one position per row per step
            for step in range(new):  # the padded cache after each step, and the real states inside it
                reserved += len(batch) * (width + step)
                held += sum(len(work[i][0]) + min(step, work[i][1]) for i in batch)
    seconds = time.perf_counter() - start
    return summary(TOOL_NAMES["transformers"], work, seconds, ttfts, held / reserved,
                   {"batches": len(batches), "largest_batch": max(map(len, batches)), "positions_computed": positions,
                    "linear_seconds": linears.seconds})


def contiguous_reservation(work, budget_tokens: int, max_step_tokens: int, reserve) -> float:
    """Share of reserved memory holding token states for an allocator that reserves `reserve(prompt, n)`
    contiguous slots per request at admission (FCFS), simulated step by step: a request's prompt is
    prefilled in chunks of the step budget, then it gains one token per step until it has n."""
    waiting = list(range(len(work)))
    running: dict[int, int] = {}  # request -> tokens held
    used = held_total = reserved_total = 0
    while waiting or running:
        while waiting and used + reserve(*work[waiting[0]]) <= budget_tokens:
            i = waiting.pop(0)
            running[i] = 0
            used += reserve(*work[i])
        if not running:
            raise SystemExit("a single request's reservation exceeds the budget")
        budget = max_step_tokens
        for i in list(running):
            prompt = len(work[i][0])
            grow = min(prompt - running[i], max(budget, 0)) if running[i] < prompt else 1
            budget -= grow
            running[i] += grow
        held_total += sum(running.values())
        reserved_total += used
        for i in [i for i, h in running.items() if h >= len(work[i][0]) + work[i][1]]:
            used -= reserve(*work[i])
            del running[i]
    return held_total / reserved_total


TOOL_NAMES = {"paged": "paperback paged", "transformers": "transformers static batches",
              "paged-user": "paperback paged, W4 checkpoint + quantized KV"}


def user_checkpoint(args, scratch: str) -> str:
    """The W4 checkpoint the "paged-user" row serves: --user-checkpoint, else RTN W4a-g128 with the head at W4 too,
    made now under `scratch` (speed does not depend on how the codes were chosen)."""
    from paperback.cli import main as paperback_cli

    if args.user_checkpoint:
        return args.user_checkpoint
    path = f"{scratch}/{args.model}-w4a-g128"
    if paperback_cli(["quantize", args.model, "-o", path, "--method", "rtn", "--edge-scheme", "same", "--json"]):
        raise SystemExit("quantize failed for the paged-user row's checkpoint")
    return path


def throughput(args, work, config, previous: dict | None) -> dict:
    """Both tools' rows; a tool left out of --tools keeps its row from the previous run of the same workload."""
    kept = {r["tool"]: r for r in (previous or {}).get("rows", [])}
    budget_tokens = args.kv_memory_mib * 2 ** 20 // dense_kv_bytes_per_token(config, torch.float32)
    rows = []
    for tool in TOOL_NAMES:
        if tool not in args.tools:
            if TOOL_NAMES[tool] in kept:
                rows.append(kept[TOOL_NAMES[tool]])
            elif tool != "paged-user":
                raise SystemExit(f"no earlier {tool} row to keep: run it too (--tools paged transformers)")
            continue
        with tempfile.TemporaryDirectory() as scratch:
            user = (["--user-checkpoint", user_checkpoint(args, scratch), "--user-kv", args.user_kv,
                     "--user-prefill-matmul", args.user_prefill_matmul, "--user-decode-activations",
                     args.user_decode_activations, "--user-kv-scores", args.user_kv_scores]
                    if tool == "paged-user" else [])
            rows.append(run_worker([__file__, "--worker", tool, "--model", args.model, "--requests",
                                    str(args.requests), "--seed", str(args.seed), "--kv-memory-mib",
                                    str(args.kv_memory_mib), "--max-num-seqs", str(args.max_num_seqs),
                                    "--max-step-tokens", str(args.max_step_tokens), "--max-prompt",
                                    str(args.max_prompt), "--max-output", str(args.max_output), "--budget-tokens",
                                    str(budget_tokens), *user], tool))
    contiguous = {
        "reserve prompt + max_tokens": contiguous_reservation(
            work, budget_tokens, args.max_step_tokens, lambda p, n: len(p) + n),
        f"reserve the full context ({config.max_position_embeddings})": contiguous_reservation(
            work, budget_tokens, args.max_step_tokens, lambda p, n: config.max_position_embeddings)
        if config.max_position_embeddings <= budget_tokens else None,
    }
    # Throughput splits into work avoided (positions each tool runs through the model) and speed per position.
    useful = sum(len(p) + n - 1 for p, n in work)  # a request's last token is sampled, never run
    work_ratio = rows[1].get("positions_computed", 0) / rows[0].get("positions_computed", 1)
    user_speedup = rows[2]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"] if len(rows) > 2 else None
    return {"rows": rows, "speedup": rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"],
            "user_speedup": user_speedup, "user_kv": args.user_kv if len(rows) > 2 else None,
            "user_prefill_matmul": args.user_prefill_matmul if len(rows) > 2 else None,
            "user_decode_activations": args.user_decode_activations if len(rows) > 2 else None,
            "useful_positions": useful, "work_ratio": work_ratio,
            "contiguous_utilization": contiguous, "budget_tokens": budget_tokens}


def peak_blocks(engine, add_later=()) -> tuple[int, list]:
    """Step the engine to the end; `add_later` requests join once the first request has its first token."""
    peak, outputs, pending = 0, [], list(add_later)
    while engine.scheduler.has_work or pending:
        outputs += engine.step()
        if pending and (outputs or any(s.output_ids for s in engine.scheduler.running)):
            for prompt, params in pending:
                engine.add_request(prompt, params)
            pending = []
        peak = max(peak, engine.blocks.num_used)
    return peak, outputs


def sharing(lm, work) -> dict:
    """work: 32 (prompt, length) pairs whose text builds the shared prompts and the distinct questions."""
    from paperback.engine.llm import LLMEngine
    from paperback.generation.sampling import SamplingParams

    prompt = [t for p, _ in work[:8] for t in p][:384]
    sample = SamplingParams(max_tokens=64, temperature=0.8, seed=0, ignore_eos=True)
    engine = LLMEngine(lm, kv="fp32", kv_memory=SHARING_KV_BYTES)
    engine.add_request(prompt, SamplingParams(**{**sample.__dict__, "n": 4}))
    forked, _ = peak_blocks(engine)
    engine = LLMEngine(lm, kv="fp32", kv_memory=SHARING_KV_BYTES, prefix_caching=False)
    for i in range(4):
        engine.add_request(prompt, SamplingParams(**{**sample.__dict__, "seed": i}))
    separate, _ = peak_blocks(engine)
    system = [t for p, _ in work[8:16] for t in p][:512]
    questions = [p[:48] for p, _ in work[16:32]]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    shared = {}
    for caching in (True, False):
        engine = LLMEngine(lm, kv="fp32", kv_memory=SHARING_KV_BYTES, prefix_caching=caching)
        engine.add_request(system + questions[0], greedy)
        peak, _ = peak_blocks(engine, [(system + q, greedy) for q in questions[1:]])
        shared[caching] = {"peak_blocks": peak, "prefix_hit_rate": engine.blocks.prefix_hit_rate}
    block = engine.blocks.block_size
    return {"block_size": block,
            "parallel_sampling": {"prompt_tokens": len(prompt), "n": 4, "max_tokens": 64, "peak_blocks_forked": forked,
                                  "peak_blocks_separate": separate, "saved": 1 - forked / separate},
            "system_prompt": {"system_tokens": len(system), "requests": len(questions), "question_tokens": 48,
                              "max_tokens": 16, "peak_blocks_cached": shared[True]["peak_blocks"],
                              "peak_blocks_uncached": shared[False]["peak_blocks"],
                              "prefix_hit_rate": shared[True]["prefix_hit_rate"],
                              "saved": 1 - shared[True]["peak_blocks"] / shared[False]["peak_blocks"]}}


def capacity(args) -> dict:
    """Per KV format and sequence length, the most sequences the engine's pool admits in the budget."""
    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.errors import PaperbackError
    from paperback.loading import load_model

    lm = load_model(args.model, "bf16", with_tokenizer=False)
    budget = args.capacity_mib * 2 ** 20

    def engine_for(kv: str, seqs: int):
        try:  # staging for the exact recent windows is sized by the cap on running sequences
            return LLMEngine(lm, kv=kv, kv_memory=budget, scheduler=SchedulerConfig(seqs, args.max_step_tokens))
        except PaperbackError:  # the staging alone leaves no block
            return None

    def fits(kv: str, seqs: int, tokens: int) -> bool:
        engine = engine_for(kv, seqs)
        # As many may run at once as the exact staging allows (the engine caps them to fit the budget).
        ok = engine is not None and engine.layout.max_num_seqs >= seqs and \
            engine.blocks.num_blocks >= seqs * engine.blocks.blocks_needed(tokens)
        del engine
        gc.collect()  # the engine's callbacks make a reference cycle: free its pool before the next one
        return ok

    rows = []
    for tokens in args.capacity_tokens:
        for kv in args.capacity_kv:
            lo, hi = 0, 1
            while fits(kv, hi, tokens):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(kv, mid, tokens) else (lo, mid)
            engine = engine_for(kv, 1)
            rows.append({"kv": kv, "tokens": tokens, "sequences": lo, "block_size": engine.blocks.block_size})
            del engine
            gc.collect()
        base = next(r["sequences"] for r in rows if r["tokens"] == tokens and r["kv"] in ("bf16", "fp16"))
        for r in rows:
            if r["tokens"] == tokens:
                r["vs_16bit"] = r["sequences"] / base if base else None
    return {"budget_bytes": budget, "model_dtype": "bf16", "rows": rows}


def print_tables(report: dict, model: str) -> None:
    from paperback.cli.output import print_table

    if "throughput" in report:
        t = report["throughput"]
        print_table(f"{model}: {t['rows'][0]['requests']} requests, KV budget {report['kv_memory_mib']} MiB "
                    f"({t['budget_tokens']} fp32 token states)",
                    ["tool", "req/s", "output tok/s", "TTFT p50 s", "TTFT p99 s", "KV in use holding tokens",
                     "positions run", "positions/s", "s in torch's linear"],
                    [[r["tool"], f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                      f"{r['ttft_p50_s']:.1f}", f"{r['ttft_p99_s']:.1f}", f"{100 * r['kv_utilization']:.1f}%",
                      r.get("positions_computed", ""),
                      f"{r['positions_computed'] / r['seconds']:.0f}" if "positions_computed" in r else "",
                      f"{r['linear_seconds']:.0f} of {r['seconds']:.0f}" if "linear_seconds" in r else ""]
                     for r in t["rows"]]
                    + [[f"contiguous, {k}", "", "", "", "", f"{100 * v:.1f}%" if v is not None else "does not fit",
                        "", "", ""] for k, v in t["contiguous_utilization"].items()])
        print(f"paged / transformers output tokens/s, same weights and cache (fp32): {t['speedup']:.2f}x")
        if t.get("user_speedup"):
            user = t["rows"][2]
            print(f"paged W4 + {t['user_kv']} KV / transformers fp32 (what a user runs: prefill "
                  f"{t['user_prefill_matmul']}, decode activations {t.get('user_decode_activations', 'fp32')}, "
                  f"KV scores {user.get('kv_scores', 'fp32')}): {t['user_speedup']:.2f}x")
        if t.get("work_ratio"):
            print(f"positions transformers runs per position paperback runs: {t['work_ratio']:.2f}x "
                  f"({t['useful_positions']} needed); the rest of the ratio is speed per position")
    if "sharing" in report:
        s = report["sharing"]
        p, sp = s["parallel_sampling"], s["system_prompt"]
        print_table(f"{model}: KV blocks at peak ({s['block_size']} tokens each)",
                    ["case", "shared", "not shared", "saved"],
                    [[f"n=4 samples of a {p['prompt_tokens']}-token prompt", p["peak_blocks_forked"],
                      p["peak_blocks_separate"], f"{100 * p['saved']:.0f}%"],
                     [f"{sp['requests']} requests, {sp['system_tokens']}-token system prompt",
                      sp["peak_blocks_cached"], sp["peak_blocks_uncached"], f"{100 * sp['saved']:.0f}%"]])
    if "capacity" in report:
        c = report["capacity"]
        lengths = sorted({r["tokens"] for r in c["rows"]})
        formats = list(dict.fromkeys(r["kv"] for r in c["rows"]))
        cell = {(r["kv"], r["tokens"]): r for r in c["rows"]}
        print_table(f"{model}: concurrent sequences in {c['budget_bytes'] / 2**20:.0f} MiB of KV (bf16 model), "
                    f"and against the 16-bit cache", ["KV"] + [f"{n} tokens" for n in lengths],
                    [[kv] + [f"{cell[kv, n]['sequences']} ({cell[kv, n]['vs_16bit']:.2f}x)" for n in lengths]
                     for kv in formats])


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--part", nargs="+", default=["throughput", "sharing", "capacity"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--kv-memory-mib", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-step-tokens", type=int, default=512)
    parser.add_argument("--capacity-mib", type=int, default=1024)
    parser.add_argument("--capacity-tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--capacity-kv", nargs="+", default=["bf16", "fp8", "int8", "int4", "kivi4", "kivi2"])
    parser.add_argument("--tools", nargs="+", choices=list(TOOL_NAMES), default=list(TOOL_NAMES),
                        help="rerun only these; the other keeps its row from the last run of the same workload")
    parser.add_argument("--user-kv", default="kivi2", help="the paged-user row's KV format")
    parser.add_argument("--user-prefill-matmul", default="bf16", choices=["fp32", "bf16"],
                        help="the paged-user row's matmul for steps of more than 16 rows")
    parser.add_argument("--user-decode-activations", default="int8", choices=["fp32", "int8"],
                        help="the paged-user row's decode activations against the packed weights")
    parser.add_argument("--user-kv-scores", default="int8", choices=["fp32", "int8"],
                        help="the paged-user row's scores of integer KV keys (int8 queries where the CPU allows)")
    parser.add_argument("--user-checkpoint",
                        help="the paged-user row's checkpoint (default: RTN W4a-g128, made for the run)")
    add_tag_arg(parser)
    parser.add_argument("--worker", choices=list(TOOL_NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--budget-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()  # a busy machine distorts timings, and even ratios
    from paperback.loading import load_model

    if args.worker:
        print(json.dumps((transformers_worker if args.worker == "transformers" else paged_worker)(args)))
        return 0
    lm = load_model(args.model, "fp32")
    work = workload(lm.tokenizer, args.requests, args.seed, args.max_prompt, args.max_output)
    report = {"model": args.model, "threads": torch.get_num_threads(), "kv_memory_mib": args.kv_memory_mib,
              "workload": {"requests": len(work), "seed": args.seed,
                           "prompt_tokens_mean": statistics.mean(len(p) for p, _ in work),
                           "output_tokens_mean": statistics.mean(n for _, n in work),
                           "prompt_tokens_max": max(len(p) for p, _ in work),
                           "output_tokens_max": max(n for _, n in work)}}
    if "sharing" in args.part:
        report["sharing"] = sharing(lm, workload(lm.tokenizer, 32, args.seed + 1, args.max_prompt, 16))
    if "capacity" in args.part:
        report["capacity"] = capacity(args)
    # Parts run separately merge into one file (a rerun of a part replaces it).
    name = results_name(f"serving_{args.model}", args.tag)
    previous = read_results(name)
    if "throughput" in args.part:
        config = lm.model.config
        del lm
        same = previous.get("workload") == report["workload"] and previous.get("kv_memory_mib") == args.kv_memory_mib
        report["throughput"] = throughput(args, work, config, previous.get("throughput") if same else None)
    ran = {TOOL_NAMES[t] for t in args.tools}
    kept = (any(k not in report for k in previous if k not in ("provenance", "earlier_runs"))  # parts not run
            or any(r["tool"] not in ran for r in report.get("throughput", {}).get("rows", [])))  # rows kept
    report = {**previous, **report} if kept else report  # a file rerun whole names only this run
    print_tables(report, args.model)
    write_results(name, report, kept_from=previous if kept else None)
    return 0


if __name__ == "__main__":
    sys.exit(run())
