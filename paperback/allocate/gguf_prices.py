"""Each (tensor, GGUF type) cell's price: the KL to the full model when that tensor alone takes that type.

Measuring every cell (SmolLM2 has 1,205) would run half a forward each. So each tensor's KL is measured at
one anchor type, the legal one nearest `anchor_bits` bits a weight, and every other type of that tensor is
priced at the anchor's KL per unit of output error times its own output error (`GGUFCells.error`: no
forward), the estimate paperback's own profile makes across schemes (allocate.estimate). A seeded sample
of the estimated cells is measured too: the check a fit reports.
"""

from __future__ import annotations

import random
import time

import torch

from paperback.allocate.estimate import anchor_factor, check_summary
from paperback.allocate.gguf_cells import GGUFCells, layer_of
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.progress import progress as stage_progress
from paperback.quantization.gguf_types import GGUF_TYPES, GGUFType
from paperback.quantization.model_pass import EMBED_PARAM

ANCHOR_BITS = 4.5  # the middle of the types a fit mixes (Q4_0, Q4_K): errors well above the noise floor


def anchor_type(kinds: list[GGUFType], bits: float = ANCHOR_BITS) -> GGUFType:
    """The candidate nearest `bits` bits a weight (the fewer bits on a tie)."""
    return min(kinds, key=lambda k: (abs(k.bits_per_weight - bits), k.bits_per_weight))


@torch.inference_mode()
def kl_with(probe: ReferenceProbe, param: str, weight: torch.Tensor) -> float:
    """KL of the full model with `param` replaced by `weight`, running only what the change reaches: the
    blocks from its own on, all of them for the embedding, the head alone for an untied head."""
    with swapped_weights(probe.model, {param: weight}):
        layer = layer_of(param)
        if layer is not None:
            return probe.kl_from(layer)
        if param == EMBED_PARAM:  # the input rows (and, tied, the head too)
            return probe.kl_full()
        return probe.kl_of_output(probe.final_output)


def price_cells(cells: GGUFCells, probe: ReferenceProbe, candidates: dict[str, list[GGUFType]],
                anchor_bits: float = ANCHOR_BITS, check_samples: int = 12, seed: int = 0,
                progress: bool = True) -> dict:
    """{"cells": {param: {type: {"error", "kl", "measured"}}}, "anchors": {param: type}, "check": ...}."""
    t0 = time.perf_counter()
    prices: dict[str, dict[str, dict]] = {}
    anchors = {}
    bar = stage_progress(total=sum(len(k) for k in candidates.values()), desc="price GGUF cells", unit="cell",
                         enabled=progress)
    for param, kinds in candidates.items():
        anchor = anchor_type(kinds, anchor_bits)
        anchors[param] = anchor.name
        errors = {}
        for kind in kinds:
            cell = cells.quantize(param, kind)
            errors[kind.name] = cells.error(param, cell)
            if kind is anchor:
                anchor_kl = kl_with(probe, param, cell.dequantize())
            bar.update()
        factor = anchor_factor(anchor_kl, errors[anchor.name])
        row = {}
        for kind in kinds:
            measured = kind is anchor or factor is None
            kl = anchor_kl if kind is anchor else (
                kl_with(probe, param, cells.quantize(param, kind).dequantize()) if factor is None
                else factor * errors[kind.name])
            row[kind.name] = {"error": errors[kind.name], "kl": kl, "measured": measured}
        prices[param] = row
    bar.close()
    seconds = time.perf_counter() - t0
    check = _check(cells, probe, prices, check_samples, seed, progress)
    return {"cells": prices, "anchors": anchors, "anchor_bits": anchor_bits, "check": check,
            "seconds": {"price": seconds, "check": time.perf_counter() - t0 - seconds}}


def _check(cells: GGUFCells, probe: ReferenceProbe, prices: dict, samples: int, seed: int, progress: bool) -> dict:
    """A seeded sample of estimated cells measured: how far the estimates are from the KL itself."""
    estimated = [(p, t) for p, row in prices.items() for t, cell in row.items() if not cell["measured"]]
    chosen = random.Random(seed).sample(estimated, min(samples, len(estimated)))
    points = []
    for param, name in stage_progress(chosen, desc="check estimates", enabled=progress):
        points.append({"kind": "weight", "param": param, "type": name, "estimated": prices[param][name]["kl"],
                       "measured": kl_with(probe, param, cells.quantize(param, GGUF_TYPES[name]).dequantize())})
    return check_summary(points) if points else {"samples": 0}


def costs(prices: dict) -> dict[str, dict[str, float]]:
    """{param: {type: KL}}: what the solve reads."""
    return {param: {name: cell["kl"] for name, cell in row.items()} for param, row in prices["cells"].items()}


def exact_types(prices: dict) -> dict[str, int]:
    """{type: tensors it stores with no error at all}, for types that reproduce more than half of the tensors
    they can take: the grids of an already-quantized source (the bundled models are GGUF files), which any
    fit at or above the source's size will simply give back."""
    found: dict[str, list[int]] = {}
    for row in prices["cells"].values():
        for name, cell in row.items():
            counts = found.setdefault(name, [0, 0])
            counts[0] += cell["error"] == 0
            counts[1] += 1
    return {name: exact for name, (exact, total) in found.items() if exact * 2 > total}
