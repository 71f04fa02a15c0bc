"""Post-training weight quantization: schemes, algorithms on tensors, packing.

Algorithms are pure functions of tensors (a weight and its input statistics
in, integer codes plus scales out); the model pass, QuantLinear and
checkpoint formats build on them.
"""

from paperback.quantization.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from paperback.quantization.packing import pack_codes, unpack_codes
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn
from paperback.quantization.scheme import QuantScheme

__all__ = ["GPTQConfig", "HessianAccumulator", "gptq_quantize", "pack_codes", "unpack_codes",
           "QuantizedWeight", "quantize_rtn", "QuantScheme"]
