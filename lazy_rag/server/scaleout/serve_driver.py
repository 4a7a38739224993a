"""The ingress side of the Ray Serve application: ``ServeDriver``, the server's driver interface
(``driver.Driver``) over the engine deployment's handle, and ``ServeEngines``, what
``create_app`` is given in place of a model so that the same FastAPI app as `lazy-rag serve`
runs in every ingress replica.

A request's chunks become its ``ChunkRoute`` here (an index chunk's id, else a hash of its token
ids; its length in tokens), the first argument of ``EngineReplica.generate``, which the
deployment's ``ChunkAffinityRouter`` reads to pick the replica. The replica's events come back
through Serve's streaming response and are posted to the ticket's queue as a local driver posts
them, so the routes, their errors and their cancellation are the same code as `lazy-rag serve`'s.

Errors: the replica's own (429 queue full, 503 draining, a failed request) come back as events
and are raised as the same classes; a replica that dies mid-request (Ray's actor errors) is a
503 ``engine_unavailable`` that a client retries (Serve routes the retry to a live replica and
starts a replacement); Serve's back-pressure (``max_queued_requests``) is a 429.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from dataclasses import dataclass

from . import require_ray

require_ray()

from ray.exceptions import RayActorError, TaskCancelledError  # noqa: E402
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError  # noqa: E402

from ...errors import LazyRagError, RequestFailedError  # noqa: E402
from ...segments import Chunk  # noqa: E402
from ..driver import ClientGoneError, Driver, EngineUnavailableError, QueueFullError, Ticket  # noqa: E402
from ..remote_model import RemoteModel  # noqa: E402
from .affinity import ChunkRoute  # noqa: E402
from .engine_replica import error_of  # noqa: E402

log = logging.getLogger("lazy_rag.server.scaleout")


def route_key(chunk: Chunk, salt: str = "") -> str:
    """A chunk's routing key: 16 hex digits of a hash of its index id, else of its token ids and
    the request's cache salt, as the engine keys it (the same chunk gets the same key in every
    ingress replica and in every report)."""
    h = hashlib.blake2b(digest_size=8)
    if chunk.chunk_id is not None:
        h.update(b"id\0" + chunk.chunk_id.encode())
    else:
        h.update(b"ids\0" + salt.encode() + b"\0" +
                 b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk.content))
    return h.hexdigest()


def chunk_route(segments, policy: str | None = None, salt: str = "") -> ChunkRoute:
    chunks = [s for s in segments if isinstance(s, Chunk)]
    return ChunkRoute(tuple(route_key(c, salt) for c in chunks), tuple(len(c.content) for c in chunks), policy)


def ray_error(e: BaseException) -> LazyRagError:
    """A Ray/Serve exception met while talking to the engine deployment, as the driver error the
    routes turn into an HTTP answer."""
    if isinstance(e, BackPressureError):
        return QueueFullError("Every engine replica's queue is full; retry after a moment.")
    if isinstance(e, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return EngineUnavailableError("The engine replica serving this request stopped (Ray Serve starts a "
                                      "replacement); retry the request: it goes to a live replica.")
    if isinstance(e, (TaskCancelledError, asyncio.CancelledError)):
        return ClientGoneError("The request was cancelled.")
    log.error("the engine deployment failed a request: %s: %s", type(e).__name__, e)
    return RequestFailedError("The engine replica failed this request; the server log has the details.")


@dataclass
class ServeTicket(Ticket):
    rid: int = 0
    stream: object = None       # Serve's DeploymentResponseGenerator
    pump: asyncio.Task | None = None
    replica: str | None = None


class ServeDriver(Driver):
    """``engine``: a handle to the engine deployment. ``max_queue``: requests this ingress
    replica has in the engines at once (more get 429 here; each engine replica has its own limit
    too). ``policy``: a routing policy for every request of this driver (None: the
    deployment's router decides)."""

    def __init__(self, engine, max_queue: int, policy: str | None = None):
        super().__init__(max_queue)
        self.engine = engine
        self.policy = policy
        self._streams = engine.options(stream=True)
        self._tickets: dict[int, ServeTicket] = {}
        self._ids = itertools.count()

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    @property
    def alive(self) -> bool:
        return True  # the replicas are Serve's: a dead one is replaced, and its requests fail with 503

    def stats(self) -> dict:
        """One engine replica's counters (the one the router picks for this call; every replica
        exports its own to Ray's metrics). Blocking: called from a worker thread (/metrics)."""
        try:
            return self.engine.stats.remote().result(timeout_s=30)
        except Exception as e:
            raise LazyRagError(f"No engine replica reported its counters ({type(e).__name__}).") from None

    async def submit(self, segments, *, uses_index: bool = False, **options) -> ServeTicket:
        self.check_admission(len(self._tickets))
        ticket = ServeTicket(asyncio.get_running_loop(), asyncio.Queue(), rid=next(self._ids))
        route = chunk_route(segments, self.policy, options.get("cache_salt", ""))
        ticket.stream = self._streams.generate.remote(route, segments, uses_index, options)
        self._tickets[ticket.rid] = ticket
        try:
            first = await ticket.stream.__anext__()
        except asyncio.CancelledError:  # the client left while the request waited for a replica
            self._end(ticket)
            raise
        except StopAsyncIteration:
            self._end(ticket)
            raise RequestFailedError("The engine replica ended the request without an answer.") from None
        except Exception as e:
            self._end(ticket)
            raise ray_error(e) from None
        if first[0] == "rejected":
            self._end(ticket)
            raise error_of(first[1], first[2])
        ticket.replica = first[1]
        ticket.pump = asyncio.create_task(self._pump(ticket))
        return ticket

    async def _pump(self, ticket: ServeTicket) -> None:
        """The replica's events into the ticket's queue, then None."""
        try:
            async for event in ticket.stream:
                if event[0] == "pieces":
                    for piece in event[1]:
                        ticket.queue.put_nowait(piece)
                elif event[0] == "done":
                    ticket.result = event[1]
                elif event[0] == "failed":
                    ticket.error = error_of(event[1], event[2])
            if ticket.result is None and ticket.error is None:
                ticket.error = RequestFailedError("The engine replica ended the request without an answer.")
        except asyncio.CancelledError:
            ticket.error = ClientGoneError("The client disconnected; the request was dropped.")
        except Exception as e:
            ticket.error = ray_error(e)
        finally:
            self._end(ticket)
            ticket.queue.put_nowait(None)

    def _end(self, ticket: ServeTicket) -> None:
        ticket.finished = True
        self._tickets.pop(ticket.rid, None)

    def cancel(self, ticket: ServeTicket) -> None:
        """The client left: cancel the Serve call (the replica's generator is cancelled there,
        which aborts the request and frees its KV pages)."""
        if ticket.finished:
            return
        ticket.stream.cancel()
        if ticket.pump is not None:
            ticket.pump.cancel()

    def close(self, timeout: float = 5.0) -> None:
        for t in list(self._tickets.values()):
            self.cancel(t)


class ServeEngines:
    """What ``create_app`` gets in place of a model in an ingress replica: the engine
    deployment's handle, the ``EngineSpec`` (for the tokenizer and the index's metadata and
    embedder, loaded here) and the facts an engine replica reported (``EngineReplica.info``)."""

    def __init__(self, engine, spec, info: dict, max_queue: int, policy: str | None = None):
        self.engine, self.spec, self.info = engine, spec, info
        self.max_queue, self.policy = max_queue, policy

    def open_driver(self, settings):
        """(driver, model, index, the prompt builder's tokenizer), as ``app.open_engine`` returns."""
        remote = RemoteModel(self.spec.load_tokenizer(), self.info)
        index = self.spec.load_index(remote) if self.spec.index_dir else None
        return ServeDriver(self.engine, self.max_queue, self.policy), remote, index, remote.tokenizer
