"""The engine process (vLLM V1's "engine core"): it loads the model, the engine and the index
from an ``EngineSpec`` and steps the engine, talking to the HTTP process over one pipe.

In: ("submit", id, token segments, uses_index, options), ("abort", id), ("stats", token),
("shutdown",). Out: ("ready", info) or ("failed", error) once; then ("events", [(id, kind,
payload), ...]) at most twice per loop turn (admissions before the step, the step's output after
it), so the pipe carries one message per step, not one per token per request; and ("stats",
token, Engine.stats()) on request. Event kinds: admitted, rejected (the exception), logprobs (the
step's new per-token logprobs, for requests that asked), pieces (the step's new text pieces),
done (the ``GenerationResult``), failed (the message), aborted.

The HTTP process owns this process's lifetime: SIGINT (a terminal's Ctrl-C reaches the whole
process group) and SIGTERM (a service manager may signal every process of the service) are
ignored, so that the server can drain first; "shutdown" or the pipe closing (the server died)
ends it.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time

from ..errors import LazyRagError, RequestFailedError
from ..threads import configure_threads

log = logging.getLogger("lazy_rag.server.engine")

ENGINE_FAILED_EXIT = 3   # (the supervisor restarts on any exit; the code tells the log why)


def portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (to be raised in the HTTP process), else its type and text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        cls = LazyRagError if isinstance(e, LazyRagError) else RuntimeError
        return cls(f"{type(e).__name__}: {e}")


def main(conn, spec) -> None:
    """The child process's entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [lazy-rag engine] %(name)s: %(message)s")
    try:
        configure_threads()  # the count the server's command chose ($LAZY_RAG_THREADS), before any torch work
        llm, index = spec.load(retrieve=False)
        engine = llm.engine  # allocates the KV pool: a model that does not fit fails here, not later
        info = {"model_name": llm.model_name, "context_window": llm.context_window, "device": str(llm.device),
                "dtype": str(llm.dtype).removeprefix("torch."), "vocab_rows": llm.host.parts.vocab_rows,
                # what the HTTP process's LazyIndex.load checks against the index (it has no weights)
                "fingerprint": llm.fingerprint if index is not None else None, "pid": os.getpid()}
    except Exception as e:
        if not isinstance(e, LazyRagError):  # a bug or an environment problem: the traceback helps
            log.exception("the engine process could not load the model")
        _send(conn, ("failed", portable(e)))
        return
    if _send(conn, ("ready", info)):
        failure = EngineLoop(engine, conn, index.chunk_source if index is not None else None).run()
        if failure is not None:   # the HTTP process sees the pipe close: its supervisor restarts this process
            log.error("the engine cannot serve any more (%s); the engine process exits", failure)
            conn.close()   # now, not after the exit hooks (which wait for the surviving ranks)
            sys.exit(ENGINE_FAILED_EXIT)


def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except (OSError, EOFError):  # the HTTP process is gone
        return False


def step_engine(engine, fail_all) -> bool:
    """One engine step for a server's stepping loop (the engine process's and the in-process
    driver's); True if it made progress. The engine fails single requests itself, so an exception
    here is a bug: every request in flight fails with ``fail_all(why)`` and the loop keeps serving."""
    try:
        return engine.step()
    except Exception:
        log.exception("engine step failed")
        fail_all("the engine step failed; see the server log")
        return False


class EngineLoop:
    """Reads the inbox between steps, steps while there is work, posts each step's output."""

    def __init__(self, engine, conn, index_source=None):
        self.engine, self.conn, self.index_source = engine, conn, index_source
        self.handles: dict[int, list] = {}  # request id -> [RequestHandle, pieces sent, logprobs sent]
        self.events: list[tuple] = []

    def run(self) -> "Exception | None":
        """Serve until the HTTP process says stop or goes (None), or the engine fails as a whole
        (``Engine.failure``: a tensor-parallel rank died), which is returned after the requests in
        flight have been failed with it and sent."""
        engine = self.engine
        while True:
            failure = engine.failure()
            if failure is not None:
                return self._fail_engine(failure)
            if not self._read_inbox(block=not engine.scheduler.has_work):
                break
            if not self._flush():  # admissions go out before the step: the clients' headers do not wait on it
                break
            if not engine.scheduler.has_work:
                continue
            stepped = step_engine(engine, self._fail_all)
            self._collect()
            if not self._flush():
                break
            if not stepped:
                time.sleep(0.001)  # chunk transfers in flight
        for h, *_ in self.handles.values():
            engine.abort(h)
        return None

    def _fail_engine(self, failure: Exception) -> Exception:
        # a step on a broken TP engine fails every request it holds with the rank's error
        # (TPEngine.step); aborting instead would try to reach the dead rank
        if self.engine.scheduler.has_work:
            step_engine(self.engine, self._fail_all)
        self._collect()
        self._flush()
        return failure

    def _read_inbox(self, block: bool) -> bool:
        """Handle every message waiting (waiting up to 0.5 s for one when idle); False to stop."""
        try:
            if not self.conn.poll(0.5 if block else 0):
                return True
            while True:
                if not self._handle(self.conn.recv()):
                    return False
                if not self.conn.poll(0):
                    return True
        except (EOFError, OSError):  # the HTTP process closed the pipe or died
            return False

    def _handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "submit":
            _, rid, segments, uses_index, options = msg
            try:
                handle = self.engine.submit(segments, source=self.index_source if uses_index else None, **options)
            except Exception as e:  # a bad request (LazyRagError) or a bug: that request's error
                if not isinstance(e, LazyRagError):
                    log.exception("submitting request %s failed", rid)
                self.events.append((rid, "rejected", portable(e)))
            else:
                self.handles[rid] = [handle, 0, 0]
                self.events.append((rid, "admitted", None))
        elif kind == "abort":
            entry = self.handles.pop(msg[1], None)
            if entry is not None:
                self.engine.abort(entry[0])  # frees its KV pages
            self.events.append((msg[1], "aborted", None))
        elif kind == "stats":
            return _send(self.conn, ("stats", msg[1], self.engine.stats()))
        elif kind == "shutdown":
            return False
        return True

    def _collect(self) -> None:
        for rid, entry in list(self.handles.items()):
            h, sent, lp_sent = entry
            if h.logprobs is not None and len(h.logprobs) > lp_sent:
                self.events.append((rid, "logprobs", h.logprobs[lp_sent:]))
                entry[2] = len(h.logprobs)
            if len(h.pieces) > sent:
                self.events.append((rid, "pieces", h.pieces[sent:]))
                entry[1] = len(h.pieces)
            if h.done:
                del self.handles[rid]
                if h.error is not None:
                    self.events.append((rid, "failed", str(h.error)))
                else:
                    self.events.append((rid, "done", h.result))

    def _fail_all(self, why: str) -> None:
        for rid, (h, *_) in self.handles.items():
            if not h.done:
                self.engine.abort(h)
                h.error = RequestFailedError(f"Request {rid} failed: {why}.")

    def _flush(self) -> bool:
        if not self.events:
            return True
        events, self.events = self.events, []
        return _send(self.conn, ("events", events))
