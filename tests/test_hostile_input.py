"""Hostile input to index builds (issue 25): a source file that another program writes while it
is indexed (during the read, or after it while the build runs), one that vanishes between
discovery and reading, file names with a newline, odd Unicode or bytes that are not UTF-8, and a
long file of one line (no sentence ends, or one base64-like word). Each ends in an index whose
stored chunks are exactly one read of each file (a changed file named, and re-indexed by the next
run), or in a clean skip that names the file, never a traceback."""
import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazy_rag import LazyIndex
from lazy_rag.cli import app
from lazy_rag.embedder import Embedder
from lazy_rag.errors import LazyIndexError
from lazy_rag.index import describe_index, kv_subdir, verify_index

FIRST = "The Marrow Point Lighthouse was completed in 1871. Its lamp burned whale oil until 1902."
ADDED = " A later keeper painted the tower red and white in 1955."


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def build(src, out, smollm2, embedder, **options):
    return LazyIndex.build([src], out, llm=smollm2, embedder=embedder, progress=False,
                           **{"chunk_size": 64, "chunk_overlap": 0, **options})


def records_of(index, name):
    return [r for r in index.records if Path(r.source).name == name]


# what another program writes into tower.md while lazy-rag reads it (same size, longer, shorter, renamed over)
WRITES = {"rewritten": FIRST.replace("1871", "1872").replace("1902", "1903"),
          "appended": FIRST + ADDED,
          "truncated": "The Marrow Point Lighthouse was torn down.",
          "replaced": "The Marrow Point Lighthouse is now a museum, open daily."}


def write(path, mode, text):
    if mode == "replaced":  # an editor's save: a new file renamed over the old one
        tmp = path.with_name(".tower.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    else:  # in place: the reader's open file sees the new bytes
        with open(path, "r+" if mode == "rewritten" else "a" if mode == "appended" else "w") as f:
            f.write(text[len(FIRST):] if mode == "appended" else text)


def check_stored(index, src, smollm2, name, text):
    """The index holds ``text`` as the file's one version: chunks, their token ids, the KV (verify
    checks each KV file against its chunk's token ids) and the recorded sha256."""
    recs = records_of(index, name)
    assert "".join(r.text for r in recs).replace(" ", "") == text.replace(" ", "")
    for r in recs:
        assert r.token_ids == smollm2.tokenizer(r.text, add_special_tokens=False).input_ids
    entry = index.files[str((src / name).resolve())]
    assert entry["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert verify_index(index.path)["ok"]


@pytest.mark.parametrize("mode", list(WRITES))
def test_a_write_during_the_read_never_tears_a_chunk(tmp_path, smollm2, embedder, monkeypatch, mode):
    """Another program writes the file while the build is half-way through reading it (and after
    the build took the file's stat): the stored chunks are one whole version, never half the old
    text and half the new, and nothing is reported changed since the index holds what is there."""
    src = tmp_path / "docs"
    src.mkdir()
    tower = src / "tower.md"
    tower.write_text(FIRST)
    (src / "other.md").write_text("The Kestrel Street Bakery opened in 1923.")
    import lazy_rag.documents as documents

    real, reads = documents._read_bytes, []

    def torn(path):  # the first read of tower.md: up to "1871", then the write, then the rest of the open file
        if path.name != "tower.md" or reads:
            return real(path)
        with open(path, "rb", buffering=0) as f:  # unbuffered: the rest is read after the write
            head = f.read(FIRST.index("1871") + 4)
            write(path, mode, WRITES[mode])
            reads.append(head + f.read())
        return reads[0]

    monkeypatch.setattr(documents, "_read_bytes", torn)
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    monkeypatch.undo()
    assert reads and (reads[0] not in (FIRST.encode(), WRITES[mode].encode())) == (mode in ("rewritten",
                                                                                            "truncated"))
    check_stored(index, src, smollm2, "tower.md", WRITES[mode])
    assert report.changed_files == []
    _, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert (report.files_unchanged, report.files_indexed) == (2, 0)


@pytest.mark.parametrize("mode", ["appended", "truncated"])
def test_a_file_written_after_it_was_read_is_named_and_the_next_run_reindexes_it(tmp_path, smollm2, embedder,
                                                                                 monkeypatch, mode):
    """`lazy-rag index` reads the file, then another program writes it while the build embeds and
    encodes: the index holds the version read, the run names the file, the next run re-indexes it."""
    src = tmp_path / "docs"
    src.mkdir()
    tower = src / "tower.md"
    tower.write_text(FIRST)
    (src / "other.md").write_text("The Kestrel Street Bakery opened in 1923.")
    import lazy_rag.index.build as index_mod

    real_read, read = index_mod.read_text, []

    def read_then_written(path, encoding=None):
        got = real_read(path, encoding)
        if path.name == "tower.md" and not read:
            read.append(got.text)
            write(path, mode, WRITES[mode])
        return got

    monkeypatch.setattr(index_mod, "read_text", read_then_written)
    monkeypatch.setattr(index_mod.LazyLLM, "from_pretrained", lambda *a, **k: smollm2)
    monkeypatch.setattr(index_mod, "Embedder", lambda *a, **k: embedder)
    res = CliRunner().invoke(app, ["index", str(src), "--out", str(tmp_path / "idx"), "--chunk-size", "64",
                                   "--chunk-overlap", "0"])
    monkeypatch.undo()
    assert res.exit_code == 0, res.output
    assert read == [FIRST] and tower.read_text() == WRITES[mode]
    assert f"{tower.resolve()} changed while it was indexed" in res.output.replace("\n", "")
    index = LazyIndex.load(tmp_path / "idx", llm=smollm2, embedder=embedder)
    check_stored(index, src, smollm2, "tower.md", FIRST)
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert report.changed_files == [] and report.files_unchanged == 1
    if mode == "appended":
        assert report.files_indexed == 1
        check_stored(index, src, smollm2, "tower.md", FIRST + ADDED)
    else:
        assert report.files_indexed == 1 and report.files_removed == 0  # shorter text, fewer tokens
        check_stored(index, src, smollm2, "tower.md", WRITES["truncated"])
    assert verify_index(tmp_path / "idx")["stray_kv_files"] == 0


def test_a_file_deleted_between_discovery_and_reading_is_named_and_the_rest_indexed(tmp_path, smollm2, embedder,
                                                                                  monkeypatch):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text(FIRST)
    (src / "b.md").write_text("The Kestrel Street Bakery opened in 1923.")
    import lazy_rag.index.build as index_mod

    real_read = index_mod.read_text

    def deleted_first(path, encoding=None):
        if path.name == "b.md":
            path.unlink()
        return real_read(path, encoding)

    monkeypatch.setattr(index_mod, "read_text", deleted_first)
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert report.files_indexed == 1 and {Path(r.source).name for r in index.records} == {"a.md"}
    [(path, why)] = report.skipped_files
    assert path.endswith("b.md") and why == ("unreadable (No such file or directory): check that it exists and "
                                             "that this user may read it")


def test_odd_file_names_are_indexed_or_skipped_by_name(tmp_path, smollm2, embedder):
    src = tmp_path / "docs"
    src.mkdir()
    unicode_name = "caf\u00e9 \u2615 \u05e9\u05dc\u05d5\u05dd e\u0301 \u202e.md"  # accents, emoji, Hebrew, combining, RTL
    odd = {"new\nline.md": "A name holding a newline: the bakery opens at six.",
           unicode_name: "Accents, an emoji, Hebrew, a combining mark and a right-to-left override: the ferry "
                         "leaves at nine.",
           " leading and trailing space .txt": "Spaces around the name: the tower is white."}
    for name, text in odd.items():
        (src / name).write_text(text)
    not_utf8 = os.fsencode(src) + b"/latin1-\xe9t\xe9.md"  # a name in Latin-1 bytes, not UTF-8
    with open(not_utf8, "w") as f:
        f.write("A name that is not UTF-8.")
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert {Path(r.source).name for r in index.records} == set(odd)
    assert report.skipped == {"file name is not UTF-8": 1}
    assert report.skipped_files == [(not_utf8.decode("utf-8", "backslashreplace"),
                                     "file name is not UTF-8: rename the file")]
    assert verify_index(tmp_path / "idx")["ok"]
    loaded = LazyIndex.load(tmp_path / "idx", llm=smollm2, embedder=embedder)
    assert set(loaded.files) == {str((src / n).resolve()) for n in odd}  # names round-trip through SQLite
    assert {r.source for r in loaded.records} == set(loaded.files)
    again, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert (report.files_unchanged, report.files_indexed) == (len(odd), 0)
    hit = again.retrieve("When does the ferry leave?", top_k=1)[0]
    assert Path(hit.source).name == unicode_name
    res = CliRunner().invoke(app, ["index", str(src), "--out", str(tmp_path / "idx"), "--chunk-size", "64",
                                   "--chunk-overlap", "0"])
    printed = res.output.replace("\n", "")  # the console wraps long lines
    assert res.exit_code == 0 and "latin1-\\xe9t\\xe9.md: file name is not UTF-8" in printed, res.output


def test_a_long_file_of_one_line_is_split_within_the_chunk_size(tmp_path, smollm2, embedder):
    src = tmp_path / "docs"
    src.mkdir()
    words = " ".join(f"w{i % 997}" for i in range(4000))  # one line, no sentence ends, ~20 KB
    blob = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo/+" * 300   # one base64-like "word", ~11 KB
    (src / "words.txt").write_text(words)
    (src / "blob.txt").write_text(blob)
    index, report = build(src, tmp_path / "idx", smollm2, embedder, chunk_size=256, precompute_kv=False)
    assert report.files_indexed == 2 and report.chunks_total > 2
    assert all(0 < len(r.token_ids) <= 256 for r in index.records)
    for name, text in (("words.txt", words), ("blob.txt", blob)):
        stored = "".join(r.text for r in records_of(index, name))
        assert stored.replace(" ", "") == text.replace(" ", "")  # every character, in order, no overlap
    assert verify_index(tmp_path / "idx")["ok"]


def test_a_large_text_is_split_a_section_at_a_time(smollm2, monkeypatch):
    """NLTK's sentence tokenizer runs each regular expression under a time limit (5 s), which a
    20 MB file exceeded (a TimeoutError, an OSError, read as a disk failure). The chunker hands
    the splitter a section at a time, cut at paragraph breaks. The time a scan takes grows with
    the text it scans; here the limit is made one of length (8 KB) so that the test does not
    depend on this machine's speed: the whole 16 KB text exceeds it, its 2 KB sections do not."""
    import random

    import nltk.redos

    from lazy_rag.chunking import TokenChunker, sections
    from lazy_rag.errors import LazyRagError

    scan = nltk.redos.TimedPattern.finditer

    def finditer(self, string, *args, **kwargs):
        if len(string) > 8192:
            raise TimeoutError("regular-expression match exceeded its time limit (a test's: 8 KB)")
        return scan(self, string, *args, **kwargs)

    monkeypatch.setattr(nltk.redos.TimedPattern, "finditer", finditer)
    rng = random.Random(0)
    words = "harbour lighthouse keeper tower lamp granite island ferry bakery morning bread".split()
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + ". Then it rained."
                       for _ in range(32))
    assert "".join(sections(text, 2048)) == text and max(map(len, sections(text, 2048))) <= 2048
    chunker = TokenChunker(smollm2.tokenizer, 256, 0)
    chunker.section_chars = len(text)  # the whole text at once: what the build did
    with pytest.raises(LazyRagError, match="time limit.*smaller files"):
        chunker.split(text)
    chunker.section_chars = 2048
    parts = chunker.split(text)
    assert all(0 < len(ids) <= 256 for _, ids in parts)
    squeezed = "".join(text.split())
    assert "".join("".join(p.split()) for p, _ in parts) == squeezed  # every character, in order, once


# -- an index folder from an untrusted source ---------------------------------------------------------

class Unpickled(AssertionError):
    pass


@pytest.fixture()
def no_unpickling(monkeypatch):
    """Every way to unpickle (pickle's functions and Unpickler, torch.load, numpy.load) refused and
    recorded while the test runs; the list of what was called is returned."""
    import pickle

    import numpy as np
    import torch

    calls = []

    def refuse(name):
        def refused(*args, **kwargs):
            calls.append(name)
            raise Unpickled(f"{name} called on the index load path")
        return refused

    class RefusedUnpickler(pickle.Unpickler):  # a class still, so that modules may subclass it
        def __init__(self, *args, **kwargs):
            refuse("pickle.Unpickler")()

    for name in ("load", "loads", "_load", "_loads"):
        monkeypatch.setattr(pickle, name, refuse(f"pickle.{name}"))
    monkeypatch.setattr(pickle, "Unpickler", RefusedUnpickler)
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    monkeypatch.setattr(np, "load", refuse("numpy.load"))
    return calls


class Payload:
    """Unpickling this creates ``marker``: proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def clean_index(tmp_path_factory, smollm2, embedder):
    out = tmp_path_factory.mktemp("untrusted") / "idx"
    src = out.parent / "docs"
    src.mkdir()
    (src / "tower.md").write_text(FIRST)
    (src / "bakery.md").write_text("The Kestrel Street Bakery opened in 1923.")
    index, _ = build(src, out, smollm2, embedder)
    smollm2.engine.clear_cache()
    return out, index.query("When was the lighthouse completed?", top_k=2, max_new_tokens=4).answer


def test_loading_and_querying_an_index_unpickles_nothing(clean_index, smollm2, no_unpickling):
    """The whole default load path: the model and the embedder by the names the settings hold,
    the database, vectors, wrapper and KV segments, a query, verify and describe."""
    out, want = clean_index
    smollm2.engine.clear_cache()
    index = LazyIndex.load(out, device="cpu")  # no model or embedder given: the manifest's names
    assert index.query("When was the lighthouse completed?", top_k=2, max_new_tokens=4).answer == want
    assert verify_index(out)["ok"] and describe_index(out)["chunks"] == 2
    assert no_unpickling == []


@pytest.mark.parametrize("target", ["database", "pointer", "vectors_file", "wrapper_file", "kv", "kv_record"])
def test_an_index_file_replaced_by_a_pickle_is_never_unpickled(clean_index, smollm2, embedder, tmp_path,
                                                               no_unpickling, target):
    """A crafted index: one file replaced by a pickle (torch.save's zip for the safetensors files
    and a KV segment; a KV record's body, with the CRC the table holds for it), whose unpickling
    would create a file, the checksum the settings hold updated to match (a forgery, not damage).
    The database, the vectors or the wrapper is a clean error naming the file; manifest.json is
    not read on load; KV is recomputed; nothing is unpickled."""
    import gc
    import pickle
    import zlib

    import torch

    from lazy_rag.store import IndexDB

    clean, want = clean_index
    out = tmp_path / "idx"
    gc.collect()  # no snapshot of the clean index open: its database is all in its main file
    shutil.copytree(clean, out)
    marker = tmp_path / "unpickled"
    db = IndexDB(out)
    settings = db.settings()
    kv_dir = out / kv_subdir(settings["wrapper"])
    if target == "database":
        victim = out / "index.sqlite"
    elif target == "pointer":
        victim = out / "manifest.json"
    elif target in ("kv", "kv_record"):
        victim = next(kv_dir.glob("seg-*.kvseg"))
    else:
        victim = out / settings[target]
    if target == "kv_record":  # one record's body replaced in place, its row's length and CRC made to match
        buf = io.BytesIO()
        torch.save({"k": Payload(marker)}, buf)
        body = buf.getvalue()
        seg, off = db.one("SELECT kv_seg, kv_off FROM chunks ORDER BY rowid")
        with open(victim, "r+b") as f:
            f.seek(off)
            f.write(body)
        with db.transaction() as cur:
            cur.execute("UPDATE chunks SET kv_len = ?, kv_crc = ? WHERE kv_seg = ? AND kv_off = ?",
                        (len(body), zlib.crc32(body), seg, off))
    elif victim.suffix in (".safetensors", ".kvseg"):
        torch.save({"k": Payload(marker)}, victim)
    else:
        victim.write_bytes(pickle.dumps(Payload(marker)))
    if target in settings.get("checksums", {}):
        settings["checksums"][target] = hashlib.sha256(victim.read_bytes()).hexdigest()
        with db.transaction() as cur:
            cur.execute("UPDATE settings SET value = ? WHERE key = 'checksums'", (json.dumps(settings["checksums"]),))
    db.close()
    smollm2.engine.clear_cache()
    if target in ("kv", "kv_record", "pointer"):
        index = LazyIndex.load(out, llm=smollm2, embedder=embedder)
        assert index.query("When was the lighthouse completed?", top_k=2, max_new_tokens=4).answer == want
        assert verify_index(out)["ok"]  # the query wrote the recomputed KV anew
    else:
        with pytest.raises(LazyIndexError, match=re.escape(victim.name)):
            LazyIndex.load(out, llm=smollm2, embedder=embedder)
        if target != "manifest":
            assert not verify_index(out)["ok"]
    assert no_unpickling == [] and not marker.exists()


def test_the_load_path_has_no_unpickling_code():
    """The source of the load and query path (lazy_rag/*.py, lazy_rag/engine/) neither imports a
    pickle-based loader nor calls torch.load without weights_only=True, numpy's allow_pickle or
    eval/exec: the dynamic tests above cover the paths they run, this covers the rest."""
    import ast

    import lazy_rag

    root = Path(lazy_rag.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")) + sorted((root / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{where} imports {n}" for n in names
                          if n and n.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "shelve", "joblib",
                                                       "marshal", "cloudpickle")]
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            kwargs = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec") and isinstance(func, ast.Name):
                found.append(f"{where} calls {name}()")
            if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch" and \
                    not (isinstance(kwargs.get("weights_only"), ast.Constant) and kwargs["weights_only"].value is True):
                found.append(f"{where} calls torch.load without weights_only=True")
            if isinstance(kwargs.get("allow_pickle"), ast.Constant) and kwargs["allow_pickle"].value is True:
                found.append(f"{where} passes allow_pickle=True")
    assert found == []
