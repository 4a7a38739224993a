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


def _clean(value, limit: int = 120) -> str:
    """A field of the lock's text as it may be shown: printable characters only, cut to ``limit``."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[:limit] + "..."


def _running(pid: int) -> bool | None:
    """Whether process ``pid`` of this machine runs (None: it cannot be told)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    except OSError:
        return None
    return True


def _holder(path: Path) -> str:
    """Who holds the lock, as far as the lock file's text tells: a holder writes its process id,
    host, command and start time there, but a query writing back KV takes the lock without writing
    it, so the text may name an earlier holder that is gone. Text that is not such a record (garbage,
    another program's file) is never shown as a holder."""
    find = f"`fuser -v {path}` names the process that holds it"
    try:
        info = json.loads(path.read_bytes().decode("utf-8") or "{}")
    except (OSError, ValueError):
        info = None
    pid = info.get("pid") if isinstance(info, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return (f"a process that left no record of itself (the lock file's text is not a lazy-rag lock record; "
                f"{find})")
    host, since, command = info.get("host"), info.get("since"), info.get("command")
    when = ""
    if isinstance(since, (int, float)) and not isinstance(since, bool) and 0 < since < 1e11:
        when = ", since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    what = f" ({_clean(command)}{when})" if isinstance(command, str) and command else (f" ({when[2:]})" if when else "")
    here = isinstance(host, str) and host == socket.gethostname()
    where = f" on {_clean(host, 64)}" if isinstance(host, str) and host else ""
    if here and _running(pid) is False:
        return (f"a process that left no record of itself (the lock file names process {pid}{where}{what}, which "
                f"is no longer running: a stale record, not the holder; {find})")
    return f"process {pid}{where}{what}"


def _lock_path_error(folder: Path, e: OSError) -> LazyIndexError:
    path = folder / LOCK_NAME
    if os.path.isdir(path):
        return LazyIndexError(f"The index folder's lock file {path} is a directory, not a file (lazy-rag keeps its "
                              f"writer lock there); remove it (`rmdir {path}`, or move it away if it holds "
                              "anything) and run the command again.")
    return LazyIndexError(f"Cannot write to the index folder {folder} ({e.strerror}); index into a folder you "
                          "can write, or fix its permissions.")


def _open(folder: Path) -> int:
    try:
        return os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _lock_path_error(folder, e) from e


def _same_file(fd: int, path: Path) -> bool:
    """The lock file at ``path`` is still the one ``fd`` locked (a failed build into a new folder
    removes its lock file; a writer that opened it before must lock the new one)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_lock_file(folder: Path) -> None:
    """Remove ``folder``'s lock file (the caller holds the lock: a build into a new folder that
    failed leaves nothing behind). A writer waiting on the removed file sees it gone once it has
    the lock, and locks the path anew (``writer_lock``)."""
    (Path(folder) / LOCK_NAME).unlink(missing_ok=True)


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
                if _same_file(fd, folder / LOCK_NAME):
                    break
                os.close(fd)  # its holder removed the file meanwhile: lock the one at the path now
                fd = -1
                fd = _open(folder)
                continue
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
        if fd >= 0:
            os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def try_writer_lock(folder: Path):
    """The writer lock if it is free now: yields None when held, else why not (at once)."""
    folder = Path(folder)
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        yield (f"the index folder is not writable (its lock file {LOCK_NAME} is a directory: remove it)"
               if os.path.isdir(folder / LOCK_NAME) else f"the index folder is not writable ({e.strerror})")
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
