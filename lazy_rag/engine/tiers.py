"""Chunk KV below the GPU pool: a host-memory tier, the index's on-disk ``ChunkStore``, and
encoding by the model when no tier has the chunk.

``ChunkTiers.fetch`` returns a chunk's position-free KV (keys unrotated, as stored) on the host
from the highest tier that has it, filling the tiers above on the way (a miss everywhere is
encoded by the model and written back to the store). ``ChunkTiers.place`` copies it into pool
pages in the pool's key convention; on CUDA the copy runs on its own stream from pinned memory
and returns an event, so the scheduler can run other requests while it is in flight.

Pool convention ``rotate_q`` (``kernels.DEFAULT_ROPE``): keys rotated at chunk-local positions
0..L-1 with the model's RoPE (the same ``RopeTable.rotate`` the CPU path uses), so that a table
entry with rot_shift = chunk start gives the kernel the exact logical rotation.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Sequence

import torch

from ..kv import ChunkKV
from ..lru import ByteLRU
from ..rope import RopeTable
from ..segments import token_ids_key
from .page_pool import PagePool

CONVENTIONS = ("rotate_q", "rotate_k")


def chunk_key(token_ids: Sequence[int], chunk_id: str | None, shared_prefix: Sequence[int] = ()) -> tuple:
    """Cache key of a chunk's KV: which prefix it was encoded after, and the chunk itself. The
    token ids are always part of it: two sources may use one chunk id for different texts."""
    pre = token_ids_key(tuple(shared_prefix)) if shared_prefix else ""
    return ("chunk", pre, chunk_id or "", token_ids_key(tuple(token_ids)))


def to_pool_keys(k: torch.Tensor, rope: RopeTable, convention: str) -> torch.Tensor:
    """Stored (unrotated) chunk keys [layers, L, Hkv, D] -> the pool's convention."""
    if convention == "rotate_k":
        return k
    if convention == "rotate_q":
        return rope.rotate(k, torch.arange(k.shape[1], device=k.device))
    raise ValueError(f"unknown key convention {convention!r}; choose one of {CONVENTIONS}")


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
    def __init__(self, llm, host_bytes: int = 4 << 30, store=None, pin: bool | None = None):
        """llm: a LazyLLM (encodes misses); store: a ChunkStore (disk) or None."""
        self.llm, self.store = llm, store
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.host: ByteLRU[ChunkKV] = ByteLRU(host_bytes, lambda c: c.nbytes)
        self.counters: Counter = Counter()
        self._stream = None

    def _to_host(self, kv: ChunkKV) -> ChunkKV:
        k, v = kv.k.detach().to("cpu"), kv.v.detach().to("cpu")
        if self.pin:
            k, v = k.pin_memory(), v.pin_memory()
        return ChunkKV(k, v)

    def fetch(self, key, token_ids: Sequence[int], chunk_id: str | None = None,
              shared_prefix: Sequence[int] | None = None, store=None) -> tuple[ChunkKV, str]:
        """The chunk's KV on the host and the tier it came from: host, disk or encoded.
        ``store``: the request's own chunk store (its index), else the engine's."""
        store = store if store is not None else self.store
        kv = self.host.get(key)
        if kv is not None:
            self.counters["host_hits"] += 1
            return kv, "host"
        self.counters["host_misses"] += 1
        tier = None
        if store is not None and chunk_id is not None:
            kv, _why = store.read(chunk_id, tuple(token_ids))
            if kv is not None:
                tier = "disk"
                self.counters["disk_hits"] += 1
                self.counters["bytes_from_disk"] += kv.nbytes
            else:
                self.counters["disk_misses"] += 1
        if kv is None:
            kv = self.llm.encode_chunk(list(token_ids), shared_prefix=shared_prefix)
            tier = "encoded"
            self.counters["encoded"] += 1
            self.counters["encoded_tokens"] += len(token_ids)
            if store is not None and chunk_id is not None:
                self.counters["bytes_to_disk"] += store.write(chunk_id, tuple(token_ids), kv)
        kv = self._to_host(kv)
        self.host.put(key, kv)
        return kv, tier

    def place(self, pool: PagePool, pages: list[int], kv: ChunkKV, rope: RopeTable,
              convention: str = "rotate_q") -> Transfer:
        """Copy kv into ``pages`` (keys in the pool's convention). On CUDA the copy and rotation
        run on a side stream; the returned Transfer's event marks completion."""
        self.counters["bytes_to_pool"] += kv.nbytes
        cuda = pool.device.type == "cuda"
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(device=pool.device)
        ctx = torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext()
        if cuda:  # pages may have just been freed by work still queued on the compute stream
            self._stream.wait_stream(torch.cuda.current_stream(pool.device))
        with ctx:
            k = kv.k.to(pool.device, non_blocking=True).to(pool.dtype)
            v = kv.v.to(pool.device, non_blocking=True)
            pool.write_run(pages, to_pool_keys(k, rope, convention), v)
            if not cuda:
                return Transfer()
            event = torch.cuda.Event()
            event.record(self._stream)
            # the source tensors must outlive the copy: keep them alive on the caching allocator
            k.record_stream(self._stream)
            v.record_stream(self._stream)
        return Transfer(event)
