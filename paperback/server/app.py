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

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

import paperback
from paperback.server.async_engine import AsyncEngine
from paperback.server.guard import RequestGuard, validation_message
from paperback.server.responses import error
from paperback.server.routes_chat import chat_routes
from paperback.server.routes_completions import completion_routes
from paperback.server.routes_info import info_routes
from paperback.server.serving import Serving

log = logging.getLogger("paperback.server")


def create_app(engine: AsyncEngine, model_name: str, default_max_tokens: int = 256, api_key: str | None = None,
               max_body_bytes: int = 4 * 2 ** 20) -> FastAPI:
    app = FastAPI(title="paperback", version=paperback.__version__)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)
    serving = Serving(engine, model_name, default_max_tokens)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
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

    for routes in (info_routes, completion_routes, chat_routes):
        app.include_router(routes(serving))
    return app
