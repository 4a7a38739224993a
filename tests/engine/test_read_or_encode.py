"""A request's chunks that no tier holds are encoded together (one forward), and a chunk whose
stored KV would come from the disk is encoded again instead when that is faster here
(``engine.read_or_encode``): the answer is the same either way, the record on disk is left as it
is, and the stats say which path each chunk took."""
import time

import pytest
import torch

from lazy_rag import Chunk, ChunkSource, LazyLLM
from lazy_rag.chunk_kv import NOT_IN_MEMORY
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
    # from the page cache (2 GB/s until measured) 50 MB take 26 ms: still slower than 15 ms
    assert c.should_encode(50 << 20, 500, cached=True) and not c.should_encode(20 << 20, 500, cached=True)
    c.observe_read(100 << 20, 0.01, cached=True)   # ~10 GB/s: reading 50 MB (5 ms) beats encoding
    assert not c.should_encode(50 << 20, 500, cached=True) and c.page_cache_measured == 1
    c.observe_encode(1000, 0.010 + 1000 * 3e-5)    # encodes are slower than the probe said
    assert c.token_s == pytest.approx(0.7 * 1e-5 + 0.3 * 3e-5)
    assert c.as_dict()["disk_reads_measured"] == 1 and c.as_dict()["encodes_measured"] == 1
    with c.forcing(encode=False):                  # lazy-rag compile runs each path whatever the costs
        assert not c.should_encode(50 << 20, 500)
        with c.forcing(encode=True):
            assert c.should_encode(5 << 20, 500)
        assert not c.should_encode(50 << 20, 500)
    assert c.forced is None and c.should_encode(50 << 20, 500)


def test_calibration_fits_a_fixed_and_a_per_token_cost(monkeypatch):
    import time as _time

    clock = [0.0]
    monkeypatch.setattr("lazy_rag.engine.read_or_encode.time.perf_counter", lambda: clock[0])

    def encode(n):  # 4 ms a forward + 20 us a token
        clock[0] += 0.004 + n * 20e-6

    c = ReadOrEncode()
    c.calibrate(encode, small=32, large=512)
    assert c.forward_s == pytest.approx(0.004) and c.token_s == pytest.approx(20e-6)
    # linear (a CPU): the long probe's average per token is a floor: 4 ms / 512 + 20 us
    c.calibrate(encode, small=32, large=512, linear=True)
    assert c.token_s == pytest.approx(0.004 / 512 + 20e-6)

    def noisy(n):  # a busy machine: the short probes are slowed, the long one is not slower
        clock[0] += 0.5 if n == 32 else 0.4

    c.calibrate(noisy, small=32, large=512)
    assert c.token_s == pytest.approx(0.4 / 512)  # not ~0: an encode never looks free
    assert _time.perf_counter  # the real clock is untouched outside the module


def test_a_fit_is_kept_per_machine_and_model_for_a_day(monkeypatch, tmp_path):
    """A short `lazy-rag query` process reuses the probes an earlier one measured on this
    machine for this model shape; another key, a stale or a damaged file measure again."""
    from lazy_rag.engine import read_or_encode as roe

    path = tmp_path / "cache" / "calibration.json"
    monkeypatch.setenv("LAZY_RAG_CALIBRATION", str(path))
    probes = []

    def encode(n):
        probes.append(n)

    first = ReadOrEncode()
    first.calibrate_kept("cpu x2 | model A", encode, small=32, large=512, repeats=1, linear=True)
    assert first.calibration == "measured" and probes and path.exists()
    probes.clear()
    again = ReadOrEncode()
    again.calibrate_kept("cpu x2 | model A", encode, small=32, large=512)
    assert again.calibration == "kept" and probes == []
    assert (again.forward_s, again.token_s) == (first.forward_s, first.token_s)
    other = ReadOrEncode()
    other.calibrate_kept("cpu x2 | model B", encode, small=32, large=512, repeats=1)
    assert other.calibration == "measured" and probes
    assert roe.load_calibration("cpu x2 | model A") is not None      # B's save kept A's entry
    assert roe.load_calibration("cpu x2 | model A", now=time.time() + 2 * 86400) is None   # stale
    path.write_text("{not json")
    assert roe.load_calibration("cpu x2 | model A") is None
    roe.save_calibration("k", 0.001, 1e-6)                          # a damaged file is replaced
    assert roe.load_calibration("k") == (0.001, 1e-6)
    monkeypatch.setenv("LAZY_RAG_CALIBRATION", "off")
    assert roe.calibration_path() is None and roe.load_calibration("k") is None


def test_an_unwritable_calibration_cache_only_costs_the_probes(monkeypatch, tmp_path, caplog):
    from lazy_rag.engine import read_or_encode as roe

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LAZY_RAG_CALIBRATION", str(blocker / "calibration.json"))  # under a file
    c = ReadOrEncode()
    c.calibrate_kept("k", lambda n: None, small=32, large=512, repeats=1)
    assert c.calibrated and c.calibration == "measured"
    assert "could not keep the encode calibration" in caplog.text


class ColdStore:
    """A store whose records are intact but never in the page cache (``cached=False``, per
    ``in_memory`` and ``read_nowait``) or always (``cached=True``); counts reads and writes.
    ``record_bytes``: what a record weighs (the cost of reading it)."""

    precomputed = True

    def __init__(self, kv_by_id, record_bytes, cached=False):
        self.kv_by_id, self.record_bytes, self.cached = kv_by_id, record_bytes, cached
        self.reads = self.nowait_reads = self.writes = 0

    def in_memory(self, chunk_id):
        return self.cached

    def read_nowait(self, chunk_id, token_ids):
        self.nowait_reads += 1
        if self.cached:
            self.reads += 1
            return self.kv_by_id[chunk_id], None
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


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_missing_chunks_are_encoded_in_one_forward(llm, monkeypatch, mode):
    """lazy: the three missing chunks ride in the request's own prefill forward (no encode
    forward at all); block copies its chunks before its prefill, so it encodes them in one forward
    of their own. Either way the answer equals that of chunks already cached."""
    eng = llm.engine
    reference = llm.next_token_logits(segments(), mode=mode)
    eng.clear_cache()
    encodes, forwards = [], []
    real_encode, real_forward = eng.runner.encode, eng.runner.forward
    monkeypatch.setattr(eng.runner, "encode", lambda jobs, **kw: encodes.append(len(jobs)) or real_encode(jobs, **kw))
    monkeypatch.setattr(eng.runner, "forward", lambda *a, **kw: forwards.append(a[0].numel()) or real_forward(*a, **kw))
    out = llm.generate(segments(), max_new_tokens=1, mode=mode)
    chunk_tokens = sum(len(ids) for ids in CHUNKS.values())
    if mode == "lazy":
        assert encodes == [] and len(forwards) == 1 and forwards[0] > chunk_tokens
    else:
        # then its prefill (on CUDA it may replay a captured graph, which calls no forward)
        assert encodes == [3] and forwards[0] == chunk_tokens
    assert out.stats.chunk_sources == {"encoded": 3}
    monkeypatch.undo()
    # the chunks are cached now: the next request reads them from the pool
    again = llm.generate(segments(), max_new_tokens=1, mode=mode)
    assert again.stats.chunk_sources == {"pool": 3}
    torch.testing.assert_close(llm.next_token_logits(segments(), mode=mode), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("record_bytes, cached, path", [(10 << 30, False, "recomputed"), (1, False, "disk"),
                                                         (10 << 30, True, "recomputed"), (1, True, "disk")])
def test_a_cold_chunk_is_read_or_encoded_by_cost_and_answers_the_same(llm, record_bytes, cached, path):
    """From the disk or from the page cache, a record is read or encoded again by cost."""
    eng = llm.engine
    kvs = dict(zip(CHUNKS, eng.encode_chunks(list(CHUNKS.values()), cache=False)))
    reference = llm.generate(segments(), max_new_tokens=3, mode="lazy")
    for mode in ("lazy", "block"):
        eng.clear_cache()
        store = ColdStore(kvs, record_bytes, cached)
        planner = eng.planner
        planner.chooser.forward_s, planner.chooser.token_s = 1e-3, 1e-6  # calibrated: 1 ms + 1 us/token
        out = llm.generate(segments(), max_new_tokens=3, mode=mode, source=ChunkSource((), store))
        assert out.stats.chunk_sources == {path: 3}
        assert store.writes == 0  # an intact record is never rewritten
        assert store.reads == (3 if path == "disk" else 0)
        if mode == "lazy":
            assert out.token_ids == reference.token_ids
        if path == "disk":  # each read teaches the chooser the rate of where it came from
            assert (planner.chooser.page_cache_measured if cached else planner.chooser.disk_measured) >= 3


def test_a_build_keeps_the_encode_fit_so_the_first_query_probes_nothing(monkeypatch, tmp_path, tokenizer):
    """The probes run in a build that encodes KV (seconds on a CPU for a 1.5B model; inside the
    KV pipeline, before the commit: on a GPU beside the writer's writes), where a calibration
    file keeps them: a later process's first query loads the fit instead of timing probes inside
    its TTFT. With no file to keep it in, the build probes nothing."""
    from helpers import small_llm
    from lazy_rag import LazyIndex
    from lazy_rag.engine import read_or_encode as roe
    from tiny_models import tiny_model

    texts = ["The lighthouse was completed in 1871.", "Keepers lived there until 1954.", "The lens came from Paris."]
    monkeypatch.setenv("LAZY_RAG_CALIBRATION", "off")
    built = LazyIndex.from_texts(texts, tmp_path / "off", llm=small_llm(tiny_model("llama", seed=4), tokenizer),
                                 ids=["a", "b", "c"], split=False, vectors=False, progress=False, wrapper="none")
    assert "encode_calibration_s" not in built.build_report.stages
    monkeypatch.setenv("LAZY_RAG_CALIBRATION", str(tmp_path / "calibration.json"))
    builder = small_llm(tiny_model("llama", seed=4), tokenizer)
    built = LazyIndex.from_texts(texts, tmp_path / "idx", llm=builder, ids=["a", "b", "c"], split=False,
                                 vectors=False, progress=False, wrapper="none")
    stages = built.build_report.stages
    assert stages["encode_calibration_s"] >= 0 and stages["beside_s"] >= stages["encode_calibration_s"] - 1e-3
    assert stages["beside_at_batch"] == stages["batches"] >= 1  # a CPU build: after its last batch
    assert builder.engine.planner.chooser.calibration == "measured"
    key = builder.engine.planner._calibration_key()
    assert roe.load_calibration(key) is not None
    querier = small_llm(tiny_model("llama", seed=4), tokenizer)  # another process, in effect
    assert querier.engine.planner._calibration_key() == key and not querier.engine.planner.chooser.calibrated
    loaded = LazyIndex.load(tmp_path / "idx", llm=querier)
    res = querier.generate(loaded.segments("When was it completed?", ["a", "b"]), max_new_tokens=1,
                           source=loaded.chunk_source)
    assert res.stats.chunk_sources  # the chunks came from the index, through the chooser
    assert querier.engine.planner.chooser.calibration == "kept"


def test_quantised_stored_kv_is_always_read_and_kept_apart_from_unquantised_kv(llm):
    """An index of fp8 (or int4) KV answers from its stored KV: its records are read even where
    encoding looks faster, and its chunks never share a pool or host entry with the same tokens'
    unquantised KV (nor the other way round), so neither index's answers depend on what the
    other's requests left in the engine."""
    eng = llm.engine
    plain = dict(zip(CHUNKS, eng.encode_chunks(list(CHUNKS.values()), cache=False)))
    fp8 = dict(zip(CHUNKS, eng.encode_chunks(list(CHUNKS.values()), cache=False, quantize="fp8")))
    assert all(kv.format == "fp8" for kv in fp8.values())
    eng.clear_cache()
    eng.planner.chooser.forward_s, eng.planner.chooser.token_s = 1e-3, 1e-6  # encoding looks far faster
    quantised = ColdStore(fp8, 10 << 30)
    quantised.kv_format = "fp8"
    first = llm.generate(segments(), max_new_tokens=3, output_first_logits=True, source=ChunkSource((), quantised))
    assert first.stats.chunk_sources == {"disk": 3} and quantised.reads == 3
    unquantised = ColdStore(plain, 10 << 30)
    second = llm.generate(segments(), max_new_tokens=3, output_first_logits=True, source=ChunkSource((), unquantised))
    assert second.stats.chunk_sources == {"recomputed": 3}  # not the fp8 chunks the pool holds
    again = llm.generate(segments(), max_new_tokens=3, output_first_logits=True, source=ChunkSource((), quantised))
    assert again.stats.chunk_sources == {"pool": 3}
    assert torch.equal(again.first_logits, first.first_logits)
    assert not torch.equal(second.first_logits, first.first_logits)  # fp8 KV does change the logits
    eng.clear_cache()
    alone = llm.generate(segments(), max_new_tokens=3, output_first_logits=True, source=ChunkSource((), unquantised))
    assert torch.equal(alone.first_logits, second.first_logits)


@pytest.mark.parametrize("leaves, path", [(False, "recomputed"), (True, "disk")])
def test_an_encode_that_takes_the_step_out_of_its_graph_pays_a_forward(llm, monkeypatch, leaves, path):
    """In a lazy prefill an encode costs only its tokens (the forward runs anyway), unless it
    moves the step out of its captured graph (a chunk adapter's chunk on a GPU): then it pays an
    eager forward's fixed cost too, and a record in the page cache is read instead."""
    eng = llm.engine
    kvs = dict(zip(CHUNKS, eng.encode_chunks(list(CHUNKS.values()), cache=False)))
    eng.clear_cache()
    store = ColdStore(kvs, 1 << 20, cached=True)  # 1 MB from the page cache: ~0.5 ms
    chooser = eng.planner.chooser
    chooser.forward_s, chooser.token_s = 1e-2, 1e-7  # 10 ms a forward, ~1 us a chunk's tokens
    monkeypatch.setattr(eng.runner, "encode_leaves_graph", lambda ids: leaves)
    out = llm.generate(segments(), max_new_tokens=1, mode="lazy", source=ChunkSource((), store))
    assert out.stats.chunk_sources == {path: 3}
