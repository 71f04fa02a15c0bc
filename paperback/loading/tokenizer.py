"""Tokenizer with chat template, from a GGUF file's metadata or a model directory.

`transformers` does the conversion (GGUF vocabularies become a fast
`tokenizers` tokenizer). Converting a 262k-token SentencePiece vocabulary takes
seconds, so the converted tokenizer is cached on disk, keyed by the file's
identity.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from paperback.errors import ModelFileError, PaperbackError

# End-of-turn tokens of common chat formats; generation stops at them too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>")


class NoChatTemplate(PaperbackError):
    """Chat was asked of a model whose tokenizer carries no chat template."""


def first_line(exc: Exception) -> str:
    """A library's error message, first line only (some list every variant they tried)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cache_dir() -> Path:
    return Path(os.environ.get("PAPERBACK_CACHE", Path.home() / ".cache" / "paperback"))


class Tokenizer:
    """Thin wrapper over a `transformers` fast tokenizer with the calls paperback needs."""

    def __init__(self, hf_tokenizer, extra_eos_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        vocab = hf_tokenizer.get_vocab()
        eos = {i for i in (hf_tokenizer.eos_token_id, *extra_eos_ids) if i is not None}
        self.eos_token_ids = frozenset(eos)
        self.end_of_turn_ids = frozenset(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab) | self.eos_token_ids
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)
        probe = hf_tokenizer.encode("a", add_special_tokens=True)
        self.adds_bos = self.bos_token_id is not None and bool(probe) and probe[0] == self.bos_token_id
        # What begins a document in the model's training text: BOS where every text gets one (Llama, Gemma);
        # else the separator GPT-2-style vocabularies put between documents (SmolLM2's BOS is <|im_start|>,
        # a chat turn's); else BOS or EOS; None when the tokenizer has none of them.
        separator = vocab.get("<|endoftext|>")
        fallback = self.bos_token_id if self.bos_token_id is not None else min(eos, default=None)
        self.document_start_id = (self.bos_token_id if self.adds_bos
                                  else separator if separator is not None else fallback)

        self.template_override: str | None = None  # a chat template given by the user (serve --chat-template)

    @property
    def chat_template(self) -> str | None:
        return self.template_override or getattr(self.hf, "chat_template", None) or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise PaperbackError("the text is not valid Unicode (it holds a lone surrogate)") from None
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        if not self.chat_template:
            raise NoChatTemplate("this model has no chat template; pass a plain prompt, or give a template "
                                 "(serve --chat-template FILE)")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               chat_template=self.chat_template)
        except (TemplateError, ValueError) as exc:
            raise PaperbackError(f"the chat template failed on these messages: {exc}") from None


def _file_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def tokenizer_from_gguf(path: Path, eos_ids: tuple[int, ...] = (), use_cache: bool = True) -> Tokenizer:
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / _file_key(path)
    try:
        if use_cache and (cached / "tokenizer_config.json").exists():
            return Tokenizer(AutoTokenizer.from_pretrained(cached), eos_ids)
        hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # the converters raise bare Exceptions on corrupt vocabularies
        raise ModelFileError(f"{path}: could not build a tokenizer from its metadata: {first_line(exc)}") from None
    if use_cache:
        _save_atomically(hf, cached)
    return Tokenizer(hf, eos_ids)


def _save_atomically(hf_tokenizer, target: Path) -> None:
    """Write to a temporary folder, then rename: a crash never leaves half a tokenizer."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        hf_tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a read-only or racing cache only costs time


def tokenizer_from_dir(path: Path, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
    from transformers import AutoTokenizer

    if not ((path / "tokenizer.json").exists() or (path / "tokenizer.model").exists()):
        raise ModelFileError(f"{path} has no tokenizer.json (or tokenizer.model)")
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(path), eos_ids)
    except Exception as exc:  # tokenizers raises bare Exceptions on a corrupt tokenizer.json
        raise ModelFileError(f"{path}: could not load its tokenizer: {first_line(exc)}") from None
