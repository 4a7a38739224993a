"""Temporary files for atomic writes (write, fsync, ``os.replace``), created the way ``open()``
creates files.

``tempfile.mkstemp`` makes its file 0600 whatever the umask, and ``os.replace`` keeps that mode.
Files written through it (an index's manifest, vector index and wrapper) were then unreadable
by any other user, while the same index's KV segments and SQLite table, created by ``open`` and
sqlite, were 0644 under the usual umask 022: an index built as one user (root in a container
image, a build job) and served as another failed to load. ``create_temp`` keeps mkstemp's
guarantees (a fresh name, ``O_EXCL``, in the destination folder so the rename is atomic) and
lets the umask decide the mode, as for every other file of the index; ``atomic_write_bytes`` is
the whole write through it.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def create_temp(folder: str | os.PathLike, prefix: str = "", suffix: str = ".tmp") -> tuple[int, str]:
    """(fd, path) of a new, empty file in ``folder``, mode 0666 less the umask (mkstemp's 0600 is
    what this replaces)."""
    for _ in range(100):
        path = Path(folder) / f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            return os.open(path, _FLAGS, 0o666), str(path)
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file in {folder} (100 names taken).")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: written to a temp file in the same folder,
    fsynced, then renamed over it (a reader sees the old file or the new one, never a part)."""
    path = Path(path)
    fd, tmp = create_temp(path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
