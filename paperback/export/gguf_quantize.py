"""A model quantized straight into a GGUF file with a type per tensor (paperback's methods on GGUF's grids).

`gguf_types_for(config, recipe)` gives every weight llama.cpp's type under a named recipe; any other
assignment (one type everywhere, or a fit's per-tensor choice) is a {param name: GGUFType} dict as well.
`quantize_to_gguf` runs RTN (scales searched, weighted by each input's mean square when calibration text is
given) or GPTQ block by block through the already-quantized blocks, or AWQ (scales searched at each tensor's
type and folded into the norms and rows before it, then rounded as RTN from the full model's inputs), and
writes the file: what paperback evaluated is what llama.cpp reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from paperback.errors import PaperbackError
from paperback.quantization.gguf_recipes import Recipe, TensorRole
from paperback.quantization.gguf_types import GGUFType, tiling_fallback
from paperback.quantization.model_pass import BLOCK_LINEARS, EMBED_PARAM, HEAD_PARAM, QuantizeConfig

# paperback's block linear -> llama.cpp's tensor role
ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def weight_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of every weight a GGUF fit assigns a type: block linears, the embedding, an untied head."""
    h, d = config.hidden_size, config.head_dim
    linear = {"self_attn.q_proj": (config.num_heads * d, h), "self_attn.k_proj": (config.num_kv_heads * d, h),
              "self_attn.v_proj": (config.num_kv_heads * d, h), "self_attn.o_proj": (h, config.num_heads * d),
              "mlp.gate_proj": (config.intermediate_size, h), "mlp.up_proj": (config.intermediate_size, h),
              "mlp.down_proj": (h, config.intermediate_size)}
    shapes = {f"model.layers.{i}.{name}.weight": linear[name] for i in range(config.num_layers)
              for name in BLOCK_LINEARS}
    shapes[EMBED_PARAM] = (config.vocab_size, h)
    if not config.tie_word_embeddings:
        shapes[HEAD_PARAM] = (config.vocab_size, h)
    return shapes


def tensor_role(param: str, config, in_features: int) -> TensorRole:
    """What llama.cpp's recipe rules read of `param` (rows of `in_features` weights)."""
    gqa = config.num_heads // config.num_kv_heads
    if param == HEAD_PARAM or (param == EMBED_PARAM and config.tie_word_embeddings):
        return TensorRole("output", None, config.num_layers, in_features, gqa)
    if param == EMBED_PARAM:
        return TensorRole("token_embd", None, config.num_layers, in_features, gqa)
    _, _, layer, rest = param.split(".", 3)
    return TensorRole(ROLES[rest.removesuffix(".weight")], int(layer), config.num_layers, in_features, gqa)


def gguf_types_for(config, recipe: Recipe, imatrix: bool = False) -> dict[str, GGUFType]:
    """{param: the type llama-quantize gives it under `recipe`}."""
    config.require_dense("a GGUF recipe")
    return {param: recipe.type_for(tensor_role(param, config, shape[1]), imatrix)
            for param, shape in weight_shapes(config).items()}


def uniform_types(config, kind: GGUFType) -> dict[str, GGUFType]:
    """`kind` for every weight, or llama.cpp's stand-in where `kind` cannot tile a row."""
    return {param: tiling_fallback(kind, shape[1]) for param, shape in weight_shapes(config).items()}


def tensor_bytes(config, types: dict[str, GGUFType]) -> int:
    """Bytes of the assigned weights as the file stores them."""
    shapes = weight_shapes(config)
    return sum(kind.tensor_bytes(*shapes[param]) for param, kind in types.items())


def check_types(config, types: dict[str, GGUFType]) -> None:
    """Every weight has a type that tiles its rows (a PaperbackError naming the first that does not)."""
    shapes = weight_shapes(config)
    missing = sorted(set(shapes) - set(types))
    if missing:
        raise PaperbackError(f"no GGUF type given for {missing[0]} ({len(missing)} weights without one)")
    for param, kind in types.items():
        if param not in shapes:
            raise PaperbackError(f"{param} is not a weight of this model")
        if not kind.can_tile(shapes[param][1]):
            raise PaperbackError(f"{param} has rows of {shapes[param][1]} weights, which {kind.name} (blocks of "
                                 f"{kind.block_size}) cannot tile")


def quantize_to_gguf(lm, types: dict[str, GGUFType], out: Path, method: str = "rtn", calibration=None,
                     overwrite: bool = False, progress: bool = True, metadata: dict | None = None) -> dict:
    """Quantize `lm` (a LoadedModel from a GGUF file, fp32) in place to `types` and write the GGUF file `out`.
    `calibration`: (N, L) token ids (GPTQ needs them; RTN weighs its scale search by them when given).
    `metadata`: what to record under `paperback.recipe` in the file (JSON)."""
    from paperback.allocate.gguf_cells import GGUFCells
    from paperback.quantization.model_pass import quantize_model

    out = Path(out)
    if out.exists() and not overwrite:
        raise PaperbackError(f"{out} exists; pass --overwrite to replace it")
    source = Path(lm.source.path)
    if source.suffix != ".gguf":
        raise PaperbackError(f"{lm.source.label} is not a GGUF file; GGUF output copies the tokenizer and chat "
                             "template of the GGUF file a model came from (a Hugging Face source is not built yet)")
    check_types(lm.config, types)
    if method == "awq":
        if calibration is None:
            raise PaperbackError("AWQ needs calibration text")
        cells = GGUFCells(lm.model, calibration, "awq", scale_types=types, progress=progress)
        results = {param: cells.quantize(param, kind) for param, kind in types.items()}
        for param, weight in results.items():  # the model holds what the file holds, as the other methods leave it
            cells.params[param].data.copy_(weight.dequantize())
    else:
        targets = BLOCK_LINEARS + ("embed", "head")
        first = next(iter(types.values()))
        config = QuantizeConfig(method, first, targets=targets, layer_schemes=dict(types))
        results = quantize_model(lm.model, config, calibration, progress=progress)
    record = {"method": method, "types": {p: t.name for p, t in types.items()}, **(metadata or {})}
    return write_weights(lm, results, out, record, progress)


def write_weights(lm, weights: dict, out: Path, record: dict, progress: bool = True, reader=None) -> dict:
    """Write `lm` as the GGUF file `out` with `weights` ({param: GGUFWeight}) in place of its own (every other
    tensor at F32), the metadata of the GGUF file it came from (`reader`: that file opened, see write_gguf), and
    `record` under `paperback.recipe`."""
    from paperback.export.gguf_export import write_gguf

    tensors = []
    seen = set()
    for name, param in lm.model.named_parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        tensors.append((name, weights.get(name, param.detach().float())))
    summary = write_gguf(Path(lm.source.path), lm.config, tensors, out, progress,
                         extra={"paperback.recipe": json.dumps(record, sort_keys=True)}, reader=reader)
    summary["tensor_bytes"] = sum(w.storage_bytes() for w in weights.values())
    return summary
