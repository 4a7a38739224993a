"""``ProcessDriver``: the engine in its own process (``engine_worker``), as vLLM V1 runs its
engine core, so that the HTTP process's work (JSON bodies, tokenizing, SSE events) and the
engine's host-side step work no longer take turns on one interpreter lock.

The child is started with multiprocessing's "spawn" (a fresh interpreter: safe with CUDA, which
a forked child cannot use) and builds the model, engine and index from an ``EngineSpec``; this
process never loads the weights. One pipe carries requests (token ids: tokenizing stays here)
and, back, one message per engine step with every advanced request's new pieces and results. A
sender thread writes the pipe (the event loop never blocks on a full pipe while the engine is in
a long step); a receiver thread reads it and posts each step's pieces to the event loop in one
call. If the child dies, every request in flight ends with ``EngineUnavailableError`` (503), new
ones are refused with it, and ``alive`` turns False (``/ready`` 503).
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import queue
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ..errors import LazyRagError, RequestFailedError
from . import engine_worker
from .driver import ClientGoneError, Driver, EngineUnavailableError, Ticket, post
from .engine_spec import EngineSpec

log = logging.getLogger("lazy_rag.server")


@dataclass
class RemoteTicket(Ticket):
    rid: int = 0
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    abort_sent: bool = False


class ProcessDriver(Driver):
    """Starts the engine process and waits until it has loaded the model (raises the child's
    error, e.g. an unknown model, if it could not). ``info``: what the child reported (model
    name, context window, device, dtype, vocabulary rows, fingerprint, pid)."""

    def __init__(self, spec: EngineSpec, max_queue: int = 64):
        super().__init__(max_queue)
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # this is an engine process re-running the main script that started it (spawn does)
            raise LazyRagError("The script that starts the server ran again in the engine process: start the "
                               "server under `if __name__ == \"__main__\":` (the engine process imports the "
                               "main script), or pass ServerSettings(engine_process=False).")
        self.spec = spec
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=engine_worker.main, args=(child_conn, spec), name="lazy-rag-engine",
                                   daemon=True)
        self.process.start()
        child_conn.close()  # only the child holds its end now: its death reads as end-of-file here
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_child(5.0)
            self._conn.close()
            raise
        self._tickets: dict[int, RemoteTicket] = {}
        self._ids = itertools.count()
        self._stats_waiters: dict[int, concurrent.futures.Future] = {}
        self._guard = threading.Lock()  # _tickets, _stats_waiters, _alive
        self._alive = True
        self._closing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="lazy-rag-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="lazy-rag-engine-receive", daemon=True)
        self._sender.start()
        self._receiver.start()
        # multiprocessing's own exit hook would terminate (SIGTERM, which the child ignores) and
        # then join forever; this one, registered later, runs first and ends the child cleanly
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close(2.0))

    def _wait_ready(self) -> dict:
        while True:
            ready = wait([self._conn, self.process.sentinel])
            if self._conn in ready:
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    kind, payload = None, None
                if kind == "ready":
                    return payload
                if kind == "failed":
                    if isinstance(payload, LazyRagError):
                        raise payload
                    raise LazyRagError(f"The engine process could not load the model ({type(payload).__name__}: "
                                       f"{payload}); the log above has the traceback.")
            if not self.process.is_alive():
                self.process.join(1.0)
                raise LazyRagError(f"The engine process exited (code {self.process.exitcode}) while loading the "
                                   "model; the log above says why (common causes: out of memory, or a script "
                                   "that starts the server outside `if __name__ == \"__main__\":`).")

    # -- the interface ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        with self._guard:
            return len(self._tickets)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def engine_pid(self) -> int | None:
        return self.process.pid

    async def submit(self, segments, *, uses_index: bool = False, **options) -> RemoteTicket:
        """Send one request (token segments) to the engine; returns once the engine admitted it,
        or raises its refusal (``LazyRagError``: the request is bad), ``QueueFullError``,
        ``DrainingError`` or ``EngineUnavailableError``."""
        loop = asyncio.get_running_loop()
        with self._guard:
            self.check_admission(len(self._tickets))
            ticket = RemoteTicket(loop, asyncio.Queue(), rid=next(self._ids))
            self._tickets[ticket.rid] = ticket
        self._outbox.put(("submit", ticket.rid, segments, uses_index, options))
        try:
            return await asyncio.wrap_future(ticket.admitted)
        except asyncio.CancelledError:  # the client left while the request waited for admission
            self.cancel(ticket)
            raise

    def cancel(self, ticket: RemoteTicket) -> None:
        """Abort a request in the engine (its KV pages are freed there); the ticket ends when the
        engine confirms, so ``in_flight`` counts it until its pages are free."""
        if ticket.finished or ticket.abort_sent:
            return
        ticket.abort_sent = True
        self._outbox.put(("abort", ticket.rid))

    def stats(self, timeout: float = 30.0) -> dict:
        """The engine's counters, asked of the engine process (answered between two steps)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._guard:
            if not self._alive:
                raise EngineUnavailableError("The engine process is not running; it has no counters.")
            token = next(self._ids)
            self._stats_waiters[token] = fut
        self._outbox.put(("stats", token))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise LazyRagError(f"The engine process did not report its counters within {timeout:g} s "
                               "(a long step, or it is stuck; see the server log).") from None
        finally:
            with self._guard:
                self._stats_waiters.pop(token, None)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process: it aborts what it still runs and exits (killed if it does not
        within ``timeout`` seconds)."""
        if self._closing:
            return
        self._closing = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # ends the sender after the shutdown message
        self._sender.join(timeout)
        self._stop_child(timeout)
        self._receiver.join(timeout)  # it reads the child's end-of-file and ends the requests left
        self._conn.close()

    def _stop_child(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not exit within %g s; killing it", timeout)
            self.process.kill()
            self.process.join(5.0)

    # -- the two threads ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, EOFError, ValueError):  # the child is gone: the receiver reports it
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                if not wait([self._conn, self.process.sentinel], 1.0):
                    continue
                if not self._conn.poll():  # the child exited and left nothing unread
                    break
                msg = self._conn.recv()
            except (EOFError, OSError, ValueError):
                break
            if msg[0] == "events":
                self._dispatch(msg[1])
            elif msg[0] == "stats":
                with self._guard:
                    fut = self._stats_waiters.get(msg[1])
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])
        self._engine_gone()

    def _dispatch(self, events: list[tuple]) -> None:
        out = []
        with self._guard:
            for rid, kind, payload in events:
                t = self._tickets.get(rid)
                if t is None:
                    continue
                if kind == "pieces":
                    out.extend((t, piece) for piece in payload)
                    continue
                if kind == "admitted":
                    if not t.admitted.done():  # done: cancelled while it waited (the abort follows)
                        t.admitted.set_result(t)
                    continue
                # the request's end: rejected, done, failed or aborted
                del self._tickets[rid]
                t.finished = True
                if kind == "rejected":
                    if not t.admitted.done():
                        t.admitted.set_exception(payload)
                    continue
                if kind == "done":
                    t.result = payload
                elif kind == "failed":
                    t.error = RequestFailedError(payload)
                else:
                    t.error = ClientGoneError("The client disconnected; the request was dropped.")
                out.append((t, None))
        if out:
            post(out)

    def _engine_gone(self) -> None:
        """The pipe closed: expected after ``close``; otherwise the child died. Either way every
        open request ends (503) and no new one is admitted."""
        self.process.join(1.0)
        with self._guard:
            self._alive = False
            tickets, self._tickets = list(self._tickets.values()), {}
            waiters = list(self._stats_waiters.values())
        if not self._closing:
            log.error("the engine process died (exit code %s); %d requests in flight fail with 503 and /ready "
                      "answers 503 until the server is restarted", self.process.exitcode, len(tickets))
        err = EngineUnavailableError("The engine process stopped while this request was in flight"
                                     + ("" if self._closing else " (it died; see the server log)") + ".")
        out = []
        for t in tickets:
            t.finished = True
            if not t.admitted.done():
                t.admitted.set_exception(err)
            else:
                t.error = err
                out.append((t, None))
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)
        if out:
            post(out)
