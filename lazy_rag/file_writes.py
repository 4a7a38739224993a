"""Writes to the disk that the KV store and the replicas' shared folder make durable themselves:
``pwrite_all`` (a positioned write of several buffers, short writes resumed), ``start_writeback``
(the disk starts on a range now, not at the next fsync) and ``fsync_dir`` (a new or renamed
file's name durable)."""
from __future__ import annotations

import os
from pathlib import Path


def pwrite_all(fd: int, parts: list, off: int) -> None:
    """Write the buffers ``parts`` one after another at ``off`` of ``fd`` (no joined copy)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.pwritev(fd, views, off)
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _writeback_starter():
    """Linux's sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE) through ctypes (Python has no
    binding), or None elsewhere: it starts writing a range's dirty pages to the disk and returns
    without waiting."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _writeback_starter()
SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, off: int, n: int) -> None:
    """Start writing bytes [off, off + n) of ``fd`` to the disk without waiting for them (Linux);
    elsewhere a no-op, and the next fsync writes them."""
    if _START_WRITEBACK is not None:
        _START_WRITEBACK(fd, off, n, SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """fsync a folder: the names of the files created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
