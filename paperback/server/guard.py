"""What every request passes before a route sees it: the API key, the body size, and FastAPI's validation errors
in OpenAI's words; and how a route learns that its client went away."""

from __future__ import annotations

import hmac

from fastapi import Request

from paperback.server.responses import error

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


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
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


def is_disconnect(message) -> bool:
    return message.get("type") == "http.disconnect"


async def until_disconnected(request: Request) -> None:
    while not is_disconnect(await request.receive()):
        pass
