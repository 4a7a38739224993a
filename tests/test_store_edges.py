"""The store's rough edges (issue 64): the writer lock's refusals, a lost database, a build refused
for its size in a new folder, an unknown KV dtype, and errors that are no disk failure."""
import fcntl
import json
import os
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
