"""Reliability of stored indexes (issue 25's storage half): one writer per folder, checksums
of every index file checked on load and by `lazy-rag verify`, `--repair`, sources that become
unreadable, write failures (full disk) that leave the previous index and no debris, guarded
write-backs by queries, ids that try to name paths, and clean errors for damaged files."""
import errno
import json
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
from lazy_rag.store import ChunkStore

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


@pytest.fixture()
def index_copy(tmp_path, smollm2, embedder):
    """A small built index and its sources (sources are keyed by path: each test builds its own)."""
    src = tmp_path / "docs"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text)
    LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                    progress=False)
    return src, tmp_path / "idx"


def kv_dir(out: Path) -> Path:
    """The folder of the index's KV files (kv-w<digest> when its chunks are inside a wrapper, as by default)."""
    return out / kv_subdir(json.loads((out / "manifest.json").read_text()).get("wrapper"))


def kv_files(out: Path, read) -> dict:
    """``read(path)`` of every KV file of the index, by name; never empty (or every comparison of
    two of these would hold vacuously)."""
    files = {p.name: read(p) for p in kv_dir(out).glob("*.safetensors")}
    assert files, f"no KV files in {kv_dir(out)}"
    return files


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
    manifest = json.loads((out / "manifest.json").read_text())
    vf = out / manifest["vectors_file"]
    data = bytearray(vf.read_bytes())
    if damage == "flip":
        data[-40] ^= 0xFF
    elif damage == "reorder":  # swap the last two float32 rows' first values
        d = 384 * 4
        data[-2 * d:-d], data[-d:] = data[-d:], data[-2 * d:-d]
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
    assert rep.kv_bytes_written == 0  # every KV file was reused: its token ids matched
    assert kv_files(out, mtime) == kv_mtimes
    assert verify_index(out)["ok"] and answer(out, smollm2, embedder) == before


@pytest.mark.parametrize("damage", ["token_id", "last_line", "text", "bytes"])
def test_a_damaged_chunk_table_is_an_error_and_kv_is_never_repaired_from_it(index_copy, smollm2, embedder, damage):
    src, out = index_copy
    manifest = json.loads((out / "manifest.json").read_text())
    table = out / manifest["chunks_file"]
    lines = table.read_text().splitlines(keepends=True)
    rec = json.loads(lines[0])
    if damage == "token_id":
        rec["token_ids"][3] += 1
        lines[0] = json.dumps(rec) + "\n"
    elif damage == "text":
        rec["text"] = rec["text"] + " (edited)"  # what the sources would show, not what the model read
        lines[0] = json.dumps(rec) + "\n"
    elif damage == "last_line":
        lines = lines[:-1]
    table.write_text("".join(lines)) if damage != "bytes" else table.write_bytes(b"\xff\xfe\x00garbage")
    kv_before = kv_files(out, Path.read_bytes)
    with pytest.raises(LazyIndexError, match=rf"{manifest['chunks_file']}.*--repair"):
        LazyIndex.load(out, llm=smollm2, embedder=embedder)
    with pytest.raises(LazyIndexError, match="--repair"):  # an update refuses to build on it too
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert not verify_index(out)["ok"]
    assert kv_files(out, Path.read_bytes) == kv_before
    LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False,
                    repair=True)
    assert verify_index(out)["ok"]


def chunk_table(out: Path) -> list:
    """The committed chunk records (sorted), as stored."""
    m = json.loads((out / "manifest.json").read_text())
    return sorted((out / m["chunks_file"]).read_text().splitlines())


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
        vf = out / json.loads((out / "manifest.json").read_text())["vectors_file"]
        vf.write_bytes(vf.read_bytes()[:-40] + bytes(40))

    damage_vectors()
    _, rep = LazyIndex.build([other], out, **opts, repair=True)  # names only one of the two sources
    assert chunk_table(out) == table and verify_index(out)["ok"]
    assert rep.kv_bytes_written == 0 and kv_files(out, mtime) == kv_mtimes  # every KV file reused
    assert rep.files_removed == 0 and rep.skipped_files == []
    # a file of the source not named is gone: the repair cannot rebuild its chunks; it says so and changes nothing
    (src / "bakery.md").unlink()
    damage_vectors()
    def files():  # every index file but the lock (its text names the last holder)
        return sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file() and p.name != ".lock")

    before = files()
    gone = str((src / "bakery.md").resolve())
    with pytest.raises(LazyIndexError, match=rf"1 file\(s\) .* not named here .*{re.escape(gone)} \(unreadable.*"
                                             r"Nothing was changed.*--drop-missing"):
        LazyIndex.build([other], out, **opts, repair=True)
    assert files() == before
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
    assert report.files_removed == 1 and report.skipped_files == [(str((src / "bakery.md").resolve()), "binary")]
    assert all(not r.source.endswith("bakery.md") for r in index.records)
    assert verify_index(out)["ok"] and verify_index(out)["stray_kv_files"] == 0


@pytest.mark.parametrize("where", ["kv", "vectors"])
def test_a_full_disk_leaves_the_previous_index_and_no_debris(index_copy, smollm2, embedder, monkeypatch, where):
    src, out = index_copy
    before = answer(out, smollm2, embedder)
    names_before = sorted(p.name for p in out.rglob("*"))
    (src / "new.md").write_text("A brand new document about the harbour wall, finished in 1899, long and "
                                "detailed enough to need several chunks of KV. " * 3)
    real_write, calls = ChunkStore.write, []

    def full_after_one(self, chunk_id, token_ids, kv):
        calls.append(chunk_id)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path(chunk_id)))
        return real_write(self, chunk_id, token_ids, kv)

    import lazy_rag.index as index_mod

    real_atomic = index_mod._atomic_write_bytes

    def full_at_vectors(path, data):  # after the new chunk table was written
        if path.name.startswith("vectors-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_atomic(path, data)

    if where == "kv":
        monkeypatch.setattr(ChunkStore, "write", full_after_one)
    else:
        monkeypatch.setattr(index_mod, "_atomic_write_bytes", full_at_vectors)
    with pytest.raises(LazyIndexError, match="disk is full.*previous index is unchanged.*removed"):
        LazyIndex.build([src], out, llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0, progress=False)
    assert sorted(p.name for p in out.rglob("*")) == names_before
    monkeypatch.undo()
    assert answer(out, smollm2, embedder) == before and verify_index(out)["ok"]


def test_a_build_that_cannot_fit_is_refused_before_writing(tmp_path, smollm2, embedder, monkeypatch):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text(DOCS["lighthouse.md"])
    import lazy_rag.index as index_mod

    monkeypatch.setattr(index_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(LazyIndexError, match=r"needs .* GiB, but .* has 0.00 GiB free.*--kv-dtype bfloat16"):
        LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=embedder, progress=False)
    assert not list((tmp_path / "idx").rglob("*.safetensors"))


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
    dropped = [r for r in old.records if r.source.endswith("bakery.md")]
    res = old.query("When did the Kestrel Street Bakery open?", top_k=len(old.records), max_new_tokens=4)
    assert res.answer is not None
    assert not any(ChunkStore(out, "x").path(r.id).exists() for r in dropped)  # no stray KV for the new index
    assert verify_index(out)["stray_kv_files"] == 0
    # a read-only folder (simulated: root ignores permissions): the query is served from memory
    fresh = LazyIndex.load(out, llm=smollm2, embedder=embedder)
    victim = fresh.records[0]
    fresh.store.path(victim.id).unlink()

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
    wrapper_file = index.manifest.get("wrapper_file")  # the index's own chunk wrapper, beside its KV
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors")
                   if p != (out / wrapper_file if wrapper_file else None))
    store = f"deep/idx/{index.store.kv_dir.name}/"
    assert len(files) == 3 and all(f.startswith(store) for f in files)
    assert f"{store}ok-id_1.x.safetensors" in files
    assert index.segments("q", ["a/b"]) and verify_index(out)["ok"]


@pytest.mark.parametrize("damage", ["no_model", "no_chunks_file", "garbled", "not_json_object"])
def test_damaged_manifests_are_clean_errors(index_copy, damage):
    _, out = index_copy
    mf = out / "manifest.json"
    m = json.loads(mf.read_text())
    if damage == "no_model":
        del m["model"]
        mf.write_text(json.dumps(m))
    elif damage == "no_chunks_file":
        (out / m["chunks_file"]).unlink()
    elif damage == "garbled":
        mf.write_bytes(b"\xff\xfe{\x00}")
    else:
        mf.write_text("[1, 2]")
    try:
        assert not verify_index(out)["ok"]
    except LazyIndexError as e:
        assert re.search("damaged|lacks|format", str(e))
    runner = CliRunner()
    for cmd in (["inspect", str(out)], ["verify", str(out)]):
        res = runner.invoke(app, cmd)
        assert res.exit_code in (1, 2) and "Traceback" not in res.output, res.output
        assert not isinstance(res.exception, (KeyError, FileNotFoundError, UnicodeDecodeError)), res.exception


def test_cli_verify_and_bad_out_and_bad_request(index_copy, tmp_path):
    src, out = index_copy
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(out)])
    assert ok.exit_code == 0 and "OK" in ok.output
    kv = next(kv_dir(out).glob("*.safetensors"))
    data = bytearray(kv.read_bytes())
    data[-5] ^= 0xFF
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


def test_a_full_disk_inside_safetensors_is_an_oserror_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import torch

    import lazy_rag.store as store_mod
    from lazy_rag.store import ChunkKV

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(store_mod, "save_file", full)
    store = ChunkStore(tmp_path, "fp")
    with pytest.raises(OSError) as info:
        store.write("c1", [1, 2], ChunkKV(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4)))
    assert info.value.errno == errno.ENOSPC
    assert list((tmp_path / "kv").iterdir()) == []


def test_a_build_not_on_a_terminal_prints_progress_lines(tmp_path, smollm2, embedder, capsys):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text(DOCS["lighthouse.md"] + " " + DOCS["bakery.md"])
    LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=embedder, chunk_size=24, chunk_overlap=0,
                    progress=True)  # stderr is captured here, so not a terminal: lines
    err = capsys.readouterr().err
    assert "[embedding chunks]" in err and re.search(r"\[encoding chunk KV\] (\d+)/\1 \(100%\)", err)
