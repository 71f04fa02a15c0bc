"""The KV format families: one entry each, everything else reads them from here.

A family is its codecs (keys, values) built from a scheme's settings, its
label, the named specs it answers to with their defaults, whether it needs
observed statistics before it can encode (calibrated FP8 needs each layer's
key and value amax), and which of its names the allocator offers by default.
The CLI's `--kv-cache-dtype` names, the parser, the planner's bytes (from the codecs'
`bits_per_element`), the caches and the allocator's candidates all come from
FAMILIES, so a new format is a codec in `codecs.py` and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from paperback.kv.calibrate import fp8_scale
from paperback.kv.codecs import ChannelIntCodec, FP8Codec, KVCodec, NativeCodec, PairMixCodec, TokenIntCodec

if TYPE_CHECKING:
    from paperback.kv.schemes import KVScheme

NATIVE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
Amax = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVFamily:
    name: str
    codecs: Callable[[KVScheme, Amax | None], tuple[KVCodec, KVCodec]]
    label: Callable[[KVScheme], str]
    named: dict[str, dict]  # spec name -> field defaults
    candidates: tuple[str, ...] = ()  # names the allocator considers by default
    calibrated: Callable[[KVScheme], bool] = lambda scheme: False  # needs observed amax before encoding
    aliases: dict[str, str] = field(default_factory=dict)  # spec setting -> field, where it differs by family


def _native(s: KVScheme, amax):
    return NativeCodec(NATIVE[s.dtype]), NativeCodec(NATIVE[s.dtype])


def _fp8(s: KVScheme, amax):
    if s.scale == "1" or amax is None:  # uncalibrated, or only its shape and bytes are wanted
        return FP8Codec(s.dtype, 1.0), FP8Codec(s.dtype, 1.0)
    return tuple(FP8Codec(s.dtype, fp8_scale(a, s.dtype, s.per_head)) for a in amax)


def _int(s: KVScheme, amax):
    return TokenIntCodec(s.bits, s.channel_group), TokenIntCodec(s.bits, s.channel_group)


def _kivi(s: KVScheme, amax):
    return ChannelIntCodec(s.bits, s.token_group), TokenIntCodec(s.bits, s.channel_group)


def _pnmix(s: KVScheme, amax):
    return (PairMixCodec(s.high_bits, s.bits, s.top_pairs, s.token_group),
            TokenIntCodec(s.value_bits, s.channel_group))


_RECENT = {"residual": 128}
FAMILIES: dict[str, KVFamily] = {f.name: f for f in (
    KVFamily("native", _native, lambda s: s.dtype,
             {"fp16": {"dtype": "fp16"}, "bf16": {"dtype": "bf16"}, "fp32": {"dtype": "fp32"}},
             candidates=("fp16",)),
    KVFamily("fp8", _fp8, lambda s: f"fp8-{s.dtype}" + ("-cal" if s.scale == "calibrated" else ""),
             {"fp8": {"dtype": "e4m3", "bits": 8}, "fp8-e4m3": {"dtype": "e4m3", "bits": 8},
              "fp8-e5m2": {"dtype": "e5m2", "bits": 8}},
             candidates=("fp8",), calibrated=lambda s: s.scale == "calibrated"),
    KVFamily("int", _int, lambda s: f"int{s.bits}",
             {f"int{b}": {"bits": b, "channel_group": 32, **_RECENT} for b in (8, 4, 2)},
             candidates=("int8", "int4"), aliases={"g": "channel_group"}),  # per token: groups of channels
    KVFamily("kivi", _kivi, lambda s: f"kivi{s.bits}",
             {f"kivi{b}": {"bits": b, "channel_group": 32, "token_group": 32, **_RECENT} for b in (2, 4)},
             candidates=("kivi4", "kivi2")),
    KVFamily("pnmix", _pnmix, lambda s: f"pnmix{s.high_bits}/{s.bits}x{s.top_pairs}",
             {"pnmix": {"bits": 2, "channel_group": 32, "token_group": 32, **_RECENT}},
             candidates=("pnmix",)),
)}
NAMED: dict[str, tuple[str, dict]] = {name: (f.name, defaults) for f in FAMILIES.values()
                                      for name, defaults in f.named.items()}
DEFAULT_CANDIDATES: tuple[str, ...] = tuple(name for f in FAMILIES.values() for name in f.candidates)
