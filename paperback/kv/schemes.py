"""Named KV cache schemes: which codec stores keys, which stores values, and how many recent tokens stay exact.

A spec is a name with optional settings, `name[:key=value,...]`:

    fp16, bf16                   the baseline, stored as is
    fp8, fp8-e4m3, fp8-e5m2      scale=1 (vLLM's default) | calibrated; per_head=0|1
    int8, int4, int2             per token, groups of g channels (default 32), r recent tokens exact (default 128)
    kivi2, kivi4                 keys per channel in groups of g tokens, values per token in groups of
                                 vg channels; r recent tokens exact (defaults g=32, vg=32, r=128)
    pnmix                        KIVI's layout with the top RoPE pairs of each key head at hi bits, the
                                 rest at lo bits (defaults hi=4, lo=2, top=4, g=32, vg=32, vbits=2, r=128)

`r` recent tokens stay in full precision; older ones are encoded in whole
groups (`flush_group`) as the recent window slides past them.

Token retention, for any format:

    sink=S       the first S tokens (attention sinks) stay exact, never encoded
    window=W     StreamingLLM: a query at p reads only keys in (p - W, p] and the
                 sinks; everything between is evicted (the paged engine frees those
                 blocks once every layer has let them go)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from paperback.errors import PaperbackError
from paperback.kv.codecs import KVCodec
from paperback.kv.families import FAMILIES, NAMED

SINK_UNIT = 16  # sinks fill whole blocks of the paged engine's smallest block size


@dataclass(frozen=True)
class KVScheme:
    family: str  # a key of paperback.kv.families.FAMILIES
    bits: int = 16  # code bits (for pnmix: the low bits of keys)
    dtype: str = "fp16"  # native: fp16 / bf16 / fp32; fp8: e4m3 / e5m2
    channel_group: int = 32  # channels per group, per-token codecs (int: both; kivi/pnmix: values)
    token_group: int = 32  # tokens per group, per-channel key codecs (kivi, pnmix)
    residual: int = 0  # most recent tokens kept in full precision
    scale: str = "1"  # fp8: "1" or "calibrated"
    per_head: bool = False  # fp8: one scale per KV head instead of per layer
    high_bits: int = 4  # pnmix: bits of the chosen key pairs
    top_pairs: int = 4  # pnmix: RoPE pairs per key head at high_bits
    value_bits: int = 2  # pnmix: bits of the values
    sink: int = 0  # leading tokens kept exact (attention sinks)
    window: int = 0  # > 0: keys older than this many positions (sinks aside) are evicted

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise PaperbackError(f"unknown KV family '{self.family}'")
        if self.residual < 0:
            raise PaperbackError(f"the recent window must be >= 0 tokens, got {self.residual}")
        if self.family == "fp8" and self.scale not in ("1", "calibrated"):
            raise PaperbackError(f"FP8 scale must be 1 or calibrated, not '{self.scale}'")
        # Build the codecs once so bad bits or groups fail here, before any work.
        self.codecs()
        if self.sink < 0 or self.window < 0:
            raise PaperbackError("sink and window must be >= 0 tokens")
        if self.sink % SINK_UNIT:
            raise PaperbackError(f"sink={self.sink}: sinks are kept in whole cache blocks, a multiple of "
                                 f"{SINK_UNIT} tokens")
        if self.sink % self.flush_group:
            raise PaperbackError(f"sink={self.sink} is not a whole number of {self.format_label}'s "
                                 f"{self.flush_group}-token groups")
        if self.window and not self.is_native and self.window <= self.residual:
            raise PaperbackError(f"window={self.window} must exceed the exact recent window r={self.residual}: "
                                 "tokens are encoded before they are evicted")

    @property
    def label(self) -> str:
        retention = (f"+sink{self.sink}" if self.sink else "") + (f"+win{self.window}" if self.window else "")
        return self.format_label + retention

    @property
    def format_label(self) -> str:
        """The label of the format alone, retention left out."""
        return FAMILIES[self.family].label(self)

    @property
    def needs_calibration(self) -> bool:
        """Whether encoding needs each layer's observed amax first (calibrated FP8 scales)."""
        return FAMILIES[self.family].calibrated(self)

    @property
    def is_native(self) -> bool:
        return self.family == "native"

    def kept_tokens(self, tokens: int) -> int:
        """Cached tokens the next query (at position `tokens`) can read: all, or the sinks and the window."""
        return min(tokens, self.sink + self.window - 1) if self.window else tokens

    def codecs(self, amax: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[KVCodec, KVCodec]:
        """(key codec, value codec). A calibrated format takes this layer's (key, value) amax per KV head;
        without it, codecs of the right shapes and bytes (for sizing, never for storing)."""
        return FAMILIES[self.family].codecs(self, amax)

    def layer_codecs(self, layer: int, kv_amax: dict | None) -> tuple[KVCodec, KVCodec]:
        """The codecs layer `layer` stores with, refusing a calibrated format with no calibration given."""
        if not self.needs_calibration:
            return self.codecs()
        if kv_amax is None or layer not in kv_amax:
            raise PaperbackError(f"layer {layer} uses {self.label}, which needs calibration; none was given")
        return self.codecs(kv_amax[layer])

    @property
    def flush_group(self) -> int:
        """Tokens leave the recent window in multiples of this (whole key and value groups)."""
        key, value = self.codecs()
        return math.lcm(key.token_group, value.token_group)

    def check_head_dim(self, head_dim: int) -> None:
        for codec in self.codecs():
            codec.check_head_dim(head_dim)

    def bits_per_element(self, head_dim: int) -> float:
        """Steady-state stored bits per cached element, keys and values averaged (recent window not counted)."""
        key, value = self.codecs()
        return (key.bits_per_element(head_dim) + value.bits_per_element(head_dim)) / 2

    def stored_bits(self, tokens: int, head_dim: int, recent_bits: int = 16, unit: int | None = None) -> float:
        """Total bits of one cached channel (keys and values averaged) over `tokens` tokens.

        Sinks stay at `recent_bits` (a served fp16/bf16 model's dtype); after
        them, tokens older than the recent window are encoded a `unit` at a
        time (the paged engine's block; by default the smallest this format
        fits), the rest held at `recent_bits`. With a window, only the tokens
        the next query can read are counted (`kept_tokens`).
        """
        if self.is_native:
            return self.kept_tokens(tokens) * self.bits_per_element(head_dim)
        unit = unit or paged_block_size([self])
        sinks = min(tokens, -(-self.sink // unit) * unit)
        encoded = max(0, (tokens - self.residual) // unit * unit - sinks)
        tail = tokens - sinks - encoded  # the newest tokens, not yet encoded
        if self.window:
            kept = self.kept_tokens(tokens) - sinks
            tail = min(tail, kept)
            encoded = min(encoded, kept - tail)
        return encoded * self.bits_per_element(head_dim) + (sinks + tail) * recent_bits

    def paged_bits(self, tokens: int, head_dim: int, block_size: int = 16, recent_bits: int = 16,
                   pool: tuple[int, int] | None = None) -> float:
        """stored_bits as the paged engine holds them: the blocks a sequence still owns, in the format, plus,
        for quantized formats, the exact staging of its sink blocks and of the blocks not yet encoded, at
        `recent_bits`. `pool` is the (window, sink) by which the pool frees this layer's blocks
        (`layer_retention`, which a model's sliding window sets); by default this scheme's own."""
        window, sink = (self.window, self.sink) if pool is None else pool
        block = math.lcm(block_size, self.flush_group)
        blocks = -(-tokens // block)
        if window:  # blocks wholly before the next query's window, sinks aside, are freed
            blocks -= max(0, (tokens - window + 1) // block - -(-sink // block))
        slots = blocks * block
        if self.is_native:
            return slots * self.bits_per_element(head_dim)
        sink_blocks = -(-self.sink // block)
        encoded = max(sink_blocks, max(0, tokens - self.residual) // block)
        staged = (min(sink_blocks, -(-tokens // block)) + max(0, -(-tokens // block) - encoded)) * block
        return slots * self.bits_per_element(head_dim) + staged * recent_bits

    def to_dict(self) -> dict:
        return {"label": self.label, **asdict(self)}


# Setting names in specs -> dataclass fields, with their parsers.
_SETTINGS = {
    "g": ("token_group", int), "vg": ("channel_group", int), "r": ("residual", int), "bits": ("bits", int),
    "lo": ("bits", int), "hi": ("high_bits", int), "top": ("top_pairs", int), "vbits": ("value_bits", int),
    "scale": ("scale", str), "per_head": ("per_head", lambda v: v in ("1", "true", "yes")),
    "sink": ("sink", int), "window": ("window", int),
}


def layer_retention(scheme: KVScheme, model_window: int | None = None) -> tuple[int, int]:
    """(window, sink) by which a paged pool frees one layer's blocks: its scheme's retention (StreamingLLM's
    sinks and window), else the model's own sliding window, else (0, 0): the layer reads every token again."""
    if scheme.window:
        return scheme.window, scheme.sink
    return (model_window, 0) if model_window else (0, 0)


def paged_block_size(schemes, base: int = 16) -> int:
    """The block size of a paged pool holding these layers' formats: `base`, or a multiple of every token group."""
    return math.lcm(base, *(s.flush_group for s in schemes))


def parse_kv_scheme(spec: str) -> KVScheme:
    """'kivi2', 'int4:vg=32,r=64', 'fp8-e5m2:scale=calibrated', 'pnmix:hi=8,lo=1,top=6' -> KVScheme."""
    name, _, rest = spec.strip().partition(":")
    if name not in NAMED:
        raise PaperbackError(f"unknown KV format '{name}' (choose from {', '.join(NAMED)})")
    family, fields = NAMED[name]
    fields = dict(fields)
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _SETTINGS:
            raise PaperbackError(f"bad KV setting '{item}' in '{spec}' (settings: {', '.join(_SETTINGS)})")
        field_name, parse = _SETTINGS[key]
        field_name = FAMILIES[family].aliases.get(key, field_name)
        try:
            fields[field_name] = parse(value)
        except ValueError:
            raise PaperbackError(f"bad value '{value}' for KV setting '{key}'") from None
    return KVScheme(family, **fields)
