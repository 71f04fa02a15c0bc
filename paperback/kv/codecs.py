"""Codecs for blocks of cached keys or values.

A codec encodes x (..., T, D), T tokens of D channels (leading dims: batch,
KV heads), into named tensors whose second-to-last axis runs over tokens (or
over groups of `token_group` tokens), so a partly filled block grows by
concatenating fields along that axis (`append`). Decoding gives x back in a
requested dtype. `bits_per_element(D)` is the exact stored cost, scales and
minimums included; tests hold it to the bytes of the encoded tensors.

Two ways to reduce: over channels (one scale per token and group of channels:
per-token INT8/INT4, KIVI's values) or over tokens (one scale per channel and
group of G tokens: KIVI's keys, whose outlier channels would ruin per-token
groups). Integer codes are asymmetric, x ~ code * scale + minimum, with the
scale and minimum in fp16, as KIVI and Hugging Face's quantized cache store them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from paperback.errors import PaperbackError
from paperback.kernels import attention
from paperback.quantization.packing import pack_codes, packed_row_bytes, unpack_codes

Fields = dict[str, torch.Tensor]
PARAM_DTYPE = torch.float16  # scales and minimums
PARAM_BITS = 16
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def append(block: Fields, more: Fields) -> Fields:
    """A block holding `block`'s tokens followed by `more`'s (both from the same codec)."""
    return {name: torch.cat((block[name], more[name]), dim=-2) for name in block}


def fields_bytes(fields: Fields) -> int:
    return sum(t.numel() * t.element_size() for t in fields.values())


class KVCodec(ABC):
    token_group = 1  # tokens encoded together: T must be a multiple of it

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Fields: ...

    @abstractmethod
    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def bits_per_element(self, head_dim: int) -> float: ...

    def check_head_dim(self, head_dim: int) -> None:
        """Raise before any work when this codec cannot store D channels."""

    def observe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Each chunk's rotated queries and keys, before it is stored (a codec that ranks channels uses them)."""

    def kernel_source(self, fields: Fields):
        """How the C decode kernel reads this format's pool fields (num_blocks, Hkv, rows, width) in place
        (paperback.kernels.attention), or None: decoded through PyTorch."""
        return None

    def scale_bytes(self) -> int:
        """Bytes stored once per layer, beside the per-element bits (calibrated scales)."""
        return 0

    def field_shapes(self, x: torch.Tensor) -> Fields:
        """What encoding x gives, for sizing storage before any real data is seen."""
        return self.encode(x)

    def _check_tokens(self, x: torch.Tensor) -> None:
        if x.shape[-2] % self.token_group:
            raise PaperbackError(f"{type(self).__name__} encodes whole groups of {self.token_group} tokens, "
                                 f"got {x.shape[-2]}")


class NativeCodec(KVCodec):
    """Stored as is, in a floating dtype (the fp16 / bf16 baseline)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def encode(self, x):
        return {"x": x.to(self.dtype)}

    def decode(self, fields, dtype):
        return fields["x"].to(dtype)

    def bits_per_element(self, head_dim):
        return torch.finfo(self.dtype).bits


class FP8Codec(KVCodec):
    """x / scale cast to FP8 (saturating at the format's largest value).

    `scale` broadcasts over (..., Hkv, T, D): a scalar per layer, or (Hkv, 1, 1)
    per head. It is stored once per layer, not per element, so it is left out
    of bits_per_element; the cache counts it in its byte total.
    """

    def __init__(self, variant: str = "e4m3", scale: torch.Tensor | float = 1.0):
        self.dtype = FP8_DTYPES[variant]
        self.max = torch.finfo(self.dtype).max
        self.scale = torch.as_tensor(scale, dtype=torch.float32)
        if not (torch.isfinite(self.scale).all() and (self.scale > 0).all()):
            raise PaperbackError("FP8 scales must be positive and finite")

    def encode(self, x):
        scaled = x.float() / self.scale.to(x.device)
        return {"codes": scaled.clamp(-self.max, self.max).to(self.dtype)}

    def decode(self, fields, dtype):
        codes = fields["codes"]
        return (codes.float() * self.scale.to(codes.device)).to(dtype)

    def bits_per_element(self, head_dim):
        return 8.0

    def scale_bytes(self) -> int:
        return self.scale.numel() * 4

    def kernel_source(self, fields):
        return attention.fp8_source(fields["codes"], self.scale, self.dtype) if attention.kernel_readable(fields) else None


def _check_bits(bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise PaperbackError(f"unsupported KV bits {bits} (choose from {', '.join(map(str, allowed))})")


def _min_scale(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 minimum and scale spanning [lo, hi] with 2^bits codes, rounded as they are stored."""
    mn = lo.to(PARAM_DTYPE)
    scale = ((hi - mn.float()) / (2 ** bits - 1)).to(PARAM_DTYPE)
    tiny = torch.finfo(PARAM_DTYPE).tiny
    return mn, torch.where(scale.float() > 0, scale, torch.full_like(scale, tiny))


def _codes(x: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round((x - mn.float()) / scale.float()), 0, 2 ** bits - 1).to(torch.uint8)


class TokenIntCodec(KVCodec):
    """Per token, in groups of `group` channels: INT8 / INT4 caches, KIVI's values."""

    BITS = (1, 2, 3, 4, 8)

    def __init__(self, bits: int, group: int):
        _check_bits(bits, self.BITS)
        if group < 1:
            raise PaperbackError(f"KV channel group must be positive, got {group}")
        self.bits, self.group = bits, group

    def check_head_dim(self, head_dim):
        if head_dim % self.group:
            raise PaperbackError(f"channel group {self.group} does not divide the head dimension {head_dim}")

    def encode(self, x):
        self.check_head_dim(x.shape[-1])
        g = x.float().unflatten(-1, (-1, self.group))  # (..., T, D/g, g)
        mn, scale = _min_scale(g.amin(-1), g.amax(-1), self.bits)
        codes = _codes(g, mn[..., None], scale[..., None], self.bits).flatten(-2)
        return {"codes": pack_codes(codes, self.bits), "scale": scale, "min": mn}

    def decode(self, fields, dtype):
        scale, mn = fields["scale"], fields["min"]
        head_dim = scale.shape[-1] * self.group
        codes = unpack_codes(fields["codes"], self.bits, head_dim).float().unflatten(-1, (-1, self.group))
        return (codes * scale.float()[..., None] + mn.float()[..., None]).flatten(-2).to(dtype)

    def bits_per_element(self, head_dim):
        return 8 * packed_row_bytes(head_dim, self.bits) / head_dim + 2 * PARAM_BITS / self.group

    def kernel_source(self, fields):
        if not attention.kernel_readable(fields):
            return None
        return attention.int_source(True, self.bits, self.group, fields["codes"], fields["scale"], fields["min"])


class ChannelIntCodec(KVCodec):
    """Per channel, in groups of `tokens` consecutive tokens: KIVI's keys."""

    BITS = (1, 2, 3, 4, 8)

    def __init__(self, bits: int, tokens: int):
        _check_bits(bits, self.BITS)
        if tokens < 1:
            raise PaperbackError(f"KV token group must be positive, got {tokens}")
        self.bits, self.token_group = bits, tokens

    def encode(self, x):
        self._check_tokens(x)
        g = x.float().unflatten(-2, (-1, self.token_group))  # (..., T/G, G, D)
        mn, scale = _min_scale(g.amin(-2), g.amax(-2), self.bits)
        codes = _codes(g, mn[..., None, :], scale[..., None, :], self.bits).flatten(-3, -2)
        return {"codes": pack_codes(codes, self.bits), "scale": scale, "min": mn}

    def decode(self, fields, dtype):
        scale, mn = fields["scale"], fields["min"]
        codes = unpack_codes(fields["codes"], self.bits, scale.shape[-1]).float()
        g = codes.unflatten(-2, (-1, self.token_group))
        return (g * scale.float()[..., None, :] + mn.float()[..., None, :]).flatten(-3, -2).to(dtype)

    def kernel_source(self, fields):
        if not attention.kernel_readable(fields):
            return None
        return attention.int_source(False, self.bits, self.token_group, fields["codes"], fields["scale"],
                                    fields["min"])

    def bits_per_element(self, head_dim):
        return 8 * packed_row_bytes(head_dim, self.bits) / head_dim + 2 * PARAM_BITS / self.token_group


@dataclass(frozen=True)
class PairSelection:
    """Per KV head, the channels kept at high precision: whole RoPE pairs (j, j + D/2)."""

    channels: torch.Tensor  # (Hkv, n_high) long, sorted

    @property
    def num_high(self) -> int:
        return self.channels.shape[-1]


def pair_norm_sums(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, D) -> (heads, D/2): per RoPE pair (channels j, j + D/2), |pair| summed over batch and tokens.

    A pair's norm is unchanged by the rotation, so pre- and post-RoPE tensors give the same sums.
    """
    half = x.shape[-1] // 2
    return torch.sqrt(x[..., :half].float() ** 2 + x[..., half:].float() ** 2).sum(dim=(0, 2))


def select_pairs(query_norms: torch.Tensor, key_norms: torch.Tensor, top_pairs: int) -> PairSelection:
    """Each KV head's `top_pairs` pairs by mean |q pair| x mean |k pair|.

    query_norms (H, D/2), key_norms (Hkv, D/2): mean pair norms; query heads
    sharing a KV head pool theirs.
    """
    kv_heads, half = key_norms.shape
    if not 0 <= top_pairs <= half:
        raise PaperbackError(f"PN-Mix keeps 0..{half} of {half} RoPE pairs, not {top_pairs}")
    score = query_norms.unflatten(0, (kv_heads, -1)).mean(1) * key_norms
    pairs = torch.topk(score, top_pairs, dim=-1).indices
    return PairSelection(torch.sort(torch.cat((pairs, pairs + half), dim=-1), dim=-1).values)


def rank_rope_pairs(q: torch.Tensor, k: torch.Tensor, top_pairs: int) -> PairSelection:
    """select_pairs from q (B, H, T, D) and k (B, Hkv, T, D) directly (half-split RoPE layout)."""
    tokens = q.shape[0] * q.shape[2]
    return select_pairs(pair_norm_sums(q) / tokens, pair_norm_sums(k) / tokens, top_pairs)


class PairMixCodec(KVCodec):
    """PN-Mix keys: per channel in groups of `tokens` tokens, chosen RoPE pairs at `high_bits`, the rest at `low_bits`.

    The selection is made once and reused for every later block: from the
    query and key norms `observe` has summed when the first block is encoded
    (everything the prompt showed before any key left the exact recent
    window), or set directly with `select`.
    """

    def __init__(self, high_bits: int, low_bits: int, top_pairs: int, tokens: int):
        if top_pairs < 1:
            raise PaperbackError(f"PN-Mix keeps at least one RoPE pair at high precision, not {top_pairs}")
        self.high = ChannelIntCodec(high_bits, tokens)
        self.low = ChannelIntCodec(low_bits, tokens)
        self.top_pairs = top_pairs
        self.token_group = tokens
        self.selection: PairSelection | None = None
        self._norms: list[torch.Tensor] | None = None  # [query sums, key sums, tokens] until selection

    def observe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add one chunk's queries (B, H, T, D) and keys (B, Hkv, T, D) to the norms the selection will use."""
        if self.selection is not None:
            return
        sums = [pair_norm_sums(q), pair_norm_sums(k), q.shape[0] * q.shape[2]]
        self._norms = sums if self._norms is None else [a + b for a, b in zip(self._norms, sums)]

    def check_head_dim(self, head_dim):
        if head_dim % 2 or self.top_pairs >= head_dim // 2:
            raise PaperbackError(f"PN-Mix keeps {self.top_pairs} RoPE pairs at high precision; a head of {head_dim} "
                                 f"channels has {head_dim // 2} pairs, and some must stay low")

    def select(self, q: torch.Tensor, k: torch.Tensor) -> None:
        self.selection = rank_rope_pairs(q, k, self.top_pairs)

    def field_shapes(self, x: torch.Tensor) -> Fields:
        """Encoded under a throwaway ranking (only the shapes are wanted); the real one is still to come."""
        if self.selection is not None:
            return self.encode(x)
        self.select(torch.ones(1, x.shape[-3], x.shape[-2], x.shape[-1], device=x.device), x + 1)
        fields = self.encode(x)
        self.selection = None
        return fields

    def _split(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.selection is None and self._norms is not None:
            q_sums, k_sums, tokens = self._norms
            self.selection = select_pairs(q_sums / tokens, k_sums / tokens, self.top_pairs)
            self._norms = None
        if self.selection is None:
            raise PaperbackError("PN-Mix needs its channel selection (made at prefill) before encoding")
        high = self.selection.channels
        mask = torch.ones(high.shape[0], head_dim, dtype=torch.bool, device=high.device)
        mask.scatter_(1, high, False)
        low = torch.arange(head_dim, device=high.device).expand(high.shape[0], -1)[mask].view(high.shape[0], -1)
        return high, low

    @staticmethod
    def _gather(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
        # x (..., Hkv, T, D), channels (Hkv, n) -> (..., Hkv, T, n)
        index = channels[:, None, :].expand(*x.shape[:-1], channels.shape[-1])
        return torch.gather(x, -1, index)

    def encode(self, x):
        self._check_tokens(x)
        high, low = self._split(x.shape[-1])
        fields = {f"high.{k}": v for k, v in self.high.encode(self._gather(x, high)).items()}
        fields.update({f"low.{k}": v for k, v in self.low.encode(self._gather(x, low)).items()})
        return fields

    def decode(self, fields, dtype):
        high_x = self.high.decode({k[5:]: v for k, v in fields.items() if k.startswith("high.")}, dtype)
        low_x = self.low.decode({k[4:]: v for k, v in fields.items() if k.startswith("low.")}, dtype)
        head_dim = high_x.shape[-1] + low_x.shape[-1]
        high, low = self._split(head_dim)
        out = torch.empty(*high_x.shape[:-1], head_dim, dtype=dtype, device=high_x.device)
        out.scatter_(-1, high[:, None, :].expand_as(high_x), high_x)
        out.scatter_(-1, low[:, None, :].expand_as(low_x), low_x)
        return out

    def bits_per_element(self, head_dim):
        n_high, n_low = 2 * self.top_pairs, head_dim - 2 * self.top_pairs
        high = n_high * self.high.bits_per_element(n_high) if n_high else 0.0
        low = n_low * self.low.bits_per_element(n_low) if n_low else 0.0
        return (high + low) / head_dim

    def code_bits(self, head_dim: int) -> float:
        """Average bits of the codes alone (the figure the PN-Mix paper quotes)."""
        n_high = 2 * self.top_pairs
        return (n_high * self.high.bits + (head_dim - n_high) * self.low.bits) / head_dim
