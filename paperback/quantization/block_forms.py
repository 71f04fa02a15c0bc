"""Each weight method's block form: one block's linears quantized from the block's exact inputs under one
scheme, kept as codes with the scales that map them back to the block's own basis (EffectiveWeight). A profile
prices units from these; the model pass (quantization.model_pass) is the same method over a whole model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from paperback.quantization.awq import awq_block, capture_inputs, scale_groups
from paperback.quantization.gptq import HessianAccumulator, gptq_quantize
from paperback.quantization.linears import BLOCK_LINEARS, input_reader
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn


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


def rtn_block_form(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
    return {name: EffectiveWeight(quantize_rtn(layer.get_submodule(name).weight, scheme)) for name in BLOCK_LINEARS}


def gptq_block_form(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
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


def awq_block_form(layer, family, x, cos, sin, scheme, awq, gptq) -> dict[str, EffectiveWeight]:
    work = copy.deepcopy(layer)
    folded: dict[str, torch.Tensor] = {}
    results = awq_block(work, family, x, cos, sin, list(BLOCK_LINEARS), scheme, awq, folded)
    column = {}
    for group in scale_groups(family, layer):
        if group.prev in folded:
            for name in group.linears:
                column[name] = folded[group.prev]
    return {name: EffectiveWeight(q, column.get(name), folded.get(name)) for name, q in results.items()}
