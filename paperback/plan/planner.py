"""A plan: weights plus KV cache plus a runtime allowance against a memory budget, for every scheme pair.

For each weight scheme x KV format the planner gives the bytes, whether the
workload (context x users) fits, the largest context that fits for the given
users and the most users that fit at the given context. The verdict names
the store that dominates the baseline (fp16 weights, fp16 cache) and the
lever to pull first: the cheapest change, counted in bits given up, that
makes the workload fit. Flags translate a plan for vLLM and llama.cpp.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from paperback.errors import PaperbackError
from paperback.kv.schemes import parse_kv_scheme
from paperback.kv.policy import KVPolicy
from paperback.plan.arithmetic import WeightBytes, kv_bytes, kv_bytes_per_token, layer_kv_schemes, weight_bytes
from paperback.plan.shape import ModelShape
from paperback.quantization.scheme import QuantScheme

# The runtime allowance's fixed parts, stated constants. `benchmarks/bench_plan.py --allowance` measures
# what they stand for (RSS, Linux): a process that has loaded a default model and served one short request
# holds 345-347 MiB besides weights, tokenizer and KV pool, and the tokenizer 460 B per vocabulary entry on
# SmolLM2 (BPE, 22 MiB) and 1,082 B on Gemma 3 (SentencePiece, 270 MiB). The two constants' sum matches the
# measured runtime + tokenizer within 2% on both models (364 vs 369 MiB, 624 vs 615 MiB), which is what the
# plan's total needs; the split between the two parts is not measured-exact.
RUNTIME_BYTES = 304 * 2 ** 20
TOKENIZER_BYTES_PER_ENTRY = 1280
ATTENTION_KEYS_PER_STEP = 512  # keys the paged attention scores at once (32 blocks of 16)
WEIGHT_SCHEMES = ("fp16", "W8", "W4", "W3")
KV_FORMATS = ("fp16", "fp8", "int8", "int4", "kivi2")
# llama.cpp cache types by KV format (-ctk / -ctv); vLLM --kv-cache-dtype
# paperback's int8 / int4 caches are per token in groups of 32 channels with a scale and a minimum: llama.cpp's
# q8_0 holds 8-bit groups of 32 (symmetric) and q4_1 is 4-bit groups of 32 with a scale and a minimum.
LLAMA_CPP_KV = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "int8": "q8_0", "int4": "q4_1"}
# What vLLM holds on the GPU besides weights and KV blocks, as the fraction --gpu-memory-utilization covers:
# the CUDA context and cuBLAS workspaces (about 0.5 GiB), CUDA graphs (about 1 GiB at the default capture sizes)
# and the activations of one scheduled batch. Stated, not measured here (no GPU); vLLM's own profiling at start
# shrinks the KV pool if it is short.
CUDA_ALLOWANCE = 2 * 2 ** 30
VLLM_KV = {"fp16": "auto", "bf16": "auto", "fp8": "fp8_e4m3", "fp8-e4m3": "fp8_e4m3", "fp8-e5m2": "fp8_e5m2"}


def parse_weight_scheme(label: str) -> str | QuantScheme:
    """fp32 / fp16 / bf16, W8 (per channel, symmetric), W4 / W3 (g128 asym), W2 (g64), or W4a-g64 style labels."""
    if label in ("fp32", "fp16", "bf16"):
        return label
    short = {"W8": QuantScheme(8, None, True), "W4": QuantScheme(4, 128, False), "W3": QuantScheme(3, 128, False),
             "W2": QuantScheme(2, 64, False)}
    if label in short:
        return short[label]
    m = re.fullmatch(r"W(\d)([as])-(ch|g\d+)", label)
    if not m:
        raise PaperbackError(f"unknown weight scheme '{label}' (fp16, bf16, fp32, W8, W4, W3, W2 or like W4a-g64)")
    return QuantScheme(int(m[1]), None if m[3] == "ch" else int(m[3][1:]), m[2] == "s")


@dataclass
class RuntimeAllowance:
    """What a serving process holds besides weights and KV cache, part by part."""
    runtime: int  # interpreter and libraries
    tokenizer: int
    activations: int  # one prefill chunk through one layer, fp32
    logits: int  # the rows sampled in one step: one per running sequence

    @property
    def total(self) -> int:
        return self.runtime + self.tokenizer + self.activations + self.logits

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def runtime_allowance(shape: ModelShape, chunk: int = 512, users: int = 1) -> RuntimeAllowance:
    """The runtime, the tokenizer, fp32 activations of one `chunk`-token prefill step, and logits for `users` rows.

    Activations per chunk token: the residual stream and its normed copy, the attention output and the
    projected queries (4 x hidden), the MLP's gate and up products (2 x intermediate per active expert),
    and the scores and probabilities against one step of keys per query head. Logits are computed only
    for the rows a step samples, and softmax makes a second copy.
    """
    per_token = (4 * shape.hidden_size + 2 * shape.active_mlp_size(shape.moe_layers > 0)
                 + 2 * shape.num_heads * ATTENTION_KEYS_PER_STEP)
    return RuntimeAllowance(RUNTIME_BYTES, TOKENIZER_BYTES_PER_ENTRY * shape.vocab_size, chunk * per_token * 4,
                            2 * users * shape.vocab_size * 4)


@dataclass
class PlanRow:
    weights: str
    kv: str
    weight_bytes: int
    weight_overhead_bytes: int
    kv_bytes_per_token: float
    kv_bytes_at_context: float  # for all users
    kv_bytes_4k: float  # one user
    kv_bytes_32k: float
    total_bytes: float
    headroom_bytes: float
    fits: bool
    max_context: int  # for the requested users
    max_users: int  # at the requested context

    def to_dict(self) -> dict:
        return asdict(self)


def _max_fitting(lo: int, hi: int, fits) -> int:
    """Largest n in [lo, hi] with fits(n) (fits is monotone), or lo - 1."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan(shape: ModelShape, memory: int, context: int, users: int, weight_schemes=WEIGHT_SCHEMES,
         kv_formats=KV_FORMATS, chunk: int = 512, known_weights: dict[str, WeightBytes] | None = None,
         kv_policies: dict[str, KVPolicy] | None = None) -> dict:
    """known_weights: weight bytes already counted (a checkpoint's, by label), used instead of the arithmetic.
    kv_policies: per-layer KV policies by the label they appear under in kv_formats."""
    if memory <= 0 or context <= 0 or users <= 0:
        raise PaperbackError("memory, context and users must be positive")
    longest = max(context, shape.max_position_embeddings)
    allowance = runtime_allowance(shape, chunk, users)
    rows = []
    for w_label in weight_schemes:
        w = (known_weights or {}).get(w_label) or weight_bytes(shape, parse_weight_scheme(w_label))
        for kv_label in kv_formats:
            kv = (kv_policies or {}).get(kv_label) or parse_kv_scheme(kv_label)
            for scheme in layer_kv_schemes(shape, kv):
                scheme.check_head_dim(shape.head_dim)
            fixed = w.total + allowance.total

            def fits(ctx, n, _kv=kv, _w=w.total):
                return _w + runtime_allowance(shape, chunk, n).total + kv_bytes(shape, ctx, _kv, n) <= memory

            cache = kv_bytes(shape, context, kv, users)
            total = fixed + cache
            rows.append(PlanRow(
                w_label, kv_label, w.total, w.quantized_overhead, kv_bytes_per_token(shape, kv), cache,
                kv_bytes(shape, 4096, kv), kv_bytes(shape, 32768, kv), total, memory - total, total <= memory,
                max(0, _max_fitting(1, longest, lambda c: fits(c, users))),
                max(0, _max_fitting(1, 1 << 20, lambda n: fits(context, n)))))
    base = next((r for r in rows if r.weights == weight_schemes[0] and r.kv == kv_formats[0]), rows[0])
    bottleneck = "KV cache" if base.kv_bytes_at_context > base.weight_bytes else "weights"
    verdict = {"bottleneck": bottleneck, "baseline_fits": base.fits}
    if context > shape.max_position_embeddings:  # the arithmetic holds; the model was not trained that long
        verdict["warning"] = (f"context {context} is beyond the {shape.max_position_embeddings} positions "
                              f"{shape.name} was trained for")
    fitting = [r for r in rows if r.fits]
    if base.fits:
        verdict["lever"] = "none needed: the baseline fits"
    elif fitting:
        # Cheapest in precision given up: fewest weight bits lost plus cache bits lost, in that store's share.
        def cost(r):
            return (base.weight_bytes - r.weight_bytes) / base.total_bytes + \
                (base.kv_bytes_at_context - r.kv_bytes_at_context) / base.total_bytes
        best = min(fitting, key=cost)
        verdict["lever"] = f"weights {best.weights}, KV {best.kv}"
        verdict["lever_row"] = best.to_dict()
    else:
        nearest = max(rows, key=lambda r: (r.max_users, r.max_context))
        verdict["lever"] = None
        verdict["lever_row"] = nearest.to_dict()
        verdict["nearest"] = (f"nothing fits {users} x {context} tokens in {memory / 2**30:.1f} GiB; nearest: weights "
                              f"{nearest.weights}, KV {nearest.kv} serves {nearest.max_users} users at {context} "
                              f"tokens or {users} users at {nearest.max_context} tokens")
    chosen = verdict.get("lever_row") or base.to_dict()
    return {"model": shape.name, "source": shape.source, "memory": memory, "context": context, "users": users,
            "allowance": allowance.to_dict(), "rows": [r.to_dict() for r in rows], "verdict": verdict,
            "flags": hand_off_flags(chosen, context, users, memory, shape)}


def kv_capacity(shape: ModelShape, kv_formats, kv_memory: int, kv_policies: dict[str, KVPolicy] | None = None,
                max_model_len: int | None = None, block_size: int = 16, max_num_seqs: int = 32,
                max_step_tokens: int = 512) -> list[dict]:
    """Per KV format, what a pool of `kv_memory` bytes holds as the paged engine lays it out
    (`paperback.engine.pool_layout`, the same function the engine sizes its pool with): tokens, blocks,
    the running sequences its exact staging allows, and that staging's bytes. The defaults are
    `paperback serve`'s."""
    from paperback.engine.pool_layout import pool_layout
    from paperback.kv.policy import build_policy

    rows = []
    for label in kv_formats:
        kv = (kv_policies or {}).get(label) or build_policy(shape, label)
        layout = pool_layout(shape, kv, kv_memory, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_step_tokens=max_step_tokens, max_model_len=max_model_len)
        rows.append({"kv": label, **layout.to_dict()})
    return rows


def hand_off_flags(row: dict, context: int, users: int, memory: int, shape: ModelShape) -> dict:
    """The same plan as vLLM and llama.cpp command lines: the model each engine reads (a paperback export for
    quantized weights), the flags, and notes on what an engine cannot take as planned."""
    weights, kv = row["weights"], row["kv"]
    ours = weights.endswith("(this checkpoint)")
    scheme = None if ours else parse_weight_scheme(weights)
    bits = scheme.bits if isinstance(scheme, QuantScheme) else None
    vllm_notes, cpp_notes = [], []
    vllm_model, cpp_model = "MODEL", "MODEL.gguf"
    if ours or bits in (4, 8):
        vllm_model, cpp_model = "EXPORT", "EXPORT.gguf"
        vllm_notes.append("EXPORT: paperback export CKPT --format compressed-tensors -o EXPORT (vLLM reads its "
                          "quantization_config; no --quantization flag)")
        cpp_notes.append("EXPORT.gguf: paperback export CKPT --format gguf -o EXPORT.gguf")
    elif bits is not None:
        vllm_notes.append(f"vLLM has no kernel for {bits}-bit compressed-tensors weights: quantize to W4 or W8")
        cpp_notes.append(f"no GGUF block type holds {bits}-bit codes as they are: quantize to W4 or W8")
    try:
        stored = parse_kv_scheme(kv)
    except PaperbackError:  # a per-layer policy's label
        stored = None
    vllm_dtype = VLLM_KV.get(kv) or (f"fp8_{stored.dtype}" if stored is not None and stored.family == "fp8" else None)
    vllm = [f"--max-model-len {context}", f"--max-num-seqs {users}"]
    vllm_kv = row["kv_bytes_at_context"]
    if vllm_dtype is None:  # vLLM holds the cache in fp8 instead
        vllm_kv = kv_bytes(shape, context, "fp8", users)
    gpu_bytes = row["weight_bytes"] + vllm_kv + CUDA_ALLOWANCE
    if gpu_bytes <= 0.95 * memory:
        vllm.append(f"--gpu-memory-utilization {math.ceil(100 * gpu_bytes / memory) / 100:.2f}")
        vllm_notes.append(f"--gpu-memory-utilization: (weights + KV + {CUDA_ALLOWANCE / 2**30:.0f} GiB CUDA "
                          f"allowance) / {memory / 2**30:,.0f} GiB of GPU memory")
    else:
        vllm_notes.append(f"--gpu-memory-utilization omitted: weights + KV + {CUDA_ALLOWANCE / 2**30:.0f} GiB of "
                          "CUDA allowance exceed 95% of this memory")
    if vllm_dtype is not None:
        vllm.append(f"--kv-cache-dtype {vllm_dtype}")
    else:
        vllm.append("--kv-cache-dtype fp8_e4m3")
        vllm_notes.append(f"vLLM has no {kv} KV cache: fp8_e4m3 is its fewest bits")
    cpp = [f"-c {context * users}", f"-np {users}"]
    cache_type = LLAMA_CPP_KV.get(kv)
    if cache_type is None and stored is not None:
        cache_type = "q8_0" if stored.family == "fp8" else "q4_1" if stored.bits >= 4 else "q4_0"
        cpp_notes.append(f"llama.cpp has no {kv} cache type: {cache_type} is the closest")
    elif cache_type is None:
        cpp_notes.append(f"llama.cpp takes one cache type for every layer; {kv} has several")
    if cache_type is not None:
        cpp += [f"-ctk {cache_type}", f"-ctv {cache_type}"]
        if cache_type.startswith("q"):
            cpp.append("-fa on")  # llama.cpp quantizes the V cache only with flash attention
    return {"vllm": " ".join(vllm), "vllm_model": vllm_model, "vllm_notes": vllm_notes,
            "llama_cpp": " ".join(cpp), "llama_cpp_model": cpp_model, "llama_cpp_notes": cpp_notes}
