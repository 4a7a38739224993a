"""Hostile input to index builds (issue 25): a source file that changes while it is indexed, one
that vanishes between discovery and reading, file names with a newline, odd Unicode or bytes
that are not UTF-8, and a long file of one line (no sentence ends, or one base64-like word).
Each ends in an index whose stored chunks are exactly what was read, or in a clean skip that
names the file, never a traceback."""
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


def test_a_file_changing_while_indexed_stores_exactly_what_was_read_and_a_reindex_notices(tmp_path, smollm2,
                                                                                          embedder, monkeypatch):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "tower.md").write_text(FIRST)
    (src / "other.md").write_text("The Kestrel Street Bakery opened in 1923.")
    import lazy_rag.index as index_mod

    real_read, read = index_mod.read_text, {}

    def read_then_written(path):  # another program appends right after the build read the file
        text, why = real_read(path)
        if path.name == "tower.md":
            read["text"] = text
            with open(path, "a") as f:
                f.write(ADDED)
        return text, why

    monkeypatch.setattr(index_mod, "read_text", read_then_written)
    index, _ = build(src, tmp_path / "idx", smollm2, embedder)
    monkeypatch.undo()
    assert read["text"] == FIRST and (src / "tower.md").read_text() == FIRST + ADDED
    [rec] = records_of(index, "tower.md")
    assert rec.text == FIRST and rec.token_ids == smollm2.tokenizer(FIRST, add_special_tokens=False).input_ids
    entry = index.manifest["files"][str((src / "tower.md").resolve())]
    assert entry["sha256"] == hashlib.sha256(FIRST.encode()).hexdigest()  # the bytes read, not the bytes now
    assert verify_index(tmp_path / "idx")["ok"]
    # the next run sees the file as changed and indexes what it holds now; the other file is untouched
    index, report = build(src, tmp_path / "idx", smollm2, embedder)
    assert (report.files_indexed, report.files_unchanged) == (1, 1)
    assert " ".join(r.text for r in records_of(index, "tower.md")) == FIRST + ADDED
    assert verify_index(tmp_path / "idx")["ok"] and verify_index(tmp_path / "idx")["stray_kv_files"] == 0


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
