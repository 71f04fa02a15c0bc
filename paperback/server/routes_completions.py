"""/v1/completions: one or many prompts, n completions each, echo, logprobs, streaming."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from paperback.engine.outputs import RequestOutput
from paperback.errors import PaperbackError
from paperback.server.protocol import CompletionRequest
from paperback.server.responses import error, usage
from paperback.server.serving import Serving


def completion_routes(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (refused := s.wrong_model(body.model)) is not None:
            return refused
        kind = "delta" if body.stream else "final"
        try:
            prompts = [await asyncio.to_thread(s.tokenizer.encode, p) if isinstance(p, str) else list(p)
                       for p in body.prompts()]
            if body.max_tokens == 0 and not body.echo:
                raise PaperbackError("max_tokens must be at least 1 (0 only with echo)")
            if body.max_tokens == 0 and body.logprobs is None:
                return echo_only(s, body, prompts)
            scored = body.logprobs if body.echo and body.logprobs is not None else None
            work = [(p, s.params_for(p, body, body.max_tokens, logprobs=body.logprobs, prompt_logprobs=scored,
                                     output_kind=kind)) for p in prompts]
        except PaperbackError as exc:
            s.engine.metrics.rejected.labels("invalid").inc()
            return error(400, str(exc))
        ids, queues = s.submit_all("cmpl", work)
        if ids is None:
            return queues
        request_id, created = ids[0], int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)
        prompt_texts = [s.tokenizer.decode(p) for p in prompts] if body.echo else None

        def choice(prompt_index: int, output: RequestOutput, completion, first: bool) -> dict:
            text, entries = completion.text, completion.logprobs
            if first and body.echo:
                text = prompt_texts[prompt_index] + text
                if body.logprobs is not None and output.prompt_logprobs is not None:
                    entries = s.formatter.prompt_entries(output.prompt_token_ids, output.prompt_logprobs) + \
                        (entries or [])
            return {"index": prompt_index * body.n + completion.index, "text": text,
                    "logprobs": s.formatter.completion(entries) if body.logprobs is not None else None,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

        if not body.stream:
            outputs, instead = await s.finished(request, ids, queues)
            if instead is not None:
                return instead
            choices = [choice(i, o, c, True) for i, o in enumerate(outputs) for c in o.outputs]
            completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            return {"id": request_id, "object": "text_completion", "created": created, "model": s.model_name,
                    "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        started: set[int] = set()

        def chunks(i: int, output: RequestOutput):
            for c in output.outputs:
                first = (i, c.index) not in started
                started.add((i, c.index))
                if c.text or c.token_ids or c.finish_reason or first:
                    yield {"id": request_id, "object": "text_completion", "created": created, "model": s.model_name,
                           "choices": [choice(i, output, c, first)], **({"usage": None} if include_usage else {})}

        def final_usage(completion_tokens: int) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": s.model_name,
                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

        return StreamingResponse(s.stream_events(ids, queues, chunks, final_usage if include_usage else None),
                                 media_type="text/event-stream")

    return router


def echo_only(s: Serving, body: CompletionRequest, prompts: list[list[int]]) -> dict:
    """echo with max_tokens 0: the prompts themselves, nothing generated, no model run."""
    choices = [{"index": i * body.n + j, "text": s.tokenizer.decode(p), "logprobs": None,
                "finish_reason": "length"} for i, p in enumerate(prompts) for j in range(body.n)]
    return {"id": f"cmpl-{next(s.counter)}", "object": "text_completion", "created": int(time.time()),
            "model": s.model_name, "choices": choices, "usage": usage(sum(map(len, prompts)), 0)}
