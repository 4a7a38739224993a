"""``EngineDriver``: one thread that steps the engine for every HTTP request, and hands each
request's text pieces to its event-loop coroutine.

The engine can be driven by its callers (``Engine.pieces``: each waiting thread takes steps), but
a server must not spend a thread per open connection, and must decide admission in one place. So
here one thread owns the stepping: it admits cancellations between steps, runs a step (which
advances every request in flight, so concurrent HTTP requests are batched together), then posts
the new pieces of each request to its asyncio queue with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..errors import LazyRagError, RequestFailedError

log = logging.getLogger("lazy_rag.server")


class QueueFullError(LazyRagError):
    """The admission queue is full (HTTP 429; retry later)."""


class DrainingError(LazyRagError):
    """The server is shutting down and admits no new requests (HTTP 503)."""


@dataclass
class Ticket:
    """One request as the driver tracks it: the engine's handle, how many of its pieces were
    posted, and the queue its coroutine reads ("piece" strings, then None at the end)."""

    handle: object
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0
    finished: bool = False


class EngineDriver:
    """Admission (at most ``max_queue`` requests in the engine), stepping, cancellation."""

    def __init__(self, engine, max_queue: int = 64):
        if max_queue < 1:
            raise LazyRagError(f"max_queue must be at least 1, got {max_queue}.")
        self.engine = engine
        self.max_queue = max_queue
        self.draining = False
        self._tickets: dict[int, Ticket] = {}
        self._pending: list[tuple] = []         # (future, loop, segments, options) not yet in the engine
        self._cancel: list[Ticket] = []
        self._guard = threading.Lock()          # _tickets, _pending and _cancel (not the engine)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="lazy-rag-engine", daemon=True)
        self._thread.start()

    # -- what the event loop calls ------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (queued in the engine or running)."""
        with self._guard:
            return len(self._tickets) + len(self._pending)

    async def submit(self, segments, **options) -> Ticket:
        """Admit one request; its pieces go to the calling event loop. The engine's ``submit``
        (tokenizing, checking) runs in the stepping thread just before its next step, so that
        requests arriving together are prefilled together and no HTTP thread waits on the
        engine's lock. Raises ``QueueFullError``, ``DrainingError`` or the engine's request
        errors (``LazyRagError``: the request is bad)."""
        if self.draining:
            raise DrainingError("The server is shutting down; send the request to another replica or retry later.")
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._guard:
            if len(self._tickets) + len(self._pending) >= self.max_queue:
                raise QueueFullError(f"The server is busy: {len(self._tickets) + len(self._pending)} requests are "
                                     f"in flight and the limit (--max-queue) is {self.max_queue}. Retry after a moment.")
            self._pending.append((future, loop, segments, options))
        self._wake.set()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # the client left while the request waited for admission: drop it once admitted
            future.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and self.cancel(f.result()))
            raise

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request whose client went away: the driver aborts it before its next step,
        which frees its KV pages."""
        if ticket.finished:
            return
        with self._guard:
            self._cancel.append(ticket)
        self._wake.set()

    async def pieces(self, ticket: Ticket) -> AsyncIterator[str]:
        """The request's text pieces as generated; raises the request's error, if it failed.
        Leaving early (the client disconnected, the task was cancelled) cancels the request."""
        try:
            while True:
                piece = await ticket.queue.get()
                if piece is None:
                    break
                yield piece
            if ticket.handle.error is not None:
                raise ticket.handle.error
        finally:
            if not ticket.finished:
                self.cancel(ticket)

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- the stepping thread --------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._apply_cancellations()
            self._admit_pending()
            if not engine.scheduler.has_work:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                stepped = engine.step()
            except Exception:  # the engine fails single requests itself; this is a bug: keep serving
                log.exception("engine step failed")
                stepped = False
                self._fail_all("the engine step failed; see the server log")
            self._publish()
            if not stepped:
                time.sleep(0.001)  # chunk transfers in flight

    def _admit_pending(self) -> None:
        with self._guard:
            pending, self._pending = self._pending, []
        for future, loop, segments, options in pending:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                handle = self.engine.submit(segments, **options)
            except Exception as e:  # a bad request (LazyRagError) or a bug: that request's error
                future.set_exception(e)
                continue
            ticket = Ticket(handle, loop, asyncio.Queue())
            with self._guard:
                self._tickets[handle.seq.id] = ticket
            future.set_result(ticket)

    def _apply_cancellations(self) -> None:
        with self._guard:
            cancel, self._cancel = self._cancel, []
        for t in cancel:
            self.engine.abort(t.handle)
            self._retire(t, post_end=False)

    def _publish(self) -> None:
        with self._guard:
            tickets = list(self._tickets.values())
        for t in tickets:
            h = t.handle
            new = h.pieces[t.sent:]
            t.sent += len(new)
            for piece in new:
                t.loop.call_soon_threadsafe(t.queue.put_nowait, piece)
            if h.done:
                self._retire(t, post_end=True)

    def _retire(self, t: Ticket, post_end: bool) -> None:
        t.finished = True
        with self._guard:
            self._tickets.pop(t.handle.seq.id, None)
        if post_end:
            t.loop.call_soon_threadsafe(t.queue.put_nowait, None)

    def _fail_all(self, why: str) -> None:
        with self._guard:
            tickets = list(self._tickets.values())
        for t in tickets:
            if not t.handle.done:
                self.engine.abort(t.handle)
                t.handle.error = RequestFailedError(f"Request {t.handle.seq.id} failed: {why}.")
            self._retire(t, post_end=True)

