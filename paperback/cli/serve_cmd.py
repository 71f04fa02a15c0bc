"""`paperback serve [MODEL]`: an OpenAI-compatible HTTP server over the paged engine."""

from __future__ import annotations

import argparse
import signal
import threading

from paperback.cli.common import add_dtype_arg, add_kernel_args, add_model_arg, kv_cache_dtype_name
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
                                   "/tokenize, /detokenize, /version, /health and /metrics (Prometheus, vLLM's "
                                   "series). vLLM's flag names are accepted; paperback's older names stay as "
                                   "aliases.")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--kv-cache-dtype", "--kv", dest="kv", default="auto", type=kv_cache_dtype_name,
                   help="KV cache format of every layer (auto, fp32, fp16, bf16, fp8, int8, int4, kivi2, kivi4, "
                        "pnmix, with settings and retention (sink=, window=) as in `paperback eval "
                        "--kv-cache-dtype`); default (auto): the policy a fitted checkpoint carries, else fp32")
    from paperback.kernels.settings import CHOICES  # here: it reads PAPERBACK_*, whose errors main() reports

    p.add_argument("--kv-scores", choices=CHOICES["kv_scores"], default="fp32",
                   help="how decode attention scores integer-coded keys (int8/int4/int2, KIVI): fp32 (codes decoded, "
                        "exact; the default) or int8 (each query rounded to int8 and multiplied with the codes by "
                        "integer dot products, as llama.cpp does for quantized K; faster, needs AVX-512 VNNI and "
                        "VBMI, else fp32; its measured cost: docs/kv-cache.md)")
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
    p.add_argument("--max-num-batched-tokens", "--max-step-tokens", dest="max_step_tokens", type=int, default=512,
                   help="token budget of one step (chunked prefill; default 512)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 429")
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto",
                   help="when the pool runs out of blocks, the newest sequence is preempted: its blocks copied to "
                        "host memory and back (swap), freed and its tokens prefilled again later (recompute), or "
                        "whichever is measured cheaper for that sequence (auto, default)")
    p.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of host memory for swapped-out KV blocks, outside the KV budget (default 4; 0: never "
                        "swap)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes already computed (default on)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)
    p.add_argument("--served-model-name", "--served-name", dest="served_name", default=None,
                   help="model name the API reports and requests must name (default: the model's)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY or none)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) for models that carry none")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model and cache live")
    p.add_argument("--max-body-size", default="4MiB", help="largest request body accepted (default 4MiB)")
    add_dtype_arg(p)
    add_kernel_args(p)
    p.set_defaults(func=run)


def kv_cache_dtype(value: str | None) -> str | None:
    """--kv-cache-dtype (already in paperback's names: common.kv_cache_dtype_name) as a KV format, None for the
    default policy."""
    return None if value in (None, "auto") else value


def bind(host: str, port: int):
    """The listening socket, bound before the model loads so a busy port fails in a second, not a minute."""
    import socket

    from paperback.errors import PaperbackError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PaperbackError(f"cannot resolve --host {host}: {exc}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PaperbackError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server there? "
                             f"pick another --port)") from None
    return sock


def read_chat_template(value: str) -> str:
    from pathlib import Path

    from paperback.errors import PaperbackError

    path = Path(value)
    if "{" in value:  # the template itself, as vLLM accepts
        text = value
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PaperbackError(f"--chat-template {value}: cannot read it ({exc})") from None
    try:
        import jinja2

        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise PaperbackError(f"--chat-template: not a valid Jinja template ({exc.message}, line {exc.lineno})") \
            from None
    return text


def capacity_lines(engine, kv_memory: int) -> list[str]:
    """What the KV budget holds, as the engine laid it out, beside what fp16 KV would hold in it."""
    from paperback.engine.pool_layout import pool_layout
    from paperback.kv import build_policy

    layout, config = engine.layout, engine.model.config
    fp16 = pool_layout(config, build_policy(config, "fp16"), kv_memory, block_size=layout.block_size,
                       max_num_seqs=layout.requested_num_seqs, max_step_tokens=layout.max_step_tokens,
                       max_model_len=engine.max_model_len)
    pools = " + ".join(f"{n:,}" + (f" (window {g.window})" if g.window else "")
                       for g, n in zip(layout.groups, layout.num_blocks))
    lines = [f"KV cache: {kv_memory / 2**20:,.0f} MiB hold {layout.tokens:,} tokens in {pools} blocks of "
             f"{layout.block_size} ({engine.policy.label}; fp16 KV would hold {fp16.tokens:,})"]
    if layout.stage_blocks:
        capped = (f", capped from {layout.requested_num_seqs} to fit the budget"
                  if layout.max_num_seqs < layout.requested_num_seqs else "")
        lines.append(f"exact staging: {layout.stage_bytes / 2**20:,.1f} MiB in 16-bit for up to "
                     f"{layout.max_num_seqs} running sequences{capped}")
    return lines


def run(args: argparse.Namespace) -> int:
    import os

    import torch
    import uvicorn

    from paperback.engine.llm import LLMEngine
    from paperback.kernels.attention import kv_scores_in_effect, set_kv_scores
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.errors import PaperbackError
    from paperback.kv import build_policy, parse_kv_scheme
    from paperback.loading import load_model
    from paperback.memory import module_bytes
    from paperback.quantization.checkpoint import checkpoint_kv_policy
    from paperback.server.app import create_app
    from paperback.server.async_engine import AsyncEngine

    if args.memory and args.kv_memory:
        raise PaperbackError("give either --memory (total) or --kv-memory (the KV pool alone), not both")
    kv_memory = parse_bytes(args.kv_memory or "1GiB")
    total = parse_bytes(args.memory) if args.memory else None
    max_body = parse_bytes(args.max_body_size)
    if not 0 <= args.swap_space < float("inf"):
        raise PaperbackError(f"--swap-space must be at least 0 GiB and finite, got {args.swap_space}")
    swap_space = int(args.swap_space * 2 ** 30)
    kv_format = kv_cache_dtype(args.kv)
    if kv_format is not None:
        parse_kv_scheme(kv_format)  # a bad format fails before the model loads
    if args.device == "cuda" and not torch.cuda.is_available():
        raise PaperbackError("--device cuda: this machine has no CUDA device")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    sock = bind(args.host, args.port)
    try:
        lm = load_model(args.model, args.dtype)
        if args.device == "cuda":
            lm.model.to("cuda")
        if template is not None:
            lm.tokenizer.template_override = template
        if total is not None:
            weights = module_bytes(lm.model)
            kv_memory = total - weights
            if kv_memory <= 0:
                raise PaperbackError(f"--memory {args.memory} does not even hold the weights "
                                     f"({weights / 2**20:.0f} MiB)")
        fitted = None
        if kv_format is None and args.kv_policy is None and args.kv_skip_layers is None:
            fitted = checkpoint_kv_policy(lm.source.path)
        kv = kv_format if kv_format is not None or fitted is not None else "fp32"
        policy = build_policy(lm.config, kv, args.kv_skip_layers, args.kv_policy, spec=fitted)
        engine = LLMEngine(lm, kv=policy, kv_memory=kv_memory, block_size=args.block_size,
                           prefix_caching=args.enable_prefix_caching,
                           scheduler=SchedulerConfig(args.max_num_seqs, args.max_step_tokens,
                                                     args.preemption_mode),
                           max_model_len=args.max_model_len, swap_space=swap_space)
    except BaseException:
        sock.close()
        raise
    name = args.served_name or lm.source.label
    runner = AsyncEngine(engine, max_waiting=args.max_waiting, model_name=name, own_thread=False)
    note(f"serving {name} on http://{args.host}:{args.port}/v1 (up to {engine.max_model_len} tokens a request"
         f"{'; API key required' if api_key else ''})")
    for line in capacity_lines(engine, kv_memory):
        note(line)
    set_kv_scores(args.kv_scores)
    if args.kv_scores == "int8" and kv_scores_in_effect() != "int8":
        note("--kv-scores int8: this CPU lacks AVX-512 VNNI or VBMI (or the paged kernel was not built); keys are "
             "scored in fp32")
    app = create_app(runner, name, api_key=api_key, max_body_bytes=max_body)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="paperback-http")

    def stop(*_):  # the first signal: finish what is in flight, then exit; a second one: exit now
        server.force_exit = server.should_exit
        server.should_exit = True

    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    http.start()
    try:
        runner.run(keep_going=http.is_alive)  # the engine on this thread, the one that loaded the model
    finally:
        server.should_exit = True
        http.join()
        note(shutdown_line(runner.shutdown()))
        sock.close()
    return 0


def shutdown_line(left: dict) -> str:
    """What the server let go at exit: open requests failed, and whether every KV block went back."""
    if left["blocks_held"] is None:
        return "shut down: the engine was still inside a step after 30 s; nothing more was checked"
    freed = ("every KV block free, every staging slot free" if not left["blocks_held"] and not left["staging_held"]
             else f"{left['blocks_held']} KV blocks and {left['staging_held']} staging slots still held")
    return f"shut down: {left['failed']} open requests failed; {freed}"
