"""FP8 KV scales from data: the largest |key| and |value| each layer (or head) produces, over the FP8 range.

vLLM's default scale of 1.0 stores keys as they are, which wastes range when
they are small and saturates when they pass 448 (E4M3); calibrating maps the
observed absolute maximum onto the format's largest value, as llm-compressor's
kv_cache_scheme does. Calibrate on text other than the evaluation text.
"""

from __future__ import annotations

import torch

from paperback.kv.codecs import FP8_DTYPES
from paperback.models import DecoderLM
from paperback.models.cache import KVCache
from paperback.progress import progress as stage_progress


class _AmaxRecorder(KVCache):
    """A pass-through cache for whole-sequence forwards that records per-head |k| and |v| maxima."""

    def __init__(self, num_layers: int):
        self.key_amax: list[torch.Tensor | None] = [None] * num_layers
        self.value_amax: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer_idx, k, v, start_pos):
        for store, x in ((self.key_amax, k), (self.value_amax, v)):
            amax = x.detach().abs().float().amax(dim=(0, 2, 3))  # (Hkv,)
            store[layer_idx] = amax if store[layer_idx] is None else torch.maximum(store[layer_idx], amax)
        return k, v


@torch.inference_mode()
def calibrate_kv_amax(model: DecoderLM, calibration: torch.Tensor, batch_size: int = 4,
                      progress: bool = True) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (key amax, value amax)}, each (Hkv,), over calibration (N, L) token ids.

    Schemes turn these into FP8 scales for their variant, per layer or per head.
    """
    recorder = _AmaxRecorder(model.config.num_layers)
    for batch in stage_progress(calibration.split(batch_size), desc="kv amax", unit="batch", enabled=progress):
        model.hidden_states(batch, 0, recorder)
    return {i: (k, v) for i, (k, v) in enumerate(zip(recorder.key_amax, recorder.value_amax))}


def fp8_scale(amax: torch.Tensor, variant: str, per_head: bool) -> torch.Tensor:
    """The scale mapping amax onto the format's largest value: a scalar, or (Hkv, 1, 1) per head."""
    amax = amax if per_head else amax.max()
    scale = (amax.float() / torch.finfo(FP8_DTYPES[variant]).max).clamp(min=torch.finfo(torch.float32).tiny)
    return scale[:, None, None] if per_head else scale
