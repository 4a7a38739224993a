"""The chunk-KV store that every engine replica shares: the index's own store, read-only, plus a
folder of KV that replicas encoded (a chunk the index has no intact KV for: built with
``--no-precompute``, or damaged), written once by whichever replica encoded it and read by all
the others instead of encoding it again.

Why a folder of files and not the index's segments: appending to the segments needs the index's
writer lock and a commit in its SQLite database, and SQLite's WAL is safe only between processes
of one host (its shared memory is a local mmap). Replicas on many nodes share storage, not
memory; so they never write the index (it may be a read-only mount: ``IndexDB`` then opens it
immutable) and each encoded chunk becomes one file, named by what it holds:

- content-addressed: the file name is a hash of the KV's fingerprint (model, tokenizer, RoPE,
  shared prefix, wrapper), the KV folder and the chunk id; the record inside is the segments'
  record format (``LRKV`` header with the body's CRC32, then the safetensors body whose metadata
  names the chunk, its token ids' hash and the fingerprint), so a reader checks everything a
  segment read checks and a record from another model or another text is never used;
- atomic: written to a unique temporary name in the same folder (``mkstemp``: O_EXCL, so two
  writers never share one), fsynced, then renamed over the final name (``os.replace``, atomic on
  POSIX file systems and on NFS) and the folder fsynced; a reader sees the whole record or none;
- no lost updates: there is nothing to update. Two replicas that encode the same chunk at once
  write the same bytes under the same name, and the last rename wins; a record that fails its
  checks (another text under the same chunk id after a rebuild) is replaced by the next encode.

A writer killed mid-write leaves a ``.tmp-*`` file that no reader opens; ``sweep_temporary``
removes those older than an hour when a replica starts.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from ...chunk_kv import NOT_IN_MEMORY, ChunkKV
from ...errors import LazyRagError
from ...file_writes import fsync_dir, pwrite_all
from ...kv_record import RECORD_HEADER, first_byte_cached, read_body, read_header
from ...store import ChunkStore
from ...tempfiles import create_temp

log = logging.getLogger("lazy_rag.server.scaleout")

SHARED_DIR_NAME = "kv-replicas"  # default: beside the index's own KV folders
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 3600.0


class SharedChunkStore(ChunkStore):
    """A ``ChunkStore`` whose misses fall through to the replicas' shared folder and whose
    write-backs go there (never into the index). Made from a loaded index's store by
    ``share_index_store``."""

    shared_dir: Path

    def shared_path(self, chunk_id: str) -> Path:
        digest = hashlib.sha256(f"{self.fingerprint_id}\0{self.folder}\0{chunk_id}".encode()).hexdigest()
        return self.shared_dir / digest[:2] / f"{digest[2:40]}.kvrec"

    # -- reading: the index first, then the shared folder ----------------------------------------
    def _load(self, chunk_id, token_ids, nowait: bool, pin: bool, tensor_crcs: bool):
        kv, why = super()._load(chunk_id, token_ids, nowait, pin, tensor_crcs)
        if kv is not None or why == NOT_IN_MEMORY:
            return kv, why
        shared, shared_why = self._load_shared(chunk_id, token_ids, nowait, pin, tensor_crcs)
        # the shared record's reason when there is one (corrupt, another text, ...), else the
        # index's: either way the engine encodes the chunk and writes it back here
        return (shared, shared_why) if shared_why != "missing" else (None, why)

    def _load_shared(self, chunk_id, token_ids, nowait, pin, tensor_crcs) -> tuple[ChunkKV | None, str | None]:
        try:
            fd = os.open(self.shared_path(chunk_id), os.O_RDONLY)
        except FileNotFoundError:
            return None, "missing"
        except OSError as e:
            return None, f"unreadable ({e.strerror})"
        try:
            if nowait and first_byte_cached(fd, 0) is False:
                return None, NOT_IN_MEMORY
            head = os.pread(fd, RECORD_HEADER.size, 0)
            if len(head) < RECORD_HEADER.size:
                return None, "unreadable (truncated)"
            header = read_header(head)
            if header is None or header[1] != os.fstat(fd).st_size - RECORD_HEADER.size:
                return None, "unreadable (not a KV record)"
            crc, length = header
            buf, why = read_body(fd, RECORD_HEADER.size, length, crc, pin=pin)
        except OSError as e:
            return None, f"unreadable ({e.strerror})"
        finally:
            os.close(fd)
        return (None, why) if buf is None else self.unpack(chunk_id, token_ids, buf, tensor_crcs)

    def in_memory(self, chunk_id: str) -> bool | None:
        if self.location(chunk_id) is not None:
            return super().in_memory(chunk_id)
        try:
            fd = os.open(self.shared_path(chunk_id), os.O_RDONLY)
        except OSError:
            return None
        try:
            return first_byte_cached(fd, 0)
        finally:
            os.close(fd)

    def stored_bytes(self, chunk_id: str) -> int:
        n = super().stored_bytes(chunk_id)
        if n:
            return n
        try:
            return max(0, self.shared_path(chunk_id).stat().st_size - RECORD_HEADER.size)
        except OSError:
            return 0

    # -- writing: one file per chunk, atomically ---------------------------------------------------
    def write_back(self, chunk_id: str, token_ids, kv: ChunkKV) -> int:
        """Write the KV this replica encoded to the shared folder (never to the index); returns
        the bytes written (0 when the folder cannot be written: the KV is served from memory)."""
        record = self.pack(chunk_id, token_ids, kv)
        path = self.shared_path(chunk_id)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = create_temp(path.parent, prefix=TEMP_PREFIX)
            try:
                pwrite_all(fd, record.parts(), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            tmp = None
            fsync_dir(path.parent)
        except OSError as e:
            log.warning("Could not write the KV of chunk %s to the replicas' shared folder %s (%s); it is "
                        "served from memory and encoded again where it is missing.", chunk_id, self.shared_dir,
                        e.strerror or e)
            return 0
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return record.span


def sweep_temporary(shared_dir: Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Remove what killed writers left (temporary files older than ``older_than_s``); how many."""
    removed = 0
    now = time.time()
    for p in Path(shared_dir).glob(f"*/{TEMP_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                p.unlink()
                removed += 1
        except OSError:  # another replica removed it first, or it is not ours to remove
            pass
    return removed


def share_index_store(index, shared_dir: str | os.PathLike | None = None) -> SharedChunkStore:
    """Turn a loaded ``LazyIndex``'s store into a ``SharedChunkStore`` (the same object, with
    the shared folder's reads and writes): ``shared_dir`` None is ``<index>/kv-replicas``. The
    index's own write guard is dropped: replicas never write the index."""
    store = index.store
    if type(store) is not ChunkStore and not isinstance(store, SharedChunkStore):
        raise LazyRagError(f"Cannot share a {type(store).__name__}: expected the index's ChunkStore.")
    folder = Path(shared_dir).expanduser() if shared_dir else Path(index.path) / SHARED_DIR_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LazyRagError(f"Cannot create the replicas' shared KV folder {folder} ({e.strerror}); pass a "
                           "writable folder every replica can reach (--kv-share DIR).") from e
    # the loaded object is re-classed rather than copied: the index and its chunk source keep
    # pointing at it, with its open segment descriptors and its database snapshot
    store.__class__ = SharedChunkStore
    store.shared_dir = folder
    store.write_guard = None
    return store
