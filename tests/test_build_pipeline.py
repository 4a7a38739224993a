"""The index build's KV pipeline (build_pipeline) with a fake engine, both ways it runs: a writer
thread beside the encoder (an accelerator) and writes on the encoding thread (a CPU device):
order, batch sizes, stats, the first write error stopping the build and re-raised in the caller,
a caller's error stopping the writer, and ``written`` for a store of one file per chunk."""
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lazy_rag import build_pipeline
from lazy_rag.build_pipeline import CPU_BATCH_TOKENS, STAGING_SLOTS, batches_by_tokens, encode_and_write
from lazy_rag.pinned_staging import PinnedStaging
from lazy_rag.chunk_kv import ChunkKV
from lazy_rag.store import ChunkStore


def kv_for(ids) -> ChunkKV:
    t = torch.tensor(ids, dtype=torch.float32).reshape(1, len(ids), 1, 1)
    return ChunkKV(t, -t)


class FakeEngine:
    def __init__(self, fail_at: int | None = None):
        self.config = SimpleNamespace(max_batched_tokens=16384)
        self.batches, self.fail_at, self.host_ptrs = [], fail_at, []

    def encode_chunks(self, chunks, prefix, wrapper, cache=True, quantize=None, host_alloc=None):
        assert cache is False
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            raise RuntimeError("encode failed")
        self.batches.append([len(c) for c in chunks])
        self.quantize = quantize
        kvs = [kv_for(c) for c in chunks]
        if host_alloc is None:
            return kvs
        # as the engine does: each tensor copied into the host tensor host_alloc gives it
        out = [ChunkKV(*(host_alloc(t.shape, t.dtype).copy_(t) for t in (kv.k, kv.v))) for kv in kvs]
        self.host_ptrs.append(out[0].k.data_ptr())
        return out


def fake_llm(device: str, **kw):
    return SimpleNamespace(engine=FakeEngine(**kw), device=torch.device(device), dtype=torch.float32,
                           shape=SimpleNamespace(kv_bytes_per_token=2, num_layers=1, num_kv_heads=1, head_dim=1))


class Bar:
    def __init__(self):
        self.n = 0

    def advance(self, n, note=""):
        self.n += n


def records(n: int, tokens: int = 300):
    return [SimpleNamespace(id=f"c{i}", token_ids=[i * 1000 + j for j in range(tokens)]) for i in range(n)]


class ListStore:
    """One file per chunk (``path``), writes listed with their thread; fails at write ``fail_at``."""

    shared_prefix_ids, kv_dtype = (), None

    def __init__(self, fail_at: int | None = None, delay: float = 0.0):
        self.writes, self.fail_at, self.delay = [], fail_at, delay

    def path(self, chunk_id):
        return f"/kv/{chunk_id}"

    def write(self, chunk_id, token_ids, kv) -> int:
        if self.fail_at is not None and len(self.writes) == self.fail_at:
            raise OSError(28, "No space left on device")
        time.sleep(self.delay)
        assert kv.k.flatten().tolist() == list(token_ids)
        assert kv.v.flatten().tolist() == [-t for t in token_ids]
        self.writes.append((chunk_id, threading.current_thread()))
        return kv.nbytes


def writer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("lazy-rag-kv-")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_chunk_is_written_in_order_and_counted(tmp_path, device):
    """The segment store (with its prepare pool on the threaded path) gets every record, in
    order; a CPU device writes on the caller's thread in CPU_BATCH_TOKENS batches, an
    accelerator on the writer thread in the engine's max_batched_tokens batches."""
    llm, recs, bar = fake_llm(device), records(9), Bar()
    store = ChunkStore(tmp_path, "fp")
    seen = []
    real_write = store.write
    store.write = lambda cid, ids, kv: seen.append((cid, threading.current_thread())) or real_write(cid, ids, kv)
    stats = encode_and_write(llm, store, recs, None, bar, [])
    assert [cid for cid, _ in seen] == [r.id for r in recs]
    for r in recs:
        kv, why = store.read(r.id, r.token_ids)
        assert why is None and kv.k.flatten().tolist() == r.token_ids
    per_batch = max(1, CPU_BATCH_TOKENS // 300) if device == "cpu" else 9
    assert llm.engine.batches == [[300] * len(b) for b in (recs[i:i + per_batch] for i in range(0, 9, per_batch))]
    on_caller = {t is threading.current_thread() for _, t in seen}
    assert on_caller == {device == "cpu"}
    assert (stats.chunks, stats.tokens, stats.batches) == (9, 2700, len(llm.engine.batches)) and bar.n == 2700
    assert stats.kv_bytes > 9 * 2 * 300 * 4 and stats.encode_s > 0 and stats.write_s > 0
    assert stats.bound in ("encode", "write") and stats.as_dict()["tokens_per_s"] > 0
    assert not writer_threads()


@pytest.mark.parametrize("background", [False, True])
def test_the_first_write_error_stops_the_build_and_is_raised_in_the_caller(background):
    llm, store, written = fake_llm("cpu"), ListStore(fail_at=4), []
    with pytest.raises(OSError, match="No space"):
        encode_and_write(llm, store, records(12), None, Bar(), written, batch_tokens=600, background=background)
    assert [cid for cid, _ in store.writes] == ["c0", "c1", "c2", "c3"]
    assert written == ["/kv/c0", "/kv/c1", "/kv/c2", "/kv/c3"]
    # inline: nothing encoded after the failing batch; threaded: at most the batches queued meanwhile
    assert len(llm.engine.batches) == 3 if not background else len(llm.engine.batches) < 6
    assert not writer_threads()


@pytest.mark.parametrize("background", [False, True])
def test_an_encode_error_stops_the_writer_after_what_was_encoded(background):
    llm, store, written = fake_llm("cpu", fail_at=2), ListStore(), []
    with pytest.raises(RuntimeError, match="encode failed"):
        encode_and_write(llm, store, records(8), None, Bar(), written, batch_tokens=600, background=background)
    # the two batches encoded are written whole or not at all, in order; never a later one
    assert [cid for cid, _ in store.writes] in (["c0", "c1", "c2", "c3"], ["c0", "c1"], []) if background \
        else [cid for cid, _ in store.writes] == ["c0", "c1", "c2", "c3"]
    assert written == [f"/kv/{cid}" for cid, _ in store.writes]
    assert not writer_threads()


@pytest.mark.parametrize("device,kv_dtype,quantize", [("cuda", torch.float8_e4m3fn, "fp8"),
                                                      ("cuda", torch.quint4x2, "int4"),
                                                      ("cuda", None, None),
                                                      ("cpu", torch.float8_e4m3fn, None),
                                                      ("cpu", torch.quint4x2, None)])
def test_a_quantised_store_is_quantised_by_the_engine_on_an_accelerator(tmp_path, device, kv_dtype, quantize):
    """An fp8 or int4 store's build asks the engine for KV in that format (quantised on its
    device: a half or a quarter of the bytes to copy, and none of the host threads' quantising);
    a CPU build quantises in the store."""
    llm = fake_llm(device)
    store = ListStore()
    store.kv_dtype = kv_dtype
    encode_and_write(llm, store, records(3), None, Bar(), [])
    assert llm.engine.quantize == quantize


def test_batches_are_balanced_within_the_budget():
    """As many batches as filling each to the budget makes, of about equal size: 10 x 300 tokens
    at 1000 a batch are 4 batches of 2-3 records, not 3, 3, 3 and 1 (a small last batch picks
    other kernel settings, and compiled them on a fresh machine); order kept, none over budget."""
    sizes = [len(b) for b in batches_by_tokens(records(10), 1000)]
    assert len(sizes) == 4 and sum(sizes) == 10 and max(sizes) - min(sizes) <= 1
    rng = random.Random(0)
    for _ in range(50):
        recs = [SimpleNamespace(token_ids=[0] * rng.randint(1, 700)) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(700, 3000)
        batches = list(batches_by_tokens(recs, budget))
        assert [r for b in batches for r in b] == recs
        assert all(sum(len(r.token_ids) for r in b) <= budget for b in batches)
        greedy, n = 1, 0
        for r in recs:
            if n and n + len(r.token_ids) > budget:
                greedy, n = greedy + 1, 0
            n += len(r.token_ids)
        assert len(batches) <= greedy + 1
    assert list(batches_by_tokens([], 1000)) == []
    one_big = [SimpleNamespace(token_ids=[0] * 5000)]
    assert list(batches_by_tokens(one_big, 1000)) == [one_big]


def test_an_accelerator_build_reuses_its_staging_buffers(monkeypatch):
    """On CUDA the host copies land in STAGING_SLOTS reused buffers (here unpinned, on a machine
    without CUDA): a slow disk makes the encoder wait for a buffer rather than overwrite one the
    writer has not written yet (the store checks every value it writes), and no buffer beyond the
    slots is ever made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made = []

    def staging(slots, slot_bytes):
        made.append(PinnedStaging(slots, slot_bytes, pin=False))
        return made[-1]

    monkeypatch.setattr(build_pipeline, "PinnedStaging", staging)
    llm, store = fake_llm("cuda"), ListStore(delay=0.01)
    stats = encode_and_write(llm, store, records(24), None, Bar(), [], batch_tokens=600)
    assert [cid for cid, _ in store.writes] == [r.id for r in records(24)]
    assert len(llm.engine.batches) == 12 and len(set(llm.engine.host_ptrs)) <= STAGING_SLOTS
    assert stats.own_pins == 0 and len(made) == 1 and made[0].slots == STAGING_SLOTS
    assert made[0].slot_bytes >= 600 * 8 and made[0].slot_bytes < 2 * 600 * 8 + 8 * 512
    # a build of one small batch: one buffer of that batch's size
    encode_and_write(fake_llm("cuda"), ListStore(), records(1, tokens=10), None, Bar(), [], batch_tokens=600)
    assert made[1].slots == 1 and made[1].slot_bytes == 10 * 8 + 8 * 512
    # a wrapper's slots come back with each chunk's KV: room for them too
    encode_and_write(fake_llm("cuda"), ListStore(), records(2, tokens=10), SimpleNamespace(slots=5), Bar(), [],
                     batch_tokens=600)
    assert made[2].slots == 1 and made[2].slot_bytes == 2 * (10 + 5) * 8 + 8 * 512
    assert not writer_threads() and not [t for t in threading.enumerate() if t.name == "lazy-rag-pinned-staging"]


def test_the_encode_warmup_encodes_short_chunks_as_the_build_will_and_only_logs_a_failure(caplog):
    """EncodeWarmup: CHUNKS chunks of TOKENS with the build's shared prefix and wrapper, quantised
    for an fp8 store as encode_and_write's batches are (engine_quantizes: off the CPU), so that
    they find their kernels compiled; a failure is logged, not raised (the build's own encode
    raises it); only a CUDA build warms up."""
    from lazy_rag.build_pipeline import EncodeWarmup
    from lazy_rag.kernels import FP8

    calls = []

    class Engine:
        def encode_chunks(self, chunks, prefix, wrapper, cache=True, quantize=None, host_alloc=None):
            calls.append((chunks, prefix, wrapper, cache, quantize))
            if len(calls) == 2:
                raise RuntimeError("out of memory")

    from lazy_rag.build_pipeline import engine_quantizes
    from lazy_rag.kv_record import INT4
    assert engine_quantizes(FP8, torch.device("cuda")) == "fp8" and engine_quantizes(FP8, torch.device("cpu")) is None
    assert engine_quantizes(INT4, torch.device("cuda")) == "int4" and engine_quantizes(INT4, torch.device("cpu")) is None
    assert engine_quantizes(torch.bfloat16, torch.device("cuda")) is None
    llm = SimpleNamespace(engine=Engine(), device=torch.device("cuda"))    # never touched: a fake
    w = EncodeWarmup(llm, [7, 8], "wrapper", FP8)
    assert w.wait() >= 0 and w.error is None and not w.thread.is_alive()
    assert calls == [([[1] * EncodeWarmup.TOKENS] * EncodeWarmup.CHUNKS, (7, 8), "wrapper", False, "fp8")]
    assert EncodeWarmup.CHUNKS > 1 and EncodeWarmup.TOKENS * 16 > 128 and EncodeWarmup.TOKENS % 16
    with caplog.at_level("WARNING"):
        w = EncodeWarmup(llm, (), None, torch.bfloat16)
        w.wait()
    assert isinstance(w.error, RuntimeError) and calls[1][4] is None
    assert "warm-up failed (RuntimeError: out of memory)" in caplog.text
    assert not EncodeWarmup.wanted(SimpleNamespace(device=torch.device("cpu")))
    assert EncodeWarmup.wanted(llm) == torch.cuda.is_available()


def test_work_beside_the_writes_runs_once_while_the_writer_is_busy():
    """``beside_writes`` (the build's encode calibration) runs once on the encoding thread: on
    the threaded path as soon as a batch finds the writer's queue full (the disk is the bound),
    with batches still waiting to be written; a build that never waits on the disk runs it after
    its last batch is queued, and a CPU build (written inline) after its last batch, before it
    returns; a build with no batches never runs it."""
    llm, store = fake_llm("cuda"), ListStore(delay=0.02)
    seen = []

    def task():
        seen.append((threading.current_thread(), len(llm.engine.batches), len(store.writes)))

    stats = encode_and_write(llm, store, records(12), None, Bar(), [], batch_tokens=300, max_pending_bytes=1,
                             beside_writes=task)
    (thread, encoded, written), = seen
    assert thread is threading.current_thread()
    assert 1 < encoded < 12 and written < encoded - 1    # a batch queued and one written past it at least
    assert stats.beside_at_batch == encoded and stats.beside_s >= 0
    assert [cid for cid, _ in store.writes] == [r.id for r in records(12)]
    seen.clear()
    llm = fake_llm("cuda")
    stats = encode_and_write(llm, ListStore(), records(3), None, Bar(), [], batch_tokens=300, beside_writes=task)
    assert [e for _, e, _ in seen] == [3] and stats.beside_at_batch == 3
    seen.clear()
    llm, store = fake_llm("cpu"), ListStore()
    stats = encode_and_write(llm, store, records(5), None, Bar(), [], batch_tokens=300, beside_writes=task)
    assert seen == [(threading.current_thread(), 5, 5)] and stats.beside_at_batch == 5
    seen.clear()
    encode_and_write(fake_llm("cuda"), ListStore(), [], None, Bar(), [], beside_writes=task)
    assert seen == []


def test_tasks_beside_the_writes_each_take_a_full_queue_of_their_own():
    """A sequence of tasks beside the writes (the build's embedding, then its calibration) runs in
    order, each at a batch of its own that finds the writer's queue full, so that each is hidden
    behind a queue's worth of writes; the ones a build never waited for run once its last batch
    is queued."""
    llm, store = fake_llm("cuda"), ListStore(delay=0.02)
    seen = []
    tasks = [lambda i=i: seen.append((i, len(llm.engine.batches))) for i in range(2)]
    stats = encode_and_write(llm, store, records(12), None, Bar(), [], batch_tokens=300, max_pending_bytes=1,
                             beside_writes=tasks)
    assert [i for i, _ in seen] == [0, 1] and 1 < seen[0][1] < seen[1][1] < 12
    assert stats.beside_at_batch == seen[0][1] and len(tasks) == 2   # the caller's sequence is not consumed
    seen.clear()
    llm = fake_llm("cuda")
    stats = encode_and_write(llm, ListStore(), records(3), None, Bar(), [], batch_tokens=300, beside_writes=tasks)
    assert seen == [(0, 3), (1, 3)] and stats.beside_at_batch == 3


def test_an_interrupt_in_the_work_beside_the_writes_gives_every_staging_buffer_back(monkeypatch):
    """The calibration logs its own errors; an interrupt in it (Ctrl-C) stops the build like an
    encode error: raised in the caller, the writer stopped, and every batch's staging buffer,
    the one not yet queued included, given back (none stays pinned)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    leases = []

    class Staging(PinnedStaging):
        def lease(self):
            leases.append(super().lease())
            return leases[-1]

    monkeypatch.setattr(build_pipeline, "PinnedStaging", lambda slots, nbytes: Staging(slots, nbytes, pin=False))

    class Interrupt(BaseException):
        pass

    def task():
        raise Interrupt

    with pytest.raises(Interrupt):
        encode_and_write(fake_llm("cuda"), ListStore(delay=0.02), records(12), None, Bar(), [], batch_tokens=300,
                         max_pending_bytes=1, beside_writes=task)
    assert 1 < len(leases) < 12 and all(lease.buf is None for lease in leases)
    assert not writer_threads()


@pytest.mark.parametrize("lengths", [(1,), (127, 128, 129), (300, 5, 64, 700), (5,) * 40])
def test_an_int4_batch_fits_its_staging_buffer(lengths):
    """staging_bytes: a batch of chunks quantised one by one on the GPU (int4: six tensors each,
    a last key group of its own) fits the buffer, carved as PinnedStaging's leases carve it."""
    from lazy_rag.build_pipeline import staging_bytes
    from lazy_rag.kv_int4 import bytes_per_token, quantize_kv
    from lazy_rag.pinned_staging import ALIGN

    shape = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64)
    batches = [[SimpleNamespace(token_ids=[0] * n) for n in lengths]]
    per_token = bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    used = 0
    for n in lengths:
        kv = torch.randn(shape.num_layers, n, shape.num_kv_heads, shape.head_dim)
        for t in quantize_kv(kv, kv).values():
            used = -(-used // ALIGN) * ALIGN + t.numel() * t.dtype.itemsize
    assert used <= staging_bytes(shape, batches, 0, per_token, "int4")
    if len(lengths) == 40:   # many short chunks: their own groups and starts outgrow the per-token count
        assert used > staging_bytes(shape, batches, 0, per_token, None)
