"""``ProcessDriver``: the engine in its own process (``engine_worker``), as vLLM V1 runs its
engine core, so that the HTTP process's work (JSON bodies, tokenizing, SSE events) and the
engine's host-side step work no longer take turns on one interpreter lock.

The child is started with multiprocessing's "spawn" (a fresh interpreter: safe with CUDA, which
a forked child cannot use) and builds the model, engine and index from an ``EngineSpec``; this
process never loads the weights. One pipe carries requests (token ids: tokenizing stays here)
and, back, one message per engine step with every advanced request's new pieces and results. A
sender thread writes the pipe (the event loop never blocks on a full pipe while the engine is in
a long step); a receiver thread reads it and posts each step's pieces to the event loop in one
call.

If the child dies, every request in flight ends with ``EngineUnavailableError`` (503), new ones
are refused with it and ``alive`` turns False (``/ready`` 503) while a supervisor thread starts
a new child (``RestartPolicy``: bounded attempts, growing waits); once it has loaded the model,
``alive`` is True again. A child that keeps dying exhausts the attempts: the server then stays
unavailable (503) until it is restarted.
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
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ..errors import LazyRagError, RequestFailedError
from . import engine_worker
from .driver import ClientGoneError, Driver, EngineUnavailableError, Ticket, TokenLogprobs, post
from .engine_spec import EngineSpec

log = logging.getLogger("lazy_rag.server")


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine process is replaced: at most ``attempts`` starts in a row (0: never),
    waiting ``backoff_s`` before the first and twice as long before each next one, up to
    ``max_backoff_s``. A child that served ``stable_s`` seconds before it died starts the count
    again; one that dies sooner (a crash loop) counts against it, as does a start that fails."""

    attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self):
        if self.attempts < 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s or self.stable_s < 0:
            raise LazyRagError(f"Invalid engine restart policy {self}: attempts >= 0, 0 <= backoff_s <= "
                               "max_backoff_s, stable_s >= 0.")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before start number ``attempt`` (0-based) of a run of restarts."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt)


@dataclass
class RemoteTicket(Ticket):
    rid: int = 0
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    abort_sent: bool = False
    child: "EngineChild | None" = None  # the engine process it was sent to


class EngineChild:
    """One engine process, its pipe, and the outbox its sender thread writes to the pipe. Starts
    the process and waits until it has loaded the model (raises the child's error if it could
    not); ``info``: what it reported."""

    def __init__(self, spec: EngineSpec):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=engine_worker.main, args=(child_conn, spec), name="lazy-rag-engine",
                                   daemon=True)
        self.process.start()
        child_conn.close()  # only the child holds its end now: its death reads as end-of-file here
        try:
            self.info = self._wait_ready()
        except BaseException:
            self.stop(5.0)
            self.conn.close()
            raise
        self.started = time.monotonic()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender: threading.Thread | None = None
        self.receiver: threading.Thread | None = None

    def _wait_ready(self) -> dict:
        while True:
            ready = wait([self.conn, self.process.sentinel])
            if self.conn in ready:
                try:
                    kind, payload = self.conn.recv()
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

    def send_loop(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):  # the child is gone: the receiver reports it
                return

    def stop(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not exit within %g s; killing it", timeout)
            self.process.kill()
            self.process.join(5.0)


class ProcessDriver(Driver):
    """Starts the engine process and waits until it has loaded the model (raises the child's
    error, e.g. an unknown model, if it could not: the first start is not retried). ``info``:
    what the child reported (model name, context window, device, dtype, vocabulary rows,
    fingerprint, pid). ``restart``: how a child that dies later is replaced."""

    def __init__(self, spec: EngineSpec, max_queue: int = 64, restart: RestartPolicy = RestartPolicy()):
        super().__init__(max_queue)
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # this is an engine process re-running the main script that started it (spawn does)
            raise LazyRagError("The script that starts the server ran again in the engine process: start the "
                               "server under `if __name__ == \"__main__\":` (the engine process imports the "
                               "main script), or pass ServerSettings(engine_process=False).")
        self.spec, self.restart = spec, restart
        self._child = EngineChild(spec)
        self.info = self._child.info
        self._tickets: dict[int, RemoteTicket] = {}
        self._ids = itertools.count()
        self._stats_waiters: dict[int, tuple[concurrent.futures.Future, EngineChild]] = {}
        self._guard = threading.Lock()  # _tickets, _stats_waiters, _alive, _child, _restarting
        self._alive = True
        self._restarting = False
        self._closing = threading.Event()
        self._attempts = 0   # starts in the current run of restarts (RestartPolicy)
        self.restarts = 0    # children started after the first
        self._run_child(self._child)
        # multiprocessing's own exit hook would terminate (SIGTERM, which the child ignores) and
        # then join forever; this one, registered later, runs first and ends the child cleanly
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close(2.0))

    def _run_child(self, child: EngineChild) -> None:
        child.sender = threading.Thread(target=child.send_loop, name="lazy-rag-engine-send", daemon=True)
        child.receiver = threading.Thread(target=self._receive_loop, args=(child,), name="lazy-rag-engine-receive",
                                          daemon=True)
        child.sender.start()
        child.receiver.start()

    # -- the interface ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        with self._guard:
            return len(self._tickets)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def restarting(self) -> bool:
        return self._restarting

    @property
    def engine_pid(self) -> int | None:
        return self._child.process.pid

    def unavailable_reason(self) -> str:
        if self._restarting:
            return ("The engine process died and is being restarted; retry in a few seconds (GET /ready answers "
                    "200 again once it is back).")
        return super().unavailable_reason()

    async def submit(self, segments, *, uses_index: bool = False, **options) -> RemoteTicket:
        """Send one request (token segments) to the engine; returns once the engine admitted it,
        or raises its refusal (``LazyRagError``: the request is bad), ``QueueFullError``,
        ``DrainingError`` or ``EngineUnavailableError``."""
        loop = asyncio.get_running_loop()
        with self._guard:
            self.check_admission(len(self._tickets))
            ticket = RemoteTicket(loop, asyncio.Queue(), rid=next(self._ids), child=self._child)
            self._tickets[ticket.rid] = ticket
        ticket.child.outbox.put(("submit", ticket.rid, segments, uses_index, options))
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
        ticket.child.outbox.put(("abort", ticket.rid))

    def stats(self, timeout: float = 30.0) -> dict:
        """The engine's counters, asked of the engine process (answered between two steps)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._guard:
            if not self._alive:
                raise EngineUnavailableError("The engine process is not running; it has no counters.")
            token = next(self._ids)
            child = self._child
            self._stats_waiters[token] = (fut, child)
        child.outbox.put(("stats", token))
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
        within ``timeout`` seconds). A restart under way is abandoned."""
        if self._closing.is_set():
            return
        with self._guard:
            self._closing.set()
            child = self._child
        child.outbox.put(("shutdown",))
        child.outbox.put(None)  # ends the sender after the shutdown message
        child.sender.join(timeout)
        child.stop(timeout)
        child.receiver.join(timeout)  # it reads the child's end-of-file and ends the requests left
        child.conn.close()

    # -- the receiver thread ------------------------------------------------------------------------
    def _receive_loop(self, child: EngineChild) -> None:
        while True:
            try:
                if not wait([child.conn, child.process.sentinel], 1.0):
                    continue
                if not child.conn.poll():  # the child exited and left nothing unread
                    break
                msg = child.conn.recv()
            except (EOFError, OSError, ValueError):
                break
            if msg[0] == "events":
                self._dispatch(msg[1])
            elif msg[0] == "stats":
                with self._guard:
                    fut = self._stats_waiters.get(msg[1], (None,))[0]
                if fut is not None and not fut.done():
                    fut.set_result(msg[2])
        self._engine_gone(child)

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
                if kind == "logprobs":
                    out.append((t, TokenLogprobs(payload)))
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

    def _engine_gone(self, child: EngineChild) -> None:
        """The pipe closed: expected after ``close``; otherwise the child died. Either way every
        request it held ends (503); a death (not a close) starts the supervisor."""
        child.process.join(1.0)
        child.outbox.put(None)  # its sender, if still waiting for a message
        with self._guard:
            closing = self._closing.is_set()
            self._alive = False
            if not closing:
                self._restarting = self._attempts_left(time.monotonic() - child.started)
            tickets = [t for t in self._tickets.values() if t.child is child]
            for t in tickets:
                del self._tickets[t.rid]
            waiters = [f for f, c in self._stats_waiters.values() if c is child]
        if not closing:
            log.error("the engine process died (exit code %s); %d requests in flight fail with 503%s",
                      child.process.exitcode, len(tickets),
                      "; it is being restarted" if self._restarting else
                      " and /ready answers 503 until the server is restarted")
            child.conn.close()
        err = EngineUnavailableError("The engine process stopped while this request was in flight"
                                     + ("" if closing else " (it died; see the server log); retry it") + ".")
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
        if self._restarting:
            threading.Thread(target=self._supervise, name="lazy-rag-engine-restart", daemon=True).start()

    # -- the supervisor -----------------------------------------------------------------------------
    def _attempts_left(self, uptime: float) -> bool:
        if uptime >= self.restart.stable_s:
            self._attempts = 0  # it served a while: a new run of restarts
        return self._attempts < self.restart.attempts

    def _supervise(self) -> None:
        """Start a new engine process, waiting longer after each failure, until one loads the
        model or the attempts are spent; then admit requests again (or stay unavailable)."""
        while True:
            attempt = self._attempts
            if attempt >= self.restart.attempts:
                log.error("the engine process could not be restarted (%d attempts); the server answers 503 until "
                          "it is restarted", attempt)
                self._restarting = False
                return
            delay = self.restart.delay(attempt)
            log.warning("restarting the engine process in %.1f s (attempt %d of %d)", delay, attempt + 1,
                        self.restart.attempts)
            self._attempts += 1
            if self._closing.wait(delay):
                return
            try:
                child = EngineChild(self.spec)
            except Exception as e:  # the log has its cause (a LazyRagError names it)
                log.error("starting the engine process failed: %s", e)
                continue
            with self._guard:
                if self._closing.is_set():
                    closing = True
                else:
                    closing = False
                    self._child = child
                    self.restarts += 1
            if closing:
                child.outbox.put(("shutdown",))
                child.outbox.put(None)
                child.send_loop()
                child.stop(10.0)
                child.conn.close()
                return
            self._run_child(child)
            with self._guard:
                self._alive, self._restarting = True, False
            log.warning("the engine process is back (pid %s); admitting requests again", child.process.pid)
            return
