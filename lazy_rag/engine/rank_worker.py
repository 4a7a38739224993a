"""A tensor-parallel rank's engine (``tp_engine``): ``attach`` makes an engine over a rank's
share of the model one rank of its group, and a worker (``rank_pool.worker_main``) opens its
engine and runs each command rank 0's ``TPEngine`` sends (``open_rank_engine``,
``run_rank_command``)."""
from __future__ import annotations

import dataclasses

import torch

from ..errors import LazyRagError
from .engine import Engine
from .read_or_encode import ReadAlways
from .store_ref import StoreRef, open_ref
from .shard_loading import RankShare
from .tensor_parallel import HeadShard, RankGroup, ShardedParts


def attach(engine: Engine, group: RankGroup) -> Engine:
    """Make ``engine`` (built over ``ShardedParts``) one rank of ``group``: its tiers keep this
    rank's heads of stored KV and write every rank's, and stored KV is always read."""
    engine.tiers.heads = HeadShard(group, engine.host.shape.num_kv_heads)
    engine.planner.chooser = ReadAlways()
    return engine


def encode_whole(engine: Engine, chunks, prefix, wrapper, cache, quantize) -> list:
    """Chunk encode on every rank; the KV of all heads (gathered, a collective)."""
    kvs = Engine.encode_chunks(engine, chunks, prefix, wrapper, cache, quantize)
    return [engine.tiers.heads.whole(kv) for kv in kvs]


def open_rank_engine(group: RankGroup, model, tokenizer, model_name, default_source, config) -> Engine:
    """A worker's engine: the same host as rank 0's (tokenizer, default chunk source) and the same
    configuration, over this rank's share of the model. ``model``: rank 0's ``RankShare`` (this
    rank loads its own share from the same source) or the whole model (shared memory)."""
    from ..model_host import ModelHost

    if isinstance(model, RankShare):
        model = dataclasses.replace(model, rank=group.rank).load()
    host = ModelHost(model, tokenizer, model_name=model_name)
    host.default_source = default_source
    engine = Engine(host, config, parts=ShardedParts(host.parts, group))
    engine.remote_handles = {}
    engine.remote_stores = {}   # StoreRef -> this worker's read-only store
    attach(engine, group)
    gather_weight_bytes(engine, group)
    return engine


def gather_weight_bytes(engine: Engine, group: RankGroup) -> list[int]:
    """The bytes of model weights each rank's process holds (a collective, as each rank opens its
    engine): the host's model and the engine's layers, every tensor counted once, shared memory
    included (a model given in memory is whole in every rank)."""
    model, layers = engine.host.model, torch.nn.ModuleList(engine.runner.parts.layers)
    tensors = [*model.parameters(), *model.buffers(), *layers.parameters(), *layers.buffers()]
    mine = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return [int(b) for b in group.all_gather(torch.tensor([mine], dtype=torch.int64))]


def run_rank_command(engine: Engine, op: str, *args) -> None:
    """Do on this rank what rank 0's ``TPEngine`` did. A request rank 0 accepted is accepted here
    too (the same checks on the same input); its results are rank 0's to report."""
    handles = engine.remote_handles
    if op == "submit":
        rid, segments, options, eos = args
        engine.host.eos_ids = set(eos)
        source = options.get("source")
        if source is not None and isinstance(source.store, StoreRef):   # rank 0's index store, by path
            options = {**options, "source": dataclasses.replace(source, store=open_ref(source.store, engine.remote_stores))}
        handles[rid] = engine.submit(segments, **options)
    elif op == "step":
        engine.step()
        for rid in [rid for rid, h in handles.items() if h.done]:
            del handles[rid]
    elif op == "abort":
        handle = handles.pop(args[0], None)
        if handle is not None:
            engine.abort(handle)
    elif op == "encode_chunks":
        chunks, prefix, wrapper, cache, quantize = args
        with torch.inference_mode():
            encode_whole(engine, chunks, prefix, wrapper, cache, quantize)
    elif op == "clear_cache":
        engine.clear_cache()
    elif op == "written":   # rank 0's write-backs of the last step, which this rank's snapshot lacks
        for ref, chunk_id, loc in args[0]:
            open_ref(ref, engine.remote_stores).note_written(chunk_id, loc)
    else:
        raise LazyRagError(f"unknown tensor-parallel command {op!r}")
