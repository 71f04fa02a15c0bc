"""Each weight method's expert form: one MoE expert's projections (gate, up, down) quantized under one scheme
from the tokens routed to it, as bits per expert are chosen from (allocate.experts)."""

from __future__ import annotations

import torch

from paperback.quantization.gptq import GPTQConfig, gptq_quantize
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn
from paperback.quantization.scheme import QuantScheme


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return (2.0 / len(x)) * (x.T.double() @ x.double()).float()


def rtn_expert_form(weights: dict[str, torch.Tensor], x: torch.Tensor, act, scheme: QuantScheme,
                    gptq: GPTQConfig) -> dict[str, QuantizedWeight]:
    return {p: quantize_rtn(w, scheme) for p, w in weights.items()}


def gptq_expert_form(weights: dict[str, torch.Tensor], x: torch.Tensor, act, scheme: QuantScheme,
                     gptq: GPTQConfig) -> dict[str, QuantizedWeight]:
    """GPTQ on the routed tokens x (T, C): gate and up on x, down on their gated activations; RTN for an expert
    no calibration token reaches."""
    if not len(x):
        return rtn_expert_form(weights, x, act, scheme, gptq)
    inner = act(x @ weights["gate_proj"].T) * (x @ weights["up_proj"].T)
    h_in = _hessian(x)
    hessians = {"gate_proj": h_in, "up_proj": h_in, "down_proj": _hessian(inner)}
    return {p: gptq_quantize(w, hessians[p], scheme, gptq) for p, w in weights.items()}
