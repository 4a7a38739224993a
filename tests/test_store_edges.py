"""The store's rough edges (issue 64): the writer lock's refusals, a lost database, a build refused
for its size in a new folder, an unknown KV dtype, and errors that are no disk failure."""
import fcntl
import json
import os
import re
import socket
import threading
import time

import pytest

from lazy_rag.errors import LazyIndexError
from lazy_rag.index_lock import LOCK_NAME, remove_lock_file, try_writer_lock, writer_lock


def _held_with(folder, text: bytes):
    """``folder``'s lock file holding ``text``, locked by another open file (as another process would)."""
    (folder / LOCK_NAME).write_bytes(text)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _refusal(folder) -> str:
    with pytest.raises(LazyIndexError, match="Another lazy-rag process is writing") as e:
        with writer_lock(folder):
            pass
    return str(e.value)


@pytest.mark.parametrize("text", [b"rm -rf / \x1b[31mred", b"\xff\xfe", json.dumps([1, 2]).encode(),
                                  json.dumps({"pid": "evil", "host": "h", "command": "c"}).encode(),
                                  json.dumps({"pid": True}).encode(), b""])
def test_a_refusal_never_quotes_lock_text_that_is_not_a_lock_record(tmp_path, text):
    fd = _held_with(tmp_path, text)
    try:
        msg = _refusal(tmp_path)
    finally:
        os.close(fd)
    assert "not a lazy-rag lock record" in msg and f"fuser -v {tmp_path / LOCK_NAME}" in msg
    assert "evil" not in msg and "rm -rf" not in msg and "\x1b" not in msg and "process [" not in msg


def test_a_refusal_names_a_live_holder_and_calls_a_dead_one_stale(tmp_path):
    host = socket.gethostname()
    record = {"pid": os.getpid(), "host": host, "since": time.time(), "command": "lazy-rag index \x1b]0;x\x07"}
    fd = _held_with(tmp_path, json.dumps(record).encode())
    try:
        msg = _refusal(tmp_path)
        assert f"process {os.getpid()} on {host} (lazy-rag index ?]0;x?, since " in msg  # control characters shown as ?
        assert "stale" not in msg
        # a record of a process that is gone: the lock is held, but not by it (a query's write-back writes no record)
        dead = os.fork()
        if dead == 0:
            os._exit(0)
        os.waitpid(dead, 0)
        record["pid"] = dead
        os.pwrite(fd, json.dumps(record).encode().ljust(200), 0)
        msg = _refusal(tmp_path)
    finally:
        os.close(fd)
    assert f"names process {dead} on {host}" in msg and "no longer running" in msg and "stale record" in msg
    assert f"fuser -v {tmp_path / LOCK_NAME}" in msg


def test_a_lock_file_that_is_a_directory_is_named_with_the_fix(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(LazyIndexError, match=rf"lock file {tmp_path / LOCK_NAME} is a directory.*"
                                             rf"`rmdir {tmp_path / LOCK_NAME}`") as e:
        with writer_lock(tmp_path):
            pass
    assert "permissions" not in str(e.value)
    with try_writer_lock(tmp_path) as refused:
        assert "is a directory" in refused and "not writable" in refused


def test_a_writer_waiting_on_a_lock_file_its_holder_removed_locks_the_new_one(tmp_path):
    """A failed build into a new folder removes its lock file while holding it: the writer that
    waited on the old file must not think it holds the lock while a third writer holds the new one."""
    got, order = threading.Event(), []

    def waiter():
        with writer_lock(tmp_path, wait=5):
            order.append("waiter")
            got.set()
            time.sleep(0.3)
            order.append("waiter done")

    with writer_lock(tmp_path):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)  # the waiter has opened the old file and polls its lock
        remove_lock_file(tmp_path)
    assert got.wait(5)
    with writer_lock(tmp_path, wait=5):  # waits for the waiter: both lock the file now at the path
        order.append("third")
    t.join()
    assert order == ["waiter", "waiter done", "third"]


# -- with a small index ----------------------------------------------------------------------------

DOCS = {
    "lighthouse.md": "The Marrow Point Lighthouse was completed in 1871. Its lamp burned whale oil until 1902. "
                     "Keepers lived in the cottage beside it for sixty years.",
    "bakery.md": "The Kestrel Street Bakery opened in 1923. Its founders, two sisters, baked rye bread at night. "
                 "The shop still sells their poppy seed roll.",
}
OPTS = dict(chunk_size=24, chunk_overlap=0, progress=False)


@pytest.fixture(scope="module")
def embedder():
    from lazy_rag.embedder import Embedder

    return Embedder()


@pytest.fixture()
def docs(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text)
    return src


@pytest.fixture()
def built(docs, tmp_path, smollm2, embedder):
    from lazy_rag import LazyIndex

    LazyIndex.build([docs], tmp_path / "idx", llm=smollm2, embedder=embedder, **OPTS)
    return docs, tmp_path / "idx"


def _segments(out):
    segs = {p.relative_to(out).as_posix(): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("kv*/seg-*.kvseg")}
    assert segs, f"no KV segments in {out}"
    return segs


@pytest.mark.parametrize("loss", ["database_deleted", "settings_deleted"])
def test_a_lost_database_is_named_with_repair_and_repair_reuses_the_segments_kv(built, smollm2, embedder, loss):
    from typer.testing import CliRunner

    from lazy_rag import LazyIndex
    from lazy_rag.cli import app
    from lazy_rag.index import verify_index
    from helpers import index_sql

    src, out = built
    chunks = verify_index(out)["chunks"]
    if loss == "database_deleted":
        for p in out.glob("index.sqlite*"):
            p.unlink()
    else:
        index_sql(out, "DELETE FROM settings")
    segs = _segments(out)
    fix = f"lazy-rag index SOURCES --out {out} --repair"
    with pytest.raises(LazyIndexError, match=r"damaged.*" + re.escape(fix)):
        LazyIndex.load(out, llm=smollm2, embedder=embedder)
    report = verify_index(out)
    assert not report["ok"] and fix in report["problems"][0]
    res = CliRunner().invoke(app, ["verify", str(out)])
    assert res.exit_code == 1 and fix in res.output and "Traceback" not in res.output, res.output
    assert not (out / "index.sqlite").exists() or loss == "settings_deleted"  # verify created no database
    index, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, repair=True, **OPTS)
    assert rep.chunks_encoded == 0 and rep.kv_bytes_written == 0  # every record found in the segments
    assert _segments(out) == segs and len(index.records) == chunks
    assert verify_index(out)["ok"]
    assert index.query("When was the Marrow Point Lighthouse completed?", top_k=2, max_new_tokens=4).answer


def test_salvage_skips_records_of_another_kv_dtype(built, smollm2, embedder):
    """The settings that said which dtype the KV was stored in are gone: a repair asking for
    another dtype encodes again rather than mixing dtypes."""
    from lazy_rag import LazyIndex
    from lazy_rag.index import verify_index

    src, out = built
    for p in out.glob("index.sqlite*"):
        p.unlink()
    index, rep = LazyIndex.build([src], out, llm=smollm2, embedder=embedder, repair=True, kv_dtype="bf16", **OPTS)
    assert rep.chunks_encoded == len(index.records) > 0
    assert verify_index(out)["ok"]


def _tree(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) if folder.exists() else None


@pytest.mark.parametrize("folder", ["new", "empty", "with_a_file"])
def test_a_build_refused_for_its_size_leaves_a_folder_without_an_index_as_it_was(docs, tmp_path, smollm2, embedder,
                                                                                monkeypatch, folder):
    import shutil

    import lazy_rag.index.build as build_mod
    from lazy_rag import LazyIndex

    out = tmp_path / "idx"
    if folder != "new":
        out.mkdir()
    if folder == "with_a_file":
        (out / "notes.txt").write_text("mine")
    before = _tree(out)
    monkeypatch.setattr(build_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(LazyIndexError, match=r"The KV of \d+ new chunks \([\d,]+ tokens \+ 16 chunk wrapper slots "
                                             r"per chunk x [\d,]+ bytes\) needs [\d.]+ GiB, but .* has 0.00 GiB free\. "
                                             r".*--kv-dtype .*--no-precompute"):
        LazyIndex.build([docs], out, llm=smollm2, embedder=embedder, **OPTS)
    assert _tree(out) == before  # no .lock, index.sqlite or empty kv folder left (a new folder: not even it)


@pytest.mark.parametrize("error", ["timeout", "connection", "model_file_gone", "disk_full"])
def test_only_a_failure_to_write_the_index_is_reported_as_one(docs, tmp_path, smollm2, embedder, monkeypatch, error):
    """TimeoutError and ConnectionError are OSErrors, and so is a model or source file that
    cannot be read: none of them is the index's disk, and a build must not say it was."""
    import errno

    import lazy_rag.index.build as build_mod
    from lazy_rag import LazyIndex

    out = tmp_path / "idx"
    raised = {"timeout": TimeoutError("regular-expression match exceeded its time limit"),
              "connection": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
              "model_file_gone": FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path / "model.gguf")),
              "disk_full": OSError(errno.ENOSPC, "No space left on device", str(out / "kv"))}[error]

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(build_mod, "check_free_space", fail)
    if error == "disk_full":
        with pytest.raises(LazyIndexError, match="Writing the index at .* failed: the disk is full.*no index was "
                                                 "written"):
            LazyIndex.build([docs], out, llm=smollm2, embedder=embedder, **OPTS)
    else:
        with pytest.raises(type(raised)) as e:
            LazyIndex.build([docs], out, llm=smollm2, embedder=embedder, **OPTS)
        assert e.value is raised  # as it was raised: no "disk is full", "Free space" or "Writing the index failed"
    assert not out.exists()  # and no debris of the failed build in the new folder


def test_an_unknown_kv_dtype_is_the_same_clean_error_with_and_without_dry_run(docs, tmp_path, smollm2):
    from typer.testing import CliRunner

    from lazy_rag.build_estimate import estimate_build
    from lazy_rag.cli import app

    out = tmp_path / "idx"
    outputs = []
    for extra in (["--dry-run"], []):
        res = CliRunner().invoke(app, ["index", str(docs), "--out", str(out), "--kv-dtype", "int2", *extra])
        assert res.exit_code == 2 and "Traceback" not in res.output and not isinstance(res.exception, KeyError)
        outputs.append(res.output)
    assert outputs[0] == outputs[1] and "Unknown KV dtype 'int2'; choose auto, fp8, bf16" in outputs[0], outputs
    assert not out.exists()  # refused before a folder, a lock or a model
    with pytest.raises(LazyIndexError, match="Unknown KV dtype 'int2'"):  # the estimate's API too
        estimate_build([str(docs)], out, smollm2, kv_dtype="int2")
