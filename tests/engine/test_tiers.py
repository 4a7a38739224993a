"""Host tier over the disk store and encode-on-miss; placement in the pool's key convention."""
import torch

from lazy_rag import LazyLLM
from lazy_rag.engine.page_pool import PagePool
from lazy_rag.engine.tiers import ChunkTiers, chunk_key
from lazy_rag.store import ChunkStore
from tests.tiny_models import tiny_model


def test_fetch_walks_host_disk_encode_and_places_chunk_local_keys(tmp_path, tokenizer):
    llm = LazyLLM(tiny_model("llama", "llama3"), tokenizer)
    store = ChunkStore(tmp_path, llm, "fp-test", precomputed=False)
    ids = list(range(300, 313))
    key = chunk_key(ids, "c0")
    tiers = ChunkTiers(llm, host_bytes=1 << 20, store=store, pin=False)
    kv, tier = tiers.fetch(key, ids, "c0")
    assert tier == "encoded" and store.path("c0").exists()
    assert tiers.fetch(key, ids, "c0")[1] == "host"
    fresh = ChunkTiers(llm, host_bytes=1 << 20, store=store, pin=False)
    kv2, tier2 = fresh.fetch(key, ids, "c0")
    assert tier2 == "disk" and torch.equal(kv2.k, kv.k)
    assert fresh.counters["disk_hits"] == 1 and tiers.counters["encoded"] == 1

    shp = llm.shape
    pool = PagePool(shp.num_layers, 8, shp.num_kv_heads, 4, shp.head_dim)
    pages = pool.alloc(4)
    assert fresh.place(pool, pages, kv2, llm.rope, "rotate_q").ready()
    k, v = pool.read_run(pages, len(ids))
    assert torch.allclose(k, llm.rope.rotate(kv.k, torch.arange(len(ids))))
    assert torch.equal(v, kv.v)
    fresh.place(pool, pages, kv2, llm.rope, "rotate_k")
    assert torch.equal(pool.read_run(pages, len(ids))[0], kv.k)
    assert fresh.counters["bytes_to_pool"] == 2 * kv.nbytes


def test_no_store_encodes_once_then_serves_from_host(tokenizer):
    llm = LazyLLM(tiny_model("llama"), tokenizer)
    tiers = ChunkTiers(llm, host_bytes=1 << 20, pin=False)
    ids = [5, 6, 7]
    key = chunk_key(ids, None)
    assert [tiers.fetch(key, ids)[1] for _ in range(3)] == ["encoded", "host", "host"]
    assert key != chunk_key(ids, None, shared_prefix=[1, 2])
