"""``EngineReplica``: one engine (one GPU) of the Ray Serve application, the deployment the
chunk-affinity router routes to. What ``lazy-rag serve``'s engine process is to its HTTP process,
this is to the ingress replicas: it loads the model, the engine and the index (read-only, with
the replicas' shared KV folder below it: ``shared_store``), steps the engine, and streams each
request's text back; the ingress parses, tokenizes and retrieves.

The engine runs in a thread of the replica's process (``EngineDriver``): the work that made
``lazy-rag serve`` give its engine a process of its own (JSON bodies, SSE events, tokenizing)
happens in the ingress replicas here, so the replica's interpreter is left to the stepping thread
and Ray's streaming of the pieces.

``generate`` yields events, never raises for a request's own failure: ("admitted", replica id),
then ("pieces", [text, ...]) batches, then ("done", GenerationResult) or ("failed", kind,
message); or ("rejected", kind, message) instead of admission. ``kind`` names the driver's
error class (``ERRORS``), so the ingress raises the same error a local driver would. Serve calls
``check_health`` (a dead stepping thread fails it: Serve replaces the replica) and
``record_routing_stats`` (the chunks the pool holds, for the routers).
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

from ...engine.chunk_tiers import span_key
from ...errors import LazyRagError, RequestFailedError
from ..driver import ClientGoneError, DrainingError, EngineDriver, EngineUnavailableError, QueueFullError
from .affinity import RESIDENT_KEY, TAKEN_AT_KEY, VERSION_KEY, ChunkRoute
from .shared_store import share_index_store, sweep_temporary

log = logging.getLogger("lazy_rag.server.scaleout")

# the driver errors that cross from an engine replica to the ingress, by name
ERRORS = {"queue_full": QueueFullError, "draining": DrainingError, "unavailable": EngineUnavailableError,
          "client_gone": ClientGoneError, "failed": RequestFailedError, "bad_request": LazyRagError}
REPORT_LIMIT = 1 << 14   # resident chunk keys per routing-stats report (a pool of 2048-token chunks holds fewer)


def error_kind(e: LazyRagError) -> str:
    for kind, cls in ERRORS.items():
        if cls is not LazyRagError and isinstance(e, cls):
            return kind
    return "bad_request"


def error_of(kind: str, message: str) -> LazyRagError:
    return ERRORS.get(kind, RequestFailedError)(message)


class ResidentChunks:
    """The routing keys of the chunks this replica's pool holds: each admitted request's keys
    are remembered with the engine's own cache keys of its chunks (its layout's spans, in prompt
    order), and a report lists those whose pages are still in the pool."""

    def __init__(self, engine, max_keys: int = 1 << 16):
        self.engine = engine
        self.max_keys = max_keys
        self._keys: OrderedDict[str, tuple] = OrderedDict()
        self.version = 0

    def admitted(self, route: ChunkRoute, handle) -> None:
        seq = getattr(handle, "seq", None)
        spans = seq.layout.spans if seq is not None else ()
        if not route.keys or len(spans) != len(route.keys):  # prefix/full modes place no chunk spans
            return
        for key, span in zip(route.keys, spans):
            self._keys[key] = span_key(seq, span)
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        self.version += 1

    def report(self, limit: int = REPORT_LIMIT) -> list[str]:
        """The most recently used first. Read from Serve's thread while the engine steps: a dict
        lookup per key, a chunk evicted meanwhile is at worst one wrong vote."""
        pm = self.engine.pm
        out = []
        for key, engine_key in reversed(list(self._keys.items())):
            if pm.lookup(engine_key) is not None:
                out.append(key)
                if len(out) >= limit:
                    break
        return out


class EngineReplica:
    """``spec``: the ``EngineSpec`` to load (its ``index_dir`` the index to serve, read-only).
    ``max_queue``: requests in this engine at once (more get 429). ``kv_share``: the replicas'
    shared folder for KV they encode (None: ``<index>/kv-replicas``)."""

    def __init__(self, spec, max_queue: int = 64, kv_share: str | None = None):
        llm, index = spec.load(retrieve=False)
        source = None
        if index is not None:
            store = share_index_store(index, kv_share)
            removed = sweep_temporary(store.shared_dir)
            if removed:
                log.info("removed %d temporary KV files left by killed writers in %s", removed, store.shared_dir)
            source = index.chunk_source
        self.llm, self.index = llm, index
        self.driver = EngineDriver(llm.engine, max_queue, source)  # allocates the KV pool: a model too big fails here
        self.resident = ResidentChunks(llm.engine)
        self.replica_id = _replica_id()
        self._info = {"model_name": llm.model_name, "context_window": llm.context_window, "device": str(llm.device),
                      "dtype": str(llm.dtype).removeprefix("torch."), "vocab_rows": llm.host.parts.vocab_rows,
                      # what the ingress's LazyIndex.load checks against the index (it has no weights)
                      "fingerprint": llm.fingerprint if index is not None else None, "pid": os.getpid()}

    def info(self) -> dict:
        return {**self._info, "replica": self.replica_id}

    def stats(self) -> dict:
        return {**self.driver.stats(), "replica": self.replica_id, "in_flight": self.driver.in_flight}

    def check_health(self) -> None:
        if not self.driver.alive:
            raise EngineUnavailableError("The engine's stepping thread stopped; Ray Serve replaces this replica.")

    def record_routing_stats(self) -> dict:
        # taken_at: the routers keep what they sent after it (the same host's clock, or a synced one)
        taken_at = time.time()
        return {RESIDENT_KEY: self.resident.report(), VERSION_KEY: (self.replica_id, self.resident.version),
                TAKEN_AT_KEY: taken_at}

    async def generate(self, route: ChunkRoute, segments, uses_index: bool, options: dict):
        try:
            ticket = await self.driver.submit(segments, uses_index=uses_index, **options)
        except LazyRagError as e:
            yield ("rejected", error_kind(e), str(e))
            return
        self.resident.admitted(route, ticket.handle)
        yield ("admitted", self.replica_id)
        try:
            while True:
                batch = [await ticket.queue.get()]
                while not ticket.queue.empty():  # a slow consumer gets what piled up in one message
                    batch.append(ticket.queue.get_nowait())
                text = [p for p in batch if p is not None]
                if text:
                    yield ("pieces", text)
                if None in batch:
                    break
            if ticket.error is not None:
                e = ticket.error
                yield ("failed", error_kind(e) if isinstance(e, LazyRagError) else "failed", str(e))
            else:
                yield ("done", ticket.result)
        finally:
            if not ticket.finished:  # the caller went away (Serve cancelled this generator)
                self.driver.cancel(ticket)

    def __del__(self):
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests that build one directly)
        return f"local-{os.getpid()}"

