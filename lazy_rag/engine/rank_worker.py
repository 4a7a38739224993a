"""A tensor-parallel rank's engine (``tp_engine``): ``attach`` makes an engine over a rank's
share of the model one rank of its group, and a worker (``rank_pool.worker_main``) opens its
engine and runs each command rank 0's ``TPEngine`` sends (``open_rank_engine``,
``run_rank_command``).

Every decision an engine makes must come out the same on every rank. Those that read state of
the process rather than the requests are made the same way here: stored KV is always read
(``ReadAlways``: the read-or-encode choice weighs timings), a chunk copied into the pool is
ready when it is placed (``KVPlanner.lockstep``: whether a CUDA copy has finished differs per
process; the GPU orders the reads after it anyway), the pool's size is the smallest any rank can
hold (``agreed_config``: a budget from the GPU's free memory differs per process), and a CUDA
graph is used only when every rank captured it (``cuda_graphs.capture``)."""
from __future__ import annotations

import dataclasses

import torch

from ..errors import LazyRagError
from .chunk_tiers import ChunkTiers
from .config import EngineConfig
from .engine import Engine, pool_pages
from .read_or_encode import ReadAlways
from .store_ref import StoreRef, open_ref
from .shard_loading import RankShare
from .rank_group import RankGroup
from .tensor_parallel import HeadShard, ShardedParts


def attach(engine: Engine, group: RankGroup) -> Engine:
    """Make ``engine`` (built over ``ShardedParts``) one rank of ``group``: its tiers keep this
    rank's heads of stored KV and write every rank's, and stored KV is always read."""
    engine.tiers.heads = HeadShard(group, engine.host.shape.num_kv_heads)
    engine.planner.chooser = ReadAlways()
    engine.planner.lockstep = True
    return engine


def agreed_config(config: EngineConfig, parts: ShardedParts, model_dtype, group: RankGroup) -> EngineConfig:
    """``config`` with the page count of the smallest pool any rank can hold (a collective, as
    each rank opens its engine): a pool sized from the GPU's free memory differs per process, and
    ranks with pools of different sizes would evict and preempt differently."""
    if config.num_pages is not None:
        return config
    mine = pool_pages(config, parts.shape, model_dtype, group.device)
    return dataclasses.replace(config, num_pages=min(int(n) for n in group.all_gather(torch.tensor([mine]))))


def encode_whole(engine: Engine, chunks, prefix, wrapper, cache, quantize) -> list:
    """Chunk encode on every rank; the KV of all heads (gathered, a collective)."""
    kvs = Engine.encode_chunks(engine, chunks, prefix, wrapper, cache, quantize)
    return [engine.tiers.heads.whole(kv) for kv in kvs]


def open_rank_engine(group: RankGroup, model, experts, tokenizer, model_name, default_source, config,
                     tiers: ChunkTiers | None = None) -> Engine:
    """A worker's engine: the same host as rank 0's (tokenizer, default chunk source) and the same
    configuration, over this rank's share of the model, on this rank's device. ``model``: rank 0's
    ``RankShare`` (this rank loads its own share from the same source, directly on its device) or
    the whole model (shared memory; on a GPU, copied whole to this rank's GPU before it keeps its
    share). ``experts``: what runs rank 0's routed experts (``experts.experts_in_use``), which this
    rank runs too: registered in this process, where a whole model's config already names it.
    ``tiers``: the host tier it shares with this worker's other engines (``worker_tiers``)."""
    from ..experts import use_experts
    from ..model_host import ModelHost

    if isinstance(model, RankShare):
        model = dataclasses.replace(model, rank=group.rank, device=group.device).load()
    elif group.device.type == "cuda":
        model = model.to(group.device)
    if experts is not None:
        model = use_experts(model, experts)
    host = ModelHost(model, tokenizer, model_name=model_name)
    host.default_source = default_source
    parts = ShardedParts(host.parts, group)
    engine = Engine(host, agreed_config(config, parts, host.dtype, group), tiers, parts=parts)
    engine.remote_handles = {}
    engine.remote_stores = {}   # StoreRef -> this worker's read-only store
    attach(engine, group)
    gather_weight_bytes(engine, group)
    return engine


def worker_tiers(tiers: dict, spec) -> ChunkTiers | None:
    """This worker's host tier for rank 0's shared tier ``spec`` (``RankPool.tiers_spec``): one per
    key, kept in ``tiers``; None (``spec`` None): the engine makes its own."""
    if spec is None:
        return None
    key, max_bytes, pin = spec
    if key not in tiers:
        tiers[key] = ChunkTiers(max_bytes, pin)
    return tiers[key]


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
        rid, layout, options, eos = args   # rank 0's prepared layout
        engine.host.eos_ids = set(eos)
        source = options.get("source")
        if source is not None and isinstance(source.store, StoreRef):   # rank 0's index store, by path
            options = {**options, "source": dataclasses.replace(source, store=open_ref(source.store, engine.remote_stores))}
        handles[rid] = engine.submit(layout, **options)
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
