"""The chunk chain below the pool: host tier, then the request's disk store, then encoding by the
engine (straight into pool pages, kept in the host tier and written back); placement of fetched
KV in the pool's key convention; one key scheme."""
import torch

from lazy_rag import ChunkSource, LazyLLM
from lazy_rag.engine.chunk_tiers import ChunkTiers, chunk_key
from lazy_rag.engine.page_pool import PagePool
from lazy_rag.store import ChunkStore
from tests.tiny_models import tiny_model


def test_pool_host_disk_encode_chain_and_write_back(tmp_path, tokenizer):
    llm = LazyLLM(tiny_model("llama", "llama3"), tokenizer, page_size=4)
    store = ChunkStore(tmp_path, "fp-test", precomputed=False)
    ids = list(range(300, 313))
    planner, tiers = llm.engine.planner, llm.engine.tiers
    e, tier = planner.place_chunk(ids, "c0", (), store)
    assert tier == "encoded" and store.location("c0") is not None  # encoded, then written back
    llm.engine.pm.release(e)
    assert planner.place_chunk(ids, "c0", (), store)[1] == "pool"
    llm.engine.pm.release(e)
    llm.engine.clear_cache()
    e2, tier2 = planner.place_chunk(ids, "c0", (), store)
    assert tier2 == "disk" and tiers.counters["disk_hits"] == 1
    llm.engine.pm.release(e2)
    llm.engine.pm.evict_unreferenced()
    assert planner.place_chunk(ids, "c0", (), store)[1] == "host"
    assert tiers.counters["encoded"] == 1


def test_placed_keys_are_chunk_local_rotations_of_the_stored_keys(tokenizer):
    llm = LazyLLM(tiny_model("llama", "llama3"), tokenizer)
    ids = list(range(40, 53))
    kv = llm.encode_chunk(ids)
    shp = llm.shape
    pool = PagePool(shp.num_layers, 8, shp.num_kv_heads, 4, shp.head_dim)
    pages = pool.alloc(4)
    tiers = ChunkTiers(host_bytes=1 << 20, pin=False)
    assert tiers.place(pool, pages, kv, llm.host.pool_rope).ready()
    k, v = pool.read_run(pages, len(ids))
    assert torch.allclose(k, llm.host.pool_rope.rotate(kv.k, torch.arange(len(ids))))
    assert torch.equal(v, kv.v)
    assert tiers.counters["bytes_to_pool"] == kv.nbytes


def test_one_key_scheme_content_and_prefix_not_chunk_ids():
    assert chunk_key([5, 6, 7]) == chunk_key((5, 6, 7))
    assert chunk_key([5, 6, 7]) != chunk_key([5, 6, 8])
    assert chunk_key([5, 6, 7]) != chunk_key([5, 6, 7], shared_prefix=[1, 2])


def test_a_chunk_encoded_for_one_source_is_a_pool_hit_for_another(tmp_path, tokenizer):
    """The same tokens after the same prefix have the same KV whichever index holds them."""
    llm = LazyLLM(tiny_model("llama"), tokenizer, page_size=4)
    a = ChunkSource((), ChunkStore(tmp_path / "a", "fp", precomputed=False))
    b = ChunkSource((), ChunkStore(tmp_path / "b", "fp", precomputed=False))
    from lazy_rag import Chunk

    segs = [[11, 12], Chunk([20, 21, 22, 23, 24], chunk_id="x"), [30, 31]]
    first = llm.generate(segs, max_new_tokens=1, source=a)
    second = llm.generate(segs, max_new_tokens=1, source=b)
    assert first.stats.chunk_sources == {"encoded": 1} and second.stats.chunk_sources == {"pool": 1}
    assert ChunkStore(tmp_path / "a", "fp").location("x") is not None  # written back to a's store
    assert ChunkStore(tmp_path / "b", "fp").location("x") is None


def test_encoding_for_an_index_build_keeps_nothing_in_memory(tokenizer):
    """encode_chunks(cache=False): the KV comes back (the build writes it to disk), and neither the
    pool nor the host tier keeps it, however many chunks pass through."""
    llm = LazyLLM(tiny_model("llama"), tokenizer, page_size=4, num_pages=64)
    eng = llm.engine
    chunks = [list(range(100 + 13 * i, 113 + 13 * i)) for i in range(40)]  # 40 x 13 tokens > the pool
    kept = eng.encode_chunks(chunks[:2])
    assert eng.stats()["pages_in_use"] > 0 and eng.tiers.host.bytes > 0  # the default keeps them
    eng.clear_cache()
    built = [kv for i in range(0, len(chunks), 4) for kv in eng.encode_chunks(chunks[i:i + 4], cache=False)]
    assert eng.stats()["pages_in_use"] == 0 and eng.tiers.host.bytes == 0 and len(eng.tiers.host) == 0
    assert [kv.num_tokens for kv in built] == [13] * len(chunks)
    for a, b in zip(kept, built[:2]):  # the same KV either way
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
