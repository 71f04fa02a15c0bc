"""A paperback checkpoint as a GGUF file llama.cpp loads: its codes as llama.cpp's legacy block types.

llama.cpp's legacy types hold 32 weights of one row per block with one fp16
scale (and, for Q4_1, one fp16 offset), so a paperback group of 32 or any
multiple of 32 maps onto whole blocks, each block taking its group's scale:

- symmetric 4-bit (zero point 8): Q4_0, `w = d * (q - 8)`, the same codes and
  scale, bit-exact;
- asymmetric 4-bit: Q4_1, `w = d * q + m` with d the scale and m = -zero x
  scale rounded to fp16 (the one rounding: m is exact whenever the product
  fits fp16's 11 bits);
- symmetric 8-bit (zero point 128, per channel or grouped): Q8_0,
  `w = d * (q - 128)`, bit-exact.

So the codes GPTQ or AWQ chose reach llama.cpp without being rounded again.
Any other scheme is refused before anything is written, naming the ones
that map. Tensors left unpacked (norms, an unquantized embedding) are
written as F32, exactly as paperback holds them.

The tokenizer, chat template and architecture metadata are the source GGUF's,
copied field by field (both bundled models are GGUF files): llama.cpp picks
its pre-tokenizer by name, which only that file records reliably.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_pack import to_bytes
from paperback.quantization.gguf_weight import GGUFWeight
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme

BLOCK = 32  # weights per legacy block


@dataclass(frozen=True)
class BlockType:
    name: str  # gguf.GGMLQuantizationType member
    bits: int
    symmetric: bool


# (bits, symmetric) -> the legacy type that stores paperback's codes as they are.
BLOCK_TYPES = {(4, True): BlockType("Q4_0", 4, True), (4, False): BlockType("Q4_1", 4, False),
               (8, True): BlockType("Q8_0", 8, True)}
EXPRESSIBLE = "W4 symmetric (Q4_0), W4 asymmetric (Q4_1) and W8 symmetric (Q8_0), in groups of 32 or a multiple of " \
              "32, or per channel"


def block_type(scheme: QuantScheme, in_features: int, name: str) -> BlockType:
    """The legacy type that holds `scheme` exactly over rows of `in_features`, or a PaperbackError naming why."""
    kind = BLOCK_TYPES.get((scheme.bits, scheme.symmetric))
    if kind is None:
        raise PaperbackError(f"{name} is {scheme.label}, which GGUF's block types cannot hold without rounding its "
                             f"codes again; GGUF export takes {EXPRESSIBLE}")
    if in_features % BLOCK or (scheme.group_size is not None and scheme.group_size % BLOCK):
        raise PaperbackError(f"{name} is {scheme.label} over {in_features} inputs: GGUF blocks hold 32 weights of "
                             f"one group, so groups (and rows) must be multiples of 32; GGUF export takes "
                             f"{EXPRESSIBLE}")
    return kind


def encode_blocks(q: QuantizedWeight, kind: BlockType) -> np.ndarray:
    """(out, in / 32 x block bytes) uint8: each row's blocks in llama.cpp's layout."""
    codes = q.codes.to(torch.int64)
    out_features, in_features = codes.shape
    sizes = torch.tensor([hi - lo for lo, hi in q.scheme.group_bounds(in_features)])
    # Every block lies inside one group: its scale and zero are that group's (column 32b's).
    scales = q.scales.float().repeat_interleave(sizes, dim=1)[:, ::BLOCK]
    zeros = q.zeros.float().repeat_interleave(sizes, dim=1)[:, ::BLOCK]
    blocks = codes.reshape(out_features, in_features // BLOCK, BLOCK)
    d = scales.numpy().astype(np.float16)[..., None].view(np.uint8)  # (out, nb, 2)
    if kind.bits == 8:
        if not torch.all(zeros == 128):
            raise PaperbackError("a symmetric 8-bit layer without zero point 128 cannot be written as Q8_0")
        qs = (blocks - 128).to(torch.int8).numpy().view(np.uint8)
        parts = [d, qs]
    else:
        qs = (blocks[..., :16] | (blocks[..., 16:] << 4)).to(torch.uint8).numpy()
        if kind.symmetric:
            if not torch.all(zeros == 8):
                raise PaperbackError("a symmetric 4-bit layer without zero point 8 cannot be written as Q4_0")
            parts = [d, qs]
        else:
            m = (-zeros * scales).numpy().astype(np.float16)[..., None].view(np.uint8)
            parts = [d, m, qs]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(out_features, -1))


def permute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama-architecture files (paperback.loading.gguf_file undoes it)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _model_tensors(model):
    """(paperback param name, QuantizedWeight or fp32 tensor) of every weight a GGUF file stores."""
    from paperback.quantization.qlinear import QuantLinear

    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            yield f"{name}.weight", module.to_quantized()
            if module.bias is not None:
                yield f"{name}.bias", module.bias.detach().float()
    packed = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in packed:
            yield name, param.detach().float()


def export_gguf(checkpoint: Path, out: Path, overwrite: bool = False, progress: bool = True) -> dict:
    """Write `checkpoint` (a paperback directory) as the GGUF file `out`; returns what was written."""
    from paperback.loading import load_model
    from paperback.quantization.checkpoint import config_from_recipe, read_recipe

    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not overwrite:
        raise PaperbackError(f"{out} exists; pass --overwrite to replace it")
    recipe = read_recipe(checkpoint)
    config_from_recipe(recipe, checkpoint).require_dense("GGUF export")
    source = Path(str(recipe.get("source_model", "")))
    if source.suffix != ".gguf" or not source.is_file():
        raise PaperbackError(f"{checkpoint} was quantized from {source or 'an unrecorded source'}; GGUF export copies "
                             "the tokenizer and chat template of the GGUF file a checkpoint came from, and that "
                             "file is not here (export from a Hugging Face source is not built yet)")
    lm = load_model(str(checkpoint), "fp32", with_tokenizer=False)
    banded = [n for n, m in lm.model.named_modules() if hasattr(m, "band_of")]
    if banded:
        raise PaperbackError(f"{checkpoint} stores {banded[0]} in bands of vocabulary rows at different schemes "
                             "(paperback's own layout); a GGUF tensor has one type. Fit again with "
                             "--no-head-bands to export it as GGUF")
    tensors = list(_model_tensors(lm.model))
    for name, value in tensors:  # every refusal before a byte is written
        if isinstance(value, QuantizedWeight):
            block_type(value.scheme, value.shape[1], name)
    return write_gguf(source, lm.config, tensors, out, progress)


def value_numel(value) -> int:
    return int(np.prod(value.shape))


def _encoded(value) -> tuple[np.ndarray, object, str]:
    """(data, gguf raw type or None for a float array, type name) of one tensor as GGUF stores it."""
    import gguf

    if isinstance(value, QuantizedWeight):
        kind = block_type(value.scheme, value.shape[1], "tensor")
        return encode_blocks(value, kind), gguf.GGMLQuantizationType[kind.name], kind.name
    if isinstance(value, GGUFWeight):
        data = to_bytes(value)
        raw = gguf.GGMLQuantizationType[value.kind.name] if data.dtype == np.uint8 else None
        return data, raw, value.kind.name
    return value.numpy().astype(np.float32), None, "F32"


# The file type llama.cpp's tools report: that of the type most of the weights take.
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0",
              "Q6_K": "MOSTLY_Q6_K", "Q5_K": "MOSTLY_Q5_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q3_K": "MOSTLY_Q3_K_M",
              "Q2_K": "MOSTLY_Q2_K"}


def write_gguf(source: Path, config, tensors: list, out: Path, progress: bool = True,
               extra: dict[str, str] | None = None, reader=None) -> dict:
    """Write `tensors` [(paperback param name, QuantizedWeight, GGUFWeight or fp32 tensor)] as the GGUF file
    `out`, with the metadata (tokenizer, chat template, architecture) of the GGUF file `source` and the string
    fields `extra` (`reader`: `source` already opened by gguf.GGUFReader, for several files from one source).
    Written to a temporary name and renamed, so a failure leaves no partial file."""
    import gguf
    from paperback.progress import progress as stage_progress

    from paperback.loading.weight_names import GGUF_ARCHS, GGUF_BLOCK_NAMES, GGUF_GLOBAL_NAMES

    reader = reader or gguf.GGUFReader(source)
    arch_name = str(reader.fields["general.architecture"].contents())
    arch = GGUF_ARCHS[arch_name]
    to_gguf = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    block_names = {v: k for k, v in GGUF_BLOCK_NAMES.items()}
    block_names[arch.ffn_norm] = "ffn_norm"

    def gguf_name(name: str) -> str:
        if name in to_gguf:
            return to_gguf[name]
        _, _, layer, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        return f"blk.{layer}.{block_names[module]}.{kind}"

    tmp = out.with_name(out.name + f".partial{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch_name)
    skip = {"general.architecture", "general.alignment", "general.file_type"}
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "paperback.")) or key in skip:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for name, value in stage_progress(tensors, desc="export gguf", unit="tensor", enabled=progress):
        target = gguf_name(name)
        data, qtype, kind_name = _encoded(value)
        if arch.norm_offset and "norm.weight" in target:
            data = data + np.float32(arch.norm_offset)
        if arch.unpermute_qk and target.endswith(("attn_q.weight", "attn_k.weight")):
            data = permute_rope_rows(data, config.num_heads if ".attn_q." in target else config.num_kv_heads)
        counts[kind_name] = counts.get(kind_name, 0) + 1
        sizes[kind_name] = sizes.get(kind_name, 0) + value_numel(value)
        writer.add_tensor(target, np.ascontiguousarray(data), raw_dtype=qtype)
    linear = max((k for k in sizes if k != "F32"), key=sizes.get, default="F32")
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[linear]])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return {"output": str(out), "format": "gguf", "architecture": arch_name, "tensors": counts,
            "bytes": out.stat().st_size, "source_metadata": str(source)}
