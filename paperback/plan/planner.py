"""A plan: weights plus KV cache plus a runtime allowance against a memory budget, for every scheme pair.

For each weight scheme x KV format the planner gives the bytes, whether the
workload (context x users) fits, the largest context that fits for the given
users and the most users that fit at the given context. The verdict names
the store that dominates the baseline (fp16 weights, fp16 cache) and the
lever to pull first: the cheapest change, counted in bits given up, that
makes the workload fit. Flags translate a plan for vLLM and llama.cpp.
"""

from __future__ import annotations

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
LLAMA_CPP_KV = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "int8": "q8_0", "int4": "q4_0"}
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
    per_token = (4 * shape.hidden_size + 2 * shape.intermediate_size * shape.experts_per_token
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
            "flags": hand_off_flags(chosen, context, users, memory)}


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


def hand_off_flags(row: dict, context: int, users: int, memory: int) -> dict:
    """The same plan as vLLM and llama.cpp command-line settings."""
    weights, kv = row["weights"], row["kv"]
    vllm = [f"--max-model-len {context}", f"--max-num-seqs {users}",
            f"--gpu-memory-utilization {min(0.95, max(0.05, row['total_bytes'] / memory)):.2f}"]
    if weights.startswith("W4") or weights.startswith("W3") or weights.startswith("W2"):
        vllm.insert(0, "--quantization gptq")
    elif weights.startswith("W8"):
        vllm.insert(0, "--quantization compressed-tensors")
    vllm.append(f"--kv-cache-dtype {VLLM_KV[kv]}" if kv in VLLM_KV else
                f"# vLLM has no {kv} KV cache; closest: --kv-cache-dtype fp8_e4m3")
    cpp = [f"-c {context * users}", f"-np {users}"]
    if kv in LLAMA_CPP_KV:
        cpp += [f"-ctk {LLAMA_CPP_KV[kv]}", f"-ctv {LLAMA_CPP_KV[kv]}"]
        if LLAMA_CPP_KV[kv].startswith("q"):
            cpp.append("-fa on")  # llama.cpp quantizes the V cache only with flash attention
    else:
        cpp.append(f"# llama.cpp has no {kv} cache type; closest: -ctk q4_0 -ctv q4_0 -fa on")
    return {"vllm": " ".join(vllm), "llama_cpp": " ".join(cpp)}
