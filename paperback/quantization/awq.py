"""AWQ (Lin et al. 2023): activation-aware scaling and clipping, then rounding.

A linear layer's error matters most on the input channels that carry large
activations. AWQ scales those weight columns up by s (so rounding hurts them
less) and divides the layer's input by s, which is free: the division folds
into the operation that produces the input (an RMSNorm's weight, or the rows
of the linear before). The scale is s = s_x^alpha, s_x the mean activation
magnitude per input channel, with alpha chosen on a grid by the error of the
module's output. A second search then shrinks each group's weight range
(clipping outliers) where that lowers the layer's output error.

The functions below work on tensors; `awq_block` applies them to one
transformer block using the per-architecture table SCALE_GROUPS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

from paperback.errors import PaperbackError
from paperback.quantization.rtn import QuantizedWeight, check_weight, group_params, quantize_codes, quantize_rtn
from paperback.quantization.scheme import QuantScheme


@dataclass(frozen=True)
class AWQConfig:
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    clip: bool = True
    clip_grid: int = 20  # shrink ratios 1, 1 - 1/clip_grid, ... down to 1 - max_shrink
    max_shrink: float = 0.5
    clip_tokens: int = 512  # input rows sampled for the clip search
    search_samples: int = 32  # calibration sequences: activation statistics and block inputs
    search_tokens: int = 4096  # tokens the 20-point scale search evaluates on (its CPU time grows with it)

    def __post_init__(self):
        if self.grid < 1 or self.clip_grid < 1 or not 0 <= self.max_shrink < 1:
            raise PaperbackError("AWQ needs grid >= 1, clip_grid >= 1 and 0 <= max_shrink < 1")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read one input, the module producing it, and the module whose output judges a scale."""

    prev: str  # an RMSNorm (scale folds into its weight) or a linear (into its output rows)
    linears: tuple[str, ...]
    inspect: str


_ATTN_IN = ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn")
_ATTN_OUT = ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj")  # only without GQA
_MLP_OUT = ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")

# Per architecture family: where each group's input comes from. Gemma 3's MLP
# reads pre_feedforward_layernorm (its post_attention_layernorm normalises the
# attention output before the residual add, so nothing can fold into it).
SCALE_GROUPS: dict[str, tuple[ScaleGroup, ...]] = {
    "llama": (_ATTN_IN, _ATTN_OUT, ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
              _MLP_OUT),
    "gemma3": (_ATTN_IN, _ATTN_OUT, ScaleGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
               _MLP_OUT),
}


def scale_groups(family: str, layer: nn.Module) -> list[ScaleGroup]:
    """The groups that apply to this layer: v -> o only when their shapes match (no GQA)."""
    if family not in SCALE_GROUPS:
        raise PaperbackError(f"AWQ has no scale table for the '{family}' architecture")
    groups = []
    for group in SCALE_GROUPS[family]:
        prev = layer.get_submodule(group.prev)
        width = layer.get_submodule(group.linears[0]).in_features
        produced = prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()
        if produced == width:
            groups.append(group)
    return groups


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| per input channel over every token: AWQ's s_x."""
    return x.reshape(-1, x.shape[-1]).abs().float().mean(0)


def candidate_scales(s_x: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_x^alpha, normalised so that max * min = 1 (keeps weights and inputs in range)."""
    s = s_x.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_scale(weights: list[torch.Tensor], s_x: torch.Tensor, output_of: Callable[[list[torch.Tensor]], torch.Tensor],
                 reference: torch.Tensor, scheme: QuantScheme | list[QuantScheme | None], grid: int = 20,
                 quantized: list[bool] | None = None,
                 importance: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """The s = s_x^alpha (alpha on the grid) whose scaled, quantized weights give the lowest output MSE.

    output_of(ws) computes the judged module's output with the linears'
    weights replaced by ws, each already divided back by s (so the module's
    input is unchanged). scheme: one for every weight, or one per weight
    (None: left unquantized); a GGUF type rounds as its quantizer does, its
    stored scales searched weighted by `importance` (the input's mean square
    per channel; the scaled input's is importance / s^2). Returns the best
    scales and the error per alpha.
    """
    schemes = scheme if isinstance(scheme, list) else [scheme] * len(weights)
    if quantized is not None:
        schemes = [s if q else None for s, q in zip(schemes, quantized)]
    errors: list[float] = []
    best, best_err = torch.ones_like(s_x), float("inf")
    for i in range(grid):
        s = candidate_scales(s_x, i / grid)
        weighted = None if importance is None else importance / s.pow(2)
        trial = [quantize_rtn(w * s, sch, weighted).dequantize(w.dtype) / s if sch is not None else w
                 for w, sch in zip(weights, schemes)]
        err = (output_of(trial).float() - reference.float()).pow(2).mean().item()
        errors.append(err)
        if err < best_err:
            best, best_err = s, err
    return best, errors


def _clip_range(w: torch.Tensor, scheme: QuantScheme, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme.symmetric:
        amax = w.abs().amax(1) * ratio
        return -amax, amax
    return w.amin(1).clamp(max=0) * ratio, w.amax(1).clamp(min=0) * ratio


def search_clip(weight: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """The weight with each (row, group) range shrunk by the ratio that minimises that group's
    contribution to the output error ||(Q(clip(W)) - W) x||^2 over the sample rows of x (tokens, in)."""
    check_weight(weight)
    out = weight.clone().float()
    x = x.reshape(-1, x.shape[-1]).float()
    ratios = [1 - i / grid for i in range(int(max_shrink * grid) + 1)]
    for lo, hi in scheme.group_bounds(weight.shape[1]):
        w, xg = out[:, lo:hi], x[:, lo:hi]
        reference = w @ xg.T  # (out, tokens)
        best_err = torch.full((w.shape[0],), float("inf"))
        best_ratio = torch.ones(w.shape[0])
        for r in ratios:
            low, high = _clip_range(w, scheme, torch.full((w.shape[0],), r))
            clipped = torch.maximum(torch.minimum(w, high[:, None]), low[:, None])
            scale, zero = group_params(clipped, scheme)
            q = (quantize_codes(clipped, scale, zero, scheme.max_code) - zero[:, None]) * scale[:, None]
            err = (q @ xg.T - reference).pow(2).mean(1)
            better = err < best_err
            best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, r, best_ratio)
        low, high = _clip_range(w, scheme, best_ratio)
        out[:, lo:hi] = torch.maximum(torch.minimum(w, high[:, None]), low[:, None])
    return out.to(weight.dtype)


@torch.no_grad()
def fold_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Multiply the linears' input columns by s and divide prev's output by s: same function in full precision."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    elif getattr(prev, "unit_offset", False):  # Gemma's (1 + w) norm
        prev.weight.copy_(((1 + prev.weight.float()) / s - 1).to(prev.weight.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    for linear in linears:
        linear.weight.mul_(s[None, :].to(linear.weight.dtype))


def _sample_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    step = max(1, flat.shape[0] // count)
    return flat[::step][:count]


@torch.no_grad()
def search_block_scales(layer: nn.Module, family: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        targets: list[str], schemes: dict[str, object], config: AWQConfig,
                        weighted: bool = False) -> dict[str, torch.Tensor]:
    """AWQ's scale search on one block, given its input hidden states x (N, L, C): each scale group's
    s = s_x^alpha, folded into the block in place (its full-precision function is unchanged). schemes:
    {linear name: scheme or GGUF type} (linears that share a group may differ: the search quantizes each in its
    own). weighted: GGUF types round weighted by the input's mean square, as their quantizer then will.
    Returns {prev module name: s} for every scale folded."""
    folded: dict[str, torch.Tensor] = {}
    groups = scale_groups(family, layer)
    inputs = capture_inputs(layer, x, cos, sin, [g.linears[0] for g in groups])
    for group in groups:
        if not any(name in targets for name in group.linears):
            continue
        linears = [layer.get_submodule(name) for name in group.linears]
        inspect = layer.get_submodule(group.inspect)
        group_x = inputs[group.linears[0]]
        s_x = activation_scale(group_x)
        importance = group_x.reshape(-1, group_x.shape[-1]).float().pow(2).mean(0) if weighted else None
        # The grid search judges on a subset: whole sequences for attention, sampled tokens elsewhere.
        if inspect is layer.self_attn:
            group_in = group_x[: max(1, -(-config.search_tokens // x.shape[1]))]
        else:
            group_in = _sample_rows(group_x, config.search_tokens)

        def output_of(weights: list[torch.Tensor], linears=linears, inspect=inspect, group_in=group_in):
            originals = [linear.weight.data for linear in linears]
            try:
                for linear, w in zip(linears, weights):
                    linear.weight.data = w
                if inspect is layer.self_attn:
                    return inspect(group_in, cos, sin, 0, None)
                return inspect(group_in)
            finally:
                for linear, w in zip(linears, originals):
                    linear.weight.data = w

        reference = output_of([linear.weight.data for linear in linears])
        s, _ = search_scale([linear.weight.data for linear in linears], s_x, output_of,
                            reference, [schemes.get(name) if name in targets else None for name in group.linears],
                            config.grid, importance=importance)
        fold_scale(layer.get_submodule(group.prev), linears, s)
        folded[group.prev] = s
    return folded


@torch.no_grad()
def awq_block(layer: nn.Module, family: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              targets: list[str], scheme: QuantScheme | dict[str, QuantScheme], config: AWQConfig,
              folded: dict[str, torch.Tensor] | None = None) -> dict[str, QuantizedWeight]:
    """Scale, clip and round the target linears of one block, given its input hidden states x (N, L, C).

    scheme: one for every target, or {linear name: scheme}. The scales are folded into the block in place
    (search_block_scales); the returned weights are of the folded block. folded, when given, receives
    {prev module name: s} for every scale folded, so callers can map weights back to the unfolded basis.
    """
    schemes = scheme if isinstance(scheme, dict) else {name: scheme for name in targets}
    scales = search_block_scales(layer, family, x, cos, sin, targets, schemes, config)
    if folded is not None:
        folded.update(scales)
    quantized_names = list(targets)
    if config.clip:
        # Inputs again: the folds divided them by s. q and k are left unclipped, as in AWQ:
        # their errors pass through the softmax, which a per-layer output error does not see.
        inputs = capture_inputs(layer, x, cos, sin, quantized_names)
        for name in quantized_names:
            if name.endswith(("q_proj", "k_proj")):
                continue
            linear = layer.get_submodule(name)
            linear.weight.data = search_clip(linear.weight.data, _sample_rows(inputs[name], config.clip_tokens),
                                             schemes[name], config.clip_grid, config.max_shrink)
    results = {}
    for name in quantized_names:
        linear = layer.get_submodule(name)
        q = quantize_rtn(linear.weight.data, schemes[name])
        results[name] = QuantizedWeight(q.codes, q.scales, q.zeros, q.scheme, "awq")
        linear.weight.data = q.dequantize(linear.weight.dtype)
    return results


def capture_inputs(layer: nn.Module, x: torch.Tensor, cos, sin, names: list[str]) -> dict[str, torch.Tensor]:
    """The input each named linear sees when the block runs on x."""
    captured: dict[str, torch.Tensor] = {}
    hooks = [layer.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, name=name: captured.__setitem__(name, args[0])) for name in set(names)]
    try:
        layer(x, cos, sin, 0, None)
    finally:
        for h in hooks:
            h.remove()
    return captured
