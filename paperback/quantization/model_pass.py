"""Walk a model block by block and quantize its linear layers.

Each block sees the outputs of the blocks before it *after* they were
quantized, so GPTQ corrects the error that actually reaches it. Weights are
replaced by their dequantized values (the in-memory reference a packed
checkpoint must reproduce) and the quantized tensors are returned by name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from paperback.errors import PaperbackError
from paperback.models import DecoderLM
from paperback.progress import progress as stage_progress
from paperback.quantization.awq import AWQConfig, awq_block
from paperback.quantization.block_forms import awq_block_form, gptq_block_form, rtn_block_form
from paperback.quantization.expert_forms import gptq_expert_form, rtn_expert_form
from paperback.quantization.gguf_types import GGUFType
from paperback.quantization.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from paperback.quantization.head_bands import BandedWeight, HeadBands, quantize_banded
from paperback.quantization.linears import (BLOCK_LINEARS, EDGE_TARGETS, EMBED_PARAM, HEAD_PARAM,
                                            SEQUENTIAL_GROUPS, input_reader)
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn
from paperback.quantization.scheme import QuantScheme



def parse_targets(spec: str) -> tuple[str, ...]:
    """'blocks,head' -> the block linears plus 'head'; names may omit their 'self_attn.'/'mlp.' prefix."""
    short = {name.rpartition(".")[2]: name for name in BLOCK_LINEARS}
    targets: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item == "blocks":
            targets += BLOCK_LINEARS
        elif item in BLOCK_LINEARS or item in EDGE_TARGETS:
            targets.append(item)
        elif item in short:
            targets.append(short[item])
        else:
            raise PaperbackError(f"unknown quantization target '{item}' (choose from blocks, embed, head, "
                                 f"{', '.join(short)})")
    if not targets:
        raise PaperbackError("no quantization targets given")
    return tuple(dict.fromkeys(targets))



class _InputsCaptured(Exception):
    """Raised by a capture hook to stop a block's forward once the wanted inputs are seen."""




def expanded(kind: str, layer: nn.Module) -> list[str]:
    """The block linears one target kind names in `layer`: itself, or in an MoE layer each expert's projection
    of that kind and the shared expert's ("mlp.down_proj" -> "mlp.experts.0.down_proj", ...). Routers stay
    full precision, as vLLM and llm-compressor keep them."""
    experts = getattr(layer.mlp, "experts", None)
    if experts is None or not kind.startswith("mlp."):
        return [kind]
    projection = kind[len("mlp."):]
    names = [f"mlp.experts.{e}.{projection}" for e in range(len(experts))]
    return names + ([f"mlp.shared_expert.{projection}"] if layer.mlp.shared_expert is not None else [])


@dataclass(frozen=True)
class QuantizeConfig:
    method: str = "rtn"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    awq: AWQConfig = field(default_factory=AWQConfig)
    targets: tuple[str, ...] = BLOCK_LINEARS
    calibration_batch_size: int = 8
    # Precision of the calibration forwards' matmuls: "auto" is bf16 where the hardware
    # multiplies bf16 natively (CUDA, AVX512-BF16 CPUs), else fp32. Hessians, scales and
    # GPTQ's column updates always run in fp32/fp64.
    forward_dtype: str = "auto"
    # Per-layer schemes by parameter name ("model.layers.3.mlp.down_proj.weight", EMBED_PARAM, HEAD_PARAM),
    # overriding `scheme`: a mixed-precision checkpoint, as an allocation chooses it.
    layer_schemes: dict[str, QuantScheme] = field(default_factory=dict)
    # A tied head quantized in bands of vocabulary rows, each at its own scheme (quantization.head_bands);
    # it overrides layer_schemes for the embedding.
    head_bands: HeadBands | None = None

    def __post_init__(self):
        if self.forward_dtype not in ("auto", "fp32", "bf16"):
            raise PaperbackError(f"forward dtype must be auto, fp32 or bf16, not '{self.forward_dtype}'")
        if self.method not in METHODS:
            raise PaperbackError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        unknown = set(self.targets) - set(BLOCK_LINEARS) - set(EDGE_TARGETS)
        if unknown:
            raise PaperbackError(f"unknown target modules: {', '.join(sorted(unknown))}")
        if self.head_bands is not None and not set(EDGE_TARGETS) & set(self.targets):
            raise PaperbackError("head bands were given but neither the head nor the embedding is quantized")

    def scheme_for(self, param_name: str) -> QuantScheme:
        return self.layer_schemes.get(param_name, self.scheme)

    @property
    def mixed_blocks(self) -> bool:
        """Whether block linears differ in scheme (edges at their own scheme are not a mix)."""
        return any(name not in (EMBED_PARAM, HEAD_PARAM) and s != self.scheme for name, s in self.layer_schemes.items())

    @property
    def label(self) -> str:
        if self.mixed_blocks:
            return "mixed"
        edges = {s.label for name, s in self.layer_schemes.items() if name in (EMBED_PARAM, HEAD_PARAM)}
        edges.discard(self.scheme.label)
        return self.scheme.label + (f", edges {', '.join(sorted(edges))}" if edges else "")


def autocast_dtype(config: QuantizeConfig, device: torch.device) -> torch.dtype | None:
    """The dtype calibration forwards autocast to, or None for full precision."""
    if config.forward_dtype == "fp32":
        return None
    if config.forward_dtype == "bf16":
        return torch.bfloat16
    native = device.type == "cuda" or (device.type == "cpu" and torch.cpu._is_avx512_bf16_supported())
    return torch.bfloat16 if native else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    # Autocast runs the matmuls and attention in bf16 but keeps the residual stream and norms
    # in the model's dtype, so quantization noise, not bf16 rounding, dominates what each block sees.
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def _targets(layer: nn.Module, config: QuantizeConfig) -> dict[str, nn.Linear]:
    return {name: layer.get_submodule(name) for kind in config.targets if kind in BLOCK_LINEARS
            for name in expanded(kind, layer)}


def _gptq_linear(weight: torch.Tensor, H: torch.Tensor | None, scheme, config: QuantizeConfig):
    """GPTQ from the input Hessian H; rounded to nearest where no input was seen (H None)."""
    return gptq_quantize(weight, H, scheme, config.gptq) if H is not None else quantize_rtn(weight, scheme)


def _rtn_linear(weight: torch.Tensor, H: torch.Tensor | None, scheme, config: QuantizeConfig):
    """Rounded to nearest; a GGUF type's scales weigh each input by its mean square (H's diagonal) when known."""
    return quantize_rtn(weight, scheme, torch.diag(H) if H is not None else None)


def _quantize_edges(model: DecoderLM, config: QuantizeConfig, head_hessian: torch.Tensor | None,
                    results: dict[str, QuantizedWeight], quantize_linear=_gptq_linear) -> None:
    """Embedding and head: `quantize_linear` for the head with its input Hessian when known, RTN otherwise.

    The embedding has no input activations to weigh its error by, so it is rounded.
    """
    wanted = set(config.targets) & set(EDGE_TARGETS)
    if not wanted:
        return

    def quantize(weight: torch.Tensor, as_head: bool, scheme: QuantScheme) -> QuantizedWeight:
        return quantize_linear(weight, head_hessian if as_head else None, scheme, config)

    bands = config.head_bands
    if bands is not None and model.lm_head is not None:
        raise PaperbackError("head bands apply to a tied embedding; this model has its own output head")
    if model.lm_head is None:  # tied: one matrix serves both
        module, name = model.model.embed_tokens, EMBED_PARAM
        scheme = config.layer_schemes.get(HEAD_PARAM, config.scheme_for(EMBED_PARAM))
        if bands is not None and bands.uniform is not None:  # one scheme in every band: the plain head
            bands, scheme = None, bands.uniform
        if bands is not None:
            if bands.band_of.numel() != module.weight.shape[0]:
                raise PaperbackError(f"the head band layout covers {bands.band_of.numel()} tokens, the "
                                     f"vocabulary {module.weight.shape[0]}")
            q = quantize_banded(module.weight, bands, lambda rows, s: quantize(rows, "head" in wanted, s))
        else:
            q = quantize(module.weight, "head" in wanted, scheme)
        _set_weight(module, q)
        results[name] = q
        return
    if "head" in wanted:
        results[HEAD_PARAM] = q = quantize(model.lm_head.weight, True, config.scheme_for(HEAD_PARAM))
        _set_weight(model.lm_head, q)
    if "embed" in wanted:
        results[EMBED_PARAM] = q = quantize(model.model.embed_tokens.weight, False, config.scheme_for(EMBED_PARAM))
        _set_weight(model.model.embed_tokens, q)


def _set_weight(module: nn.Linear, q: QuantizedWeight | BandedWeight) -> None:
    module.weight.data = q.dequantize(module.weight.dtype)


@torch.inference_mode()
def quantize_model(model: DecoderLM, config: QuantizeConfig, calibration: torch.Tensor | None = None,
                   progress: bool = True) -> dict[str, QuantizedWeight]:
    """Quantize model's block linears in place (fake-quant); returns {param name: QuantizedWeight}.

    calibration: (N, L) token ids, required by the methods that calibrate (GPTQ, AWQ).
    """
    if config.method == "awq":
        model.config.require_dense("AWQ")
    method = METHODS[config.method]
    if method.calibrated and calibration is None:
        raise PaperbackError(f"{config.method.upper()} needs calibration data")
    results: dict[str, QuantizedWeight] = {}
    bar = stage_progress(total=len(model.model.layers), desc=f"{config.method} {config.label}", unit="block",
                         enabled=progress)
    method.model_pass(model, config, calibration, bar, results)
    bar.close()
    return results


def _rtn_pass(model: DecoderLM, config: QuantizeConfig, calibration, bar, results: dict[str, QuantizedWeight]):
    """Round every targeted weight to nearest, block by block. No calibration is needed; given one, GGUF
    types weigh their scale search by each input's mean square, measured through the blocks already
    quantized (what llama.cpp's importance matrix records)."""
    if calibration is not None and any(isinstance(s, GGUFType) for s in (config.scheme, *config.layer_schemes.values())):
        _calibrated_pass(model, config, calibration, bar, results, _rtn_linear)
        return
    for idx, layer in enumerate(model.model.layers):
        for name, module in _targets(layer, config).items():
            q = quantize_rtn(module.weight, config.scheme_for(f"model.layers.{idx}.{name}.weight"))
            _set_weight(module, q)
            results[f"model.layers.{idx}.{name}.weight"] = q
        bar.update()
    _quantize_edges(model, config, None, results)


def _gptq_pass(model: DecoderLM, config: QuantizeConfig, calibration: torch.Tensor, bar,
               results: dict[str, QuantizedWeight]) -> None:
    """GPTQ block by block on inputs through the blocks already quantized; the head too, from its Hessian."""
    _calibrated_pass(model, config, calibration, bar, results, _gptq_linear)


def _calibrated_pass(model: DecoderLM, config: QuantizeConfig, calibration: torch.Tensor, bar,
                     results: dict[str, QuantizedWeight], quantize_linear) -> None:
    """Each block's linears quantized by quantize_linear(weight, H, scheme, config) from the Hessian of their
    inputs through the blocks already quantized; the head too, from its own."""
    layers = model.model.layers
    batches = list(calibration.split(config.calibration_batch_size))
    dtype = model.dtype
    device = model.model.embed_tokens.weight.device
    low = autocast_dtype(config, device)
    positions = torch.arange(calibration.shape[1])
    hidden = [model.embed(b) for b in batches]
    for idx, layer in enumerate(layers):
        cos, sin = model.rotary_for(idx)(positions, dtype)
        targets = _targets(layer, config)
        groups = ([[n for kind in group for n in expanded(kind, layer) if n in targets] for group in SEQUENTIAL_GROUPS]
                  if config.gptq.true_sequential else [list(targets)])
        for group in filter(None, groups):
            # One accumulator per distinct input, hooked on the module that reads it; a true-sequential
            # group stops the forward once its input is captured (never among experts: each sees its own tokens,
            # so every expert must run).
            readers = {input_reader(name) for name in group}
            accumulators = {name: HessianAccumulator(layer.get_submodule(name).in_features) for name in readers}
            stop = config.gptq.true_sequential and len(readers) == 1

            def capture(_m, args, acc):
                acc.add_batch(args[0])
                if stop:
                    raise _InputsCaptured

            hooks = [layer.get_submodule(name).register_forward_pre_hook(
                         lambda m, args, acc=acc: capture(m, args, acc)) for name, acc in accumulators.items()]
            try:
                with _autocast(device, low):
                    for x in hidden:
                        try:
                            layer(x, cos, sin, 0, None)
                        except _InputsCaptured:
                            pass
            finally:
                for h in hooks:
                    h.remove()
            for name in group:
                module, accumulator = targets[name], accumulators[input_reader(name)]
                scheme = config.scheme_for(f"model.layers.{idx}.{name}.weight")
                # An expert no calibration token was routed to has no Hessian: rounded to nearest instead.
                q = quantize_linear(module.weight, accumulator.H if accumulator.rows else None, scheme, config)
                _set_weight(module, q)
                results[f"model.layers.{idx}.{name}.weight"] = q
        with _autocast(device, low):  # inputs of the next block, post-quantization
            hidden = [layer(x, cos, sin, 0, None).to(dtype) for x in hidden]
        bar.update()
    head_hessian = None
    if "head" in config.targets:
        acc = HessianAccumulator(model.config.hidden_size)
        for x in hidden:
            acc.add_batch(model.model.norm(x))
        head_hessian = acc.H
    _quantize_edges(model, config, head_hessian, results, quantize_linear)


def _awq_pass(model: DecoderLM, config: QuantizeConfig, calibration: torch.Tensor, bar,
              results: dict[str, QuantizedWeight]) -> None:
    """AWQ block by block on the first `search_samples` calibration sequences; head and embedding rounded."""
    samples = calibration[: config.awq.search_samples]
    positions = torch.arange(samples.shape[1])
    hidden = model.embed(samples)
    block_targets = [name for name in config.targets if name in BLOCK_LINEARS]
    for idx, layer in enumerate(model.model.layers):
        cos, sin = model.rotary_for(idx)(positions, hidden.dtype)
        schemes = {name: config.scheme_for(f"model.layers.{idx}.{name}.weight") for name in block_targets}
        for name, q in awq_block(layer, model.config.family, hidden, cos, sin, block_targets, schemes,
                                 config.awq).items():
            results[f"model.layers.{idx}.{name}.weight"] = q
        hidden = layer(hidden, cos, sin, 0, None)  # inputs of the next block, post-quantization
        bar.update()
    _quantize_edges(model, config, None, results)


@dataclass(frozen=True)
class WeightMethod:
    """One weight quantization method in each of its forms: the model pass (quantize a whole model in place),
    the block form (one block's linears from its exact inputs: what a profile prices), the expert form (one MoE
    expert's projections from the tokens routed to it: what bits per expert are chosen from; None where the
    method has none), whether it needs calibration text, and the settings a checkpoint's recipe records."""

    name: str
    model_pass: Callable[..., None]  # (model, config, calibration, bar, results): quantize in place
    block: Callable[..., dict]  # (layer, family, x, cos, sin, scheme, awq, gptq) -> {linear: EffectiveWeight}
    expert: Callable[..., dict] | None  # (weights, x, act, scheme, gptq) -> {projection: QuantizedWeight}
    calibrated: bool
    recipe: Callable[[QuantizeConfig, str], dict | None] = lambda config, forward_dtype: None


METHODS: dict[str, WeightMethod] = {m.name: m for m in (
    WeightMethod("rtn", _rtn_pass, rtn_block_form, rtn_expert_form, calibrated=False),
    WeightMethod("gptq", _gptq_pass, gptq_block_form, gptq_expert_form, calibrated=True,
                 recipe=lambda config, dtype: {"gptq": {**asdict(config.gptq), "forward_dtype": dtype}}),
    WeightMethod("awq", _awq_pass, awq_block_form, None, calibrated=True,
                 recipe=lambda config, dtype: {"awq": config.awq.to_dict()}),
)}
