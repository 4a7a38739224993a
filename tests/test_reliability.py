"""Reliability of stored indexes (issue 25's storage half): one writer per folder, checksums
of every index file and row checked on load, on read and by `lazy-rag verify`, `--repair`
(also of a database that is not one any more), sources that become unreadable, write failures
(full disk) that leave the previous index and no debris, a killed build that resumes from its
checkpointed KV, guarded write-backs by queries, ids that try to name paths, and clean errors for
damaged settings."""
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazy_rag import LazyIndex
from lazy_rag.cli import app
from lazy_rag.embedder import Embedder
from lazy_rag.errors import InvalidRequestError, LazyIndexError, LazyRagError
from lazy_rag.index import kv_subdir, verify_index
from lazy_rag.index_lock import writer_lock
from lazy_rag.store import ChunkStore, IndexDB
from helpers import index_settings, index_sql

DOCS = {
    "lighthouse.md": "The Marrow Point Lighthouse was completed in 1871. Its lamp burned whale oil until 1902. "
                     "Keepers lived in the cottage beside it for sixty years.",
    "bakery.md": "The Kestrel Street Bakery opened in 1923. Its founders, two sisters, baked rye bread at night. "
                 "The shop still sells their poppy seed roll.",
}
QUESTION = "When was the Marrow Point Lighthouse completed?"


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def _built_once(tmp_path_factory, smollm2, embedder):
    """The small index and its sources, built once for the module (a build per test cost ~0.4 s
    each, the suite's time budget) and kept pristine beside ``base``."""
    base = tmp_path_factory.mktemp("index-copy")
    src = base / "docs"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text)
    index = LazyIndex.build([src], base / "idx", llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                            progress=False)[0]
    index.close()  # everything in the files before they are copied
    pristine = tmp_path_factory.mktemp("index-copy-pristine") / "base"
    shutil.copytree(base, pristine, symlinks=True)
    return base, pristine


@pytest.fixture()
def index_copy(_built_once):
    """A small built index and its sources (sources are keyed by path: each test gets its own copy
    of the module's one build, restored byte for byte, modification times included, at the paths
    it was built at, whatever the test before left there)."""
    base, pristine = _built_once
    shutil.rmtree(base)
    shutil.copytree(pristine, base, symlinks=True)
    return base / "docs", base / "idx"


def kv_dir(out: Path) -> Path:
    """The folder of the index's KV segments (kv-w<digest> when its chunks are inside a wrapper, as by default)."""
    return out / kv_subdir(index_settings(out).get("wrapper"))


def kv_files(out: Path, read) -> dict:
    """``read(path)`` of every KV segment of the index, by name; never empty (or every comparison of
    two of these would hold vacuously)."""
    files = {p.relative_to(out).as_posix(): read(p) for p in out.glob("kv*/seg-*.kvseg")}  # (not via the database)
    assert files, f"no KV segments in {out}"
    return files


def sidecar(p: Path) -> bool:
    """SQLite's own files beside the database (its write-ahead log and its shared memory): they
    come and go with connections."""
    return p.name.endswith(("-wal", "-shm"))


def mtime(p: Path) -> int:
    return p.stat().st_mtime_ns


def answer(out, smollm2, embedder):
    smollm2.engine.clear_cache()
    return LazyIndex.load(out, llm=smollm2, embedder=embedder).query(QUESTION, top_k=2, max_new_tokens=6).answer


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_frees_the_lock(index_copy, smollm2,
                                                                                          embedder):
    src, out = index_copy
    with writer_lock(out):
        with pytest.raises(LazyIndexError, match=rf"Another lazy-rag process is writing .*process {os.getpid()}"):
            LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                            progress=False)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lazy_rag.index_lock import writer_lock\n"
                               f"with writer_lock({str(out)!r}):\n    print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LazyIndexError, match=f"process {holder.pid}"):
            LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                            progress=False, wait_lock=0.3)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    _, report = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                                progress=False)  # the kernel dropped the killed holder's lock
    assert report.files_unchanged == 2


@pytest.mark.parametrize("damage", ["flip", "reorder", "truncate", "delete"])
def test_damaged_vectors_are_an_error_naming_the_file_and_repair_restores_the_answers(index_copy, smollm2, embedder,
                                                                                      damage):
    src, out = index_copy
    before = answer(out, smollm2, embedder)
    manifest = index_settings(out)
    vf = out / manifest["vectors_file"]
    data = bytearray(vf.read_bytes())
    if damage == "flip":
        data[-40] ^= 0xFF
    elif damage == "reorder":  # two blocks of the stored vectors swapped: every byte there, in another order
        a, b, d = len(data) // 3, 2 * len(data) // 3, 64
        assert data[a:a + d] != data[b:b + d]
        data[a:a + d], data[b:b + d] = data[b:b + d], data[a:a + d]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    if damage == "delete":
        vf.unlink()
    else:
        vf.write_bytes(bytes(data))
    with pytest.raises(LazyIndexError, match=rf"{manifest['vectors_file']}.*--repair"):
        LazyIndex.load(out, llm=smollm2, embedder=embedder)
    report = verify_index(out)
    assert not report["ok"] and manifest["vectors_file"] in report["problems"][0]
    assert report["kv_ok"] == manifest["num_chunks"]  # the KV is intact and says so
    kv_mtimes = kv_files(out, mtime)
    _, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                             progress=False, repair=True)
    assert rep.kv_bytes_written == 0  # every KV record was reused: its token ids matched
    assert kv_files(out, mtime) == kv_mtimes
    assert verify_index(out)["ok"] and answer(out, smollm2, embedder) == before


@pytest.mark.parametrize("damage", ["token_id", "text", "row_deleted", "pages", "bytes"])
def test_a_damaged_chunk_table_is_an_error_and_kv_is_never_repaired_from_it(index_copy, smollm2, embedder, damage):
    """A row edited behind lazy-rag's back fails its checksum wherever it is read (a query, verify);
    a missing row, damaged pages or a file that is no database fail on load (and an update refuses
    to build on them). Each names index.sqlite and --repair; no KV is ever encoded from such a
    table; --repair rebuilds it from the sources, reusing the KV."""
    src, out = index_copy
    db = IndexDB(out)
    rowid, cid, tokens, text = db.one("SELECT rowid, id, token_ids, text FROM chunks ORDER BY rowid")
    db.close()
    if damage == "token_id":
        tokens = bytearray(tokens)
        tokens[12] ^= 0x01  # the fourth token id, one bit off
        index_sql(out, "UPDATE chunks SET token_ids = ? WHERE rowid = ?", (bytes(tokens), rowid))
    elif damage == "text":  # what the sources would show, not what the model read
        index_sql(out, "UPDATE chunks SET text = ? WHERE rowid = ?", (text + " (edited)", rowid))
    elif damage == "row_deleted":
        index_sql(out, "DELETE FROM chunks WHERE rowid = ?", (rowid,))
    else:
        index_sql(out, "SELECT 1")  # everything in the main file (no log beside it)
        db_file = out / "index.sqlite"
        data = bytearray(db_file.read_bytes())
        if damage == "pages":  # every page but the first (the header and the schema) overwritten
            data[4096:] = bytes(len(data) - 4096)
        else:
            data[:] = b"\xff\xfe\x00garbage"
        db_file.write_bytes(bytes(data))
    kv_before = kv_files(out, Path.read_bytes)
    if damage in ("token_id", "text"):
        index = LazyIndex.load(out, llm=smollm2, embedder=embedder)  # rows are read (and checked) when used
        with pytest.raises(LazyIndexError, match=rf"index.sqlite is damaged.*{cid}.*--repair"):
            index.by_id[cid]
        with pytest.raises(LazyIndexError, match=r"index.sqlite.*--repair"):  # a query that would use it
            index.query(QUESTION, top_k=len(index.records), max_new_tokens=2)
    else:
        with pytest.raises(LazyIndexError, match=r"index.sqlite.*--repair"):
            LazyIndex.load(out, llm=smollm2, embedder=embedder)
        with pytest.raises(LazyIndexError, match="--repair"):  # an update refuses to build on it too
            LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                            progress=False)
    report = verify_index(out)
    assert not report["ok"] and any("index.sqlite" in p and "--repair" in p for p in report["problems"])
    assert kv_files(out, Path.read_bytes) == kv_before
    _, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                             progress=False, repair=True)
    assert verify_index(out)["ok"] and answer(out, smollm2, embedder)
    assert rep.kv_bytes_written == 0  # every chunk's KV found in the segments (even with no database to say where)


def chunk_table(out: Path) -> list:
    """The committed chunk records (sorted), as JSON lines."""
    db = IndexDB(out)
    try:
        return sorted(json.dumps({"id": r[0], "source": r[1], "ordinal": r[2], "text": r[3]}, ensure_ascii=False)
                      for r in db.rows("SELECT id, source, ordinal, text FROM chunks"))
    finally:
        db.close()


def index_content(out: Path) -> list:
    """Everything the index holds: the database's rows (whatever SQLite's file bytes are: a
    checkpoint rewrites them without changing a row) and every other file's bytes but the lock's
    (its text names the last holder)."""
    db = IndexDB(out)
    try:
        rows = [(t, sorted(db.rows(f"SELECT * FROM {t}"))) for t in ("settings", "chunks", "files", "segments",
                                                                       "pending_kv")]
    finally:
        db.close()
    return rows + sorted((p.relative_to(out).as_posix(), p.read_bytes()) for p in out.rglob("*") if p.is_file()
                         and p.name != ".lock" and not p.name.startswith("index.sqlite"))


def test_repair_keeps_files_indexed_from_other_sources_and_refuses_to_drop_unreadable_ones(index_copy, smollm2,
                                                                                          embedder, tmp_path):
    src, out = index_copy
    other = tmp_path / "other"
    other.mkdir()
    (other / "harbour.md").write_text("The harbour wall of Port Sallow was finished in 1899 after four winters.")
    opts = dict(llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    LazyIndex.build([other], out, **opts)  # an update naming only the new folder keeps the first one's files
    table, kv_mtimes = chunk_table(out), kv_files(out, mtime)
    assert {json.loads(r)["source"].rsplit("/", 1)[1] for r in table} == {"lighthouse.md", "bakery.md", "harbour.md"}

    def damage_vectors():
        vf = out / index_settings(out)["vectors_file"]
        vf.write_bytes(vf.read_bytes()[:-40] + bytes(40))

    damage_vectors()
    _, rep = LazyIndex.build([other], out, **opts, repair=True)  # names only one of the two sources
    assert chunk_table(out) == table and verify_index(out)["ok"]
    assert rep.kv_bytes_written == 0 and kv_files(out, mtime) == kv_mtimes  # every KV record reused
    assert rep.files_removed == 0 and rep.skipped_files == []
    # a file of the source not named is gone: the repair cannot rebuild its chunks; it says so and changes nothing
    (src / "bakery.md").unlink()
    damage_vectors()
    before = index_content(out)
    gone = str((src / "bakery.md").resolve())
    with pytest.raises(LazyIndexError, match=rf"1 file\(s\) .* not named here .*{re.escape(gone)} \(unreadable.*"
                                             r"Nothing was changed.*--drop-missing"):
        LazyIndex.build([other], out, **opts, repair=True)
    assert index_content(out) == before
    res = CliRunner().invoke(app, ["index", str(other), "--out", str(out), "--repair", "--chunk-size", "24",
                                   "--chunk-overlap", "0"])
    assert res.exit_code == 2 and "--drop-missing" in res.output and "Traceback" not in res.output, res.output
    index, rep = LazyIndex.build([other], out, **opts, repair=True, drop_missing=True)
    assert rep.files_removed == 1 and [p for p, _ in rep.skipped_files] == [gone]
    assert chunk_table(out) == [r for r in table if json.loads(r)["source"] != gone] and verify_index(out)["ok"]
    assert answer(out, smollm2, embedder)  # and it serves


def test_drop_missing_drops_files_gone_from_sources_not_named(index_copy, smollm2, embedder, tmp_path):
    src, out = index_copy
    other = tmp_path / "other"
    other.mkdir()
    (other / "harbour.md").write_text("The harbour wall of Port Sallow was finished in 1899 after four winters.")
    opts = dict(llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    (src / "bakery.md").unlink()
    index, rep = LazyIndex.build([other], out, **opts)  # by default a file outside the sources named is kept
    assert rep.files_removed == 0 and any(r.source.endswith("bakery.md") for r in index.records)
    index, rep = LazyIndex.build([other], out, **opts, drop_missing=True)
    assert rep.files_removed == 1 and not any(r.source.endswith("bakery.md") for r in index.records)
    assert {r.source.rsplit("/", 1)[1] for r in index.records} == {"lighthouse.md", "harbour.md"}
    assert verify_index(out)["ok"] and verify_index(out)["stray_kv_files"] == 0


def test_a_source_emptied_or_made_binary_loses_its_chunks_and_is_named(index_copy, smollm2, embedder):
    src, out = index_copy
    (src / "bakery.md").write_bytes(b"\x00\x01binary now")
    index, report = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                                    progress=False)
    assert report.files_removed == 1 and report.skipped_files == [
        (str((src / "bakery.md").resolve()), "binary: it is not text; convert it to text or leave it out")]
    assert all(not r.source.endswith("bakery.md") for r in index.records)
    assert verify_index(out)["ok"] and verify_index(out)["stray_kv_files"] == 0


@pytest.mark.parametrize("where", ["kv", "vectors"])
def test_a_full_disk_leaves_the_previous_index_and_no_debris(index_copy, smollm2, embedder, monkeypatch, where):
    src, out = index_copy
    before = answer(out, smollm2, embedder)
    names_before = sorted(p.name for p in out.rglob("*") if not sidecar(p))
    content_before = index_content(out)
    (src / "new.md").write_text("A brand new document about the harbour wall, finished in 1899, long and "
                                "detailed enough to need several chunks of KV. " * 3)
    real_write, calls = ChunkStore.write, []

    def full_after_one(self, chunk_id, token_ids, kv):
        calls.append(chunk_id)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.kv_dir))
        return real_write(self, chunk_id, token_ids, kv)

    import lazy_rag.index.commit as commit_mod

    real_atomic = commit_mod.atomic_write_bytes

    def full_at_vectors(path, data):  # inside the commit, after the new rows were written
        if path.name.startswith("vectors-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_atomic(path, data)

    if where == "kv":
        monkeypatch.setattr(ChunkStore, "write", full_after_one)
    else:
        monkeypatch.setattr(commit_mod, "atomic_write_bytes", full_at_vectors)
    with pytest.raises(LazyIndexError, match="disk is full.*previous index is unchanged.*removed"):
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert sorted(p.name for p in out.rglob("*") if not sidecar(p)) == names_before
    assert index_content(out) == content_before  # the segments cut back to their committed lengths
    monkeypatch.undo()
    assert answer(out, smollm2, embedder) == before and verify_index(out)["ok"]


def test_a_build_that_cannot_fit_is_refused_before_writing(tmp_path, smollm2, embedder, monkeypatch):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text(DOCS["lighthouse.md"])
    import lazy_rag.index.build as index_mod

    monkeypatch.setattr(index_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(LazyIndexError, match=r"needs .* GiB, but .* has 0.00 GiB free.*--kv-dtype bf16"):
        LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=embedder, progress=False)
    assert not list((tmp_path / "idx").rglob("*.kvseg"))


def test_killed_writers_temp_files_are_removed_by_the_next_build(index_copy, smollm2, embedder):
    src, out = index_copy
    (kv_dir(out) / ".abc.123.tmp").write_bytes(b"half a file")
    (out / ".manifest.json.9.tmp").write_bytes(b"{")
    assert verify_index(out)["temp_files"] == 2
    LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert verify_index(out)["temp_files"] == 0


def test_a_reader_of_an_old_generation_writes_no_kv_and_a_write_failure_still_answers(index_copy, smollm2,
                                                                                     embedder, caplog):
    src, out = index_copy
    old = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    (src / "bakery.md").write_text("The Kestrel Street Bakery closed in 1990.")
    LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    smollm2.engine.clear_cache()
    dropped = {r.id for r in old.records if r.source.endswith("bakery.md")}
    for p in kv_dir(out).glob("seg-*.kvseg"):  # every chunk's KV gone: the old reader encodes each one
        p.unlink()
    content = index_content(out)
    caplog.set_level(logging.INFO, logger="lazy_rag.store")
    res = old.query("When did the Kestrel Street Bakery open?", top_k=len(old.records), max_new_tokens=4)
    assert res.answer is not None and res.stats["chunk_sources"] == {"encoded": len(old.records)}
    assert "rebuilt since it was loaded" in caplog.text
    assert index_content(out) == content  # no write-back: not a row, not a segment byte for the new index
    db = IndexDB(out)
    assert dropped and not dropped & {r[0] for r in db.rows("SELECT id FROM chunks")}
    db.close()
    assert verify_index(out)["stray_kv_files"] == 0
    # a read-only folder (simulated: root ignores permissions): the query is served from memory
    fresh = LazyIndex.load(out, llm=smollm2, embedder=embedder)

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    fresh.store.write = refuse
    smollm2.engine.clear_cache()
    got = fresh.query(QUESTION, top_k=len(fresh.records), max_new_tokens=4)
    assert got.answer is not None and "Could not write the KV" in caplog.text


def test_ids_cannot_name_paths_outside_the_store(tmp_path, smollm2, embedder):
    out = tmp_path / "deep" / "idx"
    ids = ["../../../escaped", "a/b", "ok-id_1.x"]
    index = LazyIndex.from_texts(["first text here", "second text here", "third text here"], out, llm=smollm2,
                                 embedder=embedder, ids=ids, split=False, progress=False)
    # an id is a value in a row and in its KV record's metadata, never a file name
    made = sorted(p.relative_to(out).as_posix() for p in tmp_path.rglob("*") if p.is_file() and not sidecar(p))
    wrapper_file = index.manifest["wrapper_file"]
    assert made == sorted([".lock", "index.sqlite", "manifest.json", index.manifest["vectors_file"], wrapper_file,
                           f"{index.store.folder}/seg-000001.kvseg"])
    assert {r.id for r in index.records} == set(ids) and all(index.store.read(r.id, r.token_ids)[1] is None
                                                             for r in index.records)
    assert index.segments("q", ["a/b"]) and verify_index(out)["ok"]


@pytest.mark.parametrize("damage", ["no_model", "no_settings", "no_database", "garbled", "not_json_object",
                                    "no_tables"])
def test_damaged_settings_are_clean_errors(index_copy, damage):
    _, out = index_copy
    if damage == "no_model":
        index_sql(out, "DELETE FROM settings WHERE key = 'model'")
    elif damage == "no_settings":
        index_sql(out, "DELETE FROM settings")
    elif damage == "no_database":
        for p in out.glob("index.sqlite*"):
            p.unlink()
    elif damage == "garbled":
        index_sql(out, "UPDATE settings SET value = ? WHERE key = 'chunking'", (b"\xff\xfe{\x00}",))  # not UTF-8 JSON
    elif damage == "not_json_object":
        index_sql(out, "UPDATE settings SET value = '[1, 2]' WHERE key = 'model'")
    else:  # an SQLite file, but not lazy-rag's
        index_sql(out, "DROP TABLE settings")
    try:
        assert not verify_index(out)["ok"]
    except LazyIndexError as e:
        assert re.search("damaged|lacks|format", str(e))
    runner = CliRunner()
    for cmd in (["inspect", str(out)], ["verify", str(out)]):
        res = runner.invoke(app, cmd)
        assert res.exit_code in (1, 2) and "Traceback" not in res.output, res.output
        assert not isinstance(res.exception, (KeyError, FileNotFoundError, UnicodeDecodeError)), res.exception
        # the fix, as a command to run (a lost database too: it was "run `lazy-rag index` again")
        assert f"lazy-rag index SOURCES --out {out} --repair" in res.output, res.output
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 1  # damage, not a usage error


def test_cli_verify_and_bad_out_and_bad_request(index_copy, tmp_path):
    src, out = index_copy
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(out)])
    assert ok.exit_code == 0 and "OK" in ok.output
    kv = next(kv_dir(out).glob("seg-*.kvseg"))
    data = bytearray(kv.read_bytes())
    data[-5] ^= 0xFF  # inside the last record's tensor bytes
    kv.write_bytes(bytes(data))
    bad = runner.invoke(app, ["verify", str(out)])
    assert bad.exit_code == 1 and "checksum mismatch" in bad.output
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    res = runner.invoke(app, ["index", str(src), "--out", str(a_file)])
    assert res.exit_code == 2 and "is a file, not a folder" in res.output
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        from lazy_rag.requests import SamplingParams

        SamplingParams(max_new_tokens=0)
    assert issubclass(InvalidRequestError, LazyRagError) and issubclass(InvalidRequestError, ValueError)


def test_symlink_loops_and_deep_folders_are_walked_once(tmp_path):
    from lazy_rag.chunking import discover_files

    root = tmp_path / "docs"
    deep = root.joinpath(*[f"d{i}" for i in range(60)])
    deep.mkdir(parents=True)
    (deep / "note.md").write_text("deep text")
    (root / "top.md").write_text("top text")
    (root / "d0" / "loop").symlink_to(root, target_is_directory=True)
    (root / "alias.md").symlink_to(root / "top.md")
    files, _ = discover_files([root])
    assert files == sorted({(deep / "note.md").resolve(), (root / "top.md").resolve()})


def test_a_full_disk_inside_an_append_is_an_error_and_leaves_no_partial_record(index_copy, smollm2, embedder,
                                                                             monkeypatch):
    """The disk fills half-way through writing a record (not before it, as above): the build fails
    with the message, and the segment holds not one byte of the half record."""
    src, out = index_copy
    import lazy_rag.store as store_mod

    (src / "new.md").write_text("A brand new document about the harbour wall, finished in 1899.")
    content_before = index_content(out)

    def full(fd, parts, off):
        os.pwrite(fd, bytes(parts[0]) + bytes(parts[1])[:1000], off)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "pwrite_all", full)
    with pytest.raises(LazyIndexError, match="disk is full.*previous index is unchanged"):
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert index_content(out) == content_before and verify_index(out)["ok"]


def test_a_killed_build_resumes_from_the_kv_it_checkpointed(index_copy, smollm2, embedder, monkeypatch):
    """A build commits what it appended as pending KV every CHECKPOINT_BYTES: killed after that
    (here: interrupted), the next build reuses that KV instead of encoding it again."""
    src, out = index_copy
    import lazy_rag.store as store_mod

    monkeypatch.setattr(store_mod, "CHECKPOINT_BYTES", 1)  # a checkpoint after every record
    monkeypatch.setattr(store_mod, "CHECKPOINT_MIN_S", 0.0)
    (src / "new.md").write_text("A brand new document about the harbour wall, finished in 1899, long and detailed "
                                "enough to need several chunks of KV. " * 3)
    real_write, calls = ChunkStore.write, []

    def killed_after_three(self, chunk_id, token_ids, kv):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(chunk_id)
        return real_write(self, chunk_id, token_ids, kv)

    monkeypatch.setattr(ChunkStore, "write", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    monkeypatch.setattr(ChunkStore, "write", real_write)
    assert verify_index(out)["ok"]  # the previous generation, whole
    written = []
    monkeypatch.setattr(ChunkStore, "write", lambda self, c, t, kv: (written.append(c), real_write(self, c, t, kv))[1])
    index, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                                 progress=False)
    new_ids = [r.id for r in index.records if r.source.endswith("new.md")]
    assert len(new_ids) > 3 and set(calls) <= set(new_ids) and not set(calls) & set(written)
    assert sorted(written + calls) == sorted(new_ids)  # encoded once each, across the two runs
    assert verify_index(out)["ok"] and index_settings(out)["num_chunks"] == len(index.records)


def test_a_build_whose_kv_was_all_checkpointed_fits_the_encode_costs_after_its_commit(index_copy, smollm2,
                                                                                        embedder, monkeypatch):
    """The encode calibration runs beside the KV writes; a build with nothing left to encode (a
    killed build checkpointed every chunk's KV) has no writes to hide it behind and fits it once,
    after its commit; a build that encodes fits it once, inside its pipeline."""
    import lazy_rag.index.build as build_mod
    import lazy_rag.store as store_mod

    src, out = index_copy
    monkeypatch.setattr(store_mod, "CHECKPOINT_BYTES", 1)  # a checkpoint after every record
    monkeypatch.setattr(store_mod, "CHECKPOINT_MIN_S", 0.0)
    fits = []
    monkeypatch.setattr(build_mod, "_keep_encode_calibration",
                        lambda llm, report: fits.append("commit_s" in report.stages))
    (src / "new.md").write_text("A brand new document about the harbour wall, finished in 1899. " * 4)
    real_commit = build_mod.commit

    def killed_at_commit(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "commit", killed_at_commit)
    with pytest.raises(KeyboardInterrupt):
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert fits == [False]  # beside the writes, before the commit
    monkeypatch.setattr(build_mod, "commit", real_commit)
    fits.clear()
    index, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                                 progress=False)
    assert rep.stages.get("beside_at_batch", -1) < 0 and rep.stages.get("batches", 0) == 0  # nothing encoded
    assert fits == [True] and verify_index(out)["ok"]


def test_a_build_not_on_a_terminal_prints_progress_lines(tmp_path, smollm2, embedder, capsys):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text(DOCS["lighthouse.md"] + " " + DOCS["bakery.md"])
    LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                    progress=True)  # stderr is captured here, so not a terminal: lines
    err = capsys.readouterr().err
    assert "[embedding chunks]" in err and re.search(r"\[encoding chunk KV\] (\d+)/\1 \(100%\)", err)


def test_every_file_of_an_index_takes_the_umask_so_another_user_can_serve_it(tmp_path, smollm2, embedder):
    """An index built as one user and served as another (root in a container image, a service
    account) must be readable like its segments: manifest, vector index and wrapper were written
    through mkstemp, which made them 0600 whatever the umask."""
    from lazy_rag.tempfiles import create_temp
    from lazy_rag.wrapper import ChunkWrapper

    src = tmp_path / "docs"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text)
    old = os.umask(0o022)
    try:
        out = tmp_path / "idx"
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
        wrapper = ChunkWrapper(torch_randn(4, smollm2.model.config.hidden_size), 2, 2, name="t")
        wrapper.save(tmp_path / "w.safetensors")
        files = [p for p in out.rglob("*") if p.is_file() and not sidecar(p)] + [tmp_path / "w.safetensors"]
        names = {p.name for p in files}
        assert "manifest.json" in names and any(n.startswith("vectors") for n in names)
        modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
        assert set(modes.values()) == {"0o644"}, sorted(modes.items())
        os.umask(0o077)  # the umask decides, as for open(): a private umask keeps files private
        fd, path = create_temp(tmp_path, prefix=".x.")
        os.close(fd)
        assert Path(path).stat().st_mode & 0o777 == 0o600 and Path(path).name.startswith(".x.")
    finally:
        os.umask(old)


def torch_randn(*shape):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))
