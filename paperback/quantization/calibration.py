"""Calibration samples: N seeded windows of L tokens from a named corpus or a text file.

The default corpus is the Python documentation (`pydoc`), never WikiText-2,
which is the evaluation text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from paperback.errors import DatasetError, PaperbackError
from paperback.evaluation.datasets import load_text

DEFAULT_CORPUS = "pydoc"


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


def calibration_batch(tokenizer, config: CalibrationConfig) -> torch.Tensor:
    """(num_samples, seq_len) int64 windows starting at seeded random offsets."""
    ids = tokenizer.encode(load_text(config.corpus), add_special_tokens=False)
    tokens = torch.tensor(ids, dtype=torch.long)
    return torch.stack([tokens[s:s + config.seq_len] for s in calibration_starts(len(ids), config)])
