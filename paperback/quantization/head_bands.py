"""An output head (or tied embedding) quantized in bands of vocabulary rows, each band at its own scheme.

Which rows of a head matter depends on how often a text uses their token: a
row's error moves that token's logit (weighed by how likely the token is) and,
tied, that token's input embedding (weighed by how often it appears). Over a
large vocabulary most rows are tokens an English or code text almost never
sees (Gemma 3's 262,144 rows hold every script it was trained on), so spending
the head's bytes evenly over rows wastes most of them. A band layout ranks the
tokens by use on profiling text and cuts the ranking into bands of growing size
(the most used 1/128 of the vocabulary, the next 1/128, 1/64, ..., the least
used half); each band is then one unit the allocator gives a scheme.

The layout is stored as `band_of`: one byte per token id naming its band, so
a checkpoint spends V bytes on it; a band's rows are its token ids in
increasing order. Codes of a row do not depend on which band holds it (RTN and
GPTQ quantize rows independently), so a layout with one scheme everywhere is
the plain head bit for bit, and is stored as one.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch
from torch import nn

from paperback.errors import ModelFileError, PaperbackError
from paperback.kernels.packed import packed_linear
from paperback.quantization.qlinear import QuantEmbedding
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme

# Cumulative fractions of the ranked vocabulary at which bands end: sizes double from 1/128 to a half.
BAND_ENDS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
# The fewest bits a band may take. The ranking comes from the profiled text, and another text uses tokens it
# ranked low (Gemma 3, ranked on pydoc: 0.15% of held-out pydoc's tokens fall in the least used 3/4 of the
# vocabulary, 6.9% of WikiText-2's and 7.6% of PTB's), where 2-bit rows cost about ten times what 3-bit ones do:
# W2 there took Gemma 3's KL on WikiText-2 from 0.305 (uniform W4 g128) to 0.432 at the same bytes.
MIN_BAND_BITS = 3
BAND_PREFIX = "@band"  # a band's key in a per-layer scheme map: "model.embed_tokens.weight@band3"


def band_key(param: str, band: int) -> str:
    return f"{param}{BAND_PREFIX}{band}"


def split_band_key(key: str) -> tuple[str, int | None]:
    """'model.embed_tokens.weight@band3' -> ('model.embed_tokens.weight', 3); a plain name -> (name, None)."""
    param, sep, band = key.partition(BAND_PREFIX)
    return (param, int(band)) if sep else (key, None)


def band_sizes(vocab_size: int) -> list[int]:
    """Rows per band for a vocabulary of `vocab_size` (the last band takes the remainder)."""
    ends = [min(vocab_size, max(1, round(f * vocab_size))) for f in BAND_ENDS]
    ends[-1] = vocab_size
    sizes, start = [], 0
    for end in ends:
        end = max(end, start)
        sizes.append(end - start)
        start = end
    return sizes


def band_of_ranking(ranking: torch.Tensor) -> torch.Tensor:
    """uint8 band per token id from token ids ranked most used first."""
    vocab = ranking.numel()
    band_of = torch.empty(vocab, dtype=torch.uint8)
    start = 0
    for band, size in enumerate(band_sizes(vocab)):
        band_of[ranking[start:start + size]] = band
        start += size
    return band_of


def band_rows(band_of: torch.Tensor) -> list[torch.Tensor]:
    """The token ids of each band, increasing."""
    return [torch.nonzero(band_of == b, as_tuple=True)[0] for b in range(len(BAND_ENDS))]


def encode_band_of(band_of: torch.Tensor) -> str:
    return base64.b64encode(band_of.to(torch.uint8).numpy().tobytes()).decode("ascii")


def decode_band_of(text: str, vocab_size: int) -> torch.Tensor:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError, AttributeError) as exc:
        raise PaperbackError(f"head band layout is not base64 ({exc})") from None
    band_of = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    check_band_of(band_of, vocab_size)
    return band_of


def check_band_of(band_of: torch.Tensor, vocab_size: int) -> None:
    if band_of.dtype != torch.uint8 or band_of.shape != (vocab_size,):
        raise PaperbackError(f"head band layout holds {band_of.numel()} entries, the vocabulary {vocab_size}")
    if band_of.numel() and int(band_of.max()) >= len(BAND_ENDS):
        raise PaperbackError(f"head band layout names a band past {len(BAND_ENDS) - 1}")


def stored_layout_bytes(vocab_rows: int, band_choices) -> int:
    """What a head in bands stores beside its bands: a byte per vocabulary row naming its band, paid only when
    the bands differ (bands at one scheme are stored as a plain head)."""
    return vocab_rows if len(set(band_choices)) > 1 else 0


@dataclass(frozen=True)
class HeadBands:
    """A head's band layout and each band's scheme (QuantizeConfig.head_bands)."""

    band_of: torch.Tensor = field(compare=False, repr=False)
    schemes: tuple[QuantScheme, ...]

    def __post_init__(self):
        if len(self.schemes) != len(BAND_ENDS):
            raise PaperbackError(f"a banded head needs {len(BAND_ENDS)} schemes, got {len(self.schemes)}")
        check_band_of(self.band_of, self.band_of.numel())

    @property
    def uniform(self) -> QuantScheme | None:
        """The one scheme when every band has it (then the head is stored plainly)."""
        return self.schemes[0] if len(set(self.schemes)) == 1 else None


def split_head_bands(schemes: dict[str, QuantScheme], band_of: torch.Tensor | None
                     ) -> tuple[dict[str, QuantScheme], HeadBands | None]:
    """{param or band key: scheme} -> (the per-layer schemes, the head's HeadBands or None)."""
    plain, bands = {}, {}
    for key, scheme in schemes.items():
        param, band = split_band_key(key)
        if band is None:
            plain[key] = scheme
        else:
            bands[band] = scheme
    if not bands:
        return plain, None
    if band_of is None or sorted(bands) != list(range(len(BAND_ENDS))):
        raise PaperbackError("a policy names head bands without their layout, or not every band")
    return plain, HeadBands(band_of, tuple(bands[b] for b in range(len(BAND_ENDS))))


@dataclass
class BandedWeight:
    """A (V, C) matrix quantized by bands: band b holds rows band_rows(band_of)[b] as `bands[b]`."""

    band_of: torch.Tensor
    bands: list[QuantizedWeight]
    method: str = "rtn"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.band_of.numel(), self.bands[0].shape[1])

    def storage_bits(self) -> int:
        """The bands' codes, scales and zero points, and the layout's byte per token."""
        return sum(q.scheme.storage_bits(*q.shape) for q in self.bands) + 8 * self.band_of.numel()

    def recipe_entry(self) -> dict:
        return {"bands": [{"rows": q.shape[0], "scheme": q.scheme.to_dict()} for q in self.bands],
                "method": self.method}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype)
        for rows, q in zip(band_rows(self.band_of), self.bands):
            out[rows] = q.dequantize(dtype)
        return out


def quantize_banded(weight: torch.Tensor, bands: HeadBands, quantize) -> BandedWeight:
    """Each band's rows of `weight` through quantize(rows, scheme) -> QuantizedWeight."""
    parts = [quantize(weight[rows], scheme) for rows, scheme in zip(band_rows(bands.band_of), bands.schemes)]
    return BandedWeight(bands.band_of.clone(), parts, parts[0].method)


class BandedQuantEmbedding(nn.Module):
    """A packed embedding whose rows are stored in bands of their own scheme (see the module's docstring).

    forward(ids) dequantizes the rows asked for, each from its band; as_linear(x) runs each band through
    the packed kernel and scatters the logits back to token order."""

    def __init__(self, sizes: list[int], in_features: int, schemes: tuple[QuantScheme, ...],
                 band_of: torch.Tensor | None = None):
        super().__init__()
        if len(sizes) != len(BAND_ENDS) or len(schemes) != len(BAND_ENDS):
            raise PaperbackError(f"a banded head has {len(BAND_ENDS)} bands, got {len(sizes)} sizes and "
                                 f"{len(schemes)} schemes")
        self.in_features, self.out_features = in_features, sum(sizes)
        if band_of is None:  # a shell (a checkpoint's layout is loaded into it): any layout of these sizes
            band_of = torch.empty(self.out_features, dtype=torch.uint8)
        self.register_buffer("band_of", band_of.to(torch.uint8).clone())
        self.bands = nn.ModuleList(QuantEmbedding(in_features, n, s) for n, s in zip(sizes, schemes))
        if not self.band_of.is_meta:
            self._index()

    def _index(self) -> None:
        """Where each token's row sits: its band's rows concatenated in band order (not saved)."""
        rows = band_rows(self.band_of)
        if [len(r) for r in rows] != [band.out_features for band in self.bands]:
            raise ModelFileError(f"band_of puts {[len(r) for r in rows]} rows in the bands, which hold "
                                 f"{[band.out_features for band in self.bands]}")
        order = torch.cat(rows)
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel())
        self.register_buffer("row_slot", slot, persistent=False)
        self.register_buffer("token_band", self.band_of.long(), persistent=False)
        starts = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)[:-1]
        self.register_buffer("band_start", starts, persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if not self.band_of.is_meta:
            self._index()

    @classmethod
    def from_banded(cls, q: BandedWeight) -> "BandedQuantEmbedding":
        module = cls([p.shape[0] for p in q.bands], q.shape[1], tuple(p.scheme for p in q.bands), q.band_of)
        module.bands = nn.ModuleList(QuantEmbedding.from_quantized(p) for p in q.bands)
        return module

    @property
    def schemes(self) -> tuple[QuantScheme, ...]:
        return tuple(band.scheme for band in self.bands)

    def to_banded(self) -> BandedWeight:
        return BandedWeight(self.band_of.clone(), [band.to_quantized() for band in self.bands])

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_banded().dequantize(dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        out = torch.empty(ids.numel(), self.in_features)
        bands = self.token_band[ids]
        for b in torch.unique(bands).tolist():
            where = torch.nonzero(bands == b, as_tuple=True)[0]
            local = self.row_slot[ids[where]] - self.band_start[b]
            out[where] = self.bands[b].to_quantized(local).dequantize()
        return out.reshape(*input_ids.shape, self.in_features)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        ordered = torch.cat([packed_linear(band, x) for band in self.bands], dim=-1)
        return ordered.index_select(-1, self.row_slot)

    def storage_bytes(self) -> int:
        return sum(band.storage_bytes() for band in self.bands) + self.band_of.numel()

    def extra_repr(self) -> str:
        labels = ", ".join(s.label for s in self.schemes)
        return f"num_embeddings={self.out_features}, embedding_dim={self.in_features}, bands=[{labels}]"
