"""Round-to-nearest quantization that streams: read a tensor, quantize it, keep only its packed form.

RTN needs no calibration forward, so a model never has to be whole in fp32: each source tensor is read from
its file, rounded under its scheme and kept packed, and the checkpoint is written from the packed tensors. A
3B model quantizes holding its packed output and one fp32 tensor, where loading it first would hold 13 GB.
The checkpoint is the one the in-memory pass writes (same tensors, same recipe), which a test pins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from paperback.models import ModelConfig, build_model
from paperback.progress import progress as stage_progress
from paperback.quantization.linears import BLOCK_LINEARS, EMBED_PARAM, HEAD_PARAM
from paperback.quantization.model_pass import QuantizeConfig
from paperback.quantization.pipeline import layer_entry, quantized_recipe, storage_bits, summary
from paperback.quantization.qlinear import QuantEmbedding, QuantLinear
from paperback.quantization.rtn import quantize_rtn
from paperback.quantization.scheme import QuantScheme


@dataclass
class StreamSource:
    """A model file read a tensor at a time: its config, its tensors (paperback names) and its tokenizer."""

    label: str
    path: Path
    config: ModelConfig
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    count: int
    tokenizer: Callable[[], object]


def _hf_source(source) -> StreamSource | None:
    from paperback.loading import _generation_eos
    from paperback.loading.hf_dir import HFModelDir
    from paperback.loading.tokenizer import tokenizer_from_dir

    hf_dir = HFModelDir(source.path)
    if "quantization_config" in hf_dir.hf_config:
        return None  # packed by another tool: loaded through its importer, then quantized in memory
    config = hf_dir.config()
    return StreamSource(source.label, source.path, config, lambda: hf_dir.tensors(config, one_at_a_time=True),
                        len(hf_dir.tensor_shapes()),
                        lambda: tokenizer_from_dir(source.path, _generation_eos(source.path)))


def _gguf_source(source) -> StreamSource:
    from paperback.loading.gguf_file import GGUFModelFile
    from paperback.loading.tokenizer import tokenizer_from_gguf

    gguf_file = GGUFModelFile(source.path)
    config = gguf_file.config()
    eot = gguf_file.eot_token_id
    return StreamSource(source.label, source.path, config, lambda: gguf_file.tensors(config),
                        len(gguf_file.reader.tensors),
                        lambda: tokenizer_from_gguf(source.path, (eot,) if eot is not None else ()))


# source kind (loading.sources) -> how to open it for streaming; a paperback checkpoint is already packed
STREAM_SOURCES = {"hf": _hf_source, "gguf": _gguf_source}


def streams(config: QuantizeConfig, source_kind: str) -> bool:
    """Whether `config` can quantize a model of this source kind tensor by tensor: RTN under paperback's own
    schemes with no head bands (a GGUF type's scale search reads calibration activations; bands and MoE expert
    stacks are laid out over the whole model)."""
    schemes = (config.scheme, *config.layer_schemes.values())
    return (config.method == "rtn" and config.head_bands is None and source_kind in STREAM_SOURCES
            and all(isinstance(s, QuantScheme) for s in schemes))


def quantized_params(model_config: ModelConfig, config: QuantizeConfig) -> dict[str, QuantScheme]:
    """{param name: scheme} of every weight `config` quantizes in a dense model of `model_config`, as the
    in-memory pass chooses them (a tied embedding is one matrix with the head, at the head's scheme)."""
    chosen = {}
    for idx in range(model_config.num_layers):
        for kind in config.targets:
            if kind in BLOCK_LINEARS:
                name = f"model.layers.{idx}.{kind}.weight"
                chosen[name] = config.scheme_for(name)
    edges = set(config.targets) - set(BLOCK_LINEARS)
    if model_config.tie_word_embeddings:
        if edges:
            chosen[EMBED_PARAM] = config.layer_schemes.get(HEAD_PARAM, config.scheme_for(EMBED_PARAM))
        return chosen
    if "head" in edges:
        chosen[HEAD_PARAM] = config.scheme_for(HEAD_PARAM)
    if "embed" in edges:
        chosen[EMBED_PARAM] = config.scheme_for(EMBED_PARAM)
    return chosen


def open_stream(source) -> StreamSource | None:
    """`source` (a loading.sources.ModelSource of a kind in STREAM_SOURCES) opened for streaming; None where
    its tensors cannot be read one by one as the model's (packed by another tool, or an MoE's expert stacks)."""
    stream = STREAM_SOURCES[source.kind](source)
    return stream if stream is not None and stream.config.moe is None else None


def stream_rtn_checkpoint(stream: StreamSource, config: QuantizeConfig, out_dir: Path, overwrite: bool = False,
                          progress: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """Quantize the dense model `stream` reads to a checkpoint in `out_dir` tensor by tensor; returns the
    summary `quantize` prints."""
    from paperback.loading import check_complete, checked_tensor
    from paperback.quantization.checkpoint import write_checkpoint

    stream.config.require_dense("streaming quantization")
    with torch.device("meta"):
        meta_state = build_model(stream.config).state_dict()
    schemes = quantized_params(stream.config, config)
    state: dict[str, torch.Tensor] = {}
    layers, bits, weights, seen = {}, 0, 0, set()
    start = time.perf_counter()
    for name, tensor in stage_progress(stream.tensors(), total=stream.count, desc=f"rtn {config.label}",
                                       unit="tensor", enabled=progress):
        tensor = checked_tensor(name, tensor, meta_state, stream.config, stream.label)
        if tensor is None:
            continue
        seen.add(name)
        if name not in schemes:
            state[name] = tensor.to(dtype if meta_state[name].dtype == torch.float32 else meta_state[name].dtype)
            continue
        q = quantize_rtn(tensor, schemes[name])  # upcast slab by slab inside: never the whole matrix in fp32
        del tensor
        packed = (QuantEmbedding if name == EMBED_PARAM else QuantLinear).from_quantized(q)
        module = name.removesuffix(".weight")
        state.update({f"{module}.{key}": value for key, value in packed.state_dict().items()})
        layers[name] = layer_entry(q)
        bits, weights = bits + storage_bits(q), weights + q.shape[0] * q.shape[1]
    check_complete(meta_state, seen, stream.label)
    seconds = time.perf_counter() - start
    recipe = quantized_recipe(stream.path, config, None, layers, seconds, "fp32")
    write_checkpoint(state, stream.config, stream.tokenizer(), recipe, out_dir, overwrite)
    return summary(out_dir, config, len(layers), bits / weights, seconds)
