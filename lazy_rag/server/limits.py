"""``BodySizeLimit``: ASGI middleware that answers 413 to a request body over the limit, from its
Content-Length when given, else while the body streams in (chunked uploads), before a handler
reads it all into memory."""
from __future__ import annotations

import json


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                return await self._reply(send, 400, "The Content-Length header is not a number.")
            if too_big:
                return await self._reply(send, 413, self._message(int(declared)))
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._reply(send, 413, self._message(seen))

    def _message(self, n: int) -> str:
        return (f"The request body has {n} bytes or more; this server takes at most {self.max_bytes} "
                "(--max-body-bytes). Send fewer or shorter documents, or raise the limit.")

    @staticmethod
    async def _reply(send, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large" if status == 413 else None}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
