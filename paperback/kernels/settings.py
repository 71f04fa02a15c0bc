"""The kernels' switches in one object, read from the environment once at import and changed at run time
through the bindings' setters (which also tell the C side).

| field | environment | values | what it chooses |
|---|---|---|---|
| packed_matmul | PAPERBACK_QKERNEL | 1, 0 | packed linears through `_qkernel` (0: the PyTorch reference) |
| fused_decode | PAPERBACK_FUSED_DECODE | 1, 0 | a decode step in one `_fused_decode` call where the model qualifies |
| simd | PAPERBACK_SIMD | amx, avx512vnni, avx512, avxvnni, avx2, portable | caps `_qkernel`'s code path (default: the widest the CPU runs) |
| decode_activations | PAPERBACK_DECODE_ACTIVATIONS | fp32, int8 | how decode rows meet packed codes |
| prefill_matmul | PAPERBACK_PREFILL_MATMUL | fp32, bf16 | how prefill rows meet packed weights |
| kv_scores | PAPERBACK_KV_SCORES | fp32, int8 | how decode attention scores encoded keys |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from paperback.errors import PaperbackError

CHOICES = {"decode_activations": ("fp32", "int8"), "prefill_matmul": ("fp32", "bf16"), "kv_scores": ("fp32", "int8")}
SWITCHES = ("packed_matmul", "fused_decode")  # on unless their variable is "0"
ENVIRONMENT = {"packed_matmul": "PAPERBACK_QKERNEL", "fused_decode": "PAPERBACK_FUSED_DECODE", "simd": "PAPERBACK_SIMD",
               "decode_activations": "PAPERBACK_DECODE_ACTIVATIONS", "prefill_matmul": "PAPERBACK_PREFILL_MATMUL",
               "kv_scores": "PAPERBACK_KV_SCORES"}


def checked(field: str, value: str, what: str | None = None) -> str:
    """value, or a one-line user error naming the choices (the CLI prints it as such)."""
    if value not in CHOICES[field]:
        raise PaperbackError(f"{what or field.replace('_', ' ')} must be one of {', '.join(CHOICES[field])}, "
                             f"got {value!r}")
    return value


@dataclass
class KernelSettings:
    packed_matmul: bool = True
    fused_decode: bool = True
    simd: str | None = None  # checked by _qkernel itself, which knows its paths
    decode_activations: str = "fp32"
    prefill_matmul: str = "fp32"
    kv_scores: str = "fp32"

    @classmethod
    def from_environ(cls, environ=os.environ) -> KernelSettings:
        values = {}
        for field, variable in ENVIRONMENT.items():
            raw = environ.get(variable)
            if not raw:
                continue
            if field in SWITCHES:
                values[field] = raw != "0"
            elif field in CHOICES:
                values[field] = checked(field, raw, variable)
            else:
                values[field] = raw
        return cls(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


settings = KernelSettings.from_environ()
