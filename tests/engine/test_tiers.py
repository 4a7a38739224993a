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


class _QuantisedStore:
    """A quantised store whose reads meet at a barrier: four reads in turn would never pass it."""
    kv_format = "int4"
    reads_pinned = True

    def __init__(self, kvs, barrier_parties: int):
        import threading

        self.kvs, self.threads = kvs, []
        self.barrier = threading.Barrier(barrier_parties, timeout=10)

    def read(self, chunk_id, token_ids, pin=False, tensor_crcs=True):
        import threading

        self.threads.append(threading.current_thread().name)
        self.barrier.wait()
        return self.kvs[chunk_id], None


def test_a_quantised_stores_cold_chunks_are_read_at_once(tmp_path):
    """read_ahead starts the reads of every chunk a quantised store will be read for (not those
    in the host tier), all at once; fetch takes their results in turn, the same KV a read gives."""
    from lazy_rag.chunk_kv import ChunkKV
    from lazy_rag.engine.chunk_tiers import READ_AHEAD_THREADS, host_key

    ids = {f"c{i}": list(range(10 * i, 10 * i + 7)) for i in range(READ_AHEAD_THREADS + 1)}
    kvs = {cid: ChunkKV(torch.full((1, 7, 1, 2), float(i)), torch.zeros(1, 7, 1, 2)) for i, cid in enumerate(ids)}
    store = _QuantisedStore(kvs, READ_AHEAD_THREADS)
    tiers = ChunkTiers(host_bytes=1 << 20, pin=False)
    hosted = "c0"   # in the host tier already: not read
    tiers.host.put(host_key(chunk_key(ids[hosted]), "int4"), kvs[hosted])
    chunks = [(chunk_key(t), t, cid) for cid, t in ids.items()]
    assert tiers.read_ahead(store, chunks) == READ_AHEAD_THREADS
    assert tiers.read_ahead(store, chunks) == 0                       # started once
    for key, t, cid in chunks:
        kv, tier = tiers.fetch(key, t, cid, store)
        assert torch.equal(kv.k, kvs[cid].k) and tier == ("host" if cid == hosted else "disk")
    assert len(store.threads) == READ_AHEAD_THREADS and all("read-ahead" in n for n in store.threads)
    assert not tiers._ahead


def test_read_ahead_only_for_quantised_stores_and_dropped_when_not_taken(tmp_path):
    """An unquantised store's reads are weighed against encoding one by one (read_or_encode): no
    read-ahead. Reads a request did not take are forgotten."""
    from lazy_rag.chunk_kv import ChunkKV

    tiers = ChunkTiers(host_bytes=1 << 20, pin=False)
    ids = list(range(5, 12))
    assert tiers.read_ahead(ChunkStore(tmp_path, "fp", precomputed=False), [(chunk_key(ids), ids, "c")]) == 0
    assert tiers.read_ahead(None, [(chunk_key(ids), ids, "c")]) == 0
    store = _QuantisedStore({"c": ChunkKV(torch.zeros(1, 7, 1, 2), torch.zeros(1, 7, 1, 2))}, 1)
    assert tiers.read_ahead(store, [(chunk_key(ids), ids, "c")]) == 1
    tiers.drop_read_ahead()
    assert not tiers._ahead


def test_a_lazy_request_over_an_int4_store_reads_its_chunks_ahead_with_the_same_answer(tmp_path, tokenizer,
                                                                                      monkeypatch):
    """Through the engine: a request's cold chunks of an int4 store are read ahead, all of them,
    and the answer and first logits are those of reading them one by one."""
    from lazy_rag import Chunk
    from lazy_rag.kv_record import INT4

    llm = LazyLLM(tiny_model("llama", "llama3"), tokenizer, page_size=4)
    store = ChunkStore(tmp_path, "fp", kv_dtype=INT4, precomputed=False)
    source = ChunkSource((), store)
    chunks = [Chunk(list(range(200 + 20 * i, 213 + 20 * i)), chunk_id=f"c{i}") for i in range(3)]
    segs = [[11, 12], *chunks, [30, 31, 32]]
    llm.generate(segs, max_new_tokens=1, source=source)                # encoded, written back as int4

    def answer():
        llm.engine.clear_cache()
        before = llm.engine.tiers.counters["read_ahead"]
        out = llm.generate(segs, max_new_tokens=4, source=source, output_first_logits=True)
        assert out.stats.chunk_sources == {"disk": 3}
        return out, llm.engine.tiers.counters["read_ahead"] - before

    ahead, started = answer()
    assert started == 3
    monkeypatch.setattr(ChunkTiers, "read_ahead", lambda self, store, chunks: 0)
    one_by_one, started = answer()
    assert started == 0
    assert ahead.token_ids == one_by_one.token_ids
    assert torch.equal(ahead.first_logits, one_by_one.first_logits)


def test_a_forked_child_reads_ahead_with_threads_of_its_own():
    """A process forked after reads ahead (a pre-forking server) gets a pool of its own: the
    parent's would hold no threads in the child, and its reads would never finish."""
    import os

    from lazy_rag.engine import chunk_tiers

    assert chunk_tiers.read_pool().submit(lambda: 1).result(timeout=10) == 1
    pid = os.fork()
    if pid == 0:   # the child: exit 0 only if a read-ahead task runs
        try:
            ok = chunk_tiers.read_pool().submit(lambda: 2).result(timeout=10) == 2
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
