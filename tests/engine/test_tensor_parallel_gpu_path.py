"""The GPU path of tensor parallelism, as far as a machine without GPUs can check it (the runs on
two GPUs: benchmarks/device/tp_parity_gpu.py and the runbook in benchmarks/device/README.md).

Unit level, without starting NCCL: which GPU each rank takes and the error when there are too
few, which group a collective goes over (NCCL
for device tensors, waited for on the stream only; gloo for CPU tensors) and what a failed NCCL
collective does (the group breaks and its communicator is aborted), and the decisions made the
same on every rank: a CUDA graph kept only when every rank captured it, a chunk's copy into the
pool ready once placed, the pool sized by the smallest rank's budget. Over 2 ranks on the CPU:
engines that share a host tier share it on every rank (the serving benchmark's engines do).
"""
import datetime
import gc
import random
from types import SimpleNamespace

import pytest
import torch

import lazy_rag.engine.rank_group as rank_group
from lazy_rag import Chunk, LazyLLM
from lazy_rag.engine import EngineConfig
from lazy_rag.engine.chunk_tiers import ChunkTiers
from lazy_rag.engine.cuda_graphs import capture
from lazy_rag.engine.kv_planner import KVPlanner
from lazy_rag.engine.rank_devices import check_rank_devices, rank_device
from lazy_rag.engine.rank_worker import agreed_config, worker_tiers
from lazy_rag.engine.rank_group import RankFailedError, RankGroup
from lazy_rag.engine.tp_engine import check_tensor_parallel, engine_for
from lazy_rag.errors import LazyRagError
from lazy_rag.random_models import IdTokenizer
from tiny_models import tiny_model


def _gpus(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_each_rank_takes_the_next_gpu_from_rank_0s():
    assert rank_device(torch.device("cuda", 0), 1) == torch.device("cuda", 1)
    assert rank_device(torch.device("cuda", 2), 3) == torch.device("cuda", 5)
    assert rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)   # "cuda": the first GPU
    assert rank_device(torch.device("cpu"), 3) == torch.device("cpu")


def test_too_few_gpus_are_refused_naming_the_count_and_the_ways_out(monkeypatch):
    _gpus(monkeypatch, 2)
    check_rank_devices(torch.device("cuda", 0), 2)   # two ranks on two GPUs: fine
    with pytest.raises(LazyRagError, match=r"needs 3 visible GPUs.*cuda:1\.\.cuda:2.*2 are visible.*"
                                           r"CUDA_VISIBLE_DEVICES.*tensor_parallel=1"):
        check_rank_devices(torch.device("cuda", 1), 2)
    _gpus(monkeypatch, 0)
    with pytest.raises(LazyRagError, match="needs 2 visible GPUs.*0 are visible"):
        check_tensor_parallel(SimpleNamespace(device=torch.device("cuda")), 2)


def test_only_the_cpu_and_cuda_take_ranks(monkeypatch):
    _gpus(monkeypatch, 8)
    check_tensor_parallel(SimpleNamespace(device=torch.device("cuda", 0)), 2)
    check_tensor_parallel(SimpleNamespace(device=torch.device("cpu")), 2)
    with pytest.raises(LazyRagError, match="CPU \\(gloo\\) or on CUDA GPUs \\(NCCL\\), not on mps.*tensor_parallel=1"):
        check_tensor_parallel(SimpleNamespace(device=torch.device("mps")), 2)


class _FakeWork:
    def __init__(self, fail=False):
        self.fail, self.waited = fail, []

    def wait(self, *timeout):
        self.waited.append(timeout)
        if self.fail:
            raise RuntimeError("NCCL communicator was aborted")


class _FakeNccl:
    """What RankGroup asks of a ProcessGroupNCCL: the collectives and abort."""

    def __init__(self, fail=False):
        self.calls, self.aborted, self.work = [], 0, _FakeWork(fail)

    def allreduce(self, tensors):
        self.calls.append("allreduce")
        return self.work

    def allgather(self, outs, tensors):
        self.calls.append("allgather")
        return self.work

    def abort(self):
        self.aborted += 1


def _group(monkeypatch, device, nccl=None):
    """A 1-rank group on ``device`` whose NCCL group (if any) is ``nccl``: no communicator is made."""
    import torch.distributed as dist

    made = []
    monkeypatch.setattr(rank_group, "nccl_group", lambda *a: made.append(a) or nccl)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30))
    return RankGroup(0, 1, store, 30.0, device=device), made


def _on_gpu(t):
    """A CPU tensor that says it is on a GPU (where the group sends its collectives)."""
    return SimpleNamespace(is_cuda=True, contiguous=lambda: t)


def test_a_gpu_rank_sends_device_tensors_to_nccl_unwaited_and_cpu_tensors_to_gloo(monkeypatch):
    nccl = _FakeNccl()
    group, made = _group(monkeypatch, torch.device("cuda", 1), nccl)
    assert made and made[0][-1] == torch.device("cuda", 1)   # its communicator on the rank's own GPU
    group._run(_on_gpu(torch.ones(2)), lambda pg: pg.allreduce([None]), "an all-reduce")
    assert nccl.calls == ["allreduce"] and nccl.work.waited == [()]   # ordered on the stream, no host wait
    assert group.all_reduce(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]   # a CPU tensor: gloo
    group.check_lockstep([1, 2], "a forward")
    assert nccl.calls == ["allreduce"]
    assert group.defer_lockstep and len(group.pending_lockstep) == 1   # compared before the step is read
    group.check_pending_lockstep()
    assert not group.pending_lockstep
    cpu, made = _group(monkeypatch, torch.device("cpu"))
    assert cpu.nccl is None and not made and not cpu.defer_lockstep
    cpu.settle()   # nothing queued on the CPU


def test_a_gpu_rank_gathers_host_kv_over_its_gpu_and_returns_it_on_the_host():
    """A chunk's KV encoded to the host (an index build, a warm-up) is gathered over NCCL on a GPU
    rank, not over gloo; every dtype (fp8 codes and scales too) comes back whole, on the host."""
    from lazy_rag.chunk_kv import ChunkKV
    from lazy_rag.engine.tensor_parallel import HeadShard

    sent = []

    def all_gather(b):   # rank 1's heads: this rank's bytes + 1
        sent.append((b.device, b.dtype))
        return [b, b + 1]

    group = SimpleNamespace(rank=0, size=2, nccl=_FakeNccl(), device=torch.device("cpu"),
                            all_gather=all_gather, share=lambda n: slice(0, n // 2))
    shard = HeadShard(group, 4)
    k = torch.randn(3, 5, 2, 8).to(torch.float8_e4m3fn)
    kv = ChunkKV(k, torch.randn(3, 5, 2, 8, dtype=torch.bfloat16), k_scale=torch.rand(3, 5, 2),
                 v_scale=torch.rand(3, 5, 2))
    whole = shard.whole(kv)
    for name, t in kv.tensors().items():
        got = whole.tensors()[name]
        assert got.dtype == t.dtype and got.device.type == "cpu" and got.shape[2] == 4
        assert torch.equal(got[:, :, :2].view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(got[:, :, 2:].view(torch.uint8), t.view(torch.uint8) + 1)
    assert sent and all(d == (group.device, torch.uint8) for d in sent)
    group.nccl = None   # the CPU: gloo, the same result
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(shard.whole(kv).tensors().values(), whole.tensors().values()))


def test_a_failed_nccl_collective_breaks_the_group_and_aborts_its_communicator(monkeypatch):
    nccl = _FakeNccl(fail=True)
    group, _ = _group(monkeypatch, torch.device("cuda", 0), nccl)
    with pytest.raises(RankFailedError, match="NCCL failed during an all-reduce"):
        group._run(_on_gpu(torch.ones(2)), lambda pg: pg.allreduce([None]), "an all-reduce")
    assert nccl.aborted == 1
    with pytest.raises(RankFailedError):   # every later collective, at once
        group.all_reduce(torch.ones(1))


def test_a_cuda_graph_is_kept_only_when_every_rank_captured_it(monkeypatch):
    import lazy_rag.engine.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "_capture", lambda runner, padding, forward: "graph")
    votes = []

    def runner(others_ok):
        return SimpleNamespace(group=SimpleNamespace(agree=lambda ok: votes.append(ok) or (ok and others_ok)))

    assert capture(runner(others_ok=False), None, None) is None
    assert capture(runner(others_ok=True), None, None) == "graph"
    assert votes == [True, True]
    assert capture(SimpleNamespace(group=None), None, None) == "graph"   # one process: nothing to agree


def test_a_rank_counts_a_placed_chunk_ready_without_asking_the_gpu():
    class Copy:
        waited = False

        def ready(self):   # a CUDA copy not finished yet, on this process's clock
            return False

        def wait(self):
            self.waited = True

    def seq(copy):
        return SimpleNamespace(held=[SimpleNamespace(meta={"transfer": copy})])

    alone, rank = Copy(), Copy()
    assert not KVPlanner.ready(SimpleNamespace(lockstep=False), seq(alone))
    assert KVPlanner.ready(SimpleNamespace(lockstep=True), seq(rank)) and rank.waited


def test_the_pool_holds_what_the_smallest_rank_can():
    shape = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=32)
    group = SimpleNamespace(device=torch.device("cpu"),
                            all_gather=lambda t: [t, torch.tensor([5])])   # the other rank: 5 pages
    config = EngineConfig(kv_bytes=1 << 20, page_size=16)
    assert agreed_config(config, SimpleNamespace(shape=shape), torch.float32, group).num_pages == 5
    given = EngineConfig(num_pages=9)
    assert agreed_config(given, SimpleNamespace(shape=shape), torch.float32, group) is given


def test_a_worker_keeps_one_host_tier_per_shared_tier():
    tiers = {}
    a = worker_tiers(tiers, (7, 1 << 20, False))
    assert worker_tiers(tiers, (7, 1 << 20, False)) is a and a.host.max_bytes == 1 << 20
    assert worker_tiers(tiers, None) is None


def test_engines_sharing_a_host_tier_share_it_on_every_rank():
    """A chunk one engine encoded is a host-tier hit for the next engine over the same tier on every
    rank; a worker with a tier of its own would encode what rank 0 reads and leave lockstep."""
    rng = random.Random(0)
    chunk = [rng.randrange(100, 4000) for _ in range(20)]
    segs = [[rng.randrange(100, 4000) for _ in range(4)], Chunk(chunk), [rng.randrange(100, 4000) for _ in range(3)]]
    llm = LazyLLM(tiny_model("llama"), IdTokenizer(), num_pages=32, page_size=16)
    tiers = ChunkTiers(64 << 20)
    config = EngineConfig(num_pages=32, page_size=16, tensor_parallel=2)
    first = engine_for(llm.host, config, tiers)
    first.encode_chunks([chunk])
    del first
    gc.collect()
    second = engine_for(llm.host, config, tiers)
    second.host.eos_ids = set()
    result = second.generate([dict(segments=segs, max_new_tokens=2)])[0]
    assert len(result.token_ids) == 2
    assert result.stats.chunk_sources.get("host", 0) == 1


def test_the_serving_bench_takes_a_tensor_parallel_size_but_not_for_plain_transformers():
    from lazy_rag.bench.runner import BenchConfig

    assert BenchConfig(systems=("lazy", "block"), tensor_parallel=2).validate().tensor_parallel == 2
    with pytest.raises(LazyRagError, match="--tensor-parallel 2.*drop transformers from --systems"):
        BenchConfig(tensor_parallel=2).validate()
