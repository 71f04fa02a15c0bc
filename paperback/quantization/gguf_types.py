"""GGUF's weight types as grids paperback's methods quantize onto (ggml's `type_traits` table, as data).

Every quantized type stores, for each run of `sub_block` weights of a row, an
affine grid: `w = a * (q - zero) + b`, code q in [0, max_code]. What differs is
how a and b are stored:

- legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 32 weights a block, a as one
  fp16 `d` (and b as one fp16 `m` for the _1 types);
- k-quants (Q2_K ... Q6_K): 256 weights a super-block with one fp16 `d` (and
  `dmin`), each sub-block's a = d x an integer scale of `scale_bits` (signed
  for Q3_K and Q6_K), b = -dmin x an integer min of as many bits.

So a type is one row of this table; the search for a and b, GPTQ's column
rounding and the byte packing read the row, and no code tests type names.
F32, F16 and BF16 are the unquantized references: a cast, no grid.

Dequantization follows ggml's arithmetic exactly in fp32 (`a = d * scale`,
then `a * (q - zero)` or `a * q - dmin * min`), so what paperback evaluates is
bit for bit what the `gguf` package and llama.cpp read back.
"""

from __future__ import annotations

from dataclasses import dataclass

from paperback.errors import PaperbackError

SUPER_BLOCK = 256  # weights per k-quant super-block (ggml's QK_K)


@dataclass(frozen=True)
class GGUFType:
    name: str  # gguf.GGMLQuantizationType member
    block_size: int  # weights one block holds: a row's length must be a multiple
    type_size: int  # bytes of one block
    sub_block: int = 0  # weights sharing one (a, b); 0: not a grid (float types)
    max_code: int = 0
    zero: int | None = None  # fixed code offset (symmetric grids); None: a stored min (b = -dmin * min)
    scale_bits: int = 0  # k-quants: bits of each sub-block's integer scale (and min); 0: a is an fp16 d
    signed_scale: bool = False  # k-quant scales stored signed (Q3_K, Q6_K)
    float_bits: int = 0  # float types: bits of each value

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    @property
    def is_float(self) -> bool:
        return self.sub_block == 0

    @property
    def is_kquant(self) -> bool:
        return self.scale_bits > 0

    @property
    def has_min(self) -> bool:
        return not self.is_float and self.zero is None

    @property
    def label(self) -> str:
        return self.name

    def can_tile(self, in_features: int) -> bool:
        return in_features % self.block_size == 0

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_size * self.type_size

    def tensor_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * self.row_bytes(in_features)


GGUF_TYPES = {t.name: t for t in (
    GGUFType("F32", 1, 4, float_bits=32),
    GGUFType("F16", 1, 2, float_bits=16),
    GGUFType("BF16", 1, 2, float_bits=16),
    GGUFType("Q8_0", 32, 34, 32, 254, zero=127),  # codes q + 127: ggml's int8 q in [-127, 127]
    GGUFType("Q5_1", 32, 24, 32, 31),
    GGUFType("Q5_0", 32, 22, 32, 31, zero=16),
    GGUFType("Q4_1", 32, 20, 32, 15),
    GGUFType("Q4_0", 32, 18, 32, 15, zero=8),
    GGUFType("Q6_K", SUPER_BLOCK, 210, 16, 63, zero=32, scale_bits=8, signed_scale=True),
    GGUFType("Q5_K", SUPER_BLOCK, 176, 32, 31, scale_bits=6),
    GGUFType("Q4_K", SUPER_BLOCK, 144, 32, 15, scale_bits=6),
    GGUFType("Q3_K", SUPER_BLOCK, 110, 16, 7, zero=4, scale_bits=6, signed_scale=True),
    GGUFType("Q2_K", SUPER_BLOCK, 84, 16, 3, scale_bits=4),
)}
QUANTIZED_TYPES = tuple(name for name, t in GGUF_TYPES.items() if not t.is_float)

# What llama.cpp's llama-quantize writes instead when a row cannot be tiled by super-blocks
# (src/llama-quant.cpp, the fallback for rows that are not a multiple of 256): the nearest legacy type
# of at least the bits. Q2_K and Q3_K fall back to IQ4_NL there, which paperback does not write; Q4_0 is the
# legacy type of the same bytes.
LEGACY_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def gguf_type(name: str) -> GGUFType:
    """The type named `name` (case-insensitive), or a PaperbackError listing the ones paperback writes."""
    import gguf

    found = GGUF_TYPES.get(str(name).upper())
    if found is None:
        if str(name).upper() in gguf.GGMLQuantizationType.__members__:
            raise PaperbackError(f"llama.cpp's weight type {str(name).upper()} is not one paperback writes yet "
                                 f"(it writes {', '.join(GGUF_TYPES)})")
        raise PaperbackError(f"unknown GGUF weight type '{name}': llama.cpp has no such type (paperback writes "
                             f"{', '.join(GGUF_TYPES)})")
    return found


def legal_types(in_features: int, names=QUANTIZED_TYPES) -> list[GGUFType]:
    """The types of `names` whose blocks tile a row of `in_features` weights."""
    return [GGUF_TYPES[n] for n in names if GGUF_TYPES[n].can_tile(in_features)]


def tiling_fallback(kind: GGUFType, in_features: int) -> GGUFType:
    """`kind`, or llama.cpp's legacy stand-in when its super-blocks cannot tile the row (PaperbackError if
    neither can)."""
    if kind.can_tile(in_features):
        return kind
    fallback = GGUF_TYPES.get(LEGACY_FALLBACK.get(kind.name, ""))
    if fallback is None or not fallback.can_tile(in_features):
        raise PaperbackError(f"rows of {in_features} weights cannot be stored as {kind.name} (blocks of "
                             f"{kind.block_size}) or any stand-in for it")
    return fallback
