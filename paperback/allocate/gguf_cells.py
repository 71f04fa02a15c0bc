"""Every weight of a model on any GGUF type, quantized from the full model's own inputs.

A GGUF fit prices each (tensor, type) cell alone, so every tensor is quantized from the inputs the full
model gives it on the calibration windows: one forward records, per block, the input Hessian of each linear
that reads a distinct input (q/k/v share one, gate/up another) and the head's from the final normed hidden
state. RTN searches each type's stored scales weighted by that Hessian's diagonal (the mean squared
activation, what `llama-imatrix` records); GPTQ uses the whole Hessian. AWQ first searches each block's
activation-aware scales (quantization.awq, judged at each tensor's `scale_types` type) and folds them into
the norms and rows that produce the scaled inputs, which llama.cpp reads as ordinary F32 tensors: the model's
full-precision function is unchanged, and its cells are then rounded as RTN's (the searched stored scales
stand in for AWQ's clipping). Any mix of cells is then the full model with those weights swapped in, and the
cells a fit chooses are the ones it writes.

A cell's `error` is the mean squared change of its tensor's output on the calibration inputs,
tr(dW H dW^T) / 2 with H = 2/n X^T X: what a fit scales into KL (allocate.gguf_prices).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from paperback.errors import PaperbackError
from paperback.progress import progress as stage_progress
from paperback.quantization.awq import AWQConfig, search_block_scales
from paperback.quantization.gguf_types import GGUFType
from paperback.quantization.gguf_weight import GGUFWeight
from paperback.quantization.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from paperback.quantization.model_pass import (BLOCK_LINEARS, EMBED_PARAM, HEAD_PARAM, QuantizeConfig,
                                               autocast_dtype, input_reader)
from paperback.quantization.rtn import quantize_rtn

CELL_METHODS = ("rtn", "gptq", "awq")  # what quantizes onto a GGUF grid
ERROR_ROWS = 8192  # rows of a weight whose output error is computed at once (a vocabulary-sized head is large)


def block_param(layer: int, linear: str) -> str:
    return f"model.layers.{layer}.{linear}.weight"


def layer_of(param: str) -> int | None:
    """The block a weight belongs to; None for the embedding and the head."""
    if not param.startswith("model.layers."):
        return None
    return int(param.split(".")[2])


class GGUFCells:
    """{(param, type): GGUFWeight} on demand, each from the full model's inputs on `calibration` (N, L).
    method "awq" folds its scales into `model` in place (same function in full precision); `scale_types`
    {param: GGUF type} is the type each block linear's scale is searched at (a fit's anchor types, or the
    types a file is written at)."""

    def __init__(self, model, calibration: torch.Tensor, method: str = "rtn", gptq: GPTQConfig = GPTQConfig(),
                 batch_size: int = 8, awq: AWQConfig = AWQConfig(),
                 scale_types: dict[str, GGUFType] | None = None, progress: bool = False):
        if method not in CELL_METHODS:
            raise PaperbackError(f"a GGUF fit quantizes by {', '.join(CELL_METHODS)}, not '{method}'")
        if method == "awq":
            model.config.require_dense("AWQ")
            if scale_types is None:
                raise PaperbackError("AWQ onto GGUF types needs the type each scale is searched at")
        self.model, self.method, self.gptq, self.awq = model, method, gptq, awq
        self.scale_types = scale_types or {}
        self.params = dict(model.named_parameters())
        self.tied = model.lm_head is None
        self._cells: dict[tuple[str, str], GGUFWeight] = {}
        self.folded: dict[str, torch.Tensor] = {}  # {module name: the AWQ scale folded into it}
        self._hessians = self._measure(calibration, batch_size, progress)

    @torch.inference_mode()
    def _measure(self, calibration: torch.Tensor, batch_size: int, progress: bool) -> dict[str, torch.Tensor]:
        """{reader param: its input Hessian}, through the full-precision blocks."""
        model = self.model
        device = model.model.embed_tokens.weight.device
        low = autocast_dtype(QuantizeConfig(), device)
        cast = torch.autocast(device.type, dtype=low) if low is not None else nullcontext()
        positions = torch.arange(calibration.shape[1])
        hidden = [model.embed(b) for b in calibration.split(batch_size)]
        readers = sorted({input_reader(name) for name in BLOCK_LINEARS})
        hessians = {}
        what = "AWQ scales and input statistics" if self.method == "awq" else "input statistics"
        for idx, layer in stage_progress(list(enumerate(model.model.layers)), desc=what, unit="block",
                                         enabled=progress):
            cos, sin = model.rotary_for(idx)(positions, model.dtype)
            if self.method == "awq":
                self._fold_scales(idx, layer, hidden, cos, sin)
            accumulators = {name: HessianAccumulator(layer.get_submodule(name).in_features) for name in readers}
            hooks = [layer.get_submodule(name).register_forward_pre_hook(
                lambda _m, args, acc=acc: acc.add_batch(args[0])) for name, acc in accumulators.items()]
            try:
                with cast:
                    hidden = [layer(x, cos, sin, 0, None).to(model.dtype) for x in hidden]
            finally:
                for h in hooks:
                    h.remove()
            for name, acc in accumulators.items():
                hessians[block_param(idx, name)] = acc.H
        head = HessianAccumulator(model.config.hidden_size)
        for x in hidden:
            head.add_batch(model.model.norm(x))
        hessians[EMBED_PARAM if self.tied else HEAD_PARAM] = head.H
        return hessians

    def _fold_scales(self, idx: int, layer, hidden: list[torch.Tensor], cos, sin) -> None:
        """AWQ's scales for block `idx`, searched on its first `search_samples` input windows, folded in."""
        x = torch.cat(hidden)[: self.awq.search_samples]
        schemes = {name: self.scale_types[block_param(idx, name)] for name in BLOCK_LINEARS}
        folded = search_block_scales(layer, self.model.config.family, x, cos, sin, list(BLOCK_LINEARS), schemes,
                                     self.awq, weighted=True)
        self.folded.update({f"model.layers.{idx}.{prev}": s for prev, s in folded.items()})

    def hessian(self, param: str) -> torch.Tensor | None:
        """The Hessian of `param`'s inputs; None for an untied embedding, which has no input activations
        (rounded plain, as llama.cpp does)."""
        if param.startswith("model.layers."):
            _, _, layer, linear = param.removesuffix(".weight").split(".", 3)
            return self._hessians[block_param(int(layer), input_reader(linear))]
        return self._hessians.get(param)

    def quantize(self, param: str, kind: GGUFType) -> GGUFWeight:
        """`param` on `kind`'s grid (not remembered: `quantized` keeps what it makes)."""
        weight = self.params[param].detach()
        H = self.hessian(param)
        if self.method == "gptq" and H is not None and not kind.is_float:
            return gptq_quantize(weight, H, kind, self.gptq)
        return quantize_rtn(weight, kind, None if H is None else torch.diag(H))

    def quantized(self, param: str, kind: GGUFType) -> GGUFWeight:
        key = (param, kind.name)
        if key not in self._cells:
            self._cells[key] = self.quantize(param, kind)
        return self._cells[key]

    @torch.inference_mode()
    def error(self, param: str, cell: GGUFWeight) -> float:
        """Mean squared change of `param`'s output over the calibration inputs with `cell` in its place
        (an untied embedding, read one row per token: the mean squared change of a row)."""
        weight = self.params[param].detach()
        H = self.hessian(param)
        held = cell.dequantize()
        total = 0.0
        for lo in range(0, weight.shape[0], ERROR_ROWS):
            delta = held[lo:lo + ERROR_ROWS] - weight[lo:lo + ERROR_ROWS]
            total += (delta.pow(2).sum() if H is None else ((delta @ H) * delta).sum() / 2).item()
        return total / weight.shape[0] if H is None else total

    def weights(self, types: dict[str, GGUFType]) -> dict[str, torch.Tensor]:
        """{param: dequantized weight} of an assignment, for swapping into the model."""
        return {param: self.quantized(param, kind).dequantize() for param, kind in types.items()}

    def forget(self, keep: set[tuple[str, str]] | None = None) -> None:
        """Drop the remembered cells (but those in `keep`, (param, type name) pairs)."""
        self._cells = {k: v for k, v in self._cells.items() if keep and k in keep}
