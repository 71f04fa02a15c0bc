"""One block's linears quantized under one scheme, kept as codes and mapped back to the block's own basis.

A profile asks what quantizing one unit alone costs. AWQ folds its scales
into the modules that feed each linear (norm weights, the rows of the linear
before), so a block quantized under scheme A and one under scheme B have
different norms and cannot be mixed unit by unit. Mapping each quantized
weight back through its scales (columns divided by the scale AWQ multiplied
them by, rows multiplied by the scale folded out of them) gives its
*effective* weight in the unfolded block: any mix of units from different
schemes is then the original block with those weights swapped in.
Codes are kept (uint8) rather than fp32 weights, so every scheme of every
block fits in memory at once for the additivity check.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from paperback.allocate.units import BLOCK_UNITS, HEAD_UNIT, WeightUnit
from paperback.errors import PaperbackError
from paperback.quantization.awq import AWQConfig, awq_block, capture_inputs, scale_groups
from paperback.quantization.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from paperback.quantization.model_pass import BLOCK_LINEARS, input_reader
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn
from paperback.quantization.scheme import QuantScheme


@dataclass
class EffectiveWeight:
    """weight ~ diag(row_scale) @ dequantize(q) @ diag(1 / column_scale); scales None when 1."""

    q: QuantizedWeight
    column_scale: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.q.dequantize(torch.float32)
        if self.column_scale is not None:
            w = w / self.column_scale[None, :]
        if self.row_scale is not None:
            w = w * self.row_scale[:, None]
        return w.to(dtype)


@torch.inference_mode()
def quantize_block(layer: nn.Module, family: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   scheme: QuantScheme, method: str, awq: AWQConfig | None = None,
                   gptq: GPTQConfig | None = None) -> dict[str, EffectiveWeight]:
    """Every linear of `layer` quantized by `method` under `scheme`, from its full-precision inputs x (N, L, C).

    The layer itself is left unchanged (AWQ works on a copy).
    """
    if method not in BLOCK_METHODS:
        raise PaperbackError(f"unknown method '{method}' (choose from {', '.join(BLOCK_METHODS)})")
    return BLOCK_METHODS[method](layer, family, x, cos, sin, scheme, awq or AWQConfig(), gptq or GPTQConfig())


def _rtn_block(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
    return {name: EffectiveWeight(quantize_rtn(layer.get_submodule(name).weight, scheme)) for name in BLOCK_LINEARS}


def _gptq_block(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
    readers = sorted({input_reader(name) for name in BLOCK_LINEARS})
    inputs = capture_inputs(layer, x, cos, sin, readers)
    hessians = {}
    for name in readers:
        acc = HessianAccumulator(layer.get_submodule(name).in_features)
        acc.add_batch(inputs[name])
        hessians[name] = acc.H
    return {name: EffectiveWeight(gptq_quantize(layer.get_submodule(name).weight, hessians[input_reader(name)],
                                                scheme, gptq))
            for name in BLOCK_LINEARS}


def _awq_block(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
    work = copy.deepcopy(layer)
    folded: dict[str, torch.Tensor] = {}
    results = awq_block(work, family, x, cos, sin, list(BLOCK_LINEARS), scheme, awq, folded)
    column = {}
    for group in scale_groups(family, layer):
        if group.prev in folded:
            for name in group.linears:
                column[name] = folded[group.prev]
    return {name: EffectiveWeight(q, column.get(name), folded.get(name)) for name, q in results.items()}


@torch.inference_mode()
def quantized_blocks(model, calibration: torch.Tensor, schemes_of, method: str, awq: AWQConfig | None = None):
    """Yields (layer index, {scheme label: {linear name: EffectiveWeight}}) for each block, its schemes
    `schemes_of(index)` each quantized from the full model's own inputs to that block on `calibration` (N, L)
    token ids: every block sees exact inputs, so any mix of blocks' schemes can be swapped in afterwards."""
    x = model.embed(calibration)
    positions = torch.arange(calibration.shape[1], device=model.device)
    for idx, layer in enumerate(model.model.layers):
        cos, sin = model.rotary_for(idx)(positions, model.dtype)
        yield idx, {s.label: quantize_block(layer, model.config.family, x, cos, sin, s, method, awq)
                    for s in schemes_of(idx)}
        x = layer(x, cos, sin, 0, None)


def effective_key(unit: WeightUnit) -> str:
    """Which quantized piece a unit's weights come from: its block, or the head."""
    return HEAD_UNIT if unit.name == HEAD_UNIT else f"layers.{unit.layer}"


def unit_weights(effective: dict[tuple[str, str], dict[str, EffectiveWeight]], unit: WeightUnit,
                 label: str) -> dict[str, torch.Tensor]:
    """{param name: effective weight} of `unit` under the scheme labelled `label`, from the pieces `effective`
    holds by (effective_key, label): a block's linears by their names in the block, the head by its param."""
    pieces = effective[(effective_key(unit), label)]
    if unit.name == HEAD_UNIT:
        return {p: w.weight() for p, w in pieces.items()}
    names = BLOCK_UNITS[unit.name.rsplit(".", 1)[1]]
    return {f"model.layers.{unit.layer}.{n}.weight": pieces[n].weight() for n in names}


# Each weight method (paperback.quantization.model_pass.METHODS) on one block from its exact inputs.
BLOCK_METHODS = {"rtn": _rtn_block, "gptq": _gptq_block, "awq": _awq_block}
