"""The chunk-KV store the engine replicas share (``scaleout.shared_store``; no Ray needed): KV one
replica encodes is read by another instead of encoded again, two processes writing and reading
the same chunks at once never see a partial or foreign record, and what a killed writer leaves
is never read and is swept."""
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lazy_rag.server.scaleout.shared_store import (SHARED_DIR_NAME, TEMP_PREFIX, SharedChunkStore,
                                                   share_index_store, sweep_temporary)
from lazy_rag.chunk_kv import ChunkKV
from lazy_rag.store import ChunkStore

FINGERPRINT = "test-model-fingerprint"
CHUNKS = 12


def kv_of(i: int, tokens: int = 24) -> tuple[tuple[int, ...], ChunkKV]:
    """Chunk i's token ids and KV: the same in every process."""
    g = torch.Generator().manual_seed(i)
    return tuple(range(i, i + tokens)), ChunkKV(torch.randn(2, tokens, 2, 8, generator=g),
                                                torch.randn(2, tokens, 2, 8, generator=g))


def shared_store(root: Path, shared: Path, fingerprint: str = FINGERPRINT) -> SharedChunkStore:
    index = SimpleNamespace(store=ChunkStore(root, fingerprint), path=root)
    return share_index_store(index, shared)


def writer_and_reader(root: str, shared: str, order: int, rounds: int, out) -> None:
    """A replica: write every chunk (in its own order) and read every chunk, several rounds; a
    read is either missing or exactly the chunk's KV."""
    store = shared_store(Path(root), Path(shared))
    ids = list(range(CHUNKS))[::order]
    bad = []
    for _ in range(rounds):
        for i in ids:
            tokens, kv = kv_of(i)
            assert store.write_back(f"c{i}", tokens, kv) > 0
            for j in ids:
                tokens_j, want = kv_of(j)
                got, why = store.read(f"c{j}", tokens_j)
                if got is None and why != "missing":
                    bad.append((j, why))
                elif got is not None and not (torch.equal(got.k, want.k) and torch.equal(got.v, want.v)):
                    bad.append((j, "different KV"))
    out.put(bad)


def test_two_processes_write_and_read_the_same_chunks_at_once(tmp_path):
    root, shared = tmp_path / "index", tmp_path / "shared"
    root.mkdir()
    ctx = multiprocessing.get_context("fork")  # torch already imported: no second start-up
    out = ctx.Queue()
    procs = [ctx.Process(target=writer_and_reader, args=(str(root), str(shared), order, 3, out))
             for order in (1, -1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert results == [[], []]
    store = shared_store(root, shared)
    for i in range(CHUNKS):  # every chunk whole, whoever renamed last
        tokens, want = kv_of(i)
        got, why = store.read(f"c{i}", tokens)
        assert why is None and torch.equal(got.k, want.k)
    assert not list(shared.glob(f"*/{TEMP_PREFIX}*"))  # nothing left half-written
    assert not (root / "index.sqlite").exists()  # replicas never write the index


def test_records_of_another_model_or_text_are_not_read_and_are_replaced(tmp_path):
    root, shared = tmp_path / "index", tmp_path / "shared"
    root.mkdir()
    tokens, kv = kv_of(1)
    shared_store(root, shared, fingerprint="another-model").write_back("c1", tokens, kv)
    store = shared_store(root, shared)
    assert store.read("c1", tokens) == (None, "missing")  # another fingerprint: another file name
    store.write_back("c1", tokens, kv)
    other_text = tuple(t + 1 for t in tokens)
    assert store.read("c1", other_text) == (None, "token ids differ")
    path = store.shared_path("c1")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.read("c1", tokens) == (None, "checksum mismatch (corrupt)")
    store.write_back("c1", tokens, kv)  # the next encode replaces it
    assert store.read("c1", tokens)[1] is None and store.stored_bytes("c1") == path.stat().st_size - 16


def test_the_index_is_read_first_and_never_written(tmp_path):
    root, shared = tmp_path / "index", tmp_path / "shared"
    root.mkdir()
    tokens, kv = kv_of(2)
    plain = ChunkStore(root, FINGERPRINT)
    plain.write("c2", tokens, kv)  # the index's own record (a store used alone commits at once)
    segments_before = sorted((p.name, p.stat().st_size) for p in root.rglob("*.kvseg"))
    store = share_index_store(SimpleNamespace(store=plain, path=root), shared)
    assert isinstance(store, SharedChunkStore) and store.location("c2") is not None
    got, why = store.read("c2", tokens)
    assert why is None and torch.equal(got.v, kv.v)
    tokens3, kv3 = kv_of(3)
    store.write_back("c3", tokens3, kv3)
    assert sorted((p.name, p.stat().st_size) for p in root.rglob("*.kvseg")) == segments_before
    assert store.read("c3", tokens3)[1] is None and store.shared_path("c3").is_relative_to(shared)


def test_a_killed_writers_leftovers_are_never_read_and_are_swept(tmp_path):
    root = tmp_path / "index"
    root.mkdir()
    store = shared_store(root, None)  # the default folder: beside the index's KV
    assert store.shared_dir == root / SHARED_DIR_NAME
    tokens, kv = kv_of(4)
    final = store.shared_path("c4")
    final.parent.mkdir(parents=True)
    half = final.parent / f"{TEMP_PREFIX}killed"
    half.write_bytes(b"LRKV" + b"\0" * 9)  # what a writer killed mid-record leaves
    assert store.read("c4", tokens) == (None, "missing")
    os.utime(half, (time.time() - 7200, time.time() - 7200))
    fresh = final.parent / f"{TEMP_PREFIX}writing-now"
    fresh.write_bytes(b"")
    assert sweep_temporary(store.shared_dir) == 1
    assert not half.exists() and fresh.exists()  # one being written now is left alone


def test_a_chunk_one_replica_encoded_is_read_by_another(tmp_path, smollm2, corpus_index):
    """Two engines (separate pools and host tiers, as two replicas) over one index built without
    KV: the first encodes the retrieved chunks and writes them to the shared folder, the second
    reads them from there instead of encoding them."""
    from lazy_rag import LazyIndex
    from lazy_rag.engine import Engine, EngineConfig

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ferry.md").write_text("The ferry to Port Sallow is painted a deep green and leaves at noon.")
    (docs / "tower.md").write_text("The Marrow Point Lighthouse was completed in 1871 by Agnes Thorold.")
    built, _ = LazyIndex.build([str(docs)], tmp_path / "index", llm=smollm2, embedder=corpus_index.embedder,
                               progress=False, precompute_kv=False)  # the session's embedder: no second load
    question = "Which colour is the ferry?"
    replicas = []
    for _ in range(2):
        index = LazyIndex.load(built.path, llm=smollm2, embedder=corpus_index.embedder)
        share_index_store(index, tmp_path / "shared")
        engine = Engine(smollm2.host, EngineConfig(kv_bytes=64 << 20, host_bytes=64 << 20))
        # set read-or-encode costs instead of the probes each new engine would time (tests run
        # with the kept calibration off; conftest makes every choice a read anyway)
        engine.planner.chooser.forward_s, engine.planner.chooser.token_s = 0.0, 1e-3
        replicas.append((index, engine))
    answers = []
    for index, engine in replicas:
        segments = index.segments(question, index.retrieve(question, 2))
        handle = engine.submit(segments, max_new_tokens=4, source=index.chunk_source)
        engine.run_until_done()
        answers.append(handle.result)
    first, second = answers
    assert first.stats.chunk_sources == {"encoded": 2}
    assert second.stats.chunk_sources == {"disk": 2}
    assert second.text == first.text
    assert len(list((tmp_path / "shared").glob("*/*.kvrec"))) == 2


@pytest.fixture(autouse=True)
def _no_stray_processes():
    # only what this test started: a tensor-parallel rank pool an earlier test file of the same
    # pytest worker left running is shared by design (RankPool, spawned once per run)
    before = set(multiprocessing.active_children())
    yield
    assert not set(multiprocessing.active_children()) - before
