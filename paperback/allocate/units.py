"""What an allocation chooses between: weight units with their candidate schemes, KV layers with their formats.

A weight unit is the set of linears that must share a scheme: the ones that
read one input and share AWQ's scale (q/k/v; gate/up), or stand alone (o,
down), plus the output head (tied to the embedding on models that tie them).
Every option's bytes are exact: packed codes, fp16 scales and zero points as
`QuantLinear` stores them; unquantized tensors count at 16 bits, as the
planner counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from paperback.errors import PaperbackError
from paperback.kv.families import DEFAULT_CANDIDATES
from paperback.kv.schemes import KVScheme, layer_retention, paged_block_size, parse_kv_scheme
from paperback.models.config import ModelConfig
from paperback.plan.planner import parse_weight_scheme
from paperback.quantization.head_bands import band_key, split_band_key
from paperback.quantization.model_pass import EMBED_PARAM, HEAD_PARAM
from paperback.quantization.packing import packed_row_bytes
from paperback.quantization.scheme import QuantScheme

# The block's units in the order they run; each a tuple of linear names inside the block.
BLOCK_UNITS = {
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_o": ("self_attn.o_proj",),
    "mlp_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp_down": ("mlp.down_proj",),
}
HEAD_UNIT = "head"
HEAD_BAND_UNIT = "head.band"  # a tied head's bands of vocabulary rows: "head.band0" ... (quantization.head_bands)
FULL_PRECISION_LABEL = "fp16"  # an unquantized option, counted at 16 bits
DEFAULT_WEIGHT_SCHEMES = ("W8s-ch", "W4a-g128", "W4a-g64", "W3a-g128", "W3a-g64", "W2a-g64")
DEFAULT_KV_FORMATS = DEFAULT_CANDIDATES  # each KV family names its own (paperback.kv.families)


@dataclass(frozen=True)
class WeightUnit:
    name: str  # "layers.3.mlp_down", "head" or "head.band3"
    layer: int | None  # None for the head
    params: tuple[str, ...]  # parameter names of the linears it holds (a head band: band_key(param, b))
    shapes: tuple[tuple[int, int], ...]  # (out, in) of each

    @property
    def numel(self) -> int:
        return sum(o * i for o, i in self.shapes)

    def bytes_for(self, scheme: QuantScheme | None) -> int:
        """Bytes the unit's weights take stored in `scheme` (None: unquantized, 16-bit)."""
        if scheme is None:
            return 2 * self.numel
        return sum(quantized_bytes(scheme, o, i) for o, i in self.shapes)


def head_band_units(head: WeightUnit, sizes: list[int]) -> list[WeightUnit]:
    """The head unit split into bands of `sizes` rows (head_bands.band_sizes), in band order."""
    (param,), ((_, hidden),) = head.params, head.shapes
    return [WeightUnit(f"{HEAD_BAND_UNIT}{b}", None, (band_key(param, b),), ((rows, hidden),))
            for b, rows in enumerate(sizes)]


def quantized_bytes(scheme: QuantScheme, out_features: int, in_features: int) -> int:
    """Exact bytes of a QuantLinear: packed codes, fp16 scales, packed zero points (asymmetric)."""
    groups = scheme.num_groups(in_features)
    codes = out_features * packed_row_bytes(in_features, scheme.bits)
    zeros = 0 if scheme.symmetric else out_features * packed_row_bytes(groups, scheme.bits)
    return codes + 2 * out_features * groups + zeros


def weight_units(config: ModelConfig, include_head: bool = True) -> list[WeightUnit]:
    h, d = config.hidden_size, config.head_dim
    shapes = {"self_attn.q_proj": (config.num_heads * d, h), "self_attn.k_proj": (config.num_kv_heads * d, h),
              "self_attn.v_proj": (config.num_kv_heads * d, h), "self_attn.o_proj": (h, config.num_heads * d),
              "mlp.gate_proj": (config.intermediate_size, h), "mlp.up_proj": (config.intermediate_size, h),
              "mlp.down_proj": (h, config.intermediate_size)}
    units = []
    for layer in range(config.num_layers):
        for unit, linears in BLOCK_UNITS.items():
            units.append(WeightUnit(f"layers.{layer}.{unit}", layer,
                                    tuple(f"model.layers.{layer}.{n}.weight" for n in linears),
                                    tuple(shapes[n] for n in linears)))
    if include_head:
        param = EMBED_PARAM if config.tie_word_embeddings else HEAD_PARAM
        units.append(WeightUnit(HEAD_UNIT, None, (param,), ((config.vocab_size, h),)))
    return units


# A checkpoint stores the tensors it does not pack as loaded, fp32 (exact), and a process loads them so.
FIXED_TENSOR_BYTES = 4


def fixed_weight_bytes(model, units: list[WeightUnit]) -> int:
    """Bytes no allocation changes, as a checkpoint stores them (FIXED_TENSOR_BYTES per value): every
    parameter outside the units (norms, biases, an untied embedding), each tensor counted once."""
    allocated = {split_band_key(p)[0] for u in units for p in u.params}
    seen: set[int] = set()
    total = 0
    for name, tensor in model.named_parameters():
        if name in allocated or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += FIXED_TENSOR_BYTES * tensor.numel()
    return total


def parse_weight_candidates(labels) -> list[QuantScheme]:
    schemes = []
    for label in labels:
        scheme = parse_weight_scheme(label)
        if isinstance(scheme, str):
            raise PaperbackError(f"weight candidate '{label}' is not a quantization scheme (e.g. W4a-g128)")
        schemes.append(scheme)
    if not schemes:
        raise PaperbackError("no weight schemes to choose from")
    return schemes


def parse_kv_candidates(specs, config: ModelConfig) -> list[KVScheme]:
    formats = [parse_kv_scheme(spec) for spec in specs]
    for scheme in formats:
        scheme.check_head_dim(config.head_dim)
        if scheme.needs_calibration:
            raise PaperbackError(f"{scheme.label} needs calibration and is not an allocation candidate yet: "
                                 "use its uncalibrated form (fp8, scale 1)")
    if not formats:
        raise PaperbackError("no KV formats to choose from")
    return formats


RETENTION_SINK = 32  # exact attention-sink tokens a retention option keeps (a whole 32-token group)


def with_retention(spec: str, sink: int = 0, window: int = 0, recent: int = 0) -> str:
    """A KV spec with retention settings added: ('kivi2', 32) -> 'kivi2:sink=32'; recent > 0 sets the exact
    recent window (r)."""
    settings = [f"sink={sink}"] * bool(sink) + [f"window={window}"] * bool(window) + [f"r={recent}"] * bool(recent)
    if not settings:
        return spec
    return spec + ("," if ":" in spec else ":") + ",".join(settings)


def retention_label(sink: int, window: int, recent: int | None = None) -> str:
    exact = f"recent {recent} exact" if recent is not None else ""
    if window:
        text = f"sinks {sink} + last {window}"
    else:
        text = f"sinks {sink} exact" if sink else "all"
    return f"{text}, {exact}" if exact else text


def kv_layer_bytes(scheme: KVScheme, config: ModelConfig, layer: int, context: int, block_size: int) -> float:
    """Bytes one sequence of `context` tokens holds in one layer's paged cache."""
    channels = 2 * config.num_kv_heads * config.head_dim
    retention = layer_retention(scheme, config.window_of(layer))
    return channels * scheme.paged_bits(context, config.head_dim, block_size, pool=retention) / 8


def pool_block_size(formats: list[KVScheme]) -> int:
    """One block size for every candidate, so each layer's bytes do not depend on the others' choices."""
    return paged_block_size(formats)

