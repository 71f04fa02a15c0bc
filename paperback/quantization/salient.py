"""The AWQ paper's salient-weight experiment: which 1% of input channels deserve full precision?

Round a layer to a low bit width, then put back the full-precision weights of
a small fraction of its input channels, chosen by one of three rules:
  activation  largest mean |x| over calibration tokens (AWQ's claim: these matter)
  weight      largest column norm of W
  random      a seeded draw, the control
Keeping channels costs bits, so the experiment only asks which rule finds
the weights whose rounding hurts most.
"""

from __future__ import annotations

import math

import torch

from paperback.errors import PaperbackError
from paperback.quantization.rtn import quantize_rtn
from paperback.quantization.scheme import QuantScheme

RULES = ("activation", "weight", "random")


def salient_channels(rule: str, weight: torch.Tensor, activation_scale: torch.Tensor | None, fraction: float,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the ceil(fraction * in_features) input channels the rule keeps."""
    in_features = weight.shape[1]
    count = max(1, math.ceil(fraction * in_features))
    if rule == "activation":
        if activation_scale is None:
            raise PaperbackError("the activation rule needs activation statistics")
        return activation_scale.topk(count).indices
    if rule == "weight":
        return weight.float().norm(dim=0).topk(count).indices
    if rule == "random":
        return torch.randperm(in_features, generator=generator)[:count]
    raise PaperbackError(f"unknown salient rule '{rule}' (choose from {', '.join(RULES)})")


def quantize_keeping(weight: torch.Tensor, scheme: QuantScheme, keep: torch.Tensor) -> torch.Tensor:
    """RTN-dequantized weight with the `keep` input channels restored to their original values."""
    out = quantize_rtn(weight, scheme).dequantize(weight.dtype)
    out[:, keep] = weight[:, keep]
    return out
