"""Chunk KV below the pool: a host-memory tier, then the request's disk store (an index's KV
files). One key scheme everywhere (``chunk_key``): the KV of a chunk depends only on its token
ids and the prefix it was encoded after (and the model, which is the engine's own), and, for a
chunk of an index that stores quantised KV (fp8, int4), on that format: such an index's answers
are defined by its stored KV, so its chunks never share pool or host entries with an
unquantised index's (nor with another format's), and their stored KV is always read rather
than encoded again (``fetch``), a request's cold chunks all at once (``read_ahead``). The one
exception is a chunk whose KV is not stored yet (an index built without KV): the request that
encodes it answers from the unquantised KV, which stays in the pool under the quantised key
until evicted; the host tier keeps only the stored format.

The planner asks ``fetch`` when a chunk is not resident in the pool; when no tier has it either,
the engine encodes it straight into its pool pages and hands the captured KV to ``keep`` (host
tier, and written back to the store). ``place`` copies fetched KV into pool pages in the pool's
key convention; on CUDA the copy runs on its own stream from pinned memory and returns an event,
so the scheduler can run other requests while it is in flight.

Pool convention (``kernels.DEFAULT_ROPE_MODE == "rotate_q"``): a chunk's keys rotated at
chunk-local positions 0..L-1, each layer's by its own RoPE table (``ModelParts.pool_rope``), so
that a table entry with rot_shift = the chunk's start gives the kernels the exact logical
rotation. Stored KV (host tier, disk) is unrotated.

fp8 (an engine whose pool is float8_e4m3fn, or a store of fp8 KV): the host tier holds a chunk's
KV in the format it was stored or encoded in (``ChunkKV`` with fp8 k / v and fp16 per-token
scales: half the bytes), under a key of that format (``host_key``); a fetch looks for the pool's
format first, and ``place`` converts the other on the pool's device. ``place`` dequantises the
unrotated keys, rotates them in fp32 and quantises them again into the pool: a placed key is
rounded twice, Q(rot(DQ(Q(k)))), where a key written by the forward is rounded once, Q(rot(k))
(measured on keys with outlier channels: relative rms error 0.022 against 0.017, per-row max
error <= 2^-3 of the row's largest element against 2^-4; tests/kernels/test_fp8.py). Values are
placed as stored (one rounding).

int4 (a store of ``--kv-dtype int4`` KV, ``kv_int4``): a storage format only, no pool is int4. The
host tier holds the chunk's int4 codes with their group scales and zeros (~0.27 of 16-bit KV's
bytes) under an "int4" key; ``place`` dequantises them on the pool's device to fp32, rotates the
keys and writes the pool's dtype (fp8 pools quantise them again per token, as any placed KV).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from ..lru import ByteLRU
from ..kernels import FP8, dequantize_rows
from ..kernels.rope import LayerRopes, RopeTable
from ..segments import token_ids_key
from ..chunk_kv import NOT_IN_MEMORY, ChunkKV, ChunkKVStore
from .page_pool import PagePool

log = logging.getLogger(__name__)

# A request's cold chunks of a quantised store are read this many at once (``read_ahead``): a
# read is a preadv, a CRC and a copy into pinned memory, all outside the GIL, so the records'
# disk reads overlap, and their CRCs and copies too where there are cores for them (4 int4
# records of the 8B shape from the disk: 44.8 ms against 71.4 in turn on a 2-core machine,
# benchmarks/chunk_reads.py).
READ_AHEAD_THREADS = 4
_read_pool: ThreadPoolExecutor | None = None
_read_pool_lock = threading.Lock()


def read_pool() -> ThreadPoolExecutor:
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="lazy-rag-read-ahead")
        return _read_pool


def _forget_read_pool() -> None:
    # a forked child has none of the parent's threads: its reads would wait forever in a copy of
    # the parent's pool
    global _read_pool, _read_pool_lock
    _read_pool, _read_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_read_pool)


def chunk_key(token_ids: Sequence[int], shared_prefix: Sequence[int] = (), salt: str = "",
              stored: str | None = None) -> tuple:
    """Cache key of a chunk's KV in every tier: the prefix it was encoded after and its tokens,
    and the request's cache salt for a chunk of the caller's own text (``Engine.submit``): the
    same tokens under two salts are two entries, so one tenant's request never finds (or times)
    the KV another tenant's request encoded. ``stored``: the quantised format its index stores
    ("fp8", "int4"; ``stored_format``), None for unquantised KV."""
    pre = _content_key(tuple(shared_prefix)) if shared_prefix else ""
    key = ("chunk", pre, _content_key(tuple(token_ids), salt))
    return (*key, stored) if stored else key


def span_key(seq, span) -> tuple:
    """The cache key of a request's chunk span: the caller's own text under the request's salt,
    an index's chunk (it has an id) under its store's format."""
    own = span.chunk_id is None
    return chunk_key(span.token_ids, seq.source.shared_prefix_ids, seq.cache_salt if own else "",
                     None if own else stored_format(seq.source.store))


def stored_format(store) -> str | None:
    """The quantised format ("fp8", "int4") a store holds its chunks' KV in; None for 16/32-bit
    KV or no store."""
    return getattr(store, "kv_format", None) if store is not None else None


HOST_FORMATS = (None, "fp8", "int4")    # ChunkKV.format's values


def host_key(key: tuple, fmt: "str | bool | None") -> tuple:
    """The host tier's key of a chunk's KV in a format (``ChunkKV.format``: "fp8", "int4", or None
    for unquantised; True means fp8): each format apart from the others."""
    fmt = "fp8" if fmt is True else fmt or None
    return (*key, fmt) if fmt else key


@functools.lru_cache(maxsize=2048)
def _content_key(ids: tuple, salt: str = "") -> str:
    # every admission keys each of its chunks: a popular chunk's sha256 is looked up (a tuple hash
    # and compare, ~10 us for 2048 tokens) instead of recomputed (~100 us with the array copy).
    # The salt is part of this cache's key too: another tenant's earlier request must not make
    # even this hash faster.
    key = token_ids_key(ids)
    return hashlib.sha256(f"{salt}\0{key}".encode()).hexdigest() if salt else key


class Transfer:
    """A chunk copy into the pool; ``ready()`` once its CUDA event has completed."""

    def __init__(self, event=None):
        self.event = event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class ChunkTiers:
    def __init__(self, host_bytes: int = 4 << 30, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.host: ByteLRU[ChunkKV] = ByteLRU(host_bytes, lambda c: c.nbytes)
        self.counters: Counter = Counter()
        self._stream = None       # CUDA side stream: host -> pool placements, pool -> host copies
        # a tensor-parallel rank's KV heads (``tensor_parallel.HeadShard``): it keeps only its
        # heads of what it reads from a store and writes every rank's heads of what it encoded
        self.heads = None
        # reads started by ``read_ahead``, by (store id, cache key): (store, future)
        self._ahead: dict[tuple, tuple[ChunkKVStore, Future]] = {}

    def to_host(self, kv: ChunkKV, wait: bool = True) -> ChunkKV:
        """A host copy of ``kv`` (every tensor: an fp8 chunk's scales too; pinned on a CUDA
        machine), not kept in the tier. ``wait=False`` (CUDA KV, pinned host): the copies are
        queued on the side stream and this returns at once; only the GPU may read the copy
        before they finish (``place`` orders its reads after them), so the caller must not
        hand it to the host (a store write)."""
        tensors = kv.tensors()
        if not wait and self.pin and all(t.is_cuda for t in tensors.values()):
            stream = self._side_stream(next(iter(tensors.values())).device)
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            out = {}
            # torch's caching pinned allocator, not memory registered per copy (cudaHostRegister):
            # that pins a fresh buffer 4x faster, but the engine's thread then registers every
            # evicted chunk and unregisters every host-tier drop, which halved the 8B paper
            # workload's throughput on an H200 (29.7 against 66.6 req/s); torch reuses its blocks
            with torch.cuda.stream(stream):
                for name, t in tensors.items():
                    out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                    t.record_stream(stream)
            return kv.with_tensors(out)
        out = {}
        for name, t in tensors.items():
            t = t.detach()
            if t.device.type == "cpu" and (not self.pin or t.is_pinned()):
                out[name] = t   # on the host as it should be (a segment store reads into pinned memory)
            else:   # one copy, straight into pinned memory (not to the host, then pinned)
                out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin).copy_(t)
        return kv.with_tensors(out)

    def _side_stream(self, device) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def read_ahead(self, store: ChunkKVStore | None, chunks) -> int:
        """Start reading at once the records ``fetch`` will read from ``store`` for ``chunks``
        ((cache key, token ids, chunk id) each) whatever a read costs: those of a quantised
        store (its answers are its stored KV, never encoded again instead) that the host tier
        lacks. ``fetch`` then takes each one's result, so a request's cold chunks wait for the
        slowest read instead of for all of them in turn; ``drop_read_ahead`` forgets those it did
        not take. Returns how many reads started."""
        stored = stored_format(store)
        if not stored or not getattr(store, "reads_pinned", False):
            return 0
        started = 0
        for key, token_ids, chunk_id in chunks:
            ahead = (id(store), key)
            if chunk_id is None or ahead in self._ahead or host_key(key, stored) in self.host:
                continue
            read = read_pool().submit(store.read, chunk_id, tuple(token_ids), pin=self.pin, tensor_crcs=False)
            self._ahead[ahead] = (store, read)
            started += 1
        self.counters["read_ahead"] += started
        return started

    def drop_read_ahead(self) -> None:
        """Forget the reads ``read_ahead`` started that no ``fetch`` took (their buffers go)."""
        for _, read in self._ahead.values():
            read.cancel()
        self._ahead.clear()

    def _read(self, store: ChunkKVStore, key, chunk_id: str, token_ids, fast: dict):
        """``store.read``'s result: the read ``read_ahead`` started for it, or a read now."""
        entry = self._ahead.pop((id(store), key), None)
        if entry is not None and entry[0] is store:
            return entry[1].result()
        return store.read(chunk_id, tuple(token_ids), **fast)

    def fetch(self, key, token_ids: Sequence[int], chunk_id: str | None,
              store: ChunkKVStore | None, kv_dtype: torch.dtype | None = None, chooser=None,
              batch_tokens: int = 0) -> tuple[ChunkKV | None, str | None]:
        """(KV on the host, "host" or "disk"; in the format it was stored or encoded in, which
        ``place`` converts to the pool's), or (None, None) when the chunk must be encoded, or
        (None, "recompute") when its stored KV is intact but not in memory and ``chooser``
        (``read_or_encode.ReadOrEncode``) finds encoding it faster than reading it from the disk
        (``batch_tokens``: tokens already to be encoded in the same forward); the record is then
        left as it is. A stored file that is damaged, foreign or (in a precomputed index) missing
        is reported and will be repaired by ``keep`` after the encode. ``kv_dtype``: the asking
        pool's dtype (its format's host copy is looked up first)."""
        stored = stored_format(store) if chunk_id is not None else None
        first = "fp8" if kv_dtype == FP8 else None
        formats = (stored,) if stored else (first, *(f for f in HOST_FORMATS if f != first))  # the pool's first
        for k in (host_key(key, f) for f in formats):
            kv = self.host.get(k)
            if kv is not None:
                self.counters["host_hits"] += 1
                return kv, "host"
        self.counters["host_misses"] += 1
        if store is None or chunk_id is None:
            return None, None
        kv, why = None, NOT_IN_MEMORY
        # a segment store reads straight into pinned memory, checking the record's CRC only
        fast = {"pin": self.pin, "tensor_crcs": False} if getattr(store, "reads_pinned", False) else {}
        # stored quantised KV is what its index answers from: read, never encoded again instead
        weigh = chooser is not None and chooser.calibrated and not stored
        nowait = getattr(store, "read_nowait", None) if weigh else None
        probe = getattr(store, "in_memory", None) if nowait is not None else None
        # in the page cache? Then the read costs its copy and CRC at the measured page-cache rate
        # (an 8B model's 32 MB chunk: ~20 ms on the H100 machine, slower than encoding it again
        # in a prefill), else the disk's rate: weighed against encoding either way
        cached = probe(chunk_id) if probe is not None else None
        if cached and chooser.should_encode(store.stored_bytes(chunk_id), len(token_ids), batch_tokens, cached=True):
            self.counters["recomputed_not_read"] += 1
            return None, "recompute"
        if nowait is not None and cached is not False:
            t0 = time.perf_counter()
            kv, why = nowait(chunk_id, tuple(token_ids), **fast)
            if kv is not None and cached:
                chooser.observe_read(kv.nbytes, time.perf_counter() - t0, cached=True)
        if why == NOT_IN_MEMORY:
            if nowait is not None and chooser.should_encode(store.stored_bytes(chunk_id), len(token_ids), batch_tokens):
                self.counters["recomputed_not_read"] += 1
                return None, "recompute"
            t0 = time.perf_counter()
            kv, why = self._read(store, key, chunk_id, token_ids, fast)
            if kv is not None and nowait is not None:  # a read that went to the disk: its rate
                chooser.observe_read(kv.nbytes, time.perf_counter() - t0)
        if kv is None:
            self.counters["disk_misses"] += 1
            if why != "missing" or store.precomputed:
                log.warning("Chunk %s KV %s: recomputing it and repairing the store.", chunk_id,
                            "file is missing" if why == "missing" else why)
                self.counters["repaired"] += 1
            return None, None
        self.counters["disk_hits"] += 1
        self.counters["bytes_from_disk"] += kv.nbytes
        # kept as stored: ``place`` converts on the pool's device (an 8B chunk's fp8 KV dequantised
        # on the host for a bf16 pool took ~25 ms of CPU per 16 MB)
        kv = self.to_host(kv if self.heads is None else self.heads.mine(kv))
        self.host.put(host_key(key, kv.format), kv)
        return kv, "disk"

    def keep(self, key, kv: ChunkKV, token_ids: Sequence[int], chunk_id: str | None,
             store: ChunkKVStore | None, wait: bool = True) -> ChunkKV:
        """Freshly encoded KV: into the host tier, and written back to the request's store.
        ``wait=False``: the host copy may still be in flight when this returns (``to_host``),
        unless the store write needs its bytes."""
        self.counters["encoded"] += 1
        self.counters["encoded_tokens"] += kv.num_tokens
        writes = store is not None and chunk_id is not None
        kv = self.to_host(kv, wait=wait or writes)
        stored = stored_format(store) if writes else None
        if not stored or kv.format == stored:  # else the next fetch reads the stored format
            self.host.put(host_key(key, kv.format), kv)
        if writes and self.heads is not None:   # the record holds every rank's heads; rank 0 writes it
            whole = self.heads.whole(kv)
            if self.heads.writes:
                self.counters["bytes_to_disk"] += store.write_back(chunk_id, tuple(token_ids), whole)
        elif writes:
            self.counters["bytes_to_disk"] += store.write_back(chunk_id, tuple(token_ids), kv)
        return kv

    def place(self, pool: PagePool, pages: list[int], kv: ChunkKV, rope_table: RopeTable | LayerRopes) -> Transfer:
        """Copy kv into ``pages``, keys rotated at chunk-local positions by ``rope_table``
        (``ModelParts.pool_rope``: each layer's own where they differ). On CUDA the copy and
        rotation run on a side stream; the returned Transfer's event marks completion. fp8 or int4
        KV, or an fp8 pool: keys dequantised, rotated in fp32 and (fp8 pool) quantised again, per
        token."""
        self.counters["bytes_to_pool"] += kv.nbytes
        cuda = pool.device.type == "cuda"
        if cuda:
            self._side_stream(pool.device)
        ctx = torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext()
        if cuda:  # pages may have just been freed by work still queued on the compute stream
            self._stream.wait_stream(torch.cuda.current_stream(pool.device))
        with ctx:
            src = {name: t.to(pool.device, non_blocking=True) for name, t in kv.tensors().items()}
            if kv.int4:   # dequantised here, on the pool's device; rotated in fp32
                k, v = kv.with_tensors(src).dequantized(torch.float32)
            elif kv.quantized or pool.quantized:   # rotated in fp32, quantised (fp8 pool) by write_run
                k = src["k"].float() if not kv.quantized else dequantize_rows(src["k"], src["k_scale"])
                v = src["v"] if not kv.quantized else dequantize_rows(src["v"], src["v_scale"])
            else:
                k, v = src["k"].to(pool.dtype), src["v"]
            pool.write_run(pages, rope_table.rotate(k, torch.arange(k.shape[1], device=k.device)), v)
            if not cuda:
                return Transfer()
            event = torch.cuda.Event()
            event.record(self._stream)
            # the source tensors must outlive the copy: keep them alive on the caching allocator
            for t in (*src.values(), k, v):
                t.record_stream(self._stream)
        return Transfer(event)
