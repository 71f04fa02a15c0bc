"""Which positions the attention reads at prefill, per layer: sinks, the recent window, heavy hitters.

This is what decides token retention: a layer whose later queries put most
of their mass on the first few tokens and the recent window loses little
when the middle is stored coarsely or evicted (StreamingLLM); one that reads
a few middle tokens heavily (H2O's heavy hitters) does not.
"""

from __future__ import annotations

import torch

from paperback.models import DecoderLM
from paperback.models.cache import KVCache


class _MassRecorder(KVCache):
    """A pass-through cache that turns each layer's rotated q and k into attention probabilities."""

    def __init__(self, model: DecoderLM, sinks: int, recent: int, heavy_fraction: float):
        attn = [layer.self_attn for layer in model.model.layers]
        self.scaling = [a.scaling for a in attn]
        self.window = [a.window for a in attn]
        self.sinks, self.recent, self.heavy_fraction = sinks, recent, heavy_fraction
        self.layers: list[dict] = [None] * len(attn)  # type: ignore[list-item]

    def update(self, layer_idx, k, v, start_pos):
        return k, v

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n, h, t, _ = q.shape
        k = k.repeat_interleave(h // k.shape[1], dim=1).float()
        scores = (q.float() @ k.transpose(-1, -2)) * self.scaling[layer_idx]  # (N, H, T, T)
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        visible = j <= i
        if self.window[layer_idx] is not None:
            visible &= j > i - self.window[layer_idx]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=(0, 1))  # (T, T)
        late = probs[t // 2:]  # queries with a long past: where retention matters
        li = i[t // 2:]
        sink = late[:, : self.sinks].sum(-1).mean().item()
        recent_mask = (j > li - self.recent) & (j <= li) & (j >= self.sinks)
        recent = (late * recent_mask).sum(-1).mean().item()
        middle_mask = (j >= self.sinks) & (j <= li - self.recent)
        middle = late * middle_mask
        received = middle.sum(0)  # per key position, over the late queries
        candidates = int(middle_mask.any(0).sum())
        top = max(1, int(round(self.heavy_fraction * candidates)))
        heavy = (received.topk(top).values.sum() / received.sum().clamp(min=1e-30)).item() if candidates else 0.0
        self.layers[layer_idx] = {
            "sink_mass": sink, "recent_mass": recent, "middle_mass": max(0.0, 1.0 - sink - recent),
            "heavy_hitter_share": heavy,
            "mass_by_position": [round(x, 7) for x in probs.sum(0).div(t).tolist()],
        }


@torch.inference_mode()
def token_importance(model: DecoderLM, windows: torch.Tensor, sinks: int = 4, recent: int = 128,
                     heavy_fraction: float = 0.1) -> list[dict]:
    """Per layer, over windows (N, T): for queries in the second half of the window, the mean attention
    mass on the first `sinks` tokens, on the `recent` tokens before each query, and the rest (the middle);
    the share of middle mass on its top `heavy_fraction` of positions; and the mass each position
    receives from all queries (sums to 1)."""
    recorder = _MassRecorder(model, sinks, recent, heavy_fraction)
    model.hidden_states(windows, 0, recorder)
    return recorder.layers
