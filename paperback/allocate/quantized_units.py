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

import torch
from torch import nn

from paperback.allocate.units import BLOCK_UNITS, HEAD_UNIT, WeightUnit
from paperback.errors import PaperbackError
from paperback.quantization.awq import AWQConfig
from paperback.quantization.block_forms import EffectiveWeight  # noqa: F401 (the profile's and second pass's)
from paperback.quantization.gptq import GPTQConfig
from paperback.quantization.model_pass import METHODS
from paperback.quantization.scheme import QuantScheme


@torch.inference_mode()
def quantize_block(layer: nn.Module, family: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   scheme: QuantScheme, method: str, awq: AWQConfig | None = None,
                   gptq: GPTQConfig | None = None) -> dict[str, EffectiveWeight]:
    """Every linear of `layer` quantized by `method` under `scheme`, from its full-precision inputs x (N, L, C).

    The layer itself is left unchanged (AWQ works on a copy).
    """
    if method not in METHODS:
        raise PaperbackError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    return METHODS[method].block(layer, family, x, cos, sin, scheme, awq or AWQConfig(), gptq or GPTQConfig())


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

