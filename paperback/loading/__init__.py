"""Load a model: config, tokenizer and weights into paperback's PyTorch modules."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from paperback.errors import ModelFileError, PaperbackError, UnsupportedModelError
from paperback.loading.experts import check_experts
from paperback.loading.gguf_file import GGUFModelFile
from paperback.loading.hf_dir import HFModelDir, read_safetensors
from paperback.loading.sources import ModelSource, resolve_model
from paperback.loading.tokenizer import Tokenizer, tokenizer_from_dir, tokenizer_from_gguf
from paperback.memory import release_freed_heap
from paperback.models import DecoderLM, ModelConfig, build_model
from paperback.models.layers import RotaryEmbedding

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# Keys some checkpoints carry that are derived, not learned.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise PaperbackError(f"unknown dtype '{name}' (choose from fp32, bf16, fp16)")
    return DTYPES[name]


def assemble_model(config: ModelConfig, tensors, dtype: torch.dtype, label: str, total: int | None = None,
                   prepare: Callable[[DecoderLM], DecoderLM] | None = None) -> DecoderLM:
    """Build the model on the meta device and assign checked tensors into it.

    `prepare` may swap modules (e.g. for packed quantized layers) before the
    tensors are checked against the model's own names and shapes. Floating
    tensors of plain modules take `dtype`; packed codes and scales keep theirs.
    """
    with torch.device("meta"):
        model = build_model(config)
    if prepare is not None:
        model = prepare(model)
    meta_state = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(tensors, total=total, desc=f"loading {label}", unit="tensor",
                             leave=False, disable=None):
        tensor = checked_tensor(name, tensor, meta_state, config, label)
        if tensor is not None:
            target = dtype if meta_state[name].dtype == torch.float32 else meta_state[name].dtype
            state[name] = tensor.to(target)
    check_complete(meta_state, state, label)
    model.load_state_dict(state, assign=True, strict=True)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return model.eval().requires_grad_(False)


def check_complete(meta_state: dict, found, label: str) -> None:
    """A ModelFileError naming the tensors the model needs (`meta_state`) that were not `found`."""
    missing = sorted(set(meta_state) - set(found))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelFileError(f"{label}: missing tensors: {shown}")


def checked_tensor(name: str, tensor: torch.Tensor, meta_state: dict, config: ModelConfig,
                   label: str) -> torch.Tensor | None:
    """`tensor` if it is what the model (`meta_state`: its state dict on the meta device) holds under `name`,
    None where the file carries something derived or redundant; a ModelFileError naming what is wrong else."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name not in meta_state:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # some tied checkpoints store the head anyway
        raise ModelFileError(f"{label}: unexpected tensor '{name}' for a {config.family} model")
    expected = meta_state[name].shape
    if tuple(tensor.shape) != tuple(expected):
        raise ModelFileError(f"{label}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    wanted = meta_state[name].dtype
    if tensor.is_floating_point() != wanted.is_floating_point or \
            (not wanted.is_floating_point and tensor.dtype != wanted):
        raise ModelFileError(f"{label}: tensor '{name}' is stored as {tensor.dtype}, which cannot hold what "
                             f"this layer needs ({wanted}): the file is corrupt or was edited")
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ModelFileError(f"{label}: tensor '{name}' holds NaN or infinite values")
    return tensor


def _generation_eos(path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return ()
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, OSError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_model(spec: str | None = None, dtype: str | torch.dtype = "fp32", with_tokenizer: bool = True) -> LoadedModel:
    """Load a bundled model name, a .gguf file or a Hugging Face directory."""
    loaded = _load(spec, dtype, with_tokenizer)
    # The file readers and loading temporaries are gone now; serving should not carry what they left behind.
    release_freed_heap()
    return loaded


def _load(spec: str | None, dtype: str | torch.dtype, with_tokenizer: bool) -> LoadedModel:
    dtype = parse_dtype(dtype)
    source = resolve_model(spec)
    # Weights first: a damaged tensor is the likelier fault and the costlier one to find late.
    if source.kind == "gguf":
        gguf_file = GGUFModelFile(source.path)
        config = gguf_file.config()
        check_experts(config, gguf_file.tensor_shapes(), source.label)
        model = assemble_model(config, gguf_file.tensors(config), dtype, source.label, len(gguf_file.reader.tensors))
        tokenizer = None
        if with_tokenizer:
            if not gguf_file.has_tokenizer:
                raise ModelFileError(f"{source.path} carries no tokenizer (no tokenizer.ggml.* metadata)")
            eot = gguf_file.eot_token_id
            tokenizer = tokenizer_from_gguf(source.path, (eot,) if eot is not None else ())
    elif source.kind == "paperback":
        from paperback.quantization.checkpoint import (
            WEIGHTS_FILE, config_from_recipe, prepare_quantized_model, read_recipe, verify_weights)

        recipe = read_recipe(source.path)
        config = config_from_recipe(recipe, source.path)
        verify_weights(recipe, source.path)
        model = assemble_model(config, read_safetensors([source.path / WEIGHTS_FILE]), dtype, source.label,
                               prepare=lambda m: prepare_quantized_model(m, recipe))
        tokenizer = tokenizer_from_dir(source.path) if with_tokenizer else None
    else:
        hf_dir = HFModelDir(source.path)
        config = hf_dir.config()
        if "quantization_config" in hf_dir.hf_config and config.moe is not None:
            raise UnsupportedModelError(f"{source.label}: MoE checkpoints quantized by other tools are not "
                                        f"supported yet (load the unquantized model and quantize it here)")
        check_experts(config, hf_dir.tensor_shapes(config), source.label)
        if "quantization_config" in hf_dir.hf_config:  # quantized elsewhere: packed layers as stored
            from paperback.quantization.checkpoint import prepare_quantized_model

            where = str(source.path / "config.json")
            qconfig = hf_dir.hf_config["quantization_config"]
            if isinstance(qconfig, dict) and qconfig.get("quant_method") in ("gptq", "awq"):
                from paperback.loading.gptq_awq_import import gptq_awq_schemes, translate_gptq_awq

                schemes = gptq_awq_schemes(qconfig, hf_dir.tensor_names(), where)
                tensors = translate_gptq_awq(hf_dir.tensors(config), schemes, qconfig, where)
            else:
                from paperback.loading.compressed_tensors_import import import_plan, translate

                schemes = import_plan(hf_dir.hf_config, hf_dir.tensor_names(), where)
                tensors = translate(hf_dir.tensors(config), schemes, where)
            layers = {"layers": {f"{m}.weight": {"scheme": s.to_dict()} for m, s in schemes.items()}}
            model = assemble_model(config, tensors, dtype, source.label,
                                   prepare=lambda m: prepare_quantized_model(m, layers))
        else:
            model = assemble_model(config, hf_dir.tensors(config), dtype, source.label)
        tokenizer = tokenizer_from_dir(source.path, _generation_eos(source.path)) if with_tokenizer else None
    return LoadedModel(model, tokenizer, config, source, dtype)


__all__ = ["LoadedModel", "load_model", "parse_dtype", "assemble_model", "resolve_model", "Tokenizer"]
