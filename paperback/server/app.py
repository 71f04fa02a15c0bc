"""An OpenAI-compatible HTTP API over the paged engine (FastAPI), with vLLM's extra routes.

/v1/completions and /v1/chat/completions (streaming by server-sent events),
/v1/models, /tokenize, /detokenize, /version, /health and /metrics
(Prometheus, vLLM's series). Every field of a request is honoured or refused
by name (paperback.server.protocol). Any bad request gets a 4xx with
OpenAI's error body, never a 500: bodies over the size limit are refused
before parsing, tokenizing and chat templates run off the event loop, a
request that fails inside the engine fails alone, and a client that
disconnects (streaming or not) has its request aborted, which frees its KV
blocks at once. A full waiting queue answers 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

import paperback
from paperback.engine.outputs import RequestOutput
from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams
from paperback.loading.tokenizer import NoChatTemplate
from paperback.server.async_engine import AsyncEngine, Overloaded
from paperback.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from paperback.server.responses import LogprobFormatter, error, usage

log = logging.getLogger("paperback.server")
RETRY_AFTER_S = 1
# Fields whose type is a union: pydantic reports every branch; one sentence says what is expected.
_UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
                 "stop": "a string or a list of strings", "content": "a string or a list of content parts"}


class RequestGuard:
    """ASGI middleware: the API key on /v1 routes (401), and the body size limit (413) before any parsing."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await error(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                   "authentication_error")(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(scope, receive, send)
        body, more = b"", True
        while more:  # read the whole body here, bounded, whatever the client declared
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the client's disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error(413, f"the request body exceeds {self.max_body_bytes} bytes", "invalid_request_error")
        await response(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind, msg = first.get("type"), str(first.get("msg", "")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if kind == "extra_forbidden":
        return f"unknown parameter '{'.'.join(loc)}'", ".".join(loc)
    where = ".".join(loc)
    field = next((p for p in reversed(loc) if p in _UNION_FIELDS), None)
    if field is not None and sum(1 for e in errors if field in map(str, e.get("loc", ()))) > 1:
        return f"{field} must be {_UNION_FIELDS[field]}", field
    return (f"{where}: {msg}" if where else msg), (where or None)


def _is_disconnect(message) -> bool:
    return message.get("type") == "http.disconnect"


async def _until_disconnected(request: Request) -> None:
    while not _is_disconnect(await request.receive()):
        pass


def create_app(engine: AsyncEngine, model_name: str, default_max_tokens: int = 256, api_key: str | None = None,
               max_body_bytes: int = 4 * 2 ** 20) -> FastAPI:
    app = FastAPI(title="paperback", version=paperback.__version__)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)
    tokenizer = engine.tokenizer
    formatter = LogprobFormatter(tokenizer)
    counter = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        engine.metrics.rejected.labels("invalid").inc()
        return error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404
                     else "invalid_request_error")

    @app.exception_handler(Exception)
    async def bug(_request, exc: Exception):
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": paperback.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "paperback", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():  # the engine thread updates them after every step and while idle
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def wrong_model(name: str | None):
        if name not in (None, model_name):
            return error(404, f"model '{name}' is not served here (this server serves '{model_name}')",
                         "not_found_error", param="model")
        return None

    async def chat_prompt(messages, add_generation_prompt: bool = True) -> list[int]:
        def render():
            text = tokenizer.apply_chat_template([m.for_template() for m in messages], add_generation_prompt)
            return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        return await asyncio.to_thread(render)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (refused := wrong_model(body.model)) is not None:
            return refused
        try:
            if body.messages is not None:
                ids = await chat_prompt(body.messages, body.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        except PaperbackError as exc:
            return error(400, str(exc))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (refused := wrong_model(body.model)) is not None:
            return refused
        if any(t >= engine.vocab_size for t in body.tokens):
            return error(400, f"token ids must be in [0, {engine.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    # --- generation -------------------------------------------------------------------------------------------
    def params_for(prompt_ids: list[int], body, max_tokens: int | None, **kwargs) -> SamplingParams:
        if max_tokens is None:  # as much as fits, up to the default
            max_tokens = max(1, min(default_max_tokens, engine.max_model_len - len(prompt_ids)))
        params = body.sampling_params(max_tokens, **kwargs)
        engine.check_request(prompt_ids, params)
        return params

    def submit_all(prefix: str, work: list[tuple[list[int], SamplingParams]]):
        """Submit every prompt, or none: (request ids, queues), or the 429 response."""
        ids, queues = [], []
        try:
            for prompt_ids, params in work:
                request_id = f"{prefix}-{next(counter)}"
                queues.append(engine.submit(prompt_ids, params, request_id))
                ids.append(request_id)
        except Overloaded as exc:
            for request_id in ids:
                engine.cancel(request_id)
            engine.metrics.rejected.labels("overloaded").inc()
            return None, error(429, f"server busy: {exc}; retry later", "rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        return ids, queues

    async def collect(request: Request, ids: list[str], queues: list[asyncio.Queue]):
        """The final output of every request, or None when the client went away first (all are aborted)."""
        results = asyncio.ensure_future(asyncio.gather(*(q.get() for q in queues)))
        watcher = asyncio.ensure_future(_until_disconnected(request))
        done, _ = await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            results.cancel()
            for request_id in ids:
                engine.cancel(request_id)
            # read the cancelled gather's outcome, or asyncio logs it as an error when the future is collected
            await asyncio.gather(results, return_exceptions=True)
            return None
        watcher.cancel()
        return results.result()

    async def finished(request: Request, ids: list[str], queues: list[asyncio.Queue]):
        """(final outputs, None), or (None, the response to send instead: the client left, or one failed)."""
        outputs = await collect(request, ids, queues)
        if outputs is None:
            return None, Response(status_code=499)
        failed = failure(outputs)
        return (None, failed) if failed is not None else (outputs, None)

    def failure(items) -> Response | None:
        for item in items:
            if isinstance(item, PaperbackError):
                return error(400, str(item))
            if isinstance(item, Exception):
                return error(500, f"the request failed: {item}", "server_error")
            if item.error is not None:
                return error(500, f"the request failed: {item.error}", "server_error")
        return None

    async def merged(queues: list[asyncio.Queue]):
        """(prompt index, item) from every request's queue until each has finished or failed."""
        out: asyncio.Queue = asyncio.Queue()

        async def forward(i, q):
            while True:
                item = await q.get()
                await out.put((i, item))
                if isinstance(item, Exception) or item.finished:
                    return

        tasks = [asyncio.ensure_future(forward(i, q)) for i, q in enumerate(queues)]
        try:
            for _ in range(sum(1 for _ in queues)):
                while True:
                    i, item = await out.get()
                    yield i, item
                    if isinstance(item, Exception) or item.finished:
                        break
        finally:
            for task in tasks:
                task.cancel()

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    async def stream_events(ids, queues, make_chunks, final_usage):
        """Server-sent events for every request's deltas; aborts what is unfinished if the client leaves."""
        open_ids = set(ids)
        completion_tokens = 0
        try:
            async for i, item in merged(queues):
                if isinstance(item, Exception) or item.error is not None:
                    message = str(item) if isinstance(item, Exception) else item.error
                    yield sse({"error": {"message": message, "type": "server_error", "code": 500}})
                    open_ids.discard(ids[i])
                    continue
                completion_tokens += sum(len(c.token_ids) for c in item.outputs)
                for chunk in make_chunks(i, item):
                    yield sse(chunk)
                if item.finished:
                    open_ids.discard(ids[i])
            if final_usage is not None:
                yield sse(final_usage(completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for request_id in open_ids:  # the client went away mid-stream: free the blocks now
                engine.cancel(request_id)

    # --- /v1/completions ----------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (refused := wrong_model(body.model)) is not None:
            return refused
        kind = "delta" if body.stream else "final"
        try:
            prompts = [await asyncio.to_thread(tokenizer.encode, p) if isinstance(p, str) else list(p)
                       for p in body.prompts()]
            if body.max_tokens == 0 and not body.echo:
                raise PaperbackError("max_tokens must be at least 1 (0 only with echo)")
            if body.max_tokens == 0 and body.logprobs is None:
                return echo_only(body, prompts)
            scored = body.logprobs if body.echo and body.logprobs is not None else None
            work = [(p, params_for(p, body, body.max_tokens, logprobs=body.logprobs, prompt_logprobs=scored,
                                   output_kind=kind)) for p in prompts]
        except PaperbackError as exc:
            engine.metrics.rejected.labels("invalid").inc()
            return error(400, str(exc))
        ids, queues = submit_all("cmpl", work)
        if ids is None:
            return queues
        request_id, created = ids[0], int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)
        prompt_texts = [tokenizer.decode(p) for p in prompts] if body.echo else None

        def choice(prompt_index: int, output: RequestOutput, completion, first: bool) -> dict:
            text, entries = completion.text, completion.logprobs
            if first and body.echo:
                text = prompt_texts[prompt_index] + text
                if body.logprobs is not None and output.prompt_logprobs is not None:
                    entries = formatter.prompt_entries(output.prompt_token_ids, output.prompt_logprobs) + \
                        (entries or [])
            return {"index": prompt_index * body.n + completion.index, "text": text,
                    "logprobs": formatter.completion(entries) if body.logprobs is not None else None,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

        if not body.stream:
            outputs, instead = await finished(request, ids, queues)
            if instead is not None:
                return instead
            choices = [choice(i, o, c, True) for i, o in enumerate(outputs) for c in o.outputs]
            completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        started: set[int] = set()

        def chunks(i: int, output: RequestOutput):
            for c in output.outputs:
                first = (i, c.index) not in started
                started.add((i, c.index))
                if c.text or c.token_ids or c.finish_reason or first:
                    yield {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                           "choices": [choice(i, output, c, first)], **({"usage": None} if include_usage else {})}

        def final_usage(completion_tokens: int) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

        return StreamingResponse(stream_events(ids, queues, chunks, final_usage if include_usage else None),
                                 media_type="text/event-stream")

    def echo_only(body: CompletionRequest, prompts: list[list[int]]) -> dict:
        """echo with max_tokens 0: the prompts themselves, nothing generated, no model run."""
        choices = [{"index": i * body.n + j, "text": tokenizer.decode(p), "logprobs": None, "finish_reason": "length"}
                   for i, p in enumerate(prompts) for j in range(body.n)]
        return {"id": f"cmpl-{next(counter)}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "usage": usage(sum(map(len, prompts)), 0)}

    # --- /v1/chat/completions -----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if (refused := wrong_model(body.model)) is not None:
            return refused
        try:
            prompt_ids = await chat_prompt(body.messages)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = params_for(prompt_ids, body, body.max_completion_tokens or body.max_tokens,
                                stop_token_ids=tuple(sorted(tokenizer.end_of_turn_ids)), logprobs=logprobs,
                                output_kind="delta" if body.stream else "final")
        except NoChatTemplate as exc:
            engine.metrics.rejected.labels("invalid").inc()
            return error(400, f"{exc}", param="messages")
        except PaperbackError as exc:
            engine.metrics.rejected.labels("invalid").inc()
            return error(400, str(exc))
        ids, queues = submit_all("chatcmpl", [(prompt_ids, params)])
        if ids is None:
            return queues
        request_id, created = ids[0], int(time.time())

        def logprobs_of(completion):
            return {"content": formatter.chat(completion.logprobs or [])} if body.logprobs else None

        if not body.stream:
            outputs, instead = await finished(request, ids, queues)
            if instead is not None:
                return instead
            output = outputs[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs_of(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for c in output.outputs]
            return {"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": choices,
                    "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in output.outputs))}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        started: set[int] = set()

        def chunk(choice: dict) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
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
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [], "usage": usage(len(prompt_ids), completion_tokens)}

        return StreamingResponse(stream_events(ids, queues, chunks, final_usage if include_usage else None),
                                 media_type="text/event-stream")

    return app
