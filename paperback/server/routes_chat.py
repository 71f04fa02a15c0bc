"""/v1/chat/completions: the model's chat template, n completions, logprobs, structured output, streaming."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from paperback.engine.outputs import RequestOutput
from paperback.errors import PaperbackError
from paperback.loading.tokenizer import NoChatTemplate
from paperback.server.protocol import ChatRequest
from paperback.server.responses import error, usage
from paperback.server.serving import Serving


def chat_routes(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if (refused := s.wrong_model(body.model)) is not None:
            return refused
        try:
            prompt_ids = await s.chat_prompt(body.messages)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = s.params_for(prompt_ids, body, body.max_completion_tokens or body.max_tokens,
                                  # ignore_eos ignores the end of a turn too, as vLLM ignores every EOS id
                                  stop_token_ids=() if body.ignore_eos else tuple(sorted(s.tokenizer.end_of_turn_ids)),
                                  logprobs=logprobs,
                                  output_kind="delta" if body.stream else "final")
        except NoChatTemplate as exc:
            s.engine.metrics.rejected.labels("invalid").inc()
            return error(400, f"{exc}", param="messages")
        except PaperbackError as exc:
            s.engine.metrics.rejected.labels("invalid").inc()
            return error(400, str(exc))
        ids, queues = s.submit_all("chatcmpl", [(prompt_ids, params)])
        if ids is None:
            return queues
        request_id, created = ids[0], int(time.time())

        def logprobs_of(completion):
            return {"content": s.formatter.chat(completion.logprobs or [])} if body.logprobs else None

        if not body.stream:
            outputs, instead = await s.finished(request, ids, queues)
            if instead is not None:
                return instead
            output = outputs[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs_of(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for c in output.outputs]
            return {"id": request_id, "object": "chat.completion", "created": created, "model": s.model_name,
                    "choices": choices,
                    "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in output.outputs))}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        started: set[int] = set()

        def chunk(choice: dict) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": s.model_name,
                    "choices": [choice], **({"usage": None} if include_usage else {})}

        def chunks(_i: int, output: RequestOutput):
            for c in output.outputs:
                if c.index not in started:
                    started.add(c.index)
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                if c.text or c.token_ids:
                    yield chunk({"index": c.index, "delta": {"content": c.text} if c.text else {},
                                 "logprobs": logprobs_of(c), "finish_reason": None})
                if c.finish_reason:
                    yield chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason})

        def final_usage(completion_tokens: int) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": s.model_name,
                    "choices": [], "usage": usage(len(prompt_ids), completion_tokens)}

        return StreamingResponse(s.stream_events(ids, queues, chunks, final_usage if include_usage else None),
                                 media_type="text/event-stream")

    return router
