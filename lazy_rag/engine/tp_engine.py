"""``TPEngine``: the engine over N tensor-parallel ranks (``EngineConfig.tensor_parallel``).

Rank 0 (this process) is an ``Engine`` whose model is its share of every layer
(``tensor_parallel.ShardedParts``) and whose pool holds its KV heads of every chunk; each worker
rank (``rank_pool``) runs the same engine on its share. A model loaded as rank 0's share
(``shard_loading``: a safetensors folder, random weights) has each worker load its own from the
same source, so no process holds the whole model; one given in memory is shared with the workers
whole, each slicing its share (``stats()["rank_weight_bytes"]``: what each rank holds).

Lockstep: rank 0's scheduler decides every step, and the workers reach the same decisions because
every input to them is replicated in order: rank 0 forwards each request as it accepts it (a sampling seed filled in, so that
sampled tokens agree), each step, abort, chunk encode and cache clear, before running it
itself. Everything a decision reads is then equal on every rank: the requests, the pages, and
the logits (the residual stream is whole on every rank after each all-reduce, and the LM head
is whole), so every rank samples the same tokens. The two inputs that are not, timings, are
kept out of decisions (``read_or_encode.ReadAlways``); ``RankGroup.check_lockstep`` compares the
ranks' tokens of every forward (on GPUs while the forward is enqueued, before its output is
read), so a rank that left lockstep fails the step with an error instead of hanging.

On GPUs (``rank_devices``) rank r runs on the r-th GPU after rank 0's, its activations'
all-reduces over NCCL inside its CUDA graphs, and the decisions that read the process rather
than the requests are made the same on every rank (``rank_worker``'s docstring lists them).

What a request may hold is what can cross a process: a callable ``score_fn`` stays on rank 0
(the workers compute the same rows and drop them); chunk adapters (LoRA deltas hooked on the
whole model's modules) are refused under TP for now. An index's store travels as a ``StoreRef``
(``store_ref``): each worker opens the same folder at the same generation and reads its heads'
slice of every record; rank 0 alone writes (every rank's heads, gathered).
"""
from __future__ import annotations

import dataclasses
import functools
import random
import weakref

from ..errors import LazyRagError
from ..experts import experts_in_use
from ..requests import SamplingParams
from .engine import Engine
from .rank_pool import RankPool
from .store_ref import ref_of
from .rank_devices import check_rank_devices
from .rank_worker import agreed_config, attach, encode_whole, gather_weight_bytes
from .rank_group import RankFailedError
from .tensor_parallel import ShardedParts, check_shardable

# Engine.submit's keywords that are shorthand for SamplingParams fields (the same names)
_SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def engine_for(host, config, tiers=None) -> Engine:
    """The engine ``config`` asks for: over ``config.tensor_parallel`` ranks, or this process alone.
    ``tiers``: a host tier it shares with other engines (``Engine``'s)."""
    if getattr(host.model, "rank_share", None) is not None:   # loaded as one rank's share: for that many ranks only
        check_shardable(host.parts, config.tensor_parallel)
    return TPEngine(host, config, tiers) if config.tensor_parallel > 1 else Engine(host, config, tiers)


def check_tensor_parallel(host, size: int) -> None:
    """Refuse ``size`` ranks where they cannot run (``rank_devices.check_rank_devices``: the CPU,
    or enough GPUs), before any process starts."""
    check_rank_devices(host.device, size)


class TPEngine(Engine):
    def __init__(self, host, config, tiers=None):
        size = config.tensor_parallel
        check_tensor_parallel(host, size)
        check_shardable(host.parts, size)   # before any process starts
        self.ranks = RankPool.get(size, host.device)
        group = self.ranks.group
        parts = ShardedParts(host.parts, group)
        self.eid = self.ranks.new_engine_id()
        # a model loaded as rank 0's share (shard_loading) travels as where it was loaded from,
        # each worker loading its own share; a model given in memory travels whole, as shared
        # memory, each worker keeping its own share of it
        share = getattr(host.model, "rank_share", None)
        with self.ranks.lock:
            self.ranks.send("open", self.eid, host.model if share is None else share, experts_in_use(host.model),
                            host.tokenizer, host.model_name, host.default_source, config, self.ranks.tiers_spec(tiers))
            super().__init__(host, agreed_config(config, parts, host.dtype, group), tiers, parts=parts)
            attach(self, group)
            self.rank_weight_bytes = gather_weight_bytes(self, group)
        # write-backs rank 0 committed during a step, sent to the workers before the next one: a
        # worker's snapshot of the index cannot see them, and a rank that encoded a chunk rank 0
        # read would leave lockstep
        self._written: list = []
        self._waits_at_open = dict(group.timers)
        self._listened = weakref.WeakSet()
        weakref.finalize(self, _close, self.ranks, self.eid)

    # -- the replicated commands ------------------------------------------------------------------
    def submit(self, segments, **options):
        with self.lock, self.ranks.lock:
            options = _portable(options)
            source = options.get("source")
            # the workers open the store by path; one it cannot be is refused before rank 0 accepts
            store_ref = ref_of(source.store) if source is not None and source.store is not None else None
            if store_ref is not None and source.store not in self._listened:
                source.store.write_listeners.append(functools.partial(_note_write, self._written, store_ref))
                self._listened.add(source.store)
            handle = super().submit(segments, **options)
            if options.get("score_fn") is not None:
                options["score_fn"] = _drop_score   # (a caller's callable stays here)
            if store_ref is not None:
                options["source"] = dataclasses.replace(source, store=store_ref)
            try:
                # the prepared layout, not the segments: the workers' steps wait for nothing rank 0 did already
                self.ranks.send("submit", self.eid, handle.seq.id, handle.seq.layout, options, sorted(self.host.eos_ids))
            except LazyRagError:   # a rank is gone: no rank may hold the request
                super().abort(handle)
                raise
            except Exception as e:   # it could not be pickled: no rank holds it then, nor may this one
                super().abort(handle)
                raise LazyRagError(f"This request cannot be sent to the other tensor-parallel ranks "
                                   f"({type(e).__name__}: {e}); pass plain values (token ids, text, dataclasses).") from e
            return handle

    def step(self) -> bool:
        with self.lock, self.ranks.lock:
            try:
                self.ranks.send("step", self.eid)
                busy = super().step()   # (a forward's failure fails its requests there)
                if self._written:
                    written, self._written[:] = list(self._written), []
                    self.ranks.send("written", self.eid, written)
                return busy
            except RankFailedError as e:   # the step could not run on every rank: nothing in flight can finish
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    if seq in self.scheduler.waiting:
                        self.scheduler.waiting.remove(seq)
                    self._fail(seq, e)
                return True

    def abort(self, handle) -> None:
        with self.lock, self.ranks.lock:
            if not handle.done and handle.seq.id in self.handles:   # (what Engine.abort acts on)
                self.ranks.send("abort", self.eid, handle.seq.id)
            super().abort(handle)

    def encode_chunks(self, chunks, shared_prefix=(), wrapper=None, cache: bool = True, quantize: str | None = None,
                      host_alloc=None):
        """Every rank encodes its heads; the KV returned holds all of them (gathered), as a
        single process's would (``host_alloc`` is not used: the gathered tensors are new)."""
        _check_wrapper(wrapper)
        chunks = [[int(t) for t in ids] for ids in chunks]
        prefix = tuple(int(t) for t in shared_prefix)
        with self.lock, self.ranks.lock:
            self.ranks.send("encode_chunks", self.eid, chunks, prefix, wrapper, cache, quantize)
            return encode_whole(self, chunks, prefix, wrapper, cache, quantize)

    def clear_cache(self) -> None:
        with self.lock, self.ranks.lock:
            self.ranks.send("clear_cache", self.eid)
            super().clear_cache()

    def failure(self) -> "RankFailedError | None":
        """The error that broke the ranks' group, or a worker found dead between steps (polled by
        the server's engine loop while idle, so that /ready turns 503 before a request fails)."""
        if self.ranks.healthy():
            return None
        group = self.ranks.group
        if group.broken is None:
            group.broken = RankFailedError(
                f"A tensor-parallel rank of {self.ranks.size} exited ({self.ranks.describe_failure()}). "
                "Requests fail; create the LazyLLM (or restart the server) again.")
        return group.broken

    def stats(self) -> dict:
        # since this engine opened (the engines of one RankPool share its group and its timers)
        waits = {f"tp_{k}": round(v - self._waits_at_open.get(k, 0.0), 4) for k, v in self.ranks.group.timers.items()}
        return {**super().stats(), "tensor_parallel": self.ranks.size, "rank_weight_bytes": self.rank_weight_bytes,
                **waits}


def _portable(options: dict) -> dict:
    """``submit``'s options as every rank must see them: the sampling parameters in one
    ``SamplingParams`` with a seed whenever it samples (else each rank would draw its own)."""
    options = dict(options)
    sampling = SamplingParams.of(options.pop("sampling", None), **{k: options.pop(k, None) for k in _SAMPLING_KEYS})
    if sampling.temperature > 0 and sampling.seed is None:
        sampling = SamplingParams.of(sampling, seed=random.getrandbits(63))
    source = options.get("source")
    _check_wrapper(source.wrapper if source is not None else None)
    return {**options, "sampling": sampling}


def _check_wrapper(wrapper) -> None:
    if wrapper is not None and getattr(wrapper, "adapter", None) is not None:
        raise LazyRagError("tensor_parallel does not run chunk adapters yet (their LoRA deltas hook the whole "
                           "model's layers); use a wrapper without an adapter, or tensor_parallel=1.")


def _note_write(written: list, ref, chunk_id: str, loc) -> None:
    written.append((ref, chunk_id, loc))


def _drop_score(logits):
    return None


def _close(ranks: RankPool, eid: int) -> None:
    with ranks.lock:
        try:
            ranks.send("close", eid)
        except LazyRagError:
            pass   # the pool failed: its workers are gone with this engine's share
