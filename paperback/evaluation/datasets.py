"""Evaluation text by name: WikiText-2, PTB, Python docs, or a user's file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from paperback.errors import DatasetError

DATASETS = {
    "wikitext2": "WikiText-2 raw test split (the file llama-perplexity reads)",
    "ptb": "Penn Treebank test set (Mikolov's preprocessed text)",
    "pydoc": "Python documentation topics shipped with CPython (pydoc_data.topics)",
}
_BUNDLED_FILES = {"wikitext2": "wikitext2_test.txt", "ptb": "ptb_test.txt"}


def load_text(name: str) -> str:
    """Text of a named data set, or of a file if `name` is a path to one."""
    if name in _BUNDLED_FILES:
        return resources.files("paperback.data").joinpath(_BUNDLED_FILES[name]).read_text(encoding="utf-8")
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DatasetError(f"{path} is not UTF-8 text") from None
    raise DatasetError(f"unknown data set '{name}' (choose from {', '.join(DATASETS)}, or give a text file path)")
