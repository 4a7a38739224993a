"""Limits at the HTTP edge, before any model work.

``BodyLimits``: ASGI middleware that answers 413 to a request body over the size limit (from its
Content-Length when given, else while the body streams in: chunked uploads), before a handler
reads it all into memory, and 408 to a body that does not arrive within the client timeout (a
slow-loris body holds no more than its connection).

``HeaderDeadline``: uvicorn's HTTP protocol with a deadline on a request's headers: a connection
that has not sent a complete request within the client timeout (after it opened, or after its
last response) gets a 408 and is closed. uvicorn has none (its keep-alive timeout only closes
connections that send nothing), so a client dribbling its headers a byte at a time would hold
its connection, and a file descriptor, for as long as it likes.
"""
from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("lazy_rag.server")


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


def error_body(status: int, message: str, code: str | None) -> bytes:
    kind = "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def timeout_message(seconds: float, what: str) -> str:
    return (f"The request's {what} did not arrive within {seconds:g} s (--client-timeout); send the whole request "
            "at once, or raise the timeout.")


class BodyLimits:
    def __init__(self, app, max_bytes: int, timeout_s: float | None = None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                return await self._reply(send, 400, "The Content-Length header is not a number.", None)
            if too_big:
                return await self._reply(send, 413, self._message(int(declared)), "request_too_large")
        seen = 0
        started = False
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        body_done = False

        async def counted_receive():
            nonlocal seen, body_done
            if body_done or deadline is None:  # after the body: the wait for a disconnect has no deadline
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise BodyTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
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
                await self._reply(send, 413, self._message(seen), "request_too_large")
        except BodyTimeout:
            log.info("408: a request body did not arrive within %g s", self.timeout_s)
            if not started:
                await self._reply(send, 408, timeout_message(self.timeout_s, "body"), "request_timeout",
                                  close=True)

    def _message(self, n: int) -> str:
        return (f"The request body has {n} bytes or more; this server takes at most {self.max_bytes} "
                "(--max-body-bytes). Send fewer or shorter documents, or raise the limit.")

    @staticmethod
    async def _reply(send, status: int, message: str, code: str | None, close: bool = False) -> None:
        body = error_body(status, message, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class HeaderDeadline(AutoHTTPProtocol):
    """``header_timeout_s``: seconds a connection has to send a complete request's headers, from
    when it opened or its last response ended. Made with ``functools.partial`` as uvicorn's
    ``http`` protocol (``run.uvicorn_config``)."""

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._cycle_at_arm = None

    def _arm(self) -> None:
        self._disarm()
        self._cycle_at_arm = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.cycle is not self._cycle_at_arm or self.transport.is_closing():
            return  # a request's headers arrived in time (its body has the app's deadline)
        log.info("408: a connection sent no complete request headers within %g s", self.header_timeout_s)
        body = error_body(408, timeout_message(self.header_timeout_s, "headers"), "request_timeout")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)
