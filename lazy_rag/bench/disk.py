"""The disk under an index: its sequential write bandwidth, and a folder's files taken out of the
page cache (cold reads) or put into it (warm reads). Used by the index-build benchmarks."""
from __future__ import annotations

import os
import time
from pathlib import Path


def write_bandwidth(folder: Path, nbytes: int = 2 << 30, block: int = 64 << 20, start_writeback: bool = False,
                    keep: bool = False) -> float:
    """Sequential write bandwidth of ``folder``'s disk in GB/s: ``nbytes`` written through the page
    cache in ``block``-sized writes, the final fsync included. ``start_writeback``: each block's
    writeback is started as it is written, as the KV store's appends do (``file_writes.start_writeback``);
    without it the kernel holds the blocks dirty until its own flusher or the fsync writes them
    (on the 2-core CPU machine that measured 1.1-1.5x lower, and far noisier). ``keep``: the
    probe's file (``folder``/.write_probe) is left for the caller to delete, its blocks held."""
    from ..file_writes import pwrite_all
    from ..file_writes import start_writeback as start

    path = Path(folder) / ".write_probe"
    buf = os.urandom(block)
    n = max(1, nbytes // block)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(n):
            pwrite_all(fd, [buf], i * block)  # as the store appends: short writes resumed
            if start_writeback:
                start(fd, i * block, block)
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        if not keep:
            path.unlink(missing_ok=True)
    return n * block / dt / 1e9


def probe_first_bytes(build_bytes: int, free: int, probes: int = 1, minimum: int = 4 << 30,
                      margin: int = 3 << 30) -> int:
    """Bytes for each of ``probes`` write probes kept on disk beside a build of ``build_bytes``
    (benchmarks/index_build.py --probe-first: one just before the build, its file kept through it;
    --bracket: a second just after it, the index and the first kept), so that every one of them
    writes blocks never written before: as many as the build when all fit in ``free`` with
    ``margin`` to spare (and 5% for the file system's own blocks), else what does fit; 0 when that
    is under ``minimum``, a probe too short to measure the disk's sustained rate."""
    fits = (int(free / 1.05) - build_bytes - margin) // probes
    n = min(build_bytes, fits)
    return n if n >= minimum else 0


def read_folder(folder: Path) -> None:
    """Read every file of ``folder`` once, so that it is in the page cache."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def drop_page_cache(folder: Path) -> int:
    """Evict ``folder``'s files from the page cache (fsync, then POSIX_FADV_DONTNEED): no root
    needed. Returns the bytes of the files."""
    n = 0
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += p.stat().st_size
            finally:
                os.close(fd)
    return n
