"""Integer weight quantization schemes and their exact storage cost.

A scheme quantizes a weight matrix W (out_features, in_features) in groups of
`group_size` consecutive input features per output row (None: one group per
row, i.e. per output channel). The last group may be shorter when group_size
does not divide in_features (GPTQ's layout, ceil(in / group_size) groups).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from paperback.errors import PaperbackError

SUPPORTED_BITS = (2, 3, 4, 8)
SCALE_BITS = 16  # scales are stored in fp16


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise PaperbackError(f"unsupported bits {self.bits} (choose from {', '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size is not None and self.group_size < 1:
            raise PaperbackError(f"group size must be positive, got {self.group_size}")

    @property
    def max_code(self) -> int:
        return 2 ** self.bits - 1

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def group_bounds(self, in_features: int) -> list[tuple[int, int]]:
        size = self.group_size or in_features
        return [(lo, min(lo + size, in_features)) for lo in range(0, in_features, size)]

    def storage_bits(self, out_features: int, in_features: int) -> int:
        """Exact bits of codes, fp16 scales and (asymmetric) zero points stored at `bits` each."""
        groups = out_features * self.num_groups(in_features)
        zero_bits = 0 if self.symmetric else self.bits
        return out_features * in_features * self.bits + groups * (SCALE_BITS + zero_bits)

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return self.storage_bits(out_features, in_features) / (out_features * in_features)

    @property
    def label(self) -> str:
        group = "ch" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.bits}{'s' if self.symmetric else 'a'}-{group}"

    def to_dict(self) -> dict:
        return asdict(self)
