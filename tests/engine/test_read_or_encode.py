"""A request's chunks that no tier holds are encoded together (one forward), and a chunk whose
stored KV would come from the disk is encoded again instead when that is faster here
(``engine.read_or_encode``): the answer is the same either way, the record on disk is left as it
is, and the stats say which path each chunk took."""
import pytest
import torch

from lazy_rag import Chunk, ChunkSource, LazyLLM
from lazy_rag.engine.chunk_tiers import NOT_IN_MEMORY
from lazy_rag.engine.read_or_encode import ReadOrEncode
from tests.tiny_models import tiny_model


def test_cost_model_prefers_the_cheaper_path_and_learns_both_rates():
    c = ReadOrEncode(disk_bps=1e9)
    assert not c.should_encode(10**9, 10)  # not calibrated: always read (the behaviour without a model)
    c.calibrate(lambda n: None)            # timings of a no-op: ~0 per token
    c.forward_s, c.token_s = 0.010, 1e-5   # 10 ms a forward, 100k tokens/s
    assert c.should_encode(50 << 20, 500)          # 50 MB at 1 GB/s = 52 ms > 10 + 5 ms
    assert not c.should_encode(5 << 20, 500)       # 5 MB: 5 ms < 15 ms
    assert c.should_encode(10 << 20, 500, batch_tokens=100)  # the forward is paid already: 5 ms < 10 ms
    c.observe_read(100 << 20, 1.0)                 # the disk is slower than assumed: ~0.1 GB/s
    assert c.disk_bps == pytest.approx((100 << 20) / 1.0) and c.should_encode(5 << 20, 500)
    c.observe_encode(1000, 0.010 + 1000 * 3e-5)    # encodes are slower than the probe said
    assert c.token_s == pytest.approx(0.7 * 1e-5 + 0.3 * 3e-5)
    assert c.as_dict()["disk_reads_measured"] == 1 and c.as_dict()["encodes_measured"] == 1


def test_calibration_fits_a_fixed_and_a_per_token_cost(monkeypatch):
    import time as _time

    clock = [0.0]
    monkeypatch.setattr("lazy_rag.engine.read_or_encode.time.perf_counter", lambda: clock[0])

    def encode(n):  # 4 ms a forward + 20 us a token
        clock[0] += 0.004 + n * 20e-6

    c = ReadOrEncode()
    c.calibrate(encode, small=32, large=512)
    assert c.forward_s == pytest.approx(0.004) and c.token_s == pytest.approx(20e-6)
    assert _time.perf_counter  # the real clock is untouched outside the module


class ColdStore:
    """A store whose records are intact but, per ``read_nowait``, never in the page cache; counts
    reads and writes. ``record_bytes``: what a record weighs on disk (the cost of reading it)."""

    precomputed = True

    def __init__(self, kv_by_id, record_bytes):
        self.kv_by_id, self.record_bytes = kv_by_id, record_bytes
        self.reads = self.nowait_reads = self.writes = 0

    def read_nowait(self, chunk_id, token_ids):
        self.nowait_reads += 1
        return None, NOT_IN_MEMORY

    def stored_bytes(self, chunk_id):
        return self.record_bytes

    def read(self, chunk_id, token_ids):
        self.reads += 1
        return self.kv_by_id[chunk_id], None

    def write_back(self, chunk_id, token_ids, kv):
        self.writes += 1
        return 0


@pytest.fixture()
def llm(tokenizer, device):
    # head_dim 32: on CUDA the batched encode runs the Triton kernel
    llm = LazyLLM(tiny_model("llama", "llama3", seed=4, hidden_size=128).to(device), tokenizer, page_size=4)
    llm.eos_ids = set()
    return llm


CHUNKS = {"a": list(range(400, 411)), "b": list(range(500, 507)), "c": list(range(600, 613))}


def segments():
    return [[11, 12, 13]] + [Chunk(ids, chunk_id=cid) for cid, ids in CHUNKS.items()] + [[30, 31, 32]]


def test_missing_chunks_are_encoded_in_one_forward(llm, monkeypatch):
    eng = llm.engine
    reference = llm.next_token_logits(segments(), mode="lazy")  # placed one way
    eng.clear_cache()
    calls = []
    real = eng.runner.encode
    monkeypatch.setattr(eng.runner, "encode", lambda jobs, **kw: calls.append(len(jobs)) or real(jobs, **kw))
    out = llm.generate(segments(), max_new_tokens=1, mode="lazy")
    assert calls == [3]  # three chunks, one forward
    assert out.stats.chunk_sources == {"encoded": 3}
    torch.testing.assert_close(llm.next_token_logits(segments(), mode="lazy"), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("record_bytes, path", [(10 << 30, "recomputed"), (1, "disk")])
def test_a_cold_chunk_is_read_or_encoded_by_cost_and_answers_the_same(llm, record_bytes, path):
    eng = llm.engine
    kvs = dict(zip(CHUNKS, eng.encode_chunks(list(CHUNKS.values()), cache=False)))
    reference = llm.generate(segments(), max_new_tokens=3, mode="lazy")
    for mode in ("lazy", "block"):
        eng.clear_cache()
        store = ColdStore(kvs, record_bytes)
        planner = eng.planner
        planner.chooser.forward_s, planner.chooser.token_s = 1e-3, 1e-6  # calibrated: 1 ms + 1 us/token
        out = llm.generate(segments(), max_new_tokens=3, mode=mode, source=ChunkSource((), store))
        assert out.stats.chunk_sources == {path: 3}
        assert store.writes == 0  # an intact record is never rewritten
        assert store.reads == (3 if path == "disk" else 0)
        if mode == "lazy":
            assert out.token_ids == reference.token_ids
        if path == "disk":  # a read that went to the disk teaches the chooser the disk's rate
            assert planner.chooser.disk_measured >= 3
