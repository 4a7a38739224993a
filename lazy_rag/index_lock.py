"""One writer per index folder: an advisory ``flock`` on ``<index>/.lock``.

The kernel drops a ``flock`` when its holder exits, however it exits (``kill -9`` included), so
a killed writer never leaves a stale lock behind; the file's text only names the holder for the
error message. The holder is the only process that appends to the KV segments or writes the
index's database: builds hold the lock for their whole run (read the old generation, append,
commit, compact, clean up), and a query that repairs a KV record takes it without waiting and
writes only if the index is still at the commit it loaded, so no reader writes KV for chunks a
newer build dropped. Readers take no lock: SQLite's snapshots and the segments' committed lengths
keep what they read whole while the holder writes.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import LazyIndexError

LOCK_NAME = ".lock"


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"process {info.get('pid')} on {info.get('host')} ({info.get('command')}, since {since})"


def _open(folder: Path) -> int:
    try:
        return os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LazyIndexError(f"Cannot write to the index folder {folder} ({e.strerror}); index into a folder you "
                             "can write, or fix its permissions.") from e


@contextmanager
def writer_lock(folder: Path, wait: float = 0.0):
    """Hold ``folder``'s writer lock; a second writer waits up to ``wait`` seconds, then is refused
    with an error naming the holder."""
    folder = Path(folder)
    fd = _open(folder)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LazyIndexError(
                        f"Another lazy-rag process is writing the index at {folder}: {_holder(folder / LOCK_NAME)}. "
                        "Wait for it to finish (or pass --wait-lock SECONDS), or index into another --out folder."
                    ) from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                  "command": " ".join(sys.argv[:3])[:200]}).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def try_writer_lock(folder: Path):
    """The writer lock if it is free now: yields None when held, else why not (at once)."""
    folder = Path(folder)
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        yield f"the index folder is not writable ({e.strerror})"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield "another process is writing the index"
            return
        yield None
    finally:
        os.close(fd)
