"""What a prefix-cache hit saves in each KV format, inside the engine (no HTTP, no client timing).

    .venv/bin/python benchmarks/bench_prefix_hits.py [--kv-cache-dtype fp16 int8 kivi4] [--clients 16]
        [--budgets 1 2] [--tag NAME]

bench_llamaserver.py's request set (chat requests sharing a 96-token system prompt, rendered with the
model's chat template) on SmolLM2's W4a-g32 checkpoint with a W8 head and int8 decode activations, all
requests given to one `LLMEngine` at once, run to the end, greedy with `ignore_eos`. Each KV format runs with
the prefix cache on and off in a pool of --budgets times the bytes of --clients x --slot-tokens f16 token
states (the llama-server comparison's budget at 1), at most --clients sequences at once. Reported: output
tokens/s over the run, positions the model computed, the prefix-cache hit rate, and the sequences the pool
let run at once (a quantized format's exact staging caps them: `paperback/engine/pool_layout.py`). Writes
benchmarks/results/prefix_hits_smollm2[_<tag>].json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))

import torch  # noqa: E402

from bench_llamacpp import quantized_checkpoint  # noqa: E402
from bench_llamaserver import PAIRS, kv_bytes_per_token, request_set  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402

from paperback.cli.output import print_table  # noqa: E402


def run(lm, kv: str, kv_memory: int, caching: bool, clients: int, requests: list) -> dict:
    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.generation.sampling import SamplingParams

    engine = LLMEngine(lm, kv=kv, kv_memory=kv_memory, prefix_caching=caching,
                       scheduler=SchedulerConfig(max_num_seqs=clients))
    engine.add_request(requests[0][0][:16], SamplingParams(max_tokens=2))  # warm-up: first-call allocations
    engine.run()
    engine.positions_computed = 0
    for ids, max_tokens in requests:
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    running, output_tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished:
        running.append(engine.num_running)
        output_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
    wall = time.perf_counter() - start
    stats = engine.stats()
    return {"kv_cache_dtype": kv, "prefix_caching": caching, "kv_bytes": kv_memory, "wall_s": wall,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / wall,
            "positions_computed": engine.positions_computed,
            "prefix_hit_rate": stats["prefix_hit_rate"] if caching else None,
            "max_num_seqs": engine.layout.max_num_seqs, "mean_running": sum(running) / len(running),
            "steps": len(running)}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["fp16", "int8", "kivi4"])
    parser.add_argument("--clients", type=int, default=16, help="sequences at most at once (default 16)")
    parser.add_argument("--requests", type=int, default=32, help="requests given at once (default 32)")
    parser.add_argument("--slot-tokens", type=int, default=512, help="f16 token states per client (default 512)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0],
                        help="KV budgets as multiples of clients x slot-tokens f16 states (default 1 2)")
    parser.add_argument("--seed", type=int, default=0)
    add_tag_arg(parser)
    args = parser.parse_args()
    os.environ.setdefault("PAPERBACK_DECODE_ACTIVATIONS", "int8")  # as bench_llamaserver.py serves it
    warn_if_busy()
    from paperback.loading import load_model

    checkpoint = quantized_checkpoint("smollm2", "smollm2", PAIRS["smollm2"][1])
    lm = load_model(str(checkpoint))
    chats = request_set(lm.tokenizer, args.requests, args.seed, 96, 192, 128)
    requests = [(lm.tokenizer.encode(lm.tokenizer.apply_chat_template(r.messages), add_special_tokens=False),
                 r.max_tokens) for r in chats]  # as the server renders a chat: the template writes BOS itself
    unit = args.clients * args.slot_tokens * kv_bytes_per_token(checkpoint)
    rows = []
    for scale in args.budgets:
        for kv in args.kv_cache_dtype:
            for caching in (True, False):
                row = {"budget": scale, **run(lm, kv, int(scale * unit), caching, args.clients, requests)}
                print(row, flush=True)
                rows.append(row)
    warn_if_busy(torch.get_num_threads())
    table = []
    for row in rows:
        off = next(r for r in rows if r["budget"] == row["budget"] and r["kv_cache_dtype"] == row["kv_cache_dtype"]
                   and not r["prefix_caching"])
        row["gain_from_hits"] = row["output_tokens_per_s"] / off["output_tokens_per_s"]
        table.append([f"{row['budget']:g}x ({row['kv_bytes'] / 2 ** 20:.0f} MiB)", row["kv_cache_dtype"],
                      "on" if row["prefix_caching"] else "off", str(row["max_num_seqs"]), f"{row['mean_running']:.1f}",
                      f"{row['positions_computed']:,}",
                      f"{row['prefix_hit_rate']:.0%}" if row["prefix_hit_rate"] is not None else "-",
                      f"{row['output_tokens_per_s']:.1f}", f"{row['gain_from_hits']:.2f}x"])
    print_table(f"prefix hits inside the engine: {len(requests)} requests at once, SmolLM2 W4, "
                f"{torch.get_num_threads()} threads",
                ["KV budget", "KV", "prefix cache", "running at most", "running (mean)", "positions computed",
                 "prefix hits", "output tok/s", "x without hits"], table)
    write_results(results_name("prefix_hits_smollm2", args.tag), {
        "model": "smollm2", "checkpoint": PAIRS["smollm2"][1], "threads": torch.get_num_threads(),
        "workload": {"requests": len(requests), "clients": args.clients, "slot_tokens": args.slot_tokens,
                     "seed": args.seed, "system_tokens": 96, "max_prompt": 192, "max_output": 128},
        "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
