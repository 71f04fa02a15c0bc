"""Tokens a KV budget holds, per KV format, counted in the engine's own blocks; and the planner's prediction.

    .venv/bin/python benchmarks/bench_capacity.py [--models smollm2 gemma3] [--budgets 64 256 1024]
        [--kv-cache-dtype fp16 fp8 int8 int4 kivi4 kivi2 pnmix] [--markdown]

For each model, budget (MiB of `--kv-memory`) and KV format, uniform and
with the first two layers at fp16, an `LLMEngine` is built as `paperback
serve` builds it (blocks of 16 tokens, up to 32 running sequences, 512-token
steps). Its full-attention block pool is then filled with 256-token
sequences until no block is free, and the tokens it took are counted: the
tokens the budget holds, from the engine. Beside them: the pool's bytes as
allocated (blocks plus 16-bit exact staging), the running sequences the
staging allows, the same count from `paperback plan --kv-memory`
(`paperback.plan.planner.kv_capacity`, from the model's shape alone), and
whether the tokens grow as bits fall (fp16 < fp8/int8 < int4/kivi4 <
kivi2). No timing is measured, so the load average does not matter here.
Writes benchmarks/results/capacity.json.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from results_io import RESULTS, benchmark_parser, write_results  # noqa: E402

MiB = 2 ** 20
CLASSES = [("fp16",), ("fp8", "int8"), ("int4", "kivi4"), ("kivi2",)]


def fill(engine, seq_tokens: int = 256) -> int:
    """Tokens the engine's full-attention pool takes before no block is free (or, with none, the first pool)."""
    from paperback.engine.block_manager import NoFreeBlocks

    group = next((g for g, grp in enumerate(engine.blocks.groups) if not grp.window), 0)
    manager = engine.blocks.managers[group]
    held = seq = 0
    try:
        while True:
            manager.allocate(seq, [1] * seq_tokens)
            held, seq = held + seq_tokens, seq + 1
    except NoFreeBlocks:
        pass
    left = manager.num_free * engine.blocks.block_size  # the last, partial sequence
    return held + left


def measure(model: str, budgets: list[int], formats: list[str]) -> list[dict]:
    from paperback.engine.llm import LLMEngine
    from paperback.kv import build_policy
    from paperback.loading import load_model
    from paperback.plan.planner import kv_capacity
    from paperback.plan.shape import shape_from_config

    lm = load_model(model, "fp32", with_tokenizer=False)
    config = lm.model.config
    shape = shape_from_config(config, model, "")
    rows = []
    for budget in budgets:
        for mixed in (False, True):
            for kv in formats:
                policy = build_policy(config, kv, "0-1" if mixed else None)
                label = f"{kv} (fp16 at 0-1)" if mixed else kv
                engine = LLMEngine(lm, kv=policy, kv_memory=budget * MiB, prefix_caching=False)
                layout = engine.layout
                [predicted] = kv_capacity(shape, [label], budget * MiB, {label: policy})
                row = {"model": model, "budget_mib": budget, "kv": kv, "mixed": mixed, "tokens": fill(engine),
                       "layout_tokens": layout.tokens, "predicted_tokens": predicted["tokens"],
                       "planner_matches": predicted == {"kv": label, **layout.to_dict()},
                       "pool_bytes": engine.pool.nbytes, "stage_bytes": layout.stage_bytes,
                       "blocks": layout.total_blocks, "block_size": layout.block_size,
                       "max_num_seqs": layout.max_num_seqs}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del engine
                gc.collect()
    return rows


def monotone(rows: list[dict]) -> list[str]:
    """Where tokens held fail to grow as bits fall (empty when they always do)."""
    failures = []
    keys = {(r["model"], r["budget_mib"], r["mixed"]) for r in rows}
    for key in sorted(keys):
        tokens = {r["kv"]: r["tokens"] for r in rows if (r["model"], r["budget_mib"], r["mixed"]) == key}
        for fewer, more in zip(CLASSES[1:], CLASSES):
            if all(f in tokens for f in fewer + more) and \
                    min(tokens[f] for f in fewer) <= max(tokens[f] for f in more):
                failures.append(f"{key}: {fewer} do not hold more than {more}")
    return failures


def fp16_tokens(rows: list[dict], row: dict) -> int:
    """The fp16 row's tokens for the same model, budget and layers kept at fp16."""
    return next(r["tokens"] for r in rows if r["kv"] == "fp16" and r["mixed"] == row["mixed"]
                and r["model"] == row["model"] and r["budget_mib"] == row["budget_mib"])


def markdown(rows: list[dict], model: str = "smollm2") -> str:
    budgets = sorted({r["budget_mib"] for r in rows if r["model"] == model})
    lines = ["| KV format | " + " | ".join(f"{b} MiB: tokens (x fp16) | running seqs" for b in budgets) + " |",
             "|---|" + "---|---|" * len(budgets)]
    for kv in dict.fromkeys(r["kv"] for r in rows):
        cells = []
        for b in budgets:
            r = next(r for r in rows if r["model"] == model and r["kv"] == kv and r["budget_mib"] == b
                     and not r["mixed"])
            cells.append(f"{r['tokens']:,} ({r['tokens'] / fp16_tokens(rows, r):.2f}x) | {r['max_num_seqs']}")
        lines.append(f"| {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 1024], help="MiB")
    parser.add_argument("--kv-cache-dtype", "--kv", dest="kv", nargs="+",
                        default=["fp16", "fp8", "int8", "int4", "kivi4", "kivi2", "pnmix"])
    parser.add_argument("--markdown", action="store_true", help="print the JSON's table as Markdown (README) and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads((RESULTS / "capacity.json").read_text())["rows"]))
        return 0
    from paperback.cli.output import print_table

    rows = [r for model in args.models for r in measure(model, args.budgets, args.kv)]
    print_table("tokens a KV budget holds (the engine's blocks, filled), and the planner's count",
                ["model", "MiB", "KV", "tokens", "x fp16", "running seqs", "staging MiB", "planner"],
                [[r["model"], r["budget_mib"], r["kv"] + (" (fp16 at 0-1)" if r["mixed"] else ""),
                  f"{r['tokens']:,}", f"{r['tokens'] / fp16_tokens(rows, r):.2f}", r["max_num_seqs"],
                  f"{r['stage_bytes'] / MiB:.1f}",
                  "equal" if r["planner_matches"] and r["tokens"] == r["predicted_tokens"] else "DIFFERS"]
                 for r in rows])
    failures = monotone(rows)
    for failure in failures:
        print(f"NOT MONOTONE: {failure}", file=sys.stderr)
    write_results("capacity.json", {"rows": rows, "monotone": not failures,
                                    "planner_matches": all(r["planner_matches"] and r["tokens"] == r["predicted_tokens"]
                                                           for r in rows)})
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(run())
