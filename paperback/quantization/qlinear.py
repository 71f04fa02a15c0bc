"""QuantLinear: a linear layer that stores packed integer codes and fp16 scales.

Storage (per layer, out x in weight, G = ceil(in / group_size) groups):
  qweight  uint8 (out, ceil(in * bits / 8))   codes packed LSB first along in
  scales   fp16  (out, G)
  qzeros   uint8 (out, ceil(G * bits / 8))    zero points packed the same way
                                              (asymmetric schemes only)
Its byte count is exactly QuantScheme.storage_bits / 8 (up to row padding).

forward() runs the packed C kernel on CPU (kernels.py); reference_forward()
unpacks and dequantizes with PyTorch ops and then multiplies, on any device.
The kernel is tested against it.
"""

from __future__ import annotations

import torch
from torch import nn

from paperback.kernels.packed import packed_linear, packed_linears, reference_linear
from paperback.quantization.packing import pack_codes, packed_row_bytes, unpack_codes
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.num_groups(in_features)
        self.register_buffer("qweight", torch.zeros(out_features, packed_row_bytes(in_features, scheme.bits),
                                                    dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        if scheme.symmetric:
            self.qzeros = None
        else:
            self.register_buffer("qzeros", torch.zeros(out_features, packed_row_bytes(groups, scheme.bits),
                                                       dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_quantized(cls, q: QuantizedWeight, bias: torch.Tensor | None = None) -> "QuantLinear":
        out_features, in_features = q.shape
        layer = cls(in_features, out_features, q.scheme, bias is not None)
        layer.qweight = pack_codes(q.codes, q.scheme.bits)
        layer.scales = q.scales.to(torch.float16)
        if not q.scheme.symmetric:
            layer.qzeros = pack_codes(q.zeros.to(torch.uint8), q.scheme.bits)
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    def to_quantized(self, rows: torch.Tensor | None = None) -> QuantizedWeight:
        """The unpacked weight, or only the output rows indexed by `rows`."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        scales = pick(self.scales)
        groups = self.scheme.num_groups(self.in_features)
        if self.scheme.symmetric:
            zeros = torch.full((scales.shape[0], groups), float(2 ** (self.scheme.bits - 1)), device=scales.device)
        else:
            zeros = unpack_codes(pick(self.qzeros), self.scheme.bits, groups).float()
        codes = unpack_codes(pick(self.qweight), self.scheme.bits, self.in_features)
        return QuantizedWeight(codes, scales.float(), zeros, self.scheme)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_quantized().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(self, x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(self, x)

    @staticmethod
    def forward_many(layers: list["QuantLinear"], x: torch.Tensor) -> list[torch.Tensor]:
        """Several packed layers on one input (see kernels.packed_linears)."""
        return packed_linears(layers, x)

    def storage_bytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.qzeros] if self.qzeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.label}"


class QuantEmbedding(QuantLinear):
    """A token embedding stored packed like QuantLinear (rows = vocabulary, in = hidden size).

    forward(ids) gathers and dequantizes only the rows asked for; as_linear(x)
    uses the table as an output head (tied embeddings), through the kernel.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.to_quantized(input_ids.reshape(-1)).dequantize()
        return rows.reshape(*input_ids.shape, self.in_features)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(self, x)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.out_features}, embedding_dim={self.in_features}, scheme={self.scheme.label}"
