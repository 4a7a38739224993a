"""Hostile input to index builds (issue 25): a source file that another program writes while it
is indexed (during the read, or after it while the build runs), one that vanishes between
discovery and reading, file names with a newline, odd Unicode or bytes that are not UTF-8, and a
long file of one line (no sentence ends, or one base64-like word). Each ends in an index whose
stored chunks are exactly one read of each file (a changed file named, and re-indexed by the next
run), or in a clean skip that names the file, never a traceback."""
import hashlib
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazy_rag import LazyIndex
from lazy_rag.cli import app
from lazy_rag.embedder import Embedder
from lazy_rag.index import verify_index

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
    entry = index.manifest["files"][str((src / name).resolve())]
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
    import lazy_rag.chunking as chunking

    real, reads = chunking._read_bytes, []

    def torn(path):  # the first read of tower.md: up to "1871", then the write, then the rest of the open file
        if path.name != "tower.md" or reads:
            return real(path)
        with open(path, "rb", buffering=0) as f:  # unbuffered: the rest is read after the write
            head = f.read(FIRST.index("1871") + 4)
            write(path, mode, WRITES[mode])
            reads.append(head + f.read())
        return reads[0]

    monkeypatch.setattr(chunking, "_read_bytes", torn)
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
    import lazy_rag.index as index_mod

    real_read, read = index_mod.read_text, []

    def read_then_written(path):
        text, why = real_read(path)
        if path.name == "tower.md" and not read:
            read.append(text)
            write(path, mode, WRITES[mode])
        return text, why

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
    import lazy_rag.index as index_mod

    real_read = index_mod.read_text

    def deleted_first(path):
        if path.name == "b.md":
            path.unlink()
        return real_read(path)

    monkeypatch.setattr(index_mod, "read_text", deleted_first)
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert report.files_indexed == 1 and {Path(r.source).name for r in index.records} == {"a.md"}
    [(path, why)] = report.skipped_files
    assert path.endswith("b.md") and why == "unreadable (No such file or directory)"


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
    assert report.skipped == {"file name is not UTF-8 (rename the file)": 1}
    assert report.skipped_files == [(not_utf8.decode("utf-8", "backslashreplace"),
                                     "file name is not UTF-8 (rename the file)")]
    assert verify_index(tmp_path / "idx")["ok"]
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert set(manifest["files"]) == {str((src / n).resolve()) for n in odd}  # names round-trip through JSON
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

