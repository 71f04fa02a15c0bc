"""Quantize a loaded model and write it as a checkpoint: what `quantize` and `fit` both do."""

from __future__ import annotations

import time
from pathlib import Path

from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.checkpoint import save_checkpoint, swap_in_quantized
from paperback.quantization.head_bands import BandedWeight
from paperback.quantization.model_pass import METHODS, QuantizeConfig, autocast_dtype, quantize_model


def quantize_to_checkpoint(lm, config: QuantizeConfig, calibration: CalibrationConfig | None, out_dir: Path,
                           overwrite: bool = False, progress: bool = True, extra_recipe: dict | None = None) -> dict:
    """Quantize lm.model in place (packed layers swapped in), save it to out_dir; returns a summary.

    calibration: the samples GPTQ and AWQ read (None for RTN). extra_recipe: more
    recipe entries (a fitted checkpoint's KV policy and allocation).
    """
    batch = calibration_batch(lm.tokenizer, calibration, lm.model) if METHODS[config.method].calibrated else None
    start = time.perf_counter()
    quantized = quantize_model(lm.model, config, batch, progress=progress)
    return save_quantized(lm, config, calibration if batch is not None else None, quantized,
                          time.perf_counter() - start, out_dir, overwrite, extra_recipe)


def save_quantized(lm, config: QuantizeConfig, calibration: CalibrationConfig | None, quantized: dict,
                   seconds: float, out_dir: Path, overwrite: bool = False, extra_recipe: dict | None = None) -> dict:
    """Write lm.model, already quantized by `quantize_model` (its returned `quantized`), as a checkpoint:
    packed layers swapped in, the recipe saying how it was made; returns a summary."""
    swap_in_quantized(lm.model, quantized)
    forward_dtype = "bf16" if autocast_dtype(config, lm.model.device) else "fp32"
    layers = {name: layer_entry(q) for name, q in quantized.items()}
    recipe = quantized_recipe(lm.source.path, config, calibration, layers, seconds, forward_dtype, extra_recipe)
    save_checkpoint(lm.model, lm.tokenizer, recipe, out_dir, overwrite=overwrite)
    q_bits = sum(storage_bits(q) for q in quantized.values())
    q_weights = sum(q.shape[0] * q.shape[1] for q in quantized.values())
    return summary(out_dir, config, len(quantized), q_bits / q_weights, seconds)


def quantized_recipe(source: Path, config: QuantizeConfig, calibration: CalibrationConfig | None, layers: dict,
                     seconds: float, forward_dtype: str, extra_recipe: dict | None = None) -> dict:
    """What a checkpoint's recipe.json says of how it was made (`layers`: each packed layer's entry)."""
    return {
        "source_model": str(source),
        "method": config.method,
        "scheme": config.scheme.to_dict() if not config.mixed_blocks else None,
        **(METHODS[config.method].recipe(config, forward_dtype) or {}),  # the method's own settings, under its name
        "modules": list(config.targets),
        "calibration": calibration.to_dict() if calibration is not None else None,
        "quantize_seconds": seconds,
        "layers": layers,
        **(extra_recipe or {}),
    }


def summary(out_dir: Path, config: QuantizeConfig, layers: int, bits_per_weight: float, seconds: float) -> dict:
    return {"output": str(out_dir), "method": config.method, "scheme": config.label, "layers": layers,
            "bits_per_weight": bits_per_weight, "seconds": seconds}


def layer_entry(q) -> dict:
    """A packed layer's recipe entry: its scheme (a banded head: each band's rows and scheme) and method."""
    if isinstance(q, BandedWeight):
        return q.recipe_entry()
    return {"scheme": q.scheme.to_dict(), "method": q.method}


def storage_bits(q) -> int:
    return q.storage_bits() if isinstance(q, BandedWeight) else q.scheme.storage_bits(*q.shape)
