"""The memory-bandwidth roofline for decoding.

A decode step reads every weight once for the whole batch and each sequence's
cache once, so tokens/s can never exceed batch * bandwidth / bytes per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from paperback.memory import kv_bytes_read_per_step, weight_bytes_read_per_step


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Best observed bytes/s for a streaming read (a sum) of a buffer far larger than cache."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


@dataclass
class DecodeRoofline:
    batch: int
    context: int
    weight_bytes: int
    kv_bytes_per_sequence: int
    bandwidth_bytes_per_s: float

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.batch * self.kv_bytes_per_sequence

    @property
    def max_tokens_per_s(self) -> float:
        return self.batch * self.bandwidth_bytes_per_s / self.bytes_per_step

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_step": self.bytes_per_step, "max_tokens_per_s": self.max_tokens_per_s}


def decode_roofline(model, batch: int, context: int, bandwidth: float) -> DecodeRoofline:
    dtype = model.dtype
    return DecodeRoofline(batch, context, weight_bytes_read_per_step(model, batch),
                          kv_bytes_read_per_step(model.config, dtype, context), bandwidth)
