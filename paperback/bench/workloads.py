"""Bench prompts: equal-length slices of real text, one per batch row."""

from __future__ import annotations

import torch

from paperback.errors import DatasetError
from paperback.evaluation.datasets import load_text


def text_prompts(tokenizer, batch: int, prompt_tokens: int, dataset: str = "wikitext2") -> torch.Tensor:
    """(batch, prompt_tokens) int64 ids: row i starts i windows into the text."""
    ids = tokenizer.encode(load_text(dataset), add_special_tokens=False)
    if len(ids) < batch * prompt_tokens:
        raise DatasetError(f"{dataset} has too few tokens for {batch} prompts of {prompt_tokens}")
    rows = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(batch)]
    return torch.tensor(rows, dtype=torch.long)
