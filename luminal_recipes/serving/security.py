"""The ASGI guards in front of every route: the API key (``Authorization: Bearer KEY`` on every route but
``/health``; compared in constant time) and the body-size limit (413 before the body is read past the limit,
whether a Content-Length announces it or a chunked body grows past it)."""

from __future__ import annotations

import hmac
import json

from fastapi import HTTPException

from .errors import error_body

OPEN_PATHS = {"/health"}


async def _send_error(send, status: int, message: str, code: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: API key, then body size."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return await _send_error(send, 401, "missing or wrong API key: send `Authorization: Bearer KEY` "
                                                    "(the key given to serve --api-key or $LUMINAL_RECIPES_API_KEY)",
                                         "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        announced = headers.get(b"content-length")
        too_large = (f"the request body is larger than this server's limit of {self.max_body:,} bytes "
                     f"(serve --max-body-bytes)")
        if announced is not None:
            try:
                if int(announced) > self.max_body:
                    return await _send_error(send, 413, too_large, "body_too_large")
            except ValueError:
                return await _send_error(send, 400, "the Content-Length header is not a number")
        seen, exceeded, replaced = 0, False, False

        async def limited_receive():
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:  # a chunked body grew past the limit: the route stops reading it
                    exceeded = True
                    raise HTTPException(413, too_large)
            return message

        async def checked_send(message):
            nonlocal replaced
            if exceeded:  # whatever the framework made of the interrupted read, the answer is 413
                if message["type"] == "http.response.start" and not replaced:
                    replaced = True
                    await _send_error(send, 413, too_large, "body_too_large")
                return
            await send(message)

        await self.app(scope, limited_receive, checked_send)
