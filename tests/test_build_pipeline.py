"""The index build's KV pipeline (build_pipeline) with a fake engine, both ways it runs: a writer
thread beside the encoder (an accelerator) and writes on the encoding thread (a CPU device):
order, batch sizes, stats, the first write error stopping the build and re-raised in the caller,
a caller's error stopping the writer, and ``written`` for a store of one file per chunk."""
import threading
from types import SimpleNamespace

import pytest
import torch

from lazy_rag.build_pipeline import CPU_BATCH_TOKENS, encode_and_write
from lazy_rag.store import ChunkKV, ChunkStore


def kv_for(ids) -> ChunkKV:
    t = torch.tensor(ids, dtype=torch.float32).reshape(1, len(ids), 1, 1)
    return ChunkKV(t, -t)


class FakeEngine:
    def __init__(self, fail_at: int | None = None):
        self.config = SimpleNamespace(max_batched_tokens=16384)
        self.batches, self.fail_at = [], fail_at

    def encode_chunks(self, chunks, prefix, wrapper, cache=True, quantize=False):
        assert cache is False
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            raise RuntimeError("encode failed")
        self.batches.append([len(c) for c in chunks])
        self.quantize = quantize
        return [kv_for(c) for c in chunks]


def fake_llm(device: str, **kw):
    return SimpleNamespace(engine=FakeEngine(**kw), device=torch.device(device), dtype=torch.float32,
                           shape=SimpleNamespace(kv_bytes_per_token=2))


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

    def __init__(self, fail_at: int | None = None):
        self.writes, self.fail_at = [], fail_at

    def path(self, chunk_id):
        return f"/kv/{chunk_id}"

    def write(self, chunk_id, token_ids, kv) -> int:
        if self.fail_at is not None and len(self.writes) == self.fail_at:
            raise OSError(28, "No space left on device")
        assert kv.k.flatten().tolist() == list(token_ids)
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


@pytest.mark.parametrize("device,kv_dtype,quantize", [("cuda", torch.float8_e4m3fn, True),
                                                      ("cuda", None, False),
                                                      ("cpu", torch.float8_e4m3fn, False)])
def test_an_fp8_store_is_quantised_by_the_engine_on_an_accelerator(tmp_path, device, kv_dtype, quantize):
    """An fp8 store's build asks the engine for fp8 KV (quantised on its device: half the bytes
    to copy, and none of the host threads' quantising); a CPU build quantises in the store."""
    llm = fake_llm(device)
    store = ListStore()
    store.kv_dtype = kv_dtype
    encode_and_write(llm, store, records(3), None, Bar(), [])
    assert llm.engine.quantize is quantize
