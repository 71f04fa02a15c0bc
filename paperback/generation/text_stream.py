"""A completion's text as its tokens arrive: incremental detokenization, stop strings, and what is safe to show.

One owner for what the contiguous `generate`, the engine and the server all
need: text that might still turn out to be the start of a stop string is held
back, so a stop string is never streamed, and the text ends where the first
stop string begins.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids.

    Decodes a short window of recent ids so that multi-token characters and
    SentencePiece leading spaces come out right (the way vLLM does it).
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text at or after search_from."""
    best = None
    for s in stops:
        idx = text.find(s, max(0, search_from))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


class TextStream:
    """push() each generated token; take() the text that is safe to show so far (all of it once stopped)."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.shown = 0
        self.stop_string: str | None = None  # the stop string that ended the text

    def push(self, token_id: int) -> bool:
        """Add a token's text; True when a stop string now ends the text (cut before it)."""
        before = len(self.text)
        self.text += self.detok.push(token_id)
        hit = find_stop(self.text, self.stop, before - self.holdback) if self.stop else None
        if hit is None:
            return False
        self.text, self.stop_string = self.text[:hit[0]], hit[1]
        return True

    def take(self, final: bool = False) -> str:
        """New text that can no longer become part of a stop string (everything when final)."""
        end = len(self.text) if final or self.stop_string is not None else len(self.text) - self.holdback
        if end <= self.shown:
            return ""
        new, self.shown = self.text[self.shown:end], end
        return new
