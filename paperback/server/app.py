"""An OpenAI-compatible HTTP API over the paged engine (FastAPI).

/v1/completions and /v1/chat/completions (streaming by server-sent events),
/v1/models, /health and /metrics (Prometheus). Invalid requests get a 400
with an OpenAI-style error body; a full waiting queue gets a 429; a client
that disconnects mid-stream has its request aborted, which frees its KV
blocks at once.
"""

from __future__ import annotations

import itertools
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from paperback.engine.llm import RequestOutput
from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams
from paperback.server.async_engine import AsyncEngine, Delta, Overloaded


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False


class CompletionRequest(_Base):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(engine: AsyncEngine, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="paperback", version="1")
    tokenizer = engine.engine.tokenizer
    counter = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        engine.metrics.rejected.labels("invalid").inc()
        return _error(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "paperback"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    def sampling(body: _Base, max_tokens: int | None, stop_token_ids=()) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(max_tokens=max_tokens or default_max_tokens, temperature=body.temperature,
                              top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=tuple(stop),
                              ignore_eos=body.ignore_eos, n=body.n, stop_token_ids=tuple(stop_token_ids))

    async def run(request: Request, prompt_ids: list[int], params: SamplingParams, chat: bool):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(counter)}"
        try:
            out = engine.submit(prompt_ids, params, request_id)
        except Overloaded as exc:
            engine.metrics.rejected.labels("overloaded").inc()
            return _error(429, f"server busy: {exc}; retry later", "rate_limit_error")
        created = int(time.time())
        if not request.state.stream:
            while True:
                item = await out.get()
                if isinstance(item, Exception):
                    return _error(400 if isinstance(item, PaperbackError) else 500, str(item))
                if isinstance(item, RequestOutput):
                    return _final(item, request_id, created, len(prompt_ids), chat)
        return StreamingResponse(_stream(out, request_id, created, chat), media_type="text/event-stream")

    def _final(output: RequestOutput, request_id: str, created: int, prompt_tokens: int, chat: bool) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason} for c in output.outputs]
            return {"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage}
        choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                   for c in output.outputs]
        return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage}

    async def _stream(out, request_id: str, created: int, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        done = False

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": request_id, "object": kind, "created": created, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        started: set[int] = set()
        try:
            while True:
                item = await out.get()
                if isinstance(item, Exception):
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                    done = True
                    break
                if isinstance(item, Delta):
                    if chat and item.index not in started:
                        started.add(item.index)
                        yield chunk(item.index, None, None, role=True)
                    yield chunk(item.index, item.text, None)
                    continue
                for completion in item.outputs:
                    if chat and completion.index not in started:
                        yield chunk(completion.index, None, None, role=True)
                    yield chunk(completion.index, None if chat else "", completion.finish_reason)
                done = True
                break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away mid-stream: free its blocks now
                engine.cancel(request_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            if not body.prompt:
                return _error(400, "prompt must not be empty")
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            vocab = engine.engine.model.config.vocab_size
            if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
                return _error(400, f"prompt token ids must be a non-empty list of ids in [0, {vocab})")
        return await _checked(request, body, prompt_ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        return await _checked(request, body, prompt_ids, body.max_completion_tokens or body.max_tokens, chat=True,
                              stop_token_ids=tokenizer.end_of_turn_ids)

    async def _checked(request: Request, body: _Base, prompt_ids, max_tokens, chat: bool, stop_token_ids=()):
        if body.model not in (None, model_name):
            return _error(404, f"model '{body.model}' is not served here (this server serves '{model_name}')",
                          "not_found_error")
        try:
            params = sampling(body, max_tokens, stop_token_ids)
            limit = engine.engine.max_model_len
            if len(prompt_ids) + params.max_tokens > limit:
                raise PaperbackError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                     f"exceeds the context of {limit} tokens this server takes")
        except PaperbackError as exc:
            engine.metrics.rejected.labels("invalid").inc()
            return _error(400, str(exc))
        request.state.stream = body.stream
        return await run(request, prompt_ids, params, chat)

    return app
