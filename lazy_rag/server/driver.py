"""The engine drivers' one interface, and ``EngineDriver``: the engine in this process, stepped
by one thread.

A driver admits requests (at most ``max_queue`` at once), gives each a ``Ticket`` whose asyncio
queue receives the request's text pieces (then None), cancels requests whose clients left, and
reports the engine's counters. ``EngineDriver`` runs the engine here; ``ProcessDriver``
(``engine_process``) runs it in a child process. The routes see only this interface.

The engine can be driven by its callers (``Engine.pieces``: each waiting thread takes steps), but
a server must not spend a thread per open connection, and must decide admission in one place. So
here one thread owns the stepping: it admits cancellations between steps, runs a step (which
advances every request in flight, so concurrent HTTP requests are batched together), then posts
the step's new pieces to the event loop in one call (``call_soon_threadsafe``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..errors import LazyRagError, RequestFailedError
from .engine_worker import step_engine

log = logging.getLogger("lazy_rag.server")


class QueueFullError(LazyRagError):
    """The admission queue is full (HTTP 429; retry later)."""


class DrainingError(LazyRagError):
    """The server is shutting down and admits no new requests (HTTP 503)."""


class EngineUnavailableError(LazyRagError):
    """The engine is gone (its process died): HTTP 503, and /ready says so."""


class ClientGoneError(LazyRagError):
    """The request was dropped because its client disconnected (nobody reads the answer)."""


class TokenLogprobs(list):
    """A step's per-token log-probabilities of one request (``Engine.submit(logprobs=k)``'s
    entries: (token id, logprob, [(id, logprob)] top k)), queued before that step's pieces:
    ``Driver.pieces`` moves them to ``Ticket.logprobs``, so that a piece read has its tokens'."""


@dataclass
class Ticket:
    """One request as a driver tracks it: the queue its coroutine reads ("piece" strings, and
    ``TokenLogprobs`` when it asked for logprobs, then None at the end), its result or error once
    done, and whether the driver is done with it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    result: object = None           # GenerationResult
    error: Exception | None = None
    finished: bool = False
    logprobs: list = field(default_factory=list)  # the entries read so far (logprobs requests)


def post(deliveries: list[tuple[Ticket, object]]) -> None:
    """Hand (ticket, piece or None) pairs to their event loops: one wake-up per loop per step,
    not one per piece (at 64 streams, 64 cross-thread wake-ups a step cost the loop more than
    the pieces)."""
    by_loop: dict = defaultdict(list)
    for t, item in deliveries:
        by_loop[t.loop].append((t.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed (the server stopped): nobody reads these queues
            pass


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class Driver:
    """What both drivers share: the admission count, draining, and reading a ticket's pieces."""

    def __init__(self, max_queue: int):
        if max_queue < 1:
            raise LazyRagError(f"max_queue must be at least 1, got {max_queue}.")
        self.max_queue = max_queue
        self.draining = False

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (queued in the engine or running)."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """False once the engine cannot serve (its process died)."""
        raise NotImplementedError

    @property
    def restarting(self) -> bool:
        """True while a dead engine is being replaced (``alive`` is False meanwhile)."""
        return False

    @property
    def engine_pid(self) -> int | None:
        """The engine's process id when it runs in its own process."""
        return None

    def unavailable_reason(self) -> str:
        """What a request refused because the engine is not ``alive`` is told."""
        return ("The engine is not running (see the server log); this server cannot answer until it is restarted. "
                "Send the request to another replica.")

    def stats(self) -> dict:
        """The engine's counters (``Engine.stats``)."""
        raise NotImplementedError

    def cancel(self, ticket: Ticket) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def check_admission(self, in_flight: int) -> None:
        if self.draining:
            raise DrainingError("The server is shutting down; send the request to another replica or retry later.")
        if not self.alive:
            raise EngineUnavailableError(self.unavailable_reason())
        if in_flight >= self.max_queue:
            raise QueueFullError(f"The server is busy: {in_flight} requests are in flight and the limit "
                                 f"(--max-queue) is {self.max_queue}. Retry after a moment.")

    async def pieces(self, ticket: Ticket) -> AsyncIterator[str]:
        """The request's text pieces as generated; raises the request's error, if it failed.
        Leaving early (the client disconnected, the task was cancelled) cancels the request."""
        try:
            while True:
                piece = await ticket.queue.get()
                if piece is None:
                    break
                if isinstance(piece, TokenLogprobs):
                    ticket.logprobs.extend(piece)
                    continue
                yield piece
            if ticket.error is not None:
                raise ticket.error
        finally:
            if not ticket.finished:
                self.cancel(ticket)


@dataclass
class LocalTicket(Ticket):
    handle: object = None  # the engine's RequestHandle
    sent: int = 0
    logprobs_sent: int = 0


class EngineDriver(Driver):
    """The engine in this process: admission, stepping, cancellation. ``index_source``: the
    served index's ``chunk_source`` (requests with ``uses_index`` read their chunks from it)."""

    def __init__(self, engine, max_queue: int = 64, index_source=None):
        super().__init__(max_queue)
        self.engine = engine
        self.index_source = index_source
        self._tickets: dict[int, LocalTicket] = {}
        self._pending: list[tuple] = []         # (future, loop, segments, options) not yet in the engine
        self._cancel: list[LocalTicket] = []
        self._guard = threading.Lock()          # _tickets, _pending and _cancel (not the engine)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="lazy-rag-engine", daemon=True)
        self._thread.start()

    # -- what the event loop calls ------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        with self._guard:
            return len(self._tickets) + len(self._pending)

    @property
    def alive(self) -> bool:
        # a tensor-parallel engine whose rank died serves nothing more (Engine.failure); this
        # driver has no process to restart, so the server stays unavailable
        return self._thread.is_alive() and self.engine.failure() is None

    def stats(self) -> dict:
        return self.engine.stats()

    async def submit(self, segments, *, uses_index: bool = False, **options) -> LocalTicket:
        """Admit one request; its pieces go to the calling event loop. The engine's ``submit``
        (assembling, checking) runs in the stepping thread just before its next step, so that
        requests arriving together are prefilled together and no HTTP thread waits on the
        engine's lock. Raises ``QueueFullError``, ``DrainingError`` or the engine's request
        errors (``LazyRagError``: the request is bad)."""
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        options["source"] = self.index_source if uses_index else None
        with self._guard:
            self.check_admission(len(self._tickets) + len(self._pending))
            self._pending.append((future, loop, segments, options))
        self._wake.set()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # the client left while the request waited for admission: drop it once admitted
            future.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and self.cancel(f.result()))
            raise

    def cancel(self, ticket: LocalTicket) -> None:
        """Drop a request whose client went away: the driver aborts it before its next step,
        which frees its KV pages."""
        if ticket.finished:
            return
        with self._guard:
            self._cancel.append(ticket)
        self._wake.set()

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
            stepped = step_engine(engine, self._fail_all)
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
            ticket = LocalTicket(loop, asyncio.Queue(), handle=handle)
            with self._guard:
                self._tickets[handle.seq.id] = ticket
            future.set_result(ticket)

    def _apply_cancellations(self) -> None:
        with self._guard:
            cancel, self._cancel = self._cancel, []
        ended = []
        for t in cancel:
            if t.finished:  # done before its cancellation came
                continue
            self.engine.abort(t.handle)
            t.error = ClientGoneError("The client disconnected; the request was dropped.")
            self._retire(t)
            ended.append((t, None))  # a coroutine still waiting (a whole answer) ends too
        if ended:
            post(ended)

    def _publish(self) -> None:
        with self._guard:
            tickets = list(self._tickets.values())
        out = []
        for t in tickets:
            h = t.handle
            if h.logprobs is not None and len(h.logprobs) > t.logprobs_sent:
                out.append((t, TokenLogprobs(h.logprobs[t.logprobs_sent:])))
                t.logprobs_sent = len(h.logprobs)
            new = h.pieces[t.sent:]
            t.sent += len(new)
            out.extend((t, piece) for piece in new)
            if h.done:
                t.result, t.error = h.result, h.error
                self._retire(t)
                out.append((t, None))
        if out:
            post(out)

    def _retire(self, t: LocalTicket) -> None:
        t.finished = True
        with self._guard:
            self._tickets.pop(t.handle.seq.id, None)

    def _fail_all(self, why: str) -> None:
        with self._guard:
            tickets = list(self._tickets.values())
        for t in tickets:
            if not t.handle.done:
                self.engine.abort(t.handle)
                t.handle.error = RequestFailedError(f"Request {t.handle.seq.id} failed: {why}.")
        # _publish (next) posts their ends
