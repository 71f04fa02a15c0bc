"""`paperback plan MODEL --memory 24GiB --context 32768 --users 8`: which store limits, which lever to pull."""

from __future__ import annotations

import argparse
from pathlib import Path

from paperback.cli.common import add_json_arg, kv_cache_dtype_name
from paperback.cli.output import note, print_json, print_table
from paperback.loading.sources import DEFAULT_MODEL


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory plan from a model's config: weights vs KV cache, what fits",
                       description="Bytes of weights and of KV cache from the configuration alone (the same byte "
                                   "counts the engine sizes its pool with), for every weight scheme and KV format, "
                                   "against a memory budget: the bottleneck, the lever to pull first, the largest "
                                   "context and the most users that fit, and the equivalent vLLM / llama.cpp flags.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a preset (llama-2-7b, llama-3.1-8b, llama-3.1-70b, mistral-7b, qwen2.5-7b, "
                        "qwen2.5-72b, gemma-3-27b, mixtral-8x7b, smollm2, gemma3), a config.json, a model "
                        "directory or a .gguf file (default: %(default)s)")
    p.add_argument("--memory", required=True, help="device memory, like 24GiB or 80GB")
    p.add_argument("--context", type=int, default=4096, help="tokens per conversation (default 4096)")
    p.add_argument("--users", type=int, default=1, help="concurrent conversations (default 1)")
    p.add_argument("--weights", nargs="+", default=None, help="weight schemes (default fp16 W8 W4 W3; for a quantized "
                                                                  "checkpoint, its own scheme plus these)")
    p.add_argument("--kv-cache-dtype", "--kv", dest="kv", nargs="+", default=None, type=kv_cache_dtype_name,
                   help="KV cache formats to plan, as `serve` takes them (default fp16 fp8 int8 int4 kivi2)")
    p.add_argument("--kv-skip-layers", default=None,
                   help="layers every KV format keeps at fp16: indices, ranges (0-3), global or sliding")
    p.add_argument("--kv-policy", default=None,
                   help="a per-layer KV policy JSON file (as eval and serve take), planned as one more KV row")
    p.add_argument("--kv-memory", default=None,
                   help="also show what a KV pool of this size holds per KV format, laid out as `paperback serve "
                        "--kv-memory` lays it out (its defaults: blocks of 16, 32 sequences, 512-token steps)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk the activation allowance is sized for")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of memory against context per scheme")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.cli.serve_cmd import parse_bytes
    from paperback.plan.planner import KV_FORMATS, WEIGHT_SCHEMES, plan
    from paperback.plan.shape import load_shape

    memory = parse_bytes(args.memory)
    if args.context <= 0 or args.users <= 0:
        from paperback.errors import PaperbackError

        raise PaperbackError("--context and --users must be positive")
    shape = load_shape(args.model)
    weights, known = tuple(args.weights or WEIGHT_SCHEMES), {}
    if (Path(args.model) / "recipe.json").is_file():  # a quantized checkpoint: its own weights come first
        from paperback.plan.arithmetic import checkpoint_weight_bytes

        label, stored = checkpoint_weight_bytes(Path(args.model))
        label = f"{label} (this checkpoint)"
        known[label] = stored
        weights = (label,) + tuple(args.weights or ())
    kv_labels, policies = kv_rows(shape, tuple(args.kv or KV_FORMATS), args.kv_skip_layers, args.kv_policy)
    from paperback.quantization.checkpoint import checkpoint_kv_policy

    fitted = checkpoint_kv_policy(args.model)
    if fitted is not None:  # a fitted checkpoint: its own per-layer KV formats come first
        from paperback.kv.policy import build_policy

        policies["this checkpoint's KV policy"] = build_policy(shape, spec=fitted)
        kv_labels = ("this checkpoint's KV policy",) + kv_labels
    report = plan(shape, memory, args.context, args.users, weights, kv_labels, args.chunk, known, policies)
    if args.kv_memory:
        from paperback.plan.planner import kv_capacity

        report["kv_capacity"] = {"kv_memory": parse_bytes(args.kv_memory),
                                 "rows": kv_capacity(shape, kv_labels, parse_bytes(args.kv_memory), policies)}
    if args.plot:
        write_plot(shape, report, args.plot, policies)
    if args.json:
        print_json(report)
        return 0
    gib = 2 ** 30
    rows = [[r["weights"], r["kv"], f"{r['kv_bytes_per_token'] / 2**10:.1f}", f"{r['kv_bytes_4k'] / gib:.2f}",
             f"{r['kv_bytes_32k'] / gib:.2f}", f"{r['kv_bytes_at_context'] / gib:.2f}",
             f"{r['weight_bytes'] / gib:.2f}" + (f" (+{r['weight_overhead_bytes'] / gib:.2f} scales)"
                                                  if r["weight_overhead_bytes"] else ""),
             f"{r['total_bytes'] / gib:.2f}", f"{r['headroom_bytes'] / gib:+.2f}", "yes" if r["fits"] else "no",
             r["max_context"], r["max_users"]] for r in report["rows"]]
    parts = report["allowance"]
    print_table(f"{shape.name}: {args.users} x {args.context} tokens in {memory / gib:.1f} GiB "
                f"(runtime allowance {parts['total'] / gib:.2f} GiB: runtime {parts['runtime'] / gib:.2f}, "
                f"tokenizer {parts['tokenizer'] / gib:.2f}, activations {parts['activations'] / gib:.2f}, "
                f"logits {parts['logits'] / gib:.2f})",
                ["weights", "KV", "KiB/token", "KV 4k GiB", "KV 32k GiB", f"KV x{args.users} GiB", "weights GiB",
                 "total GiB", "headroom", "fits", f"max ctx ({args.users} users)", f"max users ({args.context})"],
                rows)
    if "kv_capacity" in report:
        capacity = report["kv_capacity"]
        print_table(f"a KV pool of {capacity['kv_memory'] / 2**20:,.0f} MiB, as `paperback serve` lays it out",
                    ["KV", "tokens held", "blocks", "block size", "running sequences", "exact staging MiB"],
                    [[r["kv"], f"{r['tokens']:,}", f"{sum(r['num_blocks']):,}", r["block_size"], r["max_num_seqs"],
                      f"{r['stage_bytes'] / 2**20:.1f}"] for r in capacity["rows"]])
    verdict = report["verdict"]
    if "warning" in verdict:
        note(f"warning: {verdict['warning']}")
    base = report["rows"][0]
    note(f"bottleneck with {base['weights']} weights and a {base['kv']} cache: {verdict['bottleneck']}")
    note(f"lever: {verdict['lever']}" if verdict["lever"] else verdict["nearest"])
    flags = report["flags"]
    note(f"vLLM: vllm serve {flags['vllm_model']} {flags['vllm']}")
    for line in flags["vllm_notes"]:
        note(f"  {line}")
    note(f"llama.cpp: llama-server -m {flags['llama_cpp_model']} {flags['llama_cpp']}")
    for line in flags["llama_cpp_notes"]:
        note(f"  {line}")
    if args.plot:
        note(f"plot: {args.plot}")
    return 0


def kv_rows(shape, formats: tuple[str, ...], skip_layers: str | None, policy_file: str | None):
    """(row labels, {label: per-layer policy}) for the KV formats, skipped layers and a policy file."""
    from paperback.kv.policy import build_policy

    labels, policies = [], {}
    for kv in formats:
        if skip_layers:
            label = f"{kv} (fp16 at {skip_layers})"
            policies[label] = build_policy(shape, kv, skip_layers)
            labels.append(label)
        else:
            labels.append(kv)
    if policy_file:
        label = f"policy {Path(policy_file).name}" + (f" (fp16 at {skip_layers})" if skip_layers else "")
        policies[label] = build_policy(shape, None, skip_layers, policy_file)
        labels.append(label)
    return tuple(labels), policies


def write_plot(shape, report: dict, path: Path, policies: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paperback.plan.arithmetic import kv_bytes

    contexts = [2 ** k for k in range(9, 18) if 2 ** k <= shape.max_position_embeddings]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    gib = 2 ** 30
    for r in report["rows"]:
        fixed = r["weight_bytes"] + report["allowance"]["total"]
        kv = (policies or {}).get(r["kv"]) or r["kv"]
        ax.plot(contexts, [(fixed + kv_bytes(shape, c, kv, report["users"])) / gib for c in contexts],
                marker=".", label=f"{r['weights']} / {r['kv']}")
    ax.axhline(report["memory"] / gib, color="k", lw=2, label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens per user)")
    ax.set_ylabel(f"memory for {report['users']} users (GiB)")
    ax.set_title(f"{shape.name}: weights + KV cache + runtime allowance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
