"""OpenAI response bodies from engine outputs: choices, log-probabilities in each API's shape, usage, errors."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from paperback.engine.outputs import TokenLogprob


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message quoting a client's lone surrogate still
    renders (UTF-8 cannot encode one)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    return AsciiJSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status_code=status, headers=headers)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobFormatter:
    """Token log-probabilities as the chat API (`content` entries) and the completions API (parallel lists)
    write them; token strings are each token decoded alone, special tokens included."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> list[dict]:
        def one(token_id: int, logprob: float) -> dict:
            piece = self.piece(token_id)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    def completion(self, entries: list[TokenLogprob], text_start: int = 0) -> dict:
        tokens, logprobs, tops, offsets = [], [], [], []
        offset = text_start
        for entry in entries:
            piece = self.piece(entry.token_id)
            tokens.append(piece)
            logprobs.append(entry.logprob)
            tops.append({self.piece(t): lp for t, lp in entry.top} or None)
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def prompt_entries(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob | None]) -> list:
        """Echoed prompt tokens' entries; the first token's logprob is None, as OpenAI writes it."""
        first = TokenLogprob(prompt_ids[0], None, [])  # type: ignore[arg-type]
        return [first, *prompt_logprobs[1:]]
