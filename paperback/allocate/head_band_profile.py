"""A tied head's cost per band of vocabulary rows and scheme: the profile's cells for head band units.

Which tokens a text uses decides which rows of the head matter
(quantization.head_bands). The reference model ranks every token by use: its
mean predicted probability plus its frequency as an input (the two ways a
tied row's error reaches the output), on the profile's head windows and,
weighed equally, on text the model writes itself from its start token. The
second is a prior for the text a deployment will read and the profile did
not: ranked on pydoc alone, a fifth of WikiText-2's tokens fell in SmolLM2's
least used 3/4 of the vocabulary. The ranking is cut into bands, and each
band's cost under each scheme is measured on the output side exactly, from
the reference's final hidden states: only that band's logits change, so

    KL_b = -sum_{v in b} p(v) d(v) + log(1 + sum_{v in b} p(v) (e^{d(v)} - 1))

with d the change of the logits, no forward through the blocks needed. The
input side (a tied row also embeds its token) is not measured per band: each
scheme's band costs are scaled so they sum to the whole head's cost measured
through the whole model (the profile's "head" cell), which counts both sides.
A check then measures random banded heads whole, as the additivity check
does for units.
"""

from __future__ import annotations

import random

import torch

from paperback.progress import progress as stage_progress
from paperback.quantization.head_bands import band_of_ranking, band_rows, band_sizes, encode_band_of
from paperback.quantization.rtn import quantize_rtn

POSITIONS_PER_CHUNK = 256
# The model's own text, as a prior for the tokens another text uses: sequences x tokens sampled from the
# start token, weighed equally with the profiled text (USAGE_VERSION names this recipe in a profile).
FREE_SEQUENCES, FREE_TOKENS = 8, 256
USAGE_VERSION = "text+free-running/1"


def usage(predicted: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """How much a text uses each token: its mean predicted probability plus its frequency (sums to 2)."""
    counts = torch.bincount(ids.reshape(-1), minlength=vocab)[:vocab].double()
    return predicted / predicted.sum() + counts / counts.sum().clamp(min=1)


@torch.inference_mode()
def free_running_usage(model, start_id: int, sequences: int = FREE_SEQUENCES, tokens: int = FREE_TOKENS,
                       seed: int = 0) -> torch.Tensor:
    """`usage` on text the model writes itself from `start_id` (sampled at temperature 1, seeded): its own
    prior over text, for the tokens a text other than the profiled one will use."""
    from paperback.generation.kv_cache import ContiguousKVCache

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    cache = ContiguousKVCache(model.config, sequences, tokens + 1, model.dtype)
    ids = torch.full((sequences, 1), start_id, dtype=torch.long)
    predicted = torch.zeros(vocab, dtype=torch.float64)
    written = []
    for position in range(tokens):
        probs = torch.softmax(model(ids, position, cache, last_only=True)[:, -1].float(), -1)
        predicted += probs.sum(0).double()
        ids = torch.multinomial(probs, 1, generator=generator)
        written.append(ids)
    return usage(predicted, torch.cat(written, dim=1), vocab)


def usage_ranking(use: torch.Tensor) -> torch.Tensor:
    """Token ids ranked by use, most used first (ties, unused tokens, by id)."""
    return torch.sort(-use, stable=True).indices


@torch.inference_mode()
def output_side_kl(hidden: torch.Tensor, probs: torch.Tensor, change: torch.Tensor, rows: list[torch.Tensor]
                   ) -> tuple[list[float], float]:
    """Mean KL(reference || head with only band b's rows changed) for each band, and with every row changed.

    hidden (N, C): the reference's final hidden states; probs (N, V): its predicted probabilities; change
    (V, C): the head's change (logits are hidden @ weight.T: the families here apply no soft-capping)."""
    order = torch.cat(rows)  # the bands' rows side by side, so each band is a slice of the logits
    change = change[order]
    ends = torch.tensor([len(r) for r in rows]).cumsum(0).tolist()
    per_band = torch.zeros(len(rows), dtype=torch.float64)
    whole = 0.0
    for lo in range(0, hidden.shape[0], POSITIONS_PER_CHUNK):
        delta = hidden[lo:lo + POSITIONS_PER_CHUNK] @ change.T
        p = probs[lo:lo + POSITIONS_PER_CHUNK][:, order]
        pd = p * delta
        grown = p * torch.expm1(delta)  # p(v) (e^d - 1): how much each changed logit adds to the partition
        start = 0
        for b, end in enumerate(ends):
            per_band[b] += (torch.log1p(grown[:, start:end].sum(-1)) - pd[:, start:end].sum(-1)).double().sum()
            start = end
        whole += (torch.log1p(grown.sum(-1)) - pd.sum(-1)).double().sum().item()
    n = hidden.shape[0]
    return (per_band / n).tolist(), whole / n


def measure_head_bands(model, param: str, probe, schemes, whole_head_kl: dict[str, float], start_id: int,
                       seed: int = 0, progress: bool = True) -> dict:
    """The band layout (ranked by the profiled text's use and the model's own text's, equally) and each band's
    cost per scheme on the profiled text (scaled to the whole head's measured cost). `probe`: the
    ReferenceProbe of the head windows, every position scored (its probabilities and final hidden states
    are the reference's here)."""
    weight = dict(model.named_parameters())[param].detach().float()
    if probe.ref_probs.shape[0] != probe.windows.numel():
        raise ValueError("head bands need a probe that scores every position")
    with torch.inference_mode():
        hidden = model.model.norm(probe.final_output).reshape(-1, probe.final_output.shape[-1]).float()
        text = usage(probe.ref_probs.double().sum(0), probe.windows, model.config.vocab_size)
    use = text + free_running_usage(model, start_id, seed=seed)
    band_of = band_of_ranking(usage_ranking(use))
    rows = band_rows(band_of)
    kl: dict[str, dict[str, float]] = {f"band{b}": {} for b in range(len(rows))}
    output_side, scale = {}, {}
    for scheme in stage_progress(schemes, desc="profile head bands", unit="scheme", enabled=progress):
        change = quantize_rtn(weight, scheme).dequantize().float() - weight
        bands, whole = output_side_kl(hidden, probe.ref_probs, change, rows)
        label = scheme.label
        output_side[label] = {"bands": bands, "whole": whole}
        # The input side of a tied row, and whatever does not add, folded in so the bands sum to the head's cost.
        scale[label] = whole_head_kl[label] / whole if whole > 0 else 1.0
        for b, cost in enumerate(bands):
            kl[f"band{b}"][label] = max(cost, 0.0) * scale[label]
    return {"band_of": encode_band_of(band_of), "sizes": band_sizes(band_of.numel()), "tokens": hidden.shape[0],
            "usage": USAGE_VERSION, "start_id": start_id,
            "kl": kl, "output_side": output_side, "scale": scale}


def random_band_assignments(schemes, bands: int, count: int, seed: int) -> list[list[str]]:
    """Banded heads to check the band costs on: a random level of precision per assignment, the bands
    spread about it, the most used bands a step more precise on average (as an allocation would)."""
    rng = random.Random(seed)
    ordered = sorted(schemes, key=lambda s: -s.bits_per_weight(4096, 4096))
    out = []
    for _ in range(count):
        level = rng.random()
        picks = []
        for b in range(bands):
            tilt = (b / max(bands - 1, 1) - 0.5) * 0.5
            i = round((level + tilt) * (len(ordered) - 1) + rng.gauss(0, 1))
            picks.append(ordered[min(len(ordered) - 1, max(0, i))].label)
        out.append(picks)
    return out
