"""An index under tensor parallelism (CPU, gloo, 2 ranks): the store on disk is the same whatever
the TP size. An index built by one process answers a TP=2 engine's lazy and block queries with the
single-process engine's and the oracle's greedy tokens (each worker opens the store by path and
reads its KV heads' slice of every record); an index built at TP=2 holds the records a TP=1 build
writes.

Records of a TP=2 build equal a TP=1 build's within fp32 summation order, not bitwise: a chunk's
K/V at layer l > 0 are projections of a residual stream whose o_proj / down_proj sums were split
over the ranks' heads and columns and added by the all-reduce (test_tensor_parallel.py measured
<= 1.2e-6 relative on logits); the tolerance here is that file's 1e-5.
"""
import pytest

from helpers import rel_err
from lazy_rag import LazyIndex, LazyLLM
from lazy_rag.oracle import greedy_block_diagonal
from tiny_models import tiny_model

TEXTS = ["The lighthouse at Marrow Point was completed in 1871 by Agnes Thorold.",
         "The bakery on Quay Street sells rye bread baked in a wood-fired oven every morning.",
         "Tides in the bay rise by four metres twice a day, and the harbour empties at low water."]
IDS = ["a", "b", "c"]
TOL, NEW = 1e-5, 4


@pytest.fixture(scope="module")
def llms(tokenizer):
    """(the engine over 2 ranks, the single-process engine) of one tiny model (2 KV heads)."""
    model = tiny_model("llama", "default", hidden_size=128)
    tp = LazyLLM(model, tokenizer, tensor_parallel=2, num_pages=64, page_size=16)
    one = LazyLLM(model, tokenizer, num_pages=64, page_size=16)
    tp.eos_ids = one.eos_ids = set()   # every answer runs its NEW tokens
    return tp, one


def _build(llm, out):
    return LazyIndex.from_texts(TEXTS, out, llm=llm, ids=IDS, split=False, vectors=False, progress=False)


def test_an_index_built_by_one_process_serves_under_tp(tmp_path, llms):
    tp, one = llms
    _build(one, tmp_path / "idx")
    index = LazyIndex.load(tmp_path / "idx", llm=tp)
    source = index.chunk_source
    segs = index.segments("Who built the lighthouse, and when?", ["a", "c"])
    for mode in ("lazy", "block"):
        tp.engine.clear_cache()   # every chunk from the disk, each rank its heads
        a = tp.generate(segs, mode=mode, max_new_tokens=NEW, source=source, output_first_logits=True)
        assert a.stats.chunk_sources == {"disk": 2}, mode
        b = one.generate(segs, mode=mode, max_new_tokens=NEW, source=source, output_first_logits=True)
        assert rel_err(a.first_logits, b.first_logits) < TOL, mode
        want = greedy_block_diagonal(one.model, one.prepare(segs, mode=mode, source=source), NEW)
        assert a.token_ids == b.token_ids == want, mode
        again = tp.generate(segs, mode=mode, max_new_tokens=NEW, source=source)   # from the ranks' pools now
        assert again.token_ids == a.token_ids and "disk" not in again.stats.chunk_sources, mode


def test_a_tp_build_writes_a_single_process_builds_records(tmp_path, llms):
    tp, one = llms
    built_tp, built_one = _build(tp, tmp_path / "tp"), _build(one, tmp_path / "one")
    assert built_tp.manifest["kv_dtype"] == built_one.manifest["kv_dtype"]
    for r in built_one.records:
        got, why = built_tp.store.read(r.id, r.token_ids)
        want, _ = built_one.store.read(r.id, r.token_ids)
        assert why is None and got.k.shape == want.k.shape and got.k.shape[2] == one.shape.num_kv_heads
        assert rel_err(got.k, want.k) < TOL and rel_err(got.v, want.v) < TOL, r.id


def test_kv_written_back_while_serving_is_read_by_every_rank(tmp_path, llms):
    """An index whose KV is deferred to first use (``precompute_kv=False``): the first query
    encodes its chunks and rank 0 writes them back (every rank's heads); once the pools and host
    tiers are cleared, the next query must read that record on every rank, not on rank 0 alone
    (a worker still on the generation it opened would encode instead, and the ranks would leave
    lockstep)."""
    tp, one = llms
    LazyIndex.from_texts(TEXTS, tmp_path / "idx", llm=one, ids=IDS, split=False, vectors=False, progress=False,
                         precompute_kv=False)
    index = LazyIndex.load(tmp_path / "idx", llm=tp)
    source = index.chunk_source
    segs = index.segments("Who built the lighthouse, and when?", ["a", "c"])
    tp.engine.clear_cache()
    first = tp.generate(segs, mode="lazy", max_new_tokens=NEW, source=source)
    assert "disk" not in first.stats.chunk_sources   # encoded: nothing was stored yet
    assert all(index.store.location(i) is not None for i in ("a", "c"))   # written back by rank 0
    tp.engine.clear_cache()
    again = tp.generate(segs, mode="lazy", max_new_tokens=NEW, source=source)
    assert again.stats.chunk_sources == {"disk": 2}
    want = greedy_block_diagonal(one.model, one.prepare(segs, mode="lazy", source=source), NEW)
    assert first.token_ids == again.token_ids == want


@pytest.mark.parametrize("kv_dtype", ["fp8", "int4"])
def test_a_quantised_index_serves_under_tp(tmp_path, llms, kv_dtype):
    """fp8 (a scale per layer, token and KV head) and int4 (codes, scales and zeros per KV head)
    records sliced by KV heads: each rank dequantises its heads of what a single process reads,
    so both engines answer alike from the same lossy records."""
    tp, one = llms
    LazyIndex.from_texts(TEXTS, tmp_path / "idx", llm=one, ids=IDS, split=False, vectors=False, progress=False,
                         kv_dtype=kv_dtype)
    index = LazyIndex.load(tmp_path / "idx", llm=tp)
    segs = index.segments("Who built the lighthouse, and when?", ["a", "b", "c"])
    tp.engine.clear_cache()
    one.engine.clear_cache()
    a = tp.generate(segs, mode="lazy", max_new_tokens=NEW, source=index.chunk_source, output_first_logits=True)
    b = one.generate(segs, mode="lazy", max_new_tokens=NEW, source=index.chunk_source, output_first_logits=True)
    assert a.stats.chunk_sources == b.stats.chunk_sources == {"disk": 3}
    assert rel_err(a.first_logits, b.first_logits) < TOL and a.token_ids == b.token_ids
