"""Calibration samples: N seeded windows of L tokens from a named corpus or a text file.

The default corpus is the Python documentation (`pydoc`), never WikiText-2,
which is the evaluation text. `generated` needs no text at all: the model
samples its own windows from the start-of-document token (self-calibration:
the text follows the model's training distribution, general English for a
web-trained model, where pydoc is one narrow domain).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from paperback.errors import DatasetError, PaperbackError
from paperback.evaluation.datasets import load_text

DEFAULT_CORPUS = "pydoc"
GENERATED = "generated"  # the corpus the model writes itself
# How the model writes it: temperature 1 keeps the text as varied as the model's distribution; top-p 0.95 drops
# the tail of rare tokens that sampling at temperature 1 would otherwise string into noise over 512 tokens.
GENERATED_TEMPERATURE, GENERATED_TOP_P = 1.0, 0.95


@dataclass(frozen=True)
class CalibrationConfig:
    corpus: str = DEFAULT_CORPUS
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    span: float = 1.0  # draw windows from this leading fraction of the corpus (keep the rest for evaluation)

    def __post_init__(self):
        if self.num_samples < 1 or self.seq_len < 2:
            raise PaperbackError("calibration needs at least 1 sample of at least 2 tokens")
        if not 0 < self.span <= 1:
            raise PaperbackError(f"calibration span must be in (0, 1], got {self.span}")

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_starts(num_tokens: int, config: CalibrationConfig) -> list[int]:
    """Where the windows of `config` start in a corpus of `num_tokens` tokens (seeded, so text held out from
    calibration can be told apart)."""
    usable = int(num_tokens * config.span)
    if usable <= config.seq_len:
        raise DatasetError(
            f"calibration text '{config.corpus}' has {usable} tokens, too few for samples of {config.seq_len}"
        )
    gen = torch.Generator().manual_seed(config.seed)
    return torch.randint(0, usable - config.seq_len, (config.num_samples,), generator=gen).tolist()


def calibration_batch(tokenizer, config: CalibrationConfig, model=None) -> torch.Tensor:
    """(num_samples, seq_len) int64 windows starting at seeded random offsets; for the `generated` corpus,
    windows `model` samples (seeded)."""
    if config.corpus == GENERATED:
        if model is None:
            raise PaperbackError(f"calibration corpus '{GENERATED}' is sampled from the model, which this step "
                                 "does not have; give a corpus name or a text file")
        return generated_batch(model, tokenizer, config)
    ids = tokenizer.encode(load_text(config.corpus), add_special_tokens=False)
    tokens = torch.tensor(ids, dtype=torch.long)
    return torch.stack([tokens[s:s + config.seq_len] for s in calibration_starts(len(ids), config)])


def generated_batch(model, tokenizer, config: CalibrationConfig, batch: int = 64) -> torch.Tensor:
    """(num_samples, seq_len) windows the model writes from the token that begins a document in its training
    text (Tokenizer.document_start_id), `batch` at a time, seeded by config.seed; EOS does not stop a window
    (the model goes on to a new document, as in packed training text). Wide batches share each step's weight
    reads among more rows; each batch is seeded by its first row's index, so the text depends on `batch` once
    num_samples exceeds the smaller one."""
    from paperback.generation.generate import generate_tokens
    from paperback.generation.sampling import SamplingParams

    start = tokenizer.document_start_id
    if start is None:
        raise PaperbackError(f"calibration corpus '{GENERATED}' starts each window at the token that begins a "
                             "document (BOS, <|endoftext|> or EOS), and this tokenizer has none")
    windows = []
    # tqdm shows the bar on a terminal only (disable=None), so logs and tests stay quiet.
    with tqdm(total=config.num_samples * (config.seq_len - 1), desc="writing calibration windows", unit="tok",
              disable=None) as bar:
        for first in range(0, config.num_samples, batch):
            rows = min(batch, config.num_samples - first)
            params = SamplingParams(max_tokens=config.seq_len - 1, temperature=GENERATED_TEMPERATURE,
                                    top_p=GENERATED_TOP_P, seed=config.seed * 1_000_003 + first, ignore_eos=True)
            prompt = torch.full((rows, 1), start, dtype=torch.long)
            tokens = []
            for token in generate_tokens(model, prompt, params):
                tokens.append(token)
                bar.update(rows)
            windows.append(torch.cat([prompt, torch.stack(tokens, dim=1)], 1))
    return torch.cat(windows)
