"""/health, /version, /v1/models, /metrics, /tokenize and /detokenize (vLLM's routes beside OpenAI's)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

import paperback
from paperback.errors import PaperbackError
from paperback.server.protocol import DetokenizeRequest, TokenizeRequest
from paperback.server.responses import error
from paperback.server.serving import Serving


def info_routes(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/version")
    async def version():
        return {"version": paperback.__version__}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": 0,
                                              "owned_by": "paperback", "max_model_len": s.engine.max_model_len}]}

    @router.get("/metrics")
    async def metrics():  # the engine thread updates them after every step and while idle
        return Response(s.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (refused := s.wrong_model(body.model)) is not None:
            return refused
        try:
            if body.messages is not None:
                ids = await s.chat_prompt(body.messages, body.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(s.tokenizer.encode, body.prompt, body.add_special_tokens)
        except PaperbackError as exc:
            return error(400, str(exc))
        return {"count": len(ids), "max_model_len": s.engine.max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if (refused := s.wrong_model(body.model)) is not None:
            return refused
        if any(t >= s.engine.vocab_size for t in body.tokens):
            return error(400, f"token ids must be in [0, {s.engine.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(s.tokenizer.decode, body.tokens, False)}

    return router
