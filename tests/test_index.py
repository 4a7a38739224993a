"""LazyIndex: build, query, incremental re-index, atomicity, repair, refusal of foreign KV."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from lazy_rag import LazyIndex, LazyLLM
from lazy_rag.embedder import Embedder
from lazy_rag.errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from tiny_models import tiny_model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture()
def corpus(tmp_path):
    src = tmp_path / "docs"
    shutil.copytree(CORPUS, src)
    (src / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (src / "binary.txt").write_bytes(b"abc\x00\x01\x02def")
    (src / "latin1.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    return src


@pytest.fixture()
def built(corpus, tmp_path, smollm2, embedder):
    """An index as a user builds it: with the model's bundled chunk wrapper (its KV folder is kv-w<digest>)."""
    out = tmp_path / "idx"
    index, report = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96,
                                    chunk_overlap=16, progress=False)
    assert index.wrapper is not None and index.store.kv_dir.name == f"kv-w{index.wrapper.digest}"
    return index, report, out


def cached_tokens(index, chunk_ids):
    """The tokens a query over these chunks reads from cache: theirs and their wrapper's slots."""
    slots = index.wrapper.slots if index.wrapper else 0
    return sum(len(index.by_id[c].token_ids) + slots for c in chunk_ids)


def test_build_skips_bad_files_and_query_answers_from_cached_kv(built, smollm2, embedder):
    index, report, out = built
    assert report.files_indexed == 3
    assert report.skipped == {"unsupported type (.png)": 1, "binary": 1, "not UTF-8": 1}
    assert report.chunks_total == len(index.records) >= 6
    assert len(list(index.store.kv_dir.glob("*.safetensors"))) == report.chunks_total
    loaded = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    smollm2.engine.clear_cache()  # a process that just started: the chunks are on disk only
    res = loaded.query("When was the Marrow Point Lighthouse completed?", top_k=2, max_new_tokens=8)
    assert res.sources[0].source.endswith("lighthouse.md")
    assert res.stats["cached_tokens"] == cached_tokens(loaded, [s.chunk_id for s in res.sources])
    assert res.stats["chunk_sources"] == {"disk": 2}
    again = loaded.query("When was the Marrow Point Lighthouse completed?", top_k=2, max_new_tokens=8)
    assert again.stats["chunk_sources"] == {"pool": 2} and again.answer == res.answer
    block = loaded.query("When was the Marrow Point Lighthouse completed?", top_k=2, max_new_tokens=8, mode="block")
    assert block.answer == res.answer


def test_reindex_unchanged_does_no_work_and_changes_are_incremental(built, corpus, smollm2, embedder):
    index, _, out = built
    kv_dir = index.store.kv_dir
    kv_files = {p.name: p.stat().st_mtime_ns for p in kv_dir.glob("*.safetensors")}
    _, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                             progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.chunks_added, rep.kv_bytes_written) == (0, 3, 0, 0)
    assert {p.name: p.stat().st_mtime_ns for p in kv_dir.glob("*.safetensors")} == kv_files
    (corpus / "bakery.md").write_text("Kestrel Street Bakery sells rye bread on Sundays only.\n")
    (corpus / "observatory.txt").unlink()
    idx2, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                                progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.files_removed, rep.chunks_added) == (1, 1, 1, 1)
    assert {r.source.rsplit("/", 1)[1] for r in idx2.records} == {"bakery.md", "lighthouse.md"}
    assert len(list(kv_dir.glob("*.safetensors"))) == len(idx2.records)  # stale KV collected
    assert len(list(out.glob("chunks-*.jsonl"))) == 1


def test_a_build_holds_no_chunk_kv_in_memory(corpus, tmp_path, smollm2, embedder):
    """The KV goes to disk only: a build leaves neither the engine's pool nor its host tier
    holding it (so a build's memory does not grow with the corpus's KV)."""
    eng = smollm2.engine
    eng.clear_cache()
    index, report = LazyIndex.build([corpus], tmp_path / "idx", llm=smollm2, embedder=embedder, chunk_size=48,
                                    chunk_overlap=0, progress=False)
    assert report.kv_bytes_written > 0 and eng.stats()["pages_in_use"] == 0 and eng.tiers.host.bytes == 0
    res = index.query("When was the Marrow Point Lighthouse completed?", top_k=2, max_new_tokens=2)
    assert res.stats["chunk_sources"] == {"disk": 2}  # a query reads them from the files


def test_interrupted_build_leaves_previous_index_loadable(built, corpus, smollm2, embedder, monkeypatch):
    index, _, out = built
    before = json.loads((out / "manifest.json").read_text())
    (corpus / "new.md").write_text("The ferry to Vellin Island costs twelve crowns.\n")
    import lazy_rag.store as store_mod

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod.ChunkStore, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16, progress=False)
    assert json.loads((out / "manifest.json").read_text()) == before
    assert len(LazyIndex.load(out, llm=smollm2, embedder=embedder).records) == len(index.records)
    # a first build killed midway leaves no index that loads
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([corpus], out.parent / "fresh", llm=smollm2, embedder=embedder, progress=False)
    with pytest.raises(LazyIndexError, match="no manifest.json"):
        LazyIndex.load(out.parent / "fresh", llm=smollm2, embedder=embedder)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_kv_is_detected_recomputed_and_repaired(built, smollm2, embedder, damage, caplog):
    index, _, out = built
    question = "What does Kestrel Street Bakery sell on Fridays?"
    fresh = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    want = fresh.query(question, top_k=2, max_new_tokens=8)
    victim = fresh.store.path(want.sources[0].chunk_id)
    good = victim.read_bytes()
    rec = fresh.by_id[want.sources[0].chunk_id]
    good_kv, _ = fresh.store.read(rec.id, rec.token_ids)
    if damage == "corrupt":
        data = bytearray(good)
        data[-100] ^= 0xFF  # flip bits inside the tensor data
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(good[: len(good) // 2])
    else:
        victim.unlink()
    reloaded = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    smollm2.engine.clear_cache()
    got = reloaded.query(question, top_k=2, max_new_tokens=8)
    assert got.answer == want.answer and got.stats["chunk_sources"] == {"encoded": 1, "disk": 1}
    assert any("recomputing" in r.message for r in caplog.records)
    repaired, why = reloaded.store.read(rec.id, rec.token_ids)  # the file is whole again
    assert why is None and torch.equal(repaired.k, good_kv.k) and torch.equal(repaired.v, good_kv.v)


def test_index_from_another_model_is_refused_naming_both(built, tokenizer, embedder):
    _, _, out = built
    other = LazyLLM(tiny_model("llama", "default"), tokenizer)
    with pytest.raises(FingerprintMismatchError, match=r"fingerprint \w+ .*loaded model has \w+"):
        LazyIndex.load(out, llm=other, embedder=embedder)


def test_kv_written_by_another_model_is_not_trusted(built, smollm2, embedder, tokenizer):
    """Even a KV file swapped in from another model's index is caught and recomputed."""
    index, _, out = built
    other_llm = LazyLLM(tiny_model("llama", "default"), tokenizer)
    rec = index.records[0]
    from lazy_rag.store import ChunkStore

    foreign = ChunkStore(out.parent / "foreign", other_llm.fingerprint["id"])
    foreign.write(rec.id, rec.token_ids, other_llm.encode_chunk(rec.token_ids))
    shutil.copy(foreign.path(rec.id), index.store.path(rec.id))
    kv, why = LazyIndex.load(out, llm=smollm2, embedder=embedder).store.read(rec.id, rec.token_ids)
    assert kv is None and "another model" in why


def test_bad_sources_and_questions(tmp_path, smollm2, embedder, built):
    with pytest.raises(LazyRagError, match="does not exist"):
        LazyIndex.build([tmp_path / "nope"], tmp_path / "o", llm=smollm2, embedder=embedder, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LazyRagError, match=r"No \.txt or \.md files"):
        LazyIndex.build([tmp_path / "empty"], tmp_path / "o", llm=smollm2, embedder=embedder, progress=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"\x00\x01")
    with pytest.raises(LazyRagError, match="could be read"):
        LazyIndex.build([tmp_path / "bin"], tmp_path / "o", llm=smollm2, embedder=embedder, progress=False)
    index, _, _ = built
    with pytest.raises(LazyRagError, match="question is empty"):
        index.query("   ")
    with pytest.raises(LazyRagError, match="top_k"):
        index.query("lighthouse?", top_k=0)


def test_from_texts_keeps_given_ids_as_chunk_ids(tmp_path, smollm2, embedder):
    index = LazyIndex.from_texts(["Alpha is the first letter.", "Omega is the last letter."], tmp_path / "t",
                                 llm=smollm2, embedder=embedder, ids=["a", "z"], split=False, progress=False)
    assert sorted(r.id for r in index.records) == ["a", "z"]
    assert index.retrieve("Which letter is last?", top_k=1)[0].chunk_id == "z"


def test_query_reads_the_index_store_into_the_pool(built, smollm2, embedder):
    """Chunk KV comes from the index's KV files into the engine's pool; later queries read it
    from the pool, and the answer is the same whichever tier served the chunks."""
    index, _, out = built
    loaded = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    smollm2.engine.clear_cache()
    before = smollm2.engine.tiers.counters["disk_hits"]
    q = "When was the Marrow Point Lighthouse completed?"
    res = loaded.query(q, top_k=2, max_new_tokens=8)
    assert res.stats["chunk_sources"] == {"disk": 2}
    assert smollm2.engine.tiers.counters["disk_hits"] - before == 2
    again = loaded.query(q, top_k=2, max_new_tokens=8)
    assert again.stats["chunk_sources"] == {"pool": 2} and again.answer == res.answer
    smollm2.engine.pm.evict_unreferenced()  # the host tier still has them
    assert loaded.query(q, top_k=2, max_new_tokens=8).stats["chunk_sources"] == {"host": 2}


def test_an_index_without_vectors_needs_no_embedder_and_names_chunks_by_id(tmp_path, smollm2, monkeypatch):
    import lazy_rag.index as index_mod

    def no_embedder(*a, **k):
        raise AssertionError("an index without vectors must not load an embedder")

    monkeypatch.setattr(index_mod, "Embedder", no_embedder)
    monkeypatch.setattr(index_mod, "_faiss", no_embedder)
    docs = ["Alpha is the first letter.", "Omega is the last letter."]
    index = LazyIndex.from_texts(docs, tmp_path / "t", llm=smollm2, ids=["a", "z"], split=False, progress=False,
                                 vectors=False)
    assert index.manifest["embedder"] is None and index.manifest["vectors_file"] is None
    loaded = LazyIndex.load(tmp_path / "t", llm=smollm2)
    with pytest.raises(LazyRagError, match="without vectors"):
        loaded.retrieve("Which letter is last?")
    res = smollm2.generate(loaded.segments("Which letter is last?", ["z", "a"]), max_new_tokens=3,
                           source=loaded.chunk_source)
    assert res.stats.cached_tokens == cached_tokens(loaded, ["z", "a"])
