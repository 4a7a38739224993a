"""LazyIndex: build, query, incremental re-index (only changed rows and KV written), atomicity,
readers of one generation while a build commits the next, repair, refusal of foreign KV, and
format-1 indexes (one KV file per chunk): refused on load, converted in place by a build."""
import json
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lazy_rag import LazyIndex, LazyLLM
from lazy_rag.embedder import Embedder
from lazy_rag.errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from lazy_rag.index import describe_index, verify_index
from lazy_rag.index_lock import writer_lock
from lazy_rag.index.format1 import format1_file_name
from lazy_rag.store import ChunkStore, IndexDB
from helpers import index_settings, index_sql
from tiny_models import tiny_model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def _restore(pristine: Path, base: Path) -> None:
    """``base`` made exactly ``pristine`` again (whatever a test left there removed), files with
    their modification times (a build tells an unchanged source and KV segment by them)."""
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(pristine, base, symlinks=True)


@pytest.fixture(scope="module")
def _built_once(tmp_path_factory, smollm2, embedder):
    """The corpus and its index, built once for the module (a build per test cost ~1.6 s each, the
    suite's time budget): kept pristine beside ``base``, and restored byte for byte at the same
    paths before each test (an index names its sources by path), so every test starts from what a
    build of its own would have left, and may change it freely."""
    base = tmp_path_factory.mktemp("built")
    src = base / "docs"
    shutil.copytree(CORPUS, src)
    (src / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (src / "binary.txt").write_bytes(b"abc\x00\x01\x02def")
    (src / "latin1.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    index, report = LazyIndex.build([src], base / "idx", llm=smollm2, embedder=embedder, chunk_size=96,
                                    chunk_overlap=16, progress=False)
    assert index.wrapper is not None and index.store.kv_dir.name == f"kv-w{index.wrapper.digest}"
    index.close()  # everything in the files before they are copied
    pristine = tmp_path_factory.mktemp("built-pristine") / "base"
    shutil.copytree(base, pristine, symlinks=True)
    return base, pristine, report


@pytest.fixture()
def corpus(_built_once):
    """The example corpus plus three files a build skips (an image, a binary, Latin-1 too short
    to tell), fresh for the test."""
    base, pristine, _ = _built_once
    _restore(pristine, base)
    return base / "docs"


@pytest.fixture()
def built(corpus, _built_once, smollm2, embedder):
    """An index as a user builds it: with the model's bundled chunk wrapper (its KV folder is
    kv-w<digest>), built from ``corpus`` (the module's one build, restored for the test: above)."""
    base, _, report = _built_once
    out = base / "idx"
    index = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    assert index.wrapper is not None and index.store.kv_dir.name == f"kv-w{index.wrapper.digest}"
    return index, report, out


def segment_files(kv_dir: Path) -> dict:
    """Every KV segment file's (size, mtime); never empty."""
    files = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in kv_dir.glob("seg-*.kvseg")}
    assert files, f"no segments in {kv_dir}"
    return files


def cached_tokens(index, chunk_ids):
    """The tokens a query over these chunks reads from cache: theirs and their wrapper's slots."""
    slots = index.wrapper.slots if index.wrapper else 0
    return sum(len(index.by_id[c].token_ids) + slots for c in chunk_ids)


def test_build_options_are_the_one_place_of_each_option_and_its_default(tmp_path):
    """Keywords are shorthand for BuildOptions' fields; a misspelt one is refused, naming the options."""
    from lazy_rag.chunking import CHUNK_SIZE
    from lazy_rag.index import BuildOptions

    assert BuildOptions().chunk_size == CHUNK_SIZE
    assert token_chunker_defaults() == (CHUNK_SIZE, BuildOptions().chunk_overlap)
    base = BuildOptions(chunk_size=64, progress=False)
    assert BuildOptions.of(base, chunk_overlap=8) == BuildOptions(chunk_size=64, chunk_overlap=8, progress=False)
    assert BuildOptions.of(None) == BuildOptions()
    with pytest.raises(TypeError, match="'chunk_sise'.*chunk_size"):
        LazyIndex.from_texts(["a text"], tmp_path / "i", chunk_sise=64)


def token_chunker_defaults() -> tuple:
    import inspect

    from lazy_rag.chunking import TokenChunker

    params = inspect.signature(TokenChunker).parameters
    return params["chunk_size"].default, params["chunk_overlap"].default


def test_a_build_embeds_on_its_llms_accelerator(tmp_path, smollm2, monkeypatch):
    """The default embedder of a build goes where the LLM is when that is a GPU (on the host's cores
    it was the slowest stage of a GPU build), and stays on the CPU otherwise."""
    import lazy_rag.index.build as build_mod
    from lazy_rag.embedder import build_device

    assert build_device(torch.device("cuda", 1)) == "cuda:1" and build_device("cuda") == "cuda"
    assert build_device(torch.device("cpu")) == "cpu"
    made = []

    class Made(Exception):
        pass

    def embedder(name, device=None):
        made.append(device)
        raise Made

    monkeypatch.setattr(build_mod, "Embedder", embedder)
    with pytest.raises(Made):
        LazyIndex.from_texts(["some text"], tmp_path / "a", llm=smollm2, progress=False)
    monkeypatch.setattr(type(smollm2), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(Made):
        LazyIndex.from_texts(["some text"], tmp_path / "b", llm=smollm2, progress=False)
    assert made == ["cpu", "cuda:0"]


def test_build_skips_bad_files_and_query_answers_from_cached_kv(built, smollm2, embedder):
    index, report, out = built
    assert report.files_indexed == 3
    # each file skipped is named with why and what to do: too little Latin-1 text to tell its encoding
    assert report.skipped == {"unsupported type (.png)": 1, "binary": 1, "encoding unclear": 1}
    named = {Path(path).name: why for path, why in report.skipped_files}
    assert set(named) == {"image.png", "binary.txt", "latin1.md"}
    assert "--encoding NAME" in named["latin1.md"] and "lazy-rag reads text, markdown, PDF" in named["image.png"]
    assert report.chunks_total == len(index.records) >= 6
    assert describe_index(out)["chunks_with_kv"] == report.chunks_total and segment_files(index.store.kv_dir)
    assert not list(out.rglob("*.jsonl")) and list(index.store.kv_dir.iterdir()) == \
        list(index.store.kv_dir.glob("seg-*.kvseg"))  # no file per chunk
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


def test_an_encoding_given_once_is_the_indexs_for_its_updates(tmp_path, smollm2, embedder):
    """A Latin-1 file too short for its encoding to be told: skipped with the fix, indexed with
    --encoding (text decoded right), still read that way by an update that does not repeat it, and
    dropped (named) once the index is told to detect encodings again."""
    src = tmp_path / "docs"
    src.mkdir()
    (src / "menu.md").write_bytes("Caf\xe9 cr\xe8me: deux euros.".encode("latin-1"))
    (src / "ferry.md").write_text("The ferry to Vell takes fifty minutes.")
    kw = dict(llm=smollm2, embedder=embedder, chunk_size=64, chunk_overlap=0, progress=False)
    _, report = LazyIndex.build([src], tmp_path / "idx", **kw)
    assert report.skipped == {"encoding unclear": 1} and report.files_indexed == 1
    index, report = LazyIndex.build([src], tmp_path / "idx", encoding="latin-1", **kw)
    menu = str((src / "menu.md").resolve())
    assert report.decoded == [(menu, "latin-1 (--encoding)")] and report.files_indexed == 1
    assert [r.text for r in index.records if r.source == menu] == ["Caf\u00e9 cr\u00e8me: deux euros."]
    _, report = LazyIndex.build([src], tmp_path / "idx", **kw)  # the index's encoding
    assert report.files_unchanged == 2 and not report.skipped
    with pytest.raises(LazyRagError, match="Unknown encoding 'latin-9000'"):
        LazyIndex.build([src], tmp_path / "idx", encoding="latin-9000", **kw)
    index, report = LazyIndex.build([src], tmp_path / "idx", encoding="auto", **kw)
    assert report.files_removed == 1 and report.skipped == {"encoding unclear": 1}
    assert {r.source for r in index.records} == {str((src / "ferry.md").resolve())}


def test_an_edited_file_reencodes_only_the_chunks_whose_text_changed(tmp_path, smollm2, embedder):
    """A file edited at its end is re-indexed whole (all its chunks are new rows), but a chunk
    whose source, place and text are unchanged keeps its stored KV: the report counts the chunks
    encoded apart from the chunks added (``lazy-rag index`` prints both)."""
    src = tmp_path / "docs"
    src.mkdir()
    paragraphs = [f"Paragraph {i} tells of the harbour town of Vell, whose {i} boats fish for herring "
                  f"in the cold months and carry salt to the inland markets in spring." for i in range(12)]
    (src / "vell.md").write_text("\n\n".join(paragraphs) + "\n")
    kw = dict(llm=smollm2, embedder=embedder, chunk_size=64, chunk_overlap=0, progress=False)
    _, first = LazyIndex.build([src], tmp_path / "idx", **kw)
    assert first.chunks_added >= 3 and first.chunks_encoded == first.chunks_added
    with open(src / "vell.md", "a") as f:
        f.write("A last line about the lighthouse keeper.\n")
    index, rep = LazyIndex.build([src], tmp_path / "idx", **kw)
    assert rep.files_indexed == 1 and rep.chunks_added == len(index.records) >= 3
    assert 1 <= rep.chunks_encoded < rep.chunks_added and rep.kv_bytes_written > 0
    assert verify_index(tmp_path / "idx")["ok"]


def test_a_build_embeds_its_chunks_beside_the_kv_writes(tmp_path, smollm2, embedder):
    """A build encodes first and embeds beside the KV writes (before the first encode the
    embedding held the first write back while the disk idled): every chunk still gets its own
    text's vector. A build with nothing to encode embeds all the same."""
    texts = ["The lighthouse was completed in 1871.", "Keepers lived there until 1954.",
             "The lens came from Paris in a crate of straw.", "Herring boats leave the harbour at dawn."]
    index = LazyIndex.from_texts(texts, tmp_path / "idx", llm=smollm2, embedder=embedder, split=False, progress=False)
    stages = index.build_report.stages
    assert stages["embed_start_s"] >= stages["encode_start_s"] and stages["beside_at_batch"] >= 1
    for text in texts:
        assert index.retrieve(text, top_k=1)[0].text == text
    kv_less = LazyIndex.from_texts(texts, tmp_path / "kv-less", llm=smollm2, embedder=embedder, split=False,
                                   precompute_kv=False, progress=False)
    assert "encode_start_s" not in kv_less.build_report.stages and kv_less.build_report.stages["embed_s"] >= 0
    assert [kv_less.retrieve(t, top_k=1)[0].text for t in texts] == texts


def test_reindex_unchanged_does_no_work_and_changes_are_incremental(built, corpus, smollm2, embedder):
    index, _, out = built
    kv_dir = index.store.kv_dir
    segments = segment_files(kv_dir)
    _, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                             progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.chunks_added, rep.kv_bytes_written, rep.rows_written) == \
        (0, 3, 0, 0, 0)
    assert segment_files(kv_dir) == segments
    (corpus / "bakery.md").write_text("Kestrel Street Bakery sells rye bread on Sundays only.\n")
    (corpus / "observatory.txt").unlink()
    idx2, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                                progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.files_removed, rep.chunks_added) == (1, 1, 1, 1)
    assert {r.source.rsplit("/", 1)[1] for r in idx2.records} == {"bakery.md", "lighthouse.md"}
    # most of the segment was the dropped files' KV: its live records were copied out and it is gone
    info = describe_index(out)
    assert rep.kv_records_moved > 0 and info["segments"] == {"count": 1, "live_fraction": 1.0, "dead_bytes": 0}
    assert set(segment_files(kv_dir)).isdisjoint(segments) and info["chunks_with_kv"] == len(idx2.records)
    assert verify_index(out)["ok"] and len(list(out.glob("vectors-*.faiss"))) == 1


def test_a_small_update_writes_only_the_changed_rows_and_kv(tmp_path, smollm2, embedder, monkeypatch):
    """One file of a hundred changes: the commit deletes its one row and inserts one, appends one
    KV record, and the vector index loses one vector and gains one; every other row, its KV
    location and every segment byte before the end stay as they were."""
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(100):
        (src / f"note{i:03d}.md").write_text(f"Note {i}: ferry {i} leaves pier {i % 7} at {i % 12 + 1} o'clock.")
    out = tmp_path / "idx"
    opts = dict(llm=smollm2, embedder=embedder, chunk_size=64, chunk_overlap=0, progress=False)
    index, rep = LazyIndex.build([src], out, **opts)
    assert rep.chunks_total == 100 and rep.rows_written == 100

    def rows():
        db = IndexDB(out)
        try:
            return {r[0]: r[1:] for r in db.rows("SELECT rowid, source, * FROM chunks")}
        finally:
            db.close()

    before, segs_before = rows(), segment_files(index.store.kv_dir)
    index.close()
    import lazy_rag.vector_index as vi

    calls = {"add": [], "remove": [], "rebuild": 0}
    real_add, real_remove = vi.VectorIndex.add, vi.VectorIndex.remove
    monkeypatch.setattr(vi.VectorIndex, "add", lambda self, ids, vecs, **k: (calls["add"].append(len(ids)),
                                                                           real_add(self, ids, vecs, **k))[1])
    monkeypatch.setattr(vi.VectorIndex, "remove", lambda self, ids: (calls["remove"].append(len(ids)),
                                                                    real_remove(self, ids))[1])
    monkeypatch.setattr(vi.VectorIndex, "rebuild", classmethod(lambda cls, *a, **k: calls.__setitem__("rebuild", 1)))
    (src / "note042.md").write_text("Note 42: the ferry now leaves pier 3 at noon.")
    index, rep = LazyIndex.build([src], out, **opts)
    assert (rep.files_indexed, rep.files_unchanged, rep.chunks_added, rep.rows_written) == (1, 99, 1, 2)
    after = rows()
    gone, new = set(before) - set(after), set(after) - set(before)
    assert len(gone) == 1 and len(new) == 1 and min(new) > max(before)  # a new rowid: never one reused
    assert before[gone.pop()][0] == after[new.pop()][0] == str((src / "note042.md").resolve())  # its file's...
    assert all(after[r] == before[r] for r in after if r in before)  # ...and no other row touched
    segs_after = segment_files(index.store.kv_dir)
    assert set(segs_after) == set(segs_before) and rep.kv_records_moved == 0
    appended = sum(size for size, _ in segs_after.values()) - sum(size for size, _ in segs_before.values())
    assert appended == rep.kv_bytes_written > 0  # one record appended, nothing rewritten
    assert calls == {"add": [1], "remove": [1], "rebuild": 0}
    assert verify_index(out)["ok"] and index.retrieve("When does the ferry leave pier 3 at noon?", 1)[0].source \
        .endswith("note042.md")


def test_a_loaded_index_reads_its_generation_while_a_build_commits_the_next(built, corpus, smollm2, embedder,
                                                                              monkeypatch):
    """A reader that loads while a build runs sees the previous generation whole (and answers
    from its KV); readers keep their generation after the commit; a new load sees the new one."""
    index, _, out = built
    old = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    old_ids, old_gen = list(old.by_id), old.manifest["generation"]
    (corpus / "bakery.md").write_text("Kestrel Street Bakery sells rye bread on Sundays only.\n")
    import lazy_rag.index.build as build_mod

    at_commit, go_on = threading.Event(), threading.Event()
    real_commit = build_mod.commit

    def paused_commit(*a, **k):  # the build has appended its KV and waits at its commit
        at_commit.set()
        assert go_on.wait(120)
        return real_commit(*a, **k)

    monkeypatch.setattr(build_mod, "commit", paused_commit)
    built_new = {}
    builder = threading.Thread(target=lambda: built_new.update(index=LazyIndex.build(
        [corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16, progress=False)[0]))
    builder.start()
    try:
        assert at_commit.wait(300)
        during = LazyIndex.load(out, llm=smollm2, embedder=embedder)
        assert during.manifest["generation"] == old_gen and list(during.by_id) == old_ids
        smollm2.engine.clear_cache()
        res = during.query("What does Kestrel Street Bakery sell on Fridays?", top_k=2, max_new_tokens=4)
        assert res.stats["chunk_sources"] == {"disk": 2}  # its KV is whole: the build appended past it
    finally:
        go_on.set()
        builder.join(300)
    new = built_new["index"]
    assert new.manifest["generation"] == old_gen + 1
    assert set(new.by_id) != set(old_ids) and "Sundays" in " ".join(r.text for r in new.records)
    for reader in (old, during):  # loaded before the commit: still the previous generation, whole
        assert reader.manifest["generation"] == old_gen and list(reader.by_id) == old_ids
        assert "Sundays" not in " ".join(r.text for r in reader.records)
        assert {s.chunk_id for s in reader.retrieve("What does the bakery sell?", top_k=3)} <= set(old_ids)
    assert LazyIndex.load(out, llm=smollm2, embedder=embedder).manifest["generation"] == old_gen + 1


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
    before = index_settings(out)
    (corpus / "new.md").write_text("The ferry to Vellin Island costs twelve crowns.\n")
    import lazy_rag.store as store_mod

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod.ChunkStore, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16, progress=False)
    assert index_settings(out) == before
    assert len(LazyIndex.load(out, llm=smollm2, embedder=embedder).records) == len(index.records)
    assert verify_index(out)["ok"]
    # a first build killed midway leaves no index that loads
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([corpus], out.parent / "fresh", llm=smollm2, embedder=embedder, progress=False)
    with pytest.raises(LazyIndexError, match="not a lazy-rag index.*interrupted"):
        LazyIndex.load(out.parent / "fresh", llm=smollm2, embedder=embedder)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "unlocated", "segment_deleted"])
def test_damaged_kv_is_detected_recomputed_and_repaired(built, smollm2, embedder, damage, caplog):
    index, _, out = built
    index.close()  # its read snapshot would hold index_sql's checkpoint for the database's busy timeout (30 s)
    question = "What does Kestrel Street Bakery sell on Fridays?"
    fresh = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    want = fresh.query(question, top_k=2, max_new_tokens=8)
    hits = [fresh.by_id[s.chunk_id] for s in want.sources]
    locs = {r.id: fresh.store.location(r.id) for r in hits}
    rec = max(hits, key=lambda r: (locs[r.id].seg, locs[r.id].off))  # stored last: a truncation spares the other
    loc = locs[rec.id]
    good_kv, _ = fresh.store.read(rec.id, rec.token_ids)
    segment = fresh.store.segment_path(loc.seg)
    fresh.close()
    if damage == "corrupt":
        data = bytearray(segment.read_bytes())
        data[loc.off + loc.length - 100] ^= 0xFF  # flip bits inside the tensor data
        segment.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(segment, loc.off + loc.length // 2)  # a copy cut short half-way through the record
    elif damage == "unlocated":  # the row has no KV (a precomputed index: it should)
        index_sql(out, "UPDATE chunks SET kv_seg = NULL, kv_off = NULL, kv_len = NULL, kv_crc = NULL WHERE id = ?",
            (rec.id,))
    else:
        segment.unlink()
    reloaded = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    smollm2.engine.clear_cache()
    got = reloaded.query(question, top_k=2, max_new_tokens=8)
    sources = {"encoded": 2} if damage == "segment_deleted" else {"encoded": 1, "disk": 1}
    assert got.answer == want.answer and got.stats["chunk_sources"] == sources
    assert any("recomputing" in r.message for r in caplog.records)
    repaired, why = reloaded.store.read(rec.id, rec.token_ids)  # the record is whole again
    # the same KV within fp32 rounding, not bitwise: the repair encodes the chunk packed with the
    # question's tokens in one forward, the build with other chunks, and the CPU's BLAS may block
    # a matmul differently by its row count (seen under load on 2 cores: ~1e-5)
    assert why is None
    torch.testing.assert_close(repaired.k, good_kv.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(repaired.v, good_kv.v, rtol=1e-4, atol=1e-4)
    again = LazyIndex.load(out, llm=smollm2, embedder=embedder)  # committed: every process reads it
    assert again.store.read(rec.id, rec.token_ids)[1] is None and again.store.location(rec.id) != loc
    report = verify_index(out)
    if damage in ("corrupt", "unlocated"):
        assert report["ok"]
    elif damage == "segment_deleted":  # the other chunks of that segment are missing until they are queried
        assert report["kv_ok"] == 2 and report["kv_damaged"] == {"missing": len(again.records) - 2}


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
    # a record of the other model's KV for this chunk, written into the index's own table and segments
    foreign = ChunkStore(out, other_llm.fingerprint["id"], kv_subdir=index.store.folder)
    with writer_lock(out):
        foreign.write(rec.id, rec.token_ids, other_llm.encode_chunk(rec.token_ids))
    foreign.close()
    kv, why = LazyIndex.load(out, llm=smollm2, embedder=embedder).store.read(rec.id, rec.token_ids)
    assert kv is None and "another model" in why


def test_bad_sources_and_questions(tmp_path, smollm2, embedder, built):
    with pytest.raises(LazyRagError, match="does not exist"):
        LazyIndex.build([tmp_path / "nope"], tmp_path / "o", llm=smollm2, embedder=embedder, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LazyRagError, match=r"No file lazy-rag reads found in"):
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
    import lazy_rag.index.build as build_mod
    import lazy_rag.index.format1 as format1_mod
    import lazy_rag.index.lazy_index as lazy_index_mod
    import lazy_rag.vector_index as vector_index_mod

    def no_embedder(*a, **k):
        raise AssertionError("an index without vectors must not load an embedder")

    monkeypatch.setattr(build_mod, "Embedder", no_embedder)
    monkeypatch.setattr(lazy_index_mod, "Embedder", no_embedder)
    monkeypatch.setattr(format1_mod, "faiss", no_embedder)
    monkeypatch.setattr(vector_index_mod, "_faiss", no_embedder)
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


# -- format 1: one KV file per chunk, the chunk table as JSON lines -------------------------------------

def write_format1(index, out: Path, generation: int = 3) -> None:
    """``index`` as lazy-rag wrote indexes before KV segments (format 1): manifest.json (the commit
    point: settings, files, the sha256 of the tables), chunks-<gen>.jsonl, vectors-<gen>.faiss
    (faiss's flat index, row i = chunk i) and one safetensors file of KV per chunk in the KV folder."""
    import hashlib

    import faiss

    from lazy_rag.kv_record import tensor_crc

    m = index.manifest
    records = list(index.records)
    out.mkdir()
    table = "".join(json.dumps({"id": r.id, "source": r.source, "ordinal": r.ordinal, "text": r.text,
                                "token_ids": r.token_ids, "metadata": r.metadata}, ensure_ascii=False) + "\n"
                    for r in records).encode()
    (out / f"chunks-{generation}.jsonl").write_bytes(table)
    flat = faiss.IndexFlatIP(m["embedder"]["dim"])
    flat.add(np.stack([index.vectors.index.reconstruct(int(r.rowid)) for r in records]))
    vectors = faiss.serialize_index(flat).tobytes()
    (out / f"vectors-{generation}.faiss").write_bytes(vectors)
    kv_dir = out / index.store.folder
    kv_dir.mkdir()
    for r in records:
        kv, why = index.store.read(r.id, r.token_ids)
        assert why is None
        save_file({"k": kv.k, "v": kv.v}, str(kv_dir / format1_file_name(r.id)),
                  metadata={"k_crc32": tensor_crc(kv.k), "v_crc32": tensor_crc(kv.v), "format": "1",
                            "tokens": index.store.tokens_key(r.token_ids), "fingerprint": index.store.fingerprint_id,
                            "dtype": str(kv.k.dtype).removeprefix("torch.")})
    shutil.copy(index.path / m["wrapper_file"], out / m["wrapper_file"])
    manifest = {k: m[k] for k in ("lazy_rag_version", "model", "kv_dtype", "embedder", "chunking", "shared_prefix",
                                  "kv_precomputed", "query_defaults", "prompt", "wrapper", "wrapper_file",
                                  "num_chunks", "num_tokens", "updated")}
    manifest.update(format_version=1, files=index.files, generation=generation,
                    chunks_file=f"chunks-{generation}.jsonl", vectors_file=f"vectors-{generation}.faiss",
                    checksums={"chunks_file": hashlib.sha256(table).hexdigest(),
                               "vectors_file": hashlib.sha256(vectors).hexdigest(),
                               "wrapper_file": m["checksums"]["wrapper_file"]})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def test_a_format1_index_is_refused_on_load_naming_the_conversion(built, smollm2, embedder, tmp_path):
    from typer.testing import CliRunner

    from lazy_rag.cli import app

    index, _, _ = built
    out = tmp_path / "old-index"
    write_format1(index, out)
    with pytest.raises(LazyIndexError, match=r"format 1.*keeping every chunk's KV: `lazy-rag index SOURCES --out "
                                             + re.escape(str(out))):
        LazyIndex.load(out, llm=smollm2, embedder=embedder)
    runner = CliRunner()
    for cmd in (["inspect", str(out)], ["verify", str(out)], ["query", str(out), "anything?"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and "format 1" in res.output and "Traceback" not in res.output, res.output
    assert (out / "manifest.json").exists() and not (out / "index.sqlite").exists()  # refused: left as it was


def test_a_build_converts_a_format1_index_in_place_reusing_every_intact_kv_file(built, corpus, smollm2, embedder,
                                                                             tmp_path):
    index, _, _ = built
    out = tmp_path / "old-index"
    write_format1(index, out)
    records = list(index.records)
    victim = records[0]  # its KV file damaged: the one chunk encoded again
    kv_file = out / index.store.folder / format1_file_name(victim.id)
    kv_file.write_bytes(kv_file.read_bytes()[:-64])
    new, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                               progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.chunks_added) == (0, 3, 0)
    assert rep.kv_bytes_written == new.store.location(victim.id).span  # every other chunk's KV copied, not encoded
    assert new.manifest["format_version"] == 2 and new.manifest["generation"] == 4
    assert json.loads((out / "manifest.json").read_text())["format_version"] == 2
    assert not list(out.glob("chunks-*.jsonl")) and not list(new.store.kv_dir.glob("*.safetensors"))
    assert [p.name for p in out.glob("vectors-*")] == ["vectors-4.faiss"] and verify_index(out)["ok"]
    assert [(r.id, r.source, r.text, r.token_ids) for r in new.records] == \
        [(r.id, r.source, r.text, r.token_ids) for r in records]
    for r in records:
        a, b = index.store.read(r.id, r.token_ids)[0], new.store.read(r.id, r.token_ids)[0]
        if r.id == victim.id:  # encoded again: equal up to the CPU kernels' summation order (threads, batch)
            torch.testing.assert_close(b.k, a.k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b.v, a.v, rtol=1e-4, atol=1e-4)
        else:  # copied: bit for bit
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    question = "When was the Marrow Point Lighthouse completed?"
    smollm2.engine.clear_cache()
    want = index.query(question, top_k=2, max_new_tokens=8)
    smollm2.engine.clear_cache()
    got = LazyIndex.load(out, llm=smollm2, embedder=embedder).query(question, top_k=2, max_new_tokens=8)
    assert got.answer == want.answer and [s.chunk_id for s in got.sources] == [s.chunk_id for s in want.sources]
    assert got.stats["chunk_sources"] == {"disk": 2}
    # the next update is an ordinary one
    (corpus / "bakery.md").write_text("Kestrel Street Bakery sells rye bread on Sundays only.\n")
    _, rep = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                             progress=False)
    assert (rep.files_indexed, rep.files_unchanged, rep.chunks_added) == (1, 2, 1) and verify_index(out)["ok"]


def test_whole_texts_are_tokenized_in_batches_exactly_as_one_by_one(tokenizer):
    """from_texts(split=False) tokenizes its texts a batch per call, through the fast tokenizer's
    backend where it pads and truncates nothing; the ids are those of one call per text."""
    import copy

    from lazy_rag.index.build import _token_ids_batched

    texts = ["", " leading space", "Ünïcode — and émoji 🚀\n\ttabs", "a" * 700, "The bakery opens at 7 a.m."] * 3
    one_by_one = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert list(_token_ids_batched(tokenizer, texts, batch=4)) == one_by_one
    padded = copy.deepcopy(tokenizer)
    padded.backend_tokenizer.enable_padding(length=4096)   # the backend would pad: the tokenizer's call is taken
    assert list(_token_ids_batched(padded, texts, batch=4)) == one_by_one


def test_ctrl_c_keeps_the_encoded_kv_and_the_next_build_resumes(corpus, tmp_path, smollm2, embedder, monkeypatch):
    """Ctrl-C during a first build: no index yet, but the KV encoded before it is kept (checkpointed
    as pending), and running the same build again encodes only the rest."""
    import lazy_rag.store as store_mod

    write = store_mod.ChunkStore.write
    calls = []

    def interrupted_after_two(self, *a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return write(self, *a, **k)

    out = tmp_path / "idx"
    with monkeypatch.context() as mp:
        mp.setattr(store_mod.ChunkStore, "write", interrupted_after_two)
        with pytest.raises(KeyboardInterrupt):
            LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96, chunk_overlap=16,
                            progress=False)
    with pytest.raises(LazyIndexError, match="not a lazy-rag index.*interrupted"):
        LazyIndex.load(out, llm=smollm2, embedder=embedder)
    index, report = LazyIndex.build([corpus], out, llm=smollm2, embedder=embedder, chunk_size=96,
                                    chunk_overlap=16, progress=False)
    assert report.chunks_added == len(index.records) > 2
    assert report.chunks_encoded == report.chunks_added - 2  # the two written before Ctrl-C were kept
    assert verify_index(out)["ok"]
