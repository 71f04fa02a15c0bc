"""`paperback serve [MODEL]`: an OpenAI-compatible HTTP server over the paged engine."""

from __future__ import annotations

import argparse

from paperback.cli.common import add_dtype_arg, add_model_arg
from paperback.cli.output import note


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    from paperback.errors import PaperbackError

    units = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            lowered, scale = lowered[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        value = float(lowered) * scale
    except ValueError:
        raise PaperbackError(f"bad memory size '{text}' (like 2GiB, 512MiB or a number of bytes)") from None
    if value <= 0:
        raise PaperbackError(f"memory size must be positive, got '{text}'")
    return int(value)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Continuous batching over a paged KV cache: /v1/completions, "
                                   "/v1/chat/completions (stream=true for server-sent events), /v1/models, "
                                   "/health and /metrics (Prometheus).")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv", default=None,
                   help="KV cache format of every layer (fp32, fp16, bf16, fp8, int8, int4, kivi2, kivi4, pnmix, "
                        "with settings and retention (sink=, window=) as in `paperback eval --kv`); default: the "
                        "policy a fitted checkpoint carries, else fp32")
    p.add_argument("--kv-policy", default=None, help="JSON per-layer KV policy (see `paperback eval --help`)")
    p.add_argument("--kv-skip-layers", default=None, help="layers kept at fp16 (indices, ranges, global, sliding)")
    p.add_argument("--kv-memory", default=None, help="memory for the KV block pool (default 1GiB)")
    p.add_argument("--memory", default=None,
                   help="total memory budget: the KV pool gets what remains after the weights")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus completion a request may have (default: the model's context); the KV "
                        "memory is split between layer groups that free blocks differently for sequences this long")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together at most")
    p.add_argument("--max-step-tokens", type=int, default=512, help="token budget of one step (chunked prefill)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 429")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--served-name", default=None, help="model name the API reports (default: the model's)")
    add_dtype_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.loading import load_model
    from paperback.server.app import create_app
    from paperback.server.async_engine import AsyncEngine

    from paperback.kv import build_policy, parse_kv_scheme

    from paperback.errors import PaperbackError
    from paperback.memory import module_bytes

    if args.memory and args.kv_memory:
        raise PaperbackError("give either --memory (total) or --kv-memory (the KV pool alone), not both")
    kv_memory = parse_bytes(args.kv_memory or "1GiB")
    total = parse_bytes(args.memory) if args.memory else None
    if args.kv is not None:
        parse_kv_scheme(args.kv)  # a bad format fails before the model loads
    lm = load_model(args.model, args.dtype)
    if total is not None:
        weights = module_bytes(lm.model)
        kv_memory = total - weights
        if kv_memory <= 0:
            raise PaperbackError(f"--memory {args.memory} does not even hold the weights ({weights / 2**20:.0f} MiB)")
    from paperback.quantization.checkpoint import checkpoint_kv_policy

    fitted = None
    if args.kv is None and args.kv_policy is None and args.kv_skip_layers is None:
        fitted = checkpoint_kv_policy(lm.source.path)
    kv = args.kv if args.kv is not None or fitted is not None else "fp32"
    policy = build_policy(lm.config, kv, args.kv_skip_layers, args.kv_policy, spec=fitted)
    engine = LLMEngine(lm, kv=policy, kv_memory=kv_memory, block_size=args.block_size,
                       prefix_caching=not args.no_prefix_caching,
                       scheduler=SchedulerConfig(args.max_num_seqs, args.max_step_tokens),
                       max_model_len=args.max_model_len)
    runner = AsyncEngine(engine, max_waiting=args.max_waiting)
    name = args.served_name or lm.source.label
    pools = " + ".join(f"{m.num_blocks} ({len(g.layers)} layers" + (f", window {g.window})" if g.window else ")")
                       for g, m in zip(engine.blocks.groups, engine.blocks.managers))
    note(f"serving {name} on http://{args.host}:{args.port}/v1 (KV blocks of {engine.blocks.block_size} tokens: "
         f"{pools}; up to {engine.max_model_len} tokens a request)")
    try:
        uvicorn.run(create_app(runner, name), host=args.host, port=args.port, log_level="warning")
    finally:
        runner.shutdown()
    return 0
