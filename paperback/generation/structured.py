"""Constrained decoding: output that must follow a JSON schema (OpenAI's response_format), through llguidance.

llguidance compiles the schema into a grammar over the model's own token
vocabulary; before each token the matcher gives the set of tokens that keep
the output valid (a bitmask over the vocabulary), the sampler draws only from
those, and the matcher consumes what was drawn. When the value is complete
only end-of-sequence is allowed, so the completion ends with a whole JSON
value. The tokenizer conversion takes about a second and is done once per
tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from paperback.errors import PaperbackError

# Compact JSON (", " and ": " separators, no free whitespace): a small model given free whitespace can emit
# newlines until max_tokens instead of the value.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """What the output must be: any JSON object ("json_object"), or a value valid under `schema`."""

    kind: str
    schema: str | None = None  # JSON text of the schema, for json_schema

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict) -> Grammar:
        if not isinstance(schema, dict):
            raise PaperbackError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    def compiled(self) -> str:
        """The llguidance grammar; a schema llguidance cannot compile is a PaperbackError naming why."""
        import llguidance

        schema = {"type": "object"} if self.kind == "json_object" else json.loads(self.schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise PaperbackError(f"the JSON schema cannot be used: {exc}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem and not problem.startswith("WARNING"):
            raise PaperbackError(f"the JSON schema cannot be used: {problem}")
        return grammar


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer, stop_ids: tuple[int, ...]):
    import llguidance

    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    if backend is None:
        raise PaperbackError("constrained decoding needs a fast (tokenizers) tokenizer")
    return llguidance.LLTokenizer(backend.to_str(), eos_token=list(stop_ids))


class GrammarMatcher:
    """One sequence's position in the grammar: allowed() before a token, accept() after it."""

    def __init__(self, grammar: Grammar, tokenizer, stop_ids: frozenset[int] | tuple[int, ...], vocab_size: int):
        import llguidance

        self.ll = llguidance.LLMatcher(_ll_tokenizer(tokenizer, tuple(sorted(stop_ids))), grammar.compiled(),
                                       log_level=0)
        if self.ll.is_error():
            raise PaperbackError(f"the JSON schema cannot be used: {self.ll.get_error()}")
        self.vocab_size = vocab_size

    def fork(self) -> GrammarMatcher:
        """An independent matcher at the same position (a parallel completion of the same prompt)."""
        twin = object.__new__(GrammarMatcher)
        twin.ll, twin.vocab_size = self.ll.deep_copy(), self.vocab_size
        return twin

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that keep the output valid."""
        bits = np.unpackbits(np.frombuffer(self.ll.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.size)
        mask[:n] = torch.from_numpy(bits[:n].astype(bool))
        return mask

    def accept(self, token: int) -> None:
        if not self.ll.consume_token(token):
            raise PaperbackError(f"token {token} does not follow the grammar: {self.ll.get_error()}")

    @property
    def done(self) -> bool:
        """The value is complete and nothing more may follow."""
        return self.ll.is_stopped()
