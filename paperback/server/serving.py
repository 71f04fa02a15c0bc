"""What the routes share: the engine and tokenizer behind them, and how a request is tokenized, checked, submitted,
awaited (aborted when its client leaves) and streamed back as server-sent events."""

from __future__ import annotations

import asyncio
import itertools
import json

from fastapi import Request
from fastapi.responses import Response

from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams
from paperback.server.async_engine import AsyncEngine, Overloaded, ShuttingDown
from paperback.server.guard import until_disconnected
from paperback.server.responses import LogprobFormatter, error

RETRY_AFTER_S = 1


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, default_max_tokens: int):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self.tokenizer = engine.tokenizer
        self.formatter = LogprobFormatter(self.tokenizer)
        self.counter = itertools.count()

    def wrong_model(self, name: str | None):
        if name not in (None, self.model_name):
            return error(404, f"model '{name}' is not served here (this server serves '{self.model_name}')",
                         "not_found_error", param="model")
        return None

    async def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list[int]:
        def render():
            text = self.tokenizer.apply_chat_template([m.for_template() for m in messages], add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        return await asyncio.to_thread(render)

    def params_for(self, prompt_ids: list[int], body, max_tokens: int | None, **kwargs) -> SamplingParams:
        if max_tokens is None:  # as much as fits, up to the default
            max_tokens = max(1, min(self.default_max_tokens, self.engine.max_model_len - len(prompt_ids)))
        params = body.sampling_params(max_tokens, **kwargs)
        self.engine.check_request(prompt_ids, params)
        return params

    def submit_all(self, prefix: str, work: list[tuple[list[int], SamplingParams]]):
        """Submit every prompt, or none: (request ids, queues), or the 429 response."""
        ids, queues = [], []
        try:
            for prompt_ids, params in work:
                request_id = f"{prefix}-{next(self.counter)}"
                queues.append(self.engine.submit(prompt_ids, params, request_id))
                ids.append(request_id)
        except Overloaded as exc:
            for request_id in ids:
                self.engine.cancel(request_id)
            self.engine.metrics.rejected.labels("overloaded").inc()
            return None, error(429, f"server busy: {exc}; retry later", "rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        return ids, queues

    async def collect(self, request: Request, ids: list[str], queues: list[asyncio.Queue]):
        """The final output of every request, or None when the client went away first (all are aborted)."""
        results = asyncio.ensure_future(asyncio.gather(*(q.get() for q in queues)))
        watcher = asyncio.ensure_future(until_disconnected(request))
        done, _ = await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            results.cancel()
            for request_id in ids:
                self.engine.cancel(request_id)
            # read the cancelled gather's outcome, or asyncio logs it as an error when the future is collected
            await asyncio.gather(results, return_exceptions=True)
            return None
        watcher.cancel()
        return results.result()

    async def finished(self, request: Request, ids: list[str], queues: list[asyncio.Queue]):
        """(final outputs, None), or (None, the response to send instead: the client left, or one failed)."""
        outputs = await self.collect(request, ids, queues)
        if outputs is None:
            return None, Response(status_code=499)
        failed = self.failure(outputs)
        return (None, failed) if failed is not None else (outputs, None)

    def failure(self, items) -> Response | None:
        for item in items:
            if isinstance(item, PaperbackError):
                return error(400, str(item))
            if isinstance(item, ShuttingDown):
                return error(503, str(item), "server_error")
            if isinstance(item, Exception):
                return error(500, f"the request failed: {item}", "server_error")
            if item.error is not None:
                return error(500, f"the request failed: {item.error}", "server_error")
        return None

    async def merged(self, queues: list[asyncio.Queue]):
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

    def sse(self, body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    async def stream_events(self, ids, queues, make_chunks, final_usage):
        """Server-sent events for every request's deltas; aborts what is unfinished if the client leaves."""
        open_ids = set(ids)
        completion_tokens = 0
        try:
            async for i, item in self.merged(queues):
                if isinstance(item, Exception) or item.error is not None:
                    message = str(item) if isinstance(item, Exception) else item.error
                    code = 503 if isinstance(item, ShuttingDown) else 500
                    yield self.sse({"error": {"message": message, "type": "server_error", "code": code}})
                    open_ids.discard(ids[i])
                    continue
                completion_tokens += sum(len(c.token_ids) for c in item.outputs)
                for chunk in make_chunks(i, item):
                    yield self.sse(chunk)
                if item.finished:
                    open_ids.discard(ids[i])
            if final_usage is not None:
                yield self.sse(final_usage(completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for request_id in open_ids:  # the client went away mid-stream: free the blocks now
                self.engine.cancel(request_id)
