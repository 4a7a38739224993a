"""The index's on-disk store: ``IndexDB`` (one SQLite file, ``index.sqlite``: the chunk table, the
files, the KV segments and the settings) and ``ChunkStore`` (every chunk's KV as one record in
large append-only segment files).

KV records. A chunk's KV is one record (``kv_record``: a header, then a safetensors body that
describes itself) appended to ``<kv folder>/seg-<n>.kvseg`` (``kv/``, or ``kv-w<digest>/`` for
chunks encoded inside a chunk wrapper, so a re-encode with a new wrapper is new records in a new
folder, committed atomically); a new segment starts once one would pass ``SEGMENT_BYTES``.

Where a chunk's KV is: its row in the chunk table holds (segment, offset, length, CRC32). A row
without one has no KV. A read (``os.pread`` of exactly those bytes) checks the CRC, the
fingerprint, the chunk id, the token ids and each tensor's CRC: a missing, corrupt or foreign
record is reported (``read`` says why), and the engine recomputes the chunk and writes it again
(``engine.chunk_tiers``). The store never encodes and keeps no KV in memory: the engine's pool
and host tier are the memory tiers.

Writes. Only the holder of the folder's writer lock (``index_lock``) appends, from the committed
length of each segment recorded in the segments table: bytes past it (a killed writer's) are cut
off by the next writer and never read. A build stages its records (``begin_build``; ``write`` is
safe from a writer thread) and its commit (one SQLite transaction, ``commit_build``) makes them
and the new segment lengths visible, after ``flush`` has fsynced the segments; every
``CHECKPOINT_BYTES`` (and ``CHECKPOINT_MIN_S`` since the last) a build also commits what it
wrote so far to ``pending_kv``, so that a build that is killed resumes instead of encoding again.
A query's write-back (``write_back``) appends and commits at once, under the index's write guard.
The build's commit also compacts: a segment whose live records fill less than ``COMPACT_BELOW``
of it has them copied to the current segment and is deleted once the commit is durable.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .chunk_kv import NOT_IN_MEMORY, ChunkKV
from .errors import LazyIndexError
from .file_writes import fsync_dir, pwrite_all, start_writeback
from .kv_record import (RECORD_HEADER, PackedRecord, first_byte_cached, kv_dtype_name, pack, quantized_format,
                        read_body, read_header, record_metadata, unpack)
from .segments import token_ids_key

log = logging.getLogger(__name__)

DB_NAME = "index.sqlite"
SEGMENT_BYTES = 1 << 30          # a new segment once one would pass this (1 GiB)
COMPACT_BELOW = 0.5              # a build compacts segments whose live records fill less than this
CHECKPOINT_BYTES = 256 << 20     # a build commits its staged KV to pending_kv every this many bytes,
CHECKPOINT_MIN_S = 2.0           # ... and at most this often: each commit fsyncs, and the writer
                                 # waits for it (the 8B build on the H100 spent 2.1 of its 13.3 s
                                 # of writing in 73 commits of 256 MiB)
SEGMENT_RE = re.compile(r"seg-(\d{6,})\.kvseg")
READ_FDS = 64                    # open segment files kept per store (a large index has thousands)
REPAIR_FIX = "rebuild it from the sources with `lazy-rag index SOURCES --out {folder} --repair`"

SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    rowid INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kv_seg INTEGER, kv_off INTEGER, kv_len INTEGER, kv_crc INTEGER,
    row_crc INTEGER, vector_crc INTEGER, source TEXT, ordinal INTEGER, n_tokens INTEGER,
    meta TEXT, token_ids BLOB, text TEXT, vector BLOB);
CREATE INDEX IF NOT EXISTS chunks_by_source ON chunks(source);
CREATE INDEX IF NOT EXISTS chunks_by_segment ON chunks(kv_seg, kv_len);
CREATE TABLE IF NOT EXISTS files (
    source TEXT PRIMARY KEY, sha256 TEXT NOT NULL, tokens INTEGER NOT NULL, chunk_ids TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS segments (id INTEGER PRIMARY KEY, folder TEXT NOT NULL, committed INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pending_kv (
    chunk_id TEXT PRIMARY KEY, seg INTEGER NOT NULL, off INTEGER NOT NULL, len INTEGER NOT NULL,
    crc INTEGER NOT NULL);
"""
# The row columns come small first: a KV lookup or a count reads the start of a row, not the
# overflow pages its text, token ids and vector spill into.


@dataclass(frozen=True)
class KVLocation:
    """Where one record's body is: segment number, offset and length of the body (its header is
    the ``RECORD_HEADER.size`` bytes before it), and the body's CRC32."""

    seg: int
    off: int
    length: int
    crc: int

    @property
    def span(self) -> int:
        """Bytes the record takes in its segment, header included."""
        return RECORD_HEADER.size + self.length


def segment_name(seg: int) -> str:
    return f"seg-{seg:06d}.kvseg"


# -- the database ----------------------------------------------------------------------------------

class DamagedIndexError(LazyIndexError):
    """The index's database cannot be read as one (garbage, a damaged page, a row that does not
    match its checksum): the fix is ``--repair``."""


class IndexDB:
    """An index folder's ``index.sqlite`` (WAL mode): settings (what manifest.json held in format 1),
    the chunk table, the files, the KV segments and a build's pending KV.

    ``snapshot=True`` (a loaded index) holds one read transaction open for the connection's life:
    every read sees the generation it loaded, while builds in other processes commit newer ones
    (WAL readers never block the writer; the WAL is checkpointed past the snapshot once it closes).
    Other connections read the latest commit. The connection may be used from several threads."""

    def __init__(self, folder, *, create: bool = False, snapshot: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / DB_NAME
        self._lock = threading.RLock()
        self.snapshot = snapshot
        if not create and not self.path.exists():
            raise FileNotFoundError(errno.ENOENT, "No such file", str(self.path))
        if create:
            self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = self._connect()
            if create:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.executescript(SCHEMA)
            # no table (another SQLite file, or garbage): damaged, said here rather than at first use
            self.conn.execute("SELECT count(*) FROM settings").fetchone()
            if snapshot:
                self._begin_snapshot()
        except sqlite3.Error as e:
            raise self.error(e) from e

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        try:
            # a commit is durable before the files it retires (old vectors, compacted segments) go
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError as e:
            conn.close()
            if getattr(e, "sqlite_errorname", "").startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")) \
                    and not os.access(self.folder, os.W_OK):
                # a read-only folder (a mounted copy): WAL readers cannot create the shared-memory
                # file; read the file as it is (a copy is made from a closed, checkpointed index)
                return sqlite3.connect(f"{self.path.as_uri()}?immutable=1", uri=True, isolation_level=None,
                                       check_same_thread=False)
            raise

    def _begin_snapshot(self) -> None:
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT count(*) FROM settings").fetchone()  # the read transaction starts here
        self._snapshot_commit = self._setting_raw("commit_id")

    def _setting_raw(self, key: str):
        row = self.conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def error(self, e: sqlite3.Error) -> Exception:
        """An SQLite error as the runtime's: a full disk or an I/O error is an OSError (a build
        reports it and leaves the previous index), anything else a damaged index naming the fix."""
        name = getattr(e, "sqlite_errorname", "") or ""
        if name.startswith("SQLITE_FULL"):
            return OSError(errno.ENOSPC, "No space left on device", str(self.path))
        if name.startswith("SQLITE_IOERR"):
            return OSError(errno.EIO, f"I/O error ({e})", str(self.path))
        if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")):
            return OSError(errno.EROFS if "READONLY" in name else errno.EACCES, str(e), str(self.path))
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            return LazyIndexError(f"{self.path} is locked by another process ({e}); try again.")
        return self.damaged(str(e))

    def damaged(self, what: str) -> "DamagedIndexError":
        return DamagedIndexError(f"{self.path} is damaged ({what}); {REPAIR_FIX.format(folder=self.folder)}.")

    def _check_snapshot(self) -> None:
        # an error inside SQLite may end the read transaction; a new one must see the same commit
        if self.snapshot and not self.conn.in_transaction:
            self._begin_snapshot_again()

    def _begin_snapshot_again(self) -> None:
        want = self._snapshot_commit
        self._begin_snapshot()
        if self._snapshot_commit != want:
            raise LazyIndexError(f"The index at {self.folder} was rebuilt while it was loaded and its view of the "
                                 "loaded generation was lost; load it again.")

    def rows(self, sql: str, args=()) -> list:
        with self._lock:
            try:
                self._check_snapshot()
                return self.conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise self.error(e) from e

    def one(self, sql: str, args=()):
        rows = self.rows(sql, args)
        return rows[0] if rows else None

    def iterate(self, sql: str, args=(), batch: int = 512) -> Iterator[tuple]:
        """Rows of one query, fetched in batches (a table of a million rows is never a list)."""
        with self._lock:
            try:
                self._check_snapshot()
                cur = self.conn.cursor()
                cur.execute(sql, args)
            except sqlite3.Error as e:
                raise self.error(e) from e
        while True:
            with self._lock:
                try:
                    rows = cur.fetchmany(batch)
                except sqlite3.Error as e:
                    raise self.error(e) from e
            if not rows:
                return
            yield from rows

    @contextmanager
    def transaction(self):
        """One write transaction (the commit point of a build): yields a cursor; commits at the
        end, rolls back on an exception. Only a holder of the writer lock writes."""
        if self.snapshot:
            raise RuntimeError("a snapshot connection never writes")
        with self._lock:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise self.error(e) from e
            cur = self.conn.cursor()
            try:
                yield cur
                self.conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise self.error(e) from e
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.Error:  # SQLite already rolled back (a full disk)
            pass

    def settings(self) -> dict:
        out = {}
        for key, value in self.rows("SELECT key, value FROM settings"):
            try:
                out[key] = json.loads(value)
            except ValueError:
                raise self.damaged(f"setting {key!r} is not JSON") from None
        return out

    def setting(self, key: str):
        row = self.one("SELECT value FROM settings WHERE key = ?", (key,))
        try:
            return None if row is None else json.loads(row[0])
        except ValueError:
            raise self.damaged(f"setting {key!r} is not JSON") from None

    @staticmethod
    def put_settings(cur, settings: dict, old: dict | None = None) -> None:
        """Write the settings that differ from ``old`` (inside the caller's transaction)."""
        for key, value in settings.items():
            if old is None or key not in old or old[key] != value:
                cur.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)",
                            (key, json.dumps(value, ensure_ascii=False)))
        for key in set(old or ()) - set(settings):
            cur.execute("DELETE FROM settings WHERE key = ?", (key,))

    def kv_location(self, chunk_id: str) -> KVLocation | None:
        row = self.one("SELECT kv_seg, kv_off, kv_len, kv_crc FROM chunks WHERE id = ?", (chunk_id,))
        if row is None or None in row:
            return None
        return KVLocation(*row)

    def segments(self, folder: str | None = None) -> dict[int, int]:
        """Segment number -> committed length (of one KV folder, or all)."""
        if folder is None:
            return dict(self.rows("SELECT id, committed FROM segments"))
        return dict(self.rows("SELECT id, committed FROM segments WHERE folder = ?", (folder,)))

    def next_segment(self) -> int:
        """Segment numbers are never reused (a reader may still hold a deleted segment open)."""
        counter = self.setting("next_segment") or 1
        top = self.one("SELECT max(id) FROM segments")[0] or 0
        return max(int(counter), top + 1)

    def close(self) -> None:
        with self._lock:
            try:
                self.conn.close()
            except sqlite3.Error:
                pass


# -- appending -------------------------------------------------------------------------------------

class _Appender:
    """Appends records to the segments of one KV folder, for the holder of the writer lock. It
    starts at the committed lengths (cutting off what a killed writer left past the last
    segment's), and keeps the new lengths until ``commit`` writes them into the caller's
    transaction; ``abort`` takes the segments back to their committed lengths."""

    def __init__(self, kv_dir: Path, folder: str, committed: dict[int, int], next_seg: int):
        self.kv_dir, self.folder = kv_dir, folder
        self.committed = dict(committed)   # seg -> length as of the last commit
        self.ends = dict(committed)        # seg -> length with this run's appends
        self.created: set[int] = set()     # segments this run started, not committed yet
        self.retired: set[int] = set()     # compacted: removed from the table by the commit
        self.next_seg = next_seg
        self.seg: int | None = None
        self._fds: dict[int, int] = {}
        self.appended = 0                  # bytes since the last commit or checkpoint
        kv_dir.mkdir(parents=True, exist_ok=True)
        if committed:
            self._open_tail(max(committed))

    def path(self, seg: int) -> Path:
        return self.kv_dir / segment_name(seg)

    def _open_tail(self, seg: int) -> None:
        want = self.committed[seg]
        try:
            size = self.path(seg).stat().st_size
        except FileNotFoundError:
            return  # gone: its records read as missing; appends go to a new segment
        if size < want or want >= SEGMENT_BYTES:
            return  # shorter than committed (damaged) or full: never appended to
        fd = os.open(self.path(seg), os.O_WRONLY)
        if size > want:
            os.ftruncate(fd, want)  # a killed writer's bytes past the commit: never read, cut off
        self.seg, self._fds[seg] = seg, fd

    def roll(self) -> None:
        seg = self.next_seg
        self.next_seg += 1
        # O_TRUNC: a killed run may have left a file of this number (never committed, never read)
        self._fds[seg] = os.open(self.path(seg), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.created.add(seg)
        self.ends[seg] = 0
        self.seg = seg

    def append(self, record: PackedRecord) -> KVLocation:
        """Append one record."""
        length, span = record.length, record.span
        if self.seg is None or (self.ends[self.seg] and self.ends[self.seg] + span > SEGMENT_BYTES):
            self.roll()
        off = self.ends[self.seg]
        fd = self._fds[self.seg]
        pwrite_all(fd, record.parts(), off)
        # the disk starts on this record now, not at the next checkpoint's fsync: a build's
        # writes then keep the disk busy while the encoder runs, instead of the page cache
        # filling up and the writer waiting on one long fsync every checkpoint (the 8B build
        # wrote at 38% of the disk's bandwidth that way)
        start_writeback(fd, off, span)
        self.ends[self.seg] = off + span
        self.appended += span
        return KVLocation(self.seg, off + RECORD_HEADER.size, length, record.crc)

    def flush(self) -> None:
        """fsync the segments written (and the folder, for new ones): before any commit."""
        for fd in self._fds.values():
            os.fsync(fd)
        if self.created:
            fsync_dir(self.kv_dir)

    def retire(self, seg: int) -> None:
        self.retired.add(seg)
        self.ends.pop(seg, None)
        if seg == self.seg:
            self.seg = None

    def commit(self, cur) -> None:
        """The segments' new lengths, new and retired segments, into the caller's transaction."""
        for seg, end in self.ends.items():
            if seg in self.created:
                cur.execute("INSERT INTO segments (id, folder, committed) VALUES (?, ?, ?)", (seg, self.folder, end))
            elif end != self.committed.get(seg):
                cur.execute("UPDATE segments SET committed = ? WHERE id = ?", (end, seg))
        for seg in self.retired:
            cur.execute("DELETE FROM segments WHERE id = ?", (seg,))
        cur.execute("INSERT OR REPLACE INTO settings (key, value) VALUES ('next_segment', ?)",
                    (json.dumps(self.next_seg),))

    def committed_now(self) -> list[int]:
        """After the caller's commit: the new lengths are the committed ones. Returns the retired
        segments (to delete: no committed row refers to them any more)."""
        retired = sorted(self.retired)
        self.committed = dict(self.ends)
        self.created, self.retired, self.appended = set(), set(), 0
        return retired

    def abort(self) -> None:
        """Back to the committed state: new segments removed, appended bytes cut off."""
        for seg in list(self.created):
            self.path(seg).unlink(missing_ok=True)
        for seg, want in self.committed.items():
            # every segment opened for appending: a failed append may have written part of a
            # record before its end was recorded
            if seg not in self.created and seg in self._fds:
                os.ftruncate(self._fds[seg], want)
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.seg = None


# -- the store -------------------------------------------------------------------------------------

class ChunkStore:
    """Chunk KV in the segments of ``root/<kv_subdir>``, located by the chunk table of ``db``.

    ``db``: the index's ``IndexDB`` (a loaded index's snapshot, or a build's connection). Without
    one the store is used alone (tests, the engine without an index): it opens or creates
    ``root/index.sqlite`` on first write, and a write of a chunk the table lacks adds a row
    holding only the chunk id and its KV location."""

    def __init__(self, root: Path, fingerprint_id: str, shared_prefix_ids=(), kv_dtype: torch.dtype | None = None,
                 precomputed: bool = True, kv_subdir: str = "kv", vocab_rows: int | None = None,
                 db: IndexDB | None = None):
        self.root = Path(root)
        self.folder = kv_subdir
        self.kv_dir = self.root / kv_subdir
        # ids from vocab_rows up are a chunk wrapper's slots, numbered per process: never hashed
        self.vocab_rows = vocab_rows
        self.fingerprint_id = fingerprint_id
        self.shared_prefix_ids = tuple(shared_prefix_ids)
        self.kv_dtype = kv_dtype
        self.precomputed = precomputed  # False: KV is encoded on first use (a missing record is expected)
        self._db = db
        self._alone = db is None
        self._lock = threading.RLock()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._appender: _Appender | None = None
        self._staged: dict[str, KVLocation] | None = None  # a build's records, until its commit
        self._unsaved: list[tuple[str, KVLocation]] = []   # staged since the last checkpoint
        self.checkpoint_s = 0.0   # this build's time in checkpoint commits (its pipeline's stage times)
        self._last_checkpoint = time.monotonic()
        # write-backs by this process: a loaded index's snapshot does not see its own commits
        self._overrides: dict[str, KVLocation] = {}
        # called with (chunk id, location) once a write-back is committed: tensor parallelism's
        # rank 0 tells its workers, whose snapshots cannot see it either (``note_written``)
        self.write_listeners: list = []
        # for write-backs by queries (repairs, first use): a callable giving a context manager that
        # yields None when writing is safe now, else why not (LazyIndex: the writer lock and the
        # generation); None: the owner (a build, or a store used alone) holds the lock itself
        self.write_guard = None

    # -- locating and reading -----------------------------------------------------------------
    @property
    def kv_format(self) -> str | None:
        """"fp8" or "int4" for a store of quantised KV, None for 16/32-bit KV: its chunks' cache
        key (``chunk_tiers.chunk_key``) carries it."""
        return quantized_format(self.kv_dtype)

    @property
    def db(self) -> IndexDB | None:
        if self._db is None and self._alone and (self.root / DB_NAME).exists():
            self._db = IndexDB(self.root)
        return self._db

    def segment_path(self, seg: int) -> Path:
        return self.kv_dir / segment_name(seg)

    def location(self, chunk_id: str) -> KVLocation | None:
        """Where the chunk's KV is, if it has any: a build's staged record, this process's
        write-back, else the chunk table's."""
        with self._lock:
            loc = self._staged.get(chunk_id) if self._staged is not None else None
            loc = loc or self._overrides.get(chunk_id)
        if loc is not None:
            return loc
        db = self.db
        return None if db is None else db.kv_location(chunk_id)

    def tokens_key(self, token_ids) -> str:
        """What a record of this store says of its token ids (``kv_record``'s ``tokens``): a hash
        of them (a wrapper's slots left out) after the shared prefix's."""
        if self.vocab_rows is not None:
            token_ids = [t for t in token_ids if t < self.vocab_rows]
        key = token_ids_key(token_ids)
        return f"{token_ids_key(self.shared_prefix_ids)}/{key}" if self.shared_prefix_ids else key

    def _read_fd(self, seg: int) -> int | None:
        with self._lock:
            fd = self._fds.get(seg)
            if fd is not None:
                self._fds.move_to_end(seg)
                return fd
            try:
                fd = os.open(self.segment_path(seg), os.O_RDONLY)
            except FileNotFoundError:
                return None
            self._fds[seg] = fd
            while len(self._fds) > READ_FDS:
                os.close(self._fds.popitem(last=False)[1])
            return fd

    # the engine's chunk tiers pass ``pin`` and ``tensor_crcs`` to ``read`` and ``read_nowait``
    reads_pinned = True

    def read(self, chunk_id: str, token_ids, *, pin: bool = False,
             tensor_crcs: bool = True) -> tuple[ChunkKV | None, str | None]:
        """(kv, None) if the chunk's record is present and intact, else (None, why). The tensors
        are views of one buffer the record is read into (``pin``: page-locked memory, for a copy
        to a GPU without staging). The body's CRC32 (from the chunk table) is always checked;
        ``tensor_crcs``: each tensor's own CRC32 too (a second pass over the bytes: an index
        check wants it, the engine's reads do not)."""
        return self._load(chunk_id, token_ids, False, pin, tensor_crcs)

    def read_nowait(self, chunk_id: str, token_ids, *, pin: bool = False,
                    tensor_crcs: bool = True) -> tuple[ChunkKV | None, str | None]:
        """``read``, if the record's bytes are all in the page cache (a read at memory speed);
        else (None, NOT_IN_MEMORY) without waiting for the disk. ``preadv`` with RWF_NOWAIT
        reads only what is cached; a kernel or file system without it reads as ``read`` does."""
        return self._load(chunk_id, token_ids, True, pin, tensor_crcs)

    def in_memory(self, chunk_id: str) -> bool | None:
        """Whether the start of the chunk's record is in the page cache (a one-byte RWF_NOWAIT
        read: no buffer of the record's size); None where that cannot be told."""
        loc = self.location(chunk_id)
        fd = None if loc is None else self._read_fd(loc.seg)
        return None if fd is None else first_byte_cached(fd, loc.off)

    def _load(self, chunk_id, token_ids, nowait: bool, pin: bool, tensor_crcs: bool):
        loc = self.location(chunk_id)
        if loc is None:
            return None, "missing"
        buf, why = self._read_record(loc, nowait, pin)
        if buf is None:
            return None, why
        return self.unpack(chunk_id, token_ids, buf, tensor_crcs)

    def _read_record(self, loc: KVLocation, nowait: bool, pin: bool) -> tuple[torch.Tensor | None, str | None]:
        """The record body at ``loc`` as a uint8 tensor, checked against its CRC32, or (None, why)."""
        fd = self._read_fd(loc.seg)
        if fd is None:
            return None, "missing"
        flags = 0
        if nowait:  # one byte first: a record not in memory costs a syscall, not a buffer of its size
            cached = first_byte_cached(fd, loc.off)
            if cached is False:
                return None, NOT_IN_MEMORY
            flags = os.RWF_NOWAIT if cached else 0  # None: RWF_NOWAIT unsupported, an ordinary read
        return read_body(fd, loc.off, loc.length, loc.crc, pin=pin, flags=flags)

    def read_body(self, loc: KVLocation) -> tuple[bytes | None, str | None]:
        """The record body at ``loc`` as bytes, checked against its CRC32, or (None, why)."""
        buf, why = self._read_record(loc, False, False)
        return (None, why) if buf is None else (buf.numpy().tobytes(), None)

    def stored_bytes(self, chunk_id: str) -> int:
        """Bytes a read of the chunk's record takes from the disk (0: it has none)."""
        loc = self.location(chunk_id)
        return 0 if loc is None else loc.length

    def unpack(self, chunk_id: str, token_ids, body, tensor_crcs: bool = True) -> tuple[ChunkKV | None, str | None]:
        """The KV of a record body (bytes, or a uint8 tensor whose views the tensors become) if it
        is this chunk's, for these token ids and this store's fingerprint (``kv_record.unpack``)."""
        return unpack(body, chunk_id=chunk_id, tokens_key=self.tokens_key(token_ids), fingerprint=self.fingerprint_id,
                      tensor_crcs=tensor_crcs)

    # -- writing ------------------------------------------------------------------------------
    def pack(self, chunk_id: str, token_ids, kv: ChunkKV) -> PackedRecord:
        """One chunk's record in this store's dtype (``kv_record.pack``): the costly, lock-free part
        of ``write``. A build runs it for several chunks at once on a thread pool and hands the
        result to ``write`` in place of the KV."""
        return pack(kv, chunk_id=chunk_id, tokens_key=self.tokens_key(token_ids), fingerprint=self.fingerprint_id,
                    dtype=self.kv_dtype)

    def write(self, chunk_id: str, token_ids, kv: "ChunkKV | PackedRecord") -> int:
        """Append one chunk's KV; returns the bytes written. In a build (``begin_build``) the record
        is staged until the build commits, and this may be called from one writer thread while
        other threads read; otherwise it is committed at once (the caller holds the writer lock)."""
        record = kv if isinstance(kv, PackedRecord) else self.pack(chunk_id, token_ids, kv)
        return self.write_record(chunk_id, record)

    def write_record(self, chunk_id: str, record: PackedRecord) -> int:
        with self._lock:
            if self._appender is not None:
                loc = self._appender.append(record)
                self._staged[chunk_id] = loc
                self._unsaved.append((chunk_id, loc))
                if (self._appender.appended >= CHECKPOINT_BYTES
                        and time.monotonic() - self._last_checkpoint >= CHECKPOINT_MIN_S):
                    self.checkpoint()
                return loc.span
            loc = self._write_now(chunk_id, record)
            return 0 if loc is None else loc.span

    def _write_now(self, chunk_id: str, record: PackedRecord) -> KVLocation | None:
        """Append and commit one record. A loaded index writes through a connection of its own
        (its snapshot never writes) and only to a chunk its table holds."""
        if self._alone:
            db = self.db or IndexDB(self.root, create=True)
            self._db = db
        else:
            db = IndexDB(self.root)
        try:
            app = self._open_appender(db)
            try:
                loc = app.append(record)
                app.flush()
                with db.transaction() as cur:
                    cur.execute("UPDATE chunks SET kv_seg = ?, kv_off = ?, kv_len = ?, kv_crc = ? WHERE id = ?",
                                (loc.seg, loc.off, loc.length, loc.crc, chunk_id))
                    if cur.rowcount == 0:
                        if not self._alone:
                            raise _NoSuchChunk
                        cur.execute("INSERT INTO chunks (id, kv_seg, kv_off, kv_len, kv_crc) VALUES (?, ?, ?, ?, ?)",
                                    (chunk_id, loc.seg, loc.off, loc.length, loc.crc))
                    app.commit(cur)
                app.committed_now()
            except _NoSuchChunk:
                app.abort()
                log.info("Chunk %s is not in the index at %s any more; its KV was not written.", chunk_id, self.root)
                return None
            except BaseException:
                app.abort()
                raise
            app.close()
        finally:
            if db is not self._db:
                db.close()
        self._overrides[chunk_id] = loc
        for listener in self.write_listeners:
            listener(chunk_id, loc)
        return loc

    def note_written(self, chunk_id: str, loc: KVLocation) -> None:
        """A record another process committed to this folder since this store's snapshot (a
        tensor-parallel worker learning rank 0's write-back): read it from now on."""
        self._overrides[chunk_id] = loc

    def _open_appender(self, db: IndexDB) -> _Appender:
        return _Appender(self.kv_dir, self.folder, db.segments(self.folder), db.next_segment())

    def write_back(self, chunk_id: str, token_ids, kv: ChunkKV) -> int:
        """A query's write of KV it had to encode (a repair, or first use): only when the guard
        allows it and the folder is writable; otherwise the KV is served from memory and the
        record is left for a later query or build (0 bytes written)."""
        if self.write_guard is None:
            return self.write(chunk_id, token_ids, kv)
        with self.write_guard() as refused:
            if refused:  # served from memory; a folder that cannot be written deserves a word
                (log.warning if "not writable" in refused else log.info)(
                    "Chunk %s KV not written back: %s.", chunk_id, refused)
                return 0
            try:
                return self.write(chunk_id, token_ids, kv)
            except OSError as e:
                log.warning("Could not write the KV of chunk %s to %s (%s); it is served from memory and will "
                            "be recomputed by a later query.", chunk_id, self.kv_dir, e.strerror or e)
                return 0

    # -- a build ------------------------------------------------------------------------------
    def begin_build(self, resume: bool = True) -> None:
        """Start staging writes (the caller holds the writer lock): segment files no commit knows
        are removed, the last segment is cut back to its committed length, and (``resume``) the
        KV an interrupted build checkpointed into this folder is staged again."""
        db = self.db
        with self._lock:
            self.remove_stray_segments(db)
            self._appender = self._open_appender(db)
            self._staged, self._unsaved = {}, []
            self._last_checkpoint, self.checkpoint_s = time.monotonic(), 0.0
            if resume:
                mine = set(self._appender.committed)
                for cid, seg, off, n, crc in db.rows("SELECT chunk_id, seg, off, len, crc FROM pending_kv"):
                    if seg in mine:
                        self._staged[cid] = KVLocation(seg, off, n, crc)

    def staged_location(self, chunk_id: str) -> KVLocation | None:
        with self._lock:
            return None if self._staged is None else self._staged.get(chunk_id)

    def staged_items(self) -> list[tuple[str, KVLocation]]:
        with self._lock:
            return list((self._staged or {}).items())

    def stage(self, chunk_id: str, loc: KVLocation) -> None:
        """Use an existing record for ``chunk_id`` in this build (KV carried over, or salvaged)."""
        with self._lock:
            self._staged[chunk_id] = loc

    def remove_stray_segments(self, db: IndexDB) -> int:
        """Segment files of this folder that no commit knows (a killed writer's new segments)."""
        known, n = set(db.segments()), 0
        if self.kv_dir.is_dir():
            for p in self.kv_dir.iterdir():
                m = SEGMENT_RE.fullmatch(p.name)
                if m and int(m.group(1)) not in known:
                    p.unlink(missing_ok=True)
                    n += 1
        return n

    def flush(self) -> None:
        """fsync this build's segments (before its commit)."""
        with self._lock:
            if self._appender is not None:
                self._appender.flush()

    def checkpoint(self) -> None:
        """Commit what the build wrote so far as pending KV: a killed build resumes from it."""
        t0 = time.perf_counter()
        with self._lock:
            app = self._appender
            app.flush()
            with self._db.transaction() as cur:
                cur.executemany("INSERT OR REPLACE INTO pending_kv (chunk_id, seg, off, len, crc) VALUES (?, ?, ?, ?, ?)",
                                [(cid, loc.seg, loc.off, loc.length, loc.crc) for cid, loc in self._unsaved])
                app.commit(cur)
            app.committed_now()
            self._unsaved = []
        self._last_checkpoint = time.monotonic()
        self.checkpoint_s += time.perf_counter() - t0

    def compact(self, cur, below: float = COMPACT_BELOW) -> tuple[int, int]:
        """Inside the build's commit transaction, after its rows are written: copy the live
        records of every segment of this folder that they fill less than ``below`` of to the
        current segment, and retire it (deleted after the commit). Returns (records, bytes) moved."""
        app = self._appender
        live = dict(cur.execute(f"SELECT kv_seg, sum(kv_len) + {RECORD_HEADER.size} * count(*) FROM chunks "
                                "WHERE kv_seg IS NOT NULL GROUP BY kv_seg").fetchall())
        # a segment this run started is all live; an empty committed one is retired too
        victims = [s for s, end in sorted(app.ends.items())
                   if s not in app.created and (end == 0 or live.get(s, 0) < below * end)]
        if not victims:
            return 0, 0
        if app.seg in victims:
            app.roll()  # never copy a segment into itself
        moved = nbytes = 0
        for seg in victims:
            rows = cur.execute("SELECT rowid, id, kv_off, kv_len, kv_crc FROM chunks WHERE kv_seg = ?",
                               (seg,)).fetchall()
            for rowid, cid, off, n, crc in rows:
                body, why = self.read_body(KVLocation(seg, off, n, crc))
                if body is None:  # damaged: the chunk is left without KV (recomputed on use)
                    log.warning("Chunk %s KV in %s is %s; compaction drops it (it is recomputed on use).", cid,
                                segment_name(seg), why)
                    cur.execute("UPDATE chunks SET kv_seg = NULL, kv_off = NULL, kv_len = NULL, kv_crc = NULL "
                                "WHERE rowid = ?", (rowid,))
                    continue
                loc = app.append(PackedRecord([body], crc))
                cur.execute("UPDATE chunks SET kv_seg = ?, kv_off = ? WHERE rowid = ?", (loc.seg, loc.off, rowid))
                moved += 1
                nbytes += loc.span
            app.retire(seg)
        app.flush()
        return moved, nbytes

    def commit_build(self, cur) -> None:
        """Inside the build's commit transaction: the segments' new lengths; pending KV is done."""
        self._appender.commit(cur)
        cur.execute("DELETE FROM pending_kv")

    def end_build(self, committed: bool) -> None:
        """After the commit (``committed``): retired segments deleted. After a failure: this run's
        appends undone (new segments removed, the others cut back to their committed lengths)."""
        with self._lock:
            app, self._appender, self._staged, self._unsaved = self._appender, None, None, []
            if app is None:
                return
            if not committed:
                app.abort()
                return
            for seg in app.committed_now():
                fd = self._fds.pop(seg, None)
                if fd is not None:
                    os.close(fd)
                app.path(seg).unlink(missing_ok=True)
            app.close()

    # -- salvage ------------------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[str, KVLocation, dict, int]]:
        """Every record of this folder's segment files, read from the files alone (``--repair``
        of an unreadable database): (chunk id, location, metadata, end of the segment's valid
        records). Only headers are read; ``read`` checks a record before it is used."""
        if not self.kv_dir.is_dir():
            return
        for p in sorted(self.kv_dir.iterdir()):
            m = SEGMENT_RE.fullmatch(p.name)
            if not m:
                continue
            seg = int(m.group(1))
            with open(p, "rb") as f:
                size, pos = os.fstat(f.fileno()).st_size, 0
                while pos + RECORD_HEADER.size <= size:
                    header = read_header(os.pread(f.fileno(), RECORD_HEADER.size, pos))
                    body_at = pos + RECORD_HEADER.size
                    if header is None or body_at + header[1] > size:
                        break  # the end of what was written whole
                    crc, n = header
                    head = os.pread(f.fileno(), min(n, 1 << 16), body_at)
                    try:
                        meta = record_metadata(head)
                    except ValueError:
                        meta = {}
                    pos = body_at + n
                    if isinstance(meta.get("chunk"), str):
                        yield meta["chunk"], KVLocation(seg, body_at, n, crc), meta, pos

    def adopt_segments(self) -> int:
        """``--repair`` of an unreadable database (the caller holds the writer lock, before
        ``begin_build``): register this folder's segment files, each up to its last whole record,
        and the last record of each chunk with this store's fingerprint as pending KV, in one
        commit; ``begin_build`` then stages them and ``read`` checks each before it is reused.
        Returns the records found."""
        ends, latest = {}, {}
        for cid, loc, meta, end in self.scan():
            ends[loc.seg] = end
            if self._reusable(meta):
                latest[cid] = loc
        with self.db.transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO segments (id, folder, committed) VALUES (?, ?, ?)",
                            [(seg, self.folder, end) for seg, end in ends.items()])
            cur.executemany("INSERT OR REPLACE INTO pending_kv (chunk_id, seg, off, len, crc) VALUES (?, ?, ?, ?, ?)",
                            [(cid, loc.seg, loc.off, loc.length, loc.crc) for cid, loc in latest.items()])
            cur.execute("INSERT OR REPLACE INTO settings (key, value) VALUES ('next_segment', ?)",
                        (json.dumps(max(ends, default=0) + 1),))
        return len(latest)

    def _reusable(self, meta: dict) -> bool:
        """A scanned record's metadata is of this store: its fingerprint, and its dtype (the KV
        dtype the lost settings had may not be this build's)."""
        if meta.get("fingerprint") != self.fingerprint_id:
            return False
        return self.kv_dtype is None or meta.get("dtype") == kv_dtype_name(self.kv_dtype)

    def salvage(self, token_ids: dict) -> int:
        """``--repair`` (in a build, after ``begin_build``): stage for each chunk named in
        ``token_ids`` the last record in this folder's segments that holds its KV (its chunk id,
        this fingerprint, these token ids), whatever the table says, so that KV the damaged table
        lost track of is reused; ``read`` checks each before it is. Returns how many were found."""
        want = {cid: self.tokens_key(ids) for cid, ids in token_ids.items()}
        found = {}
        for cid, loc, meta, _ in self.scan():
            if want.get(cid) == meta.get("tokens") and self._reusable(meta):
                found[cid] = loc
        with self._lock:
            self._staged.update(found)
        return len(found)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._alone and self._db is not None:
                self._db.close()
                self._db = None


class _NoSuchChunk(Exception):
    pass
