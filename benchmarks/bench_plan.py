"""The planner's predictions against the paged engine's measured memory, line by line.

    .venv/bin/python benchmarks/bench_plan.py [--models smollm2 gemma3] [--kv-cache-dtype fp16 int8 kivi2]
        [--contexts 1024 4096] [--users 1 4] [--markdown]
    .venv/bin/python benchmarks/bench_plan.py --allowance [--models smollm2 gemma3]

For each model, KV format, context and number of users, `paperback plan`'s
arithmetic predicts the weight bytes and the KV bytes of `users`
conversations of `context` tokens. The engine (bf16 weights and activations,
so its exact recent windows are 16-bit as the plan counts them) then runs
exactly that workload (prompts of context - 16 tokens, 16 generated) and we
measure: the weights' bytes (every parameter and packed buffer), the KV bytes
each sequence holds at its longest (its blocks x each block's bytes in every
layer's format, plus its staging slots), and the process's peak RSS while
serving (reset after loading, whose dequantizing transient is reported
apart) beside the plan's total with its runtime allowance. Each configuration runs
in its own process. The engine frees, group by group, the blocks that slide
out of a sliding-window layer's window (Gemma 3's local layers), as the plan
counts them. Writes benchmarks/results/plan_check.json.

--allowance measures the allowance's two stated constants instead, one fresh
process per model: the RSS a loaded tokenizer adds per vocabulary entry, and
what a process that has loaded the model and served one short request holds
besides weights, tokenizer and KV pool. Writes
benchmarks/results/plan_allowance.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from results_io import RESULTS, benchmark_parser, read_results, run_worker, warn_if_busy, write_results


def worker(model: str, kv: str, context: int, users: int) -> dict:
    import torch

    from paperback.bench.engines import peak_rss_bytes
    from paperback.engine.block_manager import EVICTED
    from paperback.engine.cache_groups import cache_groups
    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.evaluation import load_text
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model
    from paperback.memory import module_bytes, release_freed_heap
    from paperback.kv.schemes import paged_block_size
    from paperback.plan.arithmetic import kv_bytes, layer_kv_schemes, weight_bytes
    from paperback.plan.planner import runtime_allowance
    from paperback.plan.shape import load_shape

    lm = load_model(model, "bf16")
    loading_peak = peak_rss_bytes()
    # The prompts are the bench's input, not the server's memory: tokenize just enough text, and before
    # the peak is reset.
    text = load_text("wikitext2")
    ids = lm.tokenizer.encode(text[:users * context * 8], add_special_tokens=False)
    if len(ids) < users * context:
        raise SystemExit(f"the text gives only {len(ids)} tokens for {users} x {context}")
    ids = ids[:users * context]
    del text
    release_freed_heap()
    # Serving memory from here on: loading a GGUF dequantizes through fp32, a transient the plan does not
    # count, so the peak is reset (Linux: 5 > clear_refs sets VmHWM to the current RSS).
    Path("/proc/self/clear_refs").write_text("5")
    shape = load_shape(model)
    step_tokens = 512  # the prefill chunk the plan's runtime allowance is sized for
    block_size = paged_block_size(layer_kv_schemes(shape, kv))  # as the engine picks it
    # Each group's pool holds what the users need plus one block each (admission keeps one free per
    # running sequence), no more: the peak RSS then compares with the plan's total line by line.
    groups = cache_groups(lm.config, layer_kv_schemes(shape, kv))
    blocks_needed = [users * (g.blocks_held(context, block_size, step_tokens) + 1) for g in groups]
    engine = LLMEngine(lm, kv=kv, num_blocks=blocks_needed, prefix_caching=False,
                       scheduler=SchedulerConfig(users, step_tokens))
    pool = engine.pool
    # One block's bytes in each group's layers.
    block = [sum(t[0].numel() * t.element_size() for i in g.layers for t in pool.layers[i].tensors())
             for g in engine.blocks.groups]
    stage = sum(layer.stage_keys[0].numel() * layer.stage_keys.element_size() * 2
                for layer in pool.layers if not layer.native)
    # Between steps a running sequence holds at most context - 2 tokens: the step that computes its 15th
    # generated token samples the 16th and ends it. Measured and predicted at that length.
    tokens = context - 2
    held: dict[int, int] = {}  # sequence -> bytes it holds once it has `tokens` tokens computed

    for u in range(users):
        engine.add_request(ids[u * context:(u + 1) * context - 16], SamplingParams(max_tokens=16, ignore_eos=True))
    with torch.inference_mode():
        while engine.scheduler.has_work:
            for s in engine.scheduler.running:
                if s.num_computed == tokens and s.seq_id not in held:
                    # Its blocks in every layer's format plus its staging slots (sequences' KV add up, so
                    # the users need not reach this point in the same step).
                    tables = engine.blocks.tables(s.seq_id)
                    held[s.seq_id] = (sum((len(t) - t.count(EVICTED)) * b for t, b in zip(tables, block))
                                      + len(pool.seqs[s.seq_id].stage) * stage if s.seq_id in pool.seqs else 0)
            engine.step()
    measured_kv = sum(held.values()) if len(held) == users else 0
    predicted_kv = kv_bytes(shape, tokens, kv, users)
    rss = peak_rss_bytes()
    predicted_weights = weight_bytes(shape, "bf16").total
    allowance = runtime_allowance(shape, step_tokens, users)
    return {"model": model, "kv": kv, "context": context, "users": users,
            "weights_predicted": predicted_weights, "weights_measured": module_bytes(lm.model),
            "kv_predicted": predicted_kv, "kv_measured": measured_kv, "block_size": engine.blocks.block_size,
            "allowance": allowance.to_dict(),
            "total_predicted": predicted_weights + predicted_kv + allowance.total,
            "peak_rss": rss, "peak_rss_while_loading": loading_peak}


def markdown(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| model | KV | context x users | weights pred / meas MiB | KV pred / meas MiB "
             "| runtime allowance MiB | total pred MiB | peak RSS MiB (ratio) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv']} | {r['context']} x {r['users']} | "
                     f"{r['weights_predicted'] / mib:.1f} / {r['weights_measured'] / mib:.1f} | "
                     f"{r['kv_predicted'] / mib:.2f} / {r['kv_measured'] / mib:.2f} | "
                     f"{r['allowance']['total'] / mib:.0f} | {r['total_predicted'] / mib:.0f} | "
                     f"{r['peak_rss'] / mib:.0f} ({r['peak_rss'] / r['total_predicted']:.3f}) |")
    return "\n".join(lines)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmRSS in /proc/self/status (Linux only)")


def allowance_worker(model: str) -> dict:
    """The allowance's two stated constants, measured in one fresh process.

    Tokenizer: the RSS a loaded tokenizer adds (transformers and tokenizers
    imported before, so their code counts as runtime), per vocabulary entry.
    Runtime: the RSS of a process that has loaded the model and its
    tokenizer and served one short request, less the weights, the tokenizer
    and the KV pool.
    """
    import tokenizers  # noqa: F401  (the runtime's, not the tokenizer's)
    import transformers  # noqa: F401

    from paperback.engine.llm import LLMEngine
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model
    from paperback.loading.tokenizer import tokenizer_from_gguf
    from paperback.memory import module_bytes, release_freed_heap
    from paperback.plan.planner import RUNTIME_BYTES, TOKENIZER_BYTES_PER_ENTRY

    lm = load_model(model, "bf16", with_tokenizer=False)
    if lm.source.kind != "gguf":
        raise SystemExit(f"{model}: the allowance check reads a GGUF model's own tokenizer")
    weights = module_bytes(lm.model)
    release_freed_heap()
    before = _rss_bytes()
    lm.tokenizer = tokenizer_from_gguf(lm.source.path)
    release_freed_heap()
    tokenizer = _rss_bytes() - before
    engine = LLMEngine(lm, kv="fp16", num_blocks=64)
    engine.add_request(lm.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=8))
    engine.run()
    release_freed_heap()
    runtime = _rss_bytes() - weights - tokenizer - engine.pool.nbytes
    vocab = lm.model.config.vocab_size
    return {"model": model, "vocab_size": vocab, "runtime_bytes": runtime, "tokenizer_bytes": tokenizer,
            "tokenizer_bytes_per_entry": tokenizer / vocab, "stated_runtime_bytes": RUNTIME_BYTES,
            "stated_tokenizer_bytes_per_entry": TOKENIZER_BYTES_PER_ENTRY}


def run_allowance(models: list[str]) -> None:
    from paperback.cli.output import print_table

    rows = [run_worker([__file__, "--allowance-worker", model], f"allowance {model}") for model in models]
    mib = 2 ** 20
    print_table("the runtime allowance's constants: stated (paperback/plan/planner.py) vs measured",
                ["model", "runtime stated MiB", "runtime measured MiB", "tokenizer stated B/entry",
                 "tokenizer measured B/entry", "tokenizer measured MiB"],
                [[r["model"], f"{r['stated_runtime_bytes'] / mib:.0f}", f"{r['runtime_bytes'] / mib:.0f}",
                  r["stated_tokenizer_bytes_per_entry"], f"{r['tokenizer_bytes_per_entry']:.0f}",
                  f"{r['tokenizer_bytes'] / mib:.0f}"] for r in rows])
    write_results("plan_allowance.json", {"rows": rows})


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--kv-cache-dtype", "--kv", dest="kv", nargs="+", default=["fp16", "int8", "kivi2"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--markdown", action="store_true", help="print the JSON's table as Markdown (README) and exit")
    parser.add_argument("--allowance", action="store_true",
                        help="measure the runtime allowance's stated constants (runtime, tokenizer) instead")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--allowance-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.allowance_worker:
        print(json.dumps(allowance_worker(args.allowance_worker)))
        return 0
    if args.allowance:
        run_allowance(args.models)
        return 0
    if args.markdown:
        print(markdown(json.loads((RESULTS / "plan_check.json").read_text())["rows"]))
        return 0
    if args.worker:
        model, kv, context, users = args.worker
        print(json.dumps(worker(model, kv, int(context), int(users))))
        return 0

    from paperback.cli.output import print_table

    rows = []
    for model in args.models:
        for kv in args.kv:
            for context in args.contexts:
                for users in args.users:
                    rows.append(run_worker([__file__, "--worker", model, kv, str(context), str(users)],
                                           f"{model} {kv} {context} x {users}"))
    mib = 2 ** 20

    def key(row):
        return row["model"], row["kv"], row["context"], row["users"]

    # Rows of other configurations in the JSON stay (a run of one model keeps the other's).
    earlier = read_results("plan_check.json")
    done = {key(r) for r in rows}
    kept = [r for r in earlier.get("rows", []) if key(r) not in done]

    def ratio(a, b):
        return f"{a / b:.3f}" if b else "-"

    print_table("predicted (paperback plan) vs measured (engine, bf16), MiB",
                ["model", "KV", "context", "users", "weights pred", "weights meas", "ratio", "KV pred",
                 "KV meas", "ratio", "total pred", "peak RSS", "ratio"],
                [[r["model"], r["kv"], r["context"], r["users"], f"{r['weights_predicted'] / mib:.1f}",
                  f"{r['weights_measured'] / mib:.1f}", ratio(r["weights_measured"], r["weights_predicted"]),
                  f"{r['kv_predicted'] / mib:.2f}", f"{r['kv_measured'] / mib:.2f}",
                  ratio(r["kv_measured"], r["kv_predicted"]),
                  f"{r['total_predicted'] / mib:.0f}", f"{r['peak_rss'] / mib:.0f}",
                  ratio(r["peak_rss"], r["total_predicted"])] for r in rows])
    write_results("plan_check.json", {"rows": sorted(kept + rows, key=lambda r: (
        ["smollm2", "gemma3"].index(r["model"]) if r["model"] in ("smollm2", "gemma3") else 2, *key(r)))},
        kept_from=earlier if kept else None)
    return 0


if __name__ == "__main__":
    sys.exit(run())
