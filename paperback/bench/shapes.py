"""Random-weight checkpoints with the exact shapes of real models, for speed and memory at the sizes people run.

A decode step's cost is set by the shapes it streams (hidden size, layers, heads, KV heads, MLP width,
vocabulary, a tied head or not), not by what the weights learned, so a checkpoint of the right shapes filled
with seeded random values measures what the real model would, and nothing is downloaded. Each shape is written
twice from the same values: a Hugging Face directory (config.json, bf16 safetensors shards, tokenizer) that
paperback quantizes, and an F16 GGUF that `llama-quantize` turns into llama.cpp's own types. Both are written a
tensor at a time, so building a 3B checkpoint holds one tensor in memory, not the model.

The vocabulary is SmolLM2's bundled tokenizer (BPE merges, chat template) padded with reserved control tokens
to the shape's vocabulary size, so both engines tokenize the same text the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from paperback.errors import PaperbackError

LAYOUT_VERSION = 1  # bump when what a shape writes changes: cached checkpoints are rebuilt
SHARD_BYTES = 2 << 30  # safetensors shard size, as Hugging Face's own checkpoints are split
INIT_STD = 0.02  # Llama's initializer range
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
              "down": "ffn_down"}


# What every shape's config.json shares: a Llama decoder as transformers writes it.
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 131072}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family architecture by name and the config.json fields that give its shapes; paperback's own
    reader of config.json turns them into the model's config."""

    name: str
    fields: dict

    def hf_config(self) -> dict:
        return {**LLAMA_CONFIG, **self.fields, "_name_or_path": f"{self.name} (random weights)"}

    @property
    def config(self):
        from paperback.loading.hf_dir import config_from_hf

        return config_from_hf(self.hf_config(), Path(self.name) / "config.json")

    def linears(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each block linear, by short name."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, m = c.hidden_size, c.intermediate_size
        return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (m, h), "up": (m, h), "down": (h, m)}

    def parameter_count(self) -> int:
        c = self.config
        block = sum(o * i for o, i in self.linears().values()) + 2 * c.hidden_size
        head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return c.num_layers * block + c.vocab_size * c.hidden_size + head + c.hidden_size


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The shapes of Meta's Llama 3.2 models (their config.json files).
SHAPES: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_ROPE}),
    "llama-3.2-3b": ModelShape("llama-3.2-3b", {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_ROPE}),
}


def shape_named(name: str) -> ModelShape:
    if name not in SHAPES:
        raise PaperbackError(f"unknown model shape '{name}' (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


def _tensor_plan(shape: ModelShape) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(Hugging Face name, GGUF name, shape as torch holds it, kind) of every tensor, in file order."""
    c = shape.config
    plan = [("model.embed_tokens.weight", "token_embd.weight", (c.vocab_size, c.hidden_size), "embed")]
    for i in range(c.num_layers):
        prefix, blk = f"model.layers.{i}.", f"blk.{i}."
        plan.append((prefix + "input_layernorm.weight", blk + "attn_norm.weight", (c.hidden_size,), "norm"))
        for short, dims in shape.linears().items():
            plan.append((f"{prefix}{HF_NAMES[short]}.weight", f"{blk}{GGUF_NAMES[short]}.weight", dims, short))
        plan.append((prefix + "post_attention_layernorm.weight", blk + "ffn_norm.weight", (c.hidden_size,), "norm"))
    plan.append(("model.norm.weight", "output_norm.weight", (c.hidden_size,), "norm"))
    if not c.tie_word_embeddings:
        plan.append(("lm_head.weight", "output.weight", (c.vocab_size, c.hidden_size), "head"))
    return plan


def random_tensor(name: str, dims: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """The bf16 values of one tensor: seeded by its name, so each tensor is the same whichever file asks."""
    if kind == "norm":
        return torch.ones(dims, dtype=torch.bfloat16)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return (torch.randn(dims, generator=generator) * INIT_STD).to(torch.bfloat16)


def write_hf_dir(shape: ModelShape, out: Path, seed: int = 0) -> None:
    """config.json and bf16 safetensors shards of about SHARD_BYTES, one shard in memory at a time."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    plan = _tensor_plan(shape)
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for hf_name, _, dims, kind in plan:
        nbytes = 2 * int(np.prod(dims))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, dims, kind))
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: random_tensor(name, dims, kind, seed) for name, dims, kind in shard}, out / filename,
                  metadata={"format": "pt"})
        weight_map.update({name: filename for name, _, _ in shard})
    total = sum(2 * int(np.prod(dims)) for _, _, dims, _ in plan)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))


def rope_freq_factors(shape: ModelShape) -> np.ndarray | None:
    """llama.cpp's `rope_freqs.weight`: how much each rotary frequency is divided by under the shape's
    rope scaling (llama.cpp reads Llama 3's scaling from this tensor, not from metadata)."""
    from paperback.models.config import RopeConfig
    from paperback.models.layers import rope_inv_freq

    c = shape.config
    if c.rope.scaling_type == "default":
        return None
    plain = rope_inv_freq(RopeConfig(theta=c.rope.theta), c.head_dim)
    return (plain / rope_inv_freq(c.rope, c.head_dim)).numpy().astype(np.float32)


def _vocabulary(source, size: int) -> dict:
    """tokenizer.ggml.* fields of `source` (a GGUFReader), its token list padded to `size` with reserved
    control tokens."""
    import gguf

    fields = {key: field for key, field in source.fields.items() if key.startswith("tokenizer.")}
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > size:
        raise PaperbackError(f"the source vocabulary has {len(tokens)} tokens, more than the shape's {size}")
    pad = size - len(tokens)
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.CONTROL)] * pad
    return {"fields": fields, "tokens": tokens, "types": types}


def write_f16_gguf(shape: ModelShape, out: Path, vocabulary_source: Path, seed: int = 0) -> None:
    """The same weights as an F16 GGUF (llama.cpp's q/k row order), written tensor by tensor."""
    import gguf

    from paperback.export.gguf_export import permute_rope_rows

    c = shape.config
    source = gguf.GGUFReader(vocabulary_source)
    vocab = _vocabulary(source, c.vocab_size)
    tmp = out.with_name(out.name + f".partial{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in vocab["fields"].items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])

    freqs = rope_freq_factors(shape)
    plan = _tensor_plan(shape)
    for _, gguf_name, dims, kind in plan:  # headers first, then the data tensor by tensor
        dtype = np.float32 if kind == "norm" else np.float16
        writer.add_tensor_info(gguf_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    if freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for hf_name, gguf_name, dims, kind in plan:
            data = random_tensor(hf_name, dims, kind, seed).float().numpy()
            if kind in ("q", "k"):
                data = permute_rope_rows(data, c.num_heads if kind == "q" else c.num_kv_heads)
            writer.write_tensor_data(np.ascontiguousarray(data.astype(np.float32 if kind == "norm" else np.float16)))
        if freqs is not None:
            writer.write_tensor_data(freqs)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class ShapedCheckpoint:
    """Where one shape's files are: a Hugging Face directory and GGUF files by type (F16 and what llama-quantize
    made of it)."""

    shape: ModelShape
    hf_dir: Path
    gguf: dict[str, Path]

    def to_dict(self) -> dict:
        return {"shape": asdict(self.shape), "hf_dir": str(self.hf_dir),
                "gguf": {k: str(v) for k, v in self.gguf.items()}}


def shape_folder(root: Path, shape: ModelShape, seed: int = 0) -> Path:
    """Where under `root` a shape's files live: named by the shape, the seed and the layout, so a change of
    any of them builds anew."""
    key = hashlib.sha256(json.dumps([asdict(shape), seed, LAYOUT_VERSION]).encode()).hexdigest()[:10]
    return root / f"{shape.name}-{key}"


def build_shape(shape: ModelShape, root: Path, vocabulary_source: Path, seed: int = 0,
                quantize: Callable[[Path, Path, str], None] | None = None, gguf_types: tuple[str, ...] = (),
                on_step: Callable[[str], None] = print) -> ShapedCheckpoint:
    """The shape's checkpoint under `root` (built once, then reused): the Hugging Face directory with its
    tokenizer, the F16 GGUF, and `gguf_types` made from the F16 file by `quantize(f16, out, type)`."""
    from paperback.loading.tokenizer import tokenizer_from_gguf

    where = shape_folder(root, shape, seed)
    hf_dir, f16 = where / "hf", where / "F16.gguf"
    if not f16.is_file():
        on_step(f"{shape.name}: writing the F16 GGUF ({shape.parameter_count() / 1e9:.2f}B parameters)")
        where.mkdir(parents=True, exist_ok=True)
        write_f16_gguf(shape, f16, vocabulary_source, seed)
    if not (hf_dir / "config.json").is_file():
        on_step(f"{shape.name}: writing the bf16 safetensors directory")
        partial = where / "hf.partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_hf_dir(shape, partial, seed)
        tokenizer_from_gguf(f16, use_cache=False).hf.save_pretrained(partial)
        os.replace(partial, hf_dir)
    files = {"F16": f16}
    for kind in gguf_types:
        files[kind] = where / f"{kind}.gguf"
        if not files[kind].is_file():
            if quantize is None:
                raise PaperbackError(f"{files[kind]} is not built and no quantizer was given")
            on_step(f"{shape.name}: llama-quantize {kind}")
            quantize(f16, files[kind], kind)
    return ShapedCheckpoint(shape, hf_dir, files)

