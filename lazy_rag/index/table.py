"""The chunk table and the files table of an index's database, and every SQL statement the index
makes on them: rows read on demand (``ChunkTable``, ``ChunkIds``), each checked against the CRC32
of its content; a build's rows replaced in its commit; the counts that load, describe and verify
read. (The KV segments' own bookkeeping is the store's: ``store.IndexDB``.)"""
from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..kv_record import RECORD_HEADER
from ..store import DamagedIndexError, IndexDB

_RECORD_COLS = "rowid, id, source, ordinal, text, token_ids, meta, row_crc"


@dataclass
class ChunkRecord:
    id: str
    source: str
    ordinal: int
    text: str
    token_ids: list[int]
    metadata: dict = field(default_factory=dict)
    rowid: int | None = None  # the chunk's row in the index's table (and its id in the vector index)


def _row_crc(chunk_id: str, source: str, ordinal: int, text: str, token_ids: bytes, meta: str) -> int:
    """CRC32 over a row's content, each field length-prefixed (SQLite keeps no checksums)."""
    crc = 0
    for part in (chunk_id.encode(), source.encode(), str(ordinal).encode(), text.encode(), bytes(token_ids),
                 meta.encode()):
        crc = zlib.crc32(part, zlib.crc32(len(part).to_bytes(8, "little"), crc))
    return crc


def _row(rowid: int, r: ChunkRecord, loc, vec) -> tuple:
    """The values of a new row (``INSERT_ROW``): the record, its KV location and its vector."""
    tokens = np.asarray(r.token_ids, dtype="<i4").tobytes()
    meta = json.dumps(r.metadata, ensure_ascii=False, sort_keys=True)
    vblob = None if vec is None else np.ascontiguousarray(vec, dtype="<f4").tobytes()
    crc, vcrc = _row_crc(r.id, r.source, r.ordinal, r.text, tokens, meta), None if vblob is None else zlib.crc32(vblob)
    kv = (None, None, None, None) if loc is None else (loc.seg, loc.off, loc.length, loc.crc)
    return (rowid, r.id, *kv, crc, vcrc, r.source, r.ordinal, len(r.token_ids), meta, tokens, r.text, vblob)


def _record(db: IndexDB, row) -> ChunkRecord:
    """A row of ``_RECORD_COLS`` as a record, checked against its CRC."""
    rowid, cid, source, ordinal, text, tokens, meta, crc = row
    try:
        if crc != _row_crc(cid, source, ordinal, text, tokens, meta):
            raise ValueError("checksum")
        return ChunkRecord(cid, source, ordinal, text, np.frombuffer(tokens, dtype="<i4").tolist(), json.loads(meta),
                           rowid)
    except (TypeError, ValueError, AttributeError):
        raise db.damaged(f"the row of chunk {cid!r} does not match its checksum") from None


class ChunkTable(SequenceABC):
    """The chunk records of one generation, read from the index's snapshot when asked for: by
    position (rowid order), by rowid (``row``: a search result), by chunk id (``by_id``), or all
    in one query (iteration). Loading an index reads none of them."""

    def __init__(self, db: IndexDB, n: int):
        self._db, self._n = db, n
        self._rowids: np.ndarray | None = None
        self.by_id = ChunkIds(db, n)

    def __len__(self) -> int:
        return self._n

    def rowids(self) -> np.ndarray:
        if self._rowids is None:
            self._rowids = np.fromiter((r[0] for r in self._db.iterate("SELECT rowid FROM chunks ORDER BY rowid")),
                                       dtype=np.int64, count=self._n)
        return self._rowids

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"chunk {i} of {self._n}")
        return self.row(int(self.rowids()[i]))

    def row(self, rowid: int) -> ChunkRecord | None:
        row = self._db.one(f"SELECT {_RECORD_COLS} FROM chunks WHERE rowid = ?", (int(rowid),))
        return None if row is None else _record(self._db, row)

    def get(self, chunk_id: str) -> ChunkRecord | None:
        return self.by_id.get(chunk_id)

    def __iter__(self) -> Iterator[ChunkRecord]:
        for row in self._db.iterate(f"SELECT {_RECORD_COLS} FROM chunks ORDER BY rowid"):
            yield _record(self._db, row)


class ChunkIds(Mapping):
    """chunk id -> ``ChunkRecord`` of one generation (``index.by_id``), read on demand."""

    def __init__(self, db: IndexDB, n: int):
        self._db, self._n = db, n

    def get(self, chunk_id, default=None):
        row = self._db.one(f"SELECT {_RECORD_COLS} FROM chunks WHERE id = ?", (chunk_id,)) \
            if isinstance(chunk_id, str) else None
        return default if row is None else _record(self._db, row)

    def __getitem__(self, chunk_id) -> ChunkRecord:
        rec = self.get(chunk_id)
        if rec is None:
            raise KeyError(chunk_id)
        return rec

    def __contains__(self, chunk_id) -> bool:
        return isinstance(chunk_id, str) and self._db.one("SELECT 1 FROM chunks WHERE id = ?", (chunk_id,)) is not None

    def __iter__(self) -> Iterator[str]:
        return (r[0] for r in self._db.iterate("SELECT id FROM chunks ORDER BY rowid"))

    def __len__(self) -> int:
        return self._n


# -- reading the tables --------------------------------------------------------------------------------

def count_rows(db: IndexDB) -> int:
    return db.one("SELECT count(*) FROM chunks")[0]


def count_files(db: IndexDB) -> int:
    return db.one("SELECT count(*) FROM files")[0]


def count_rows_with_kv(db: IndexDB) -> int:
    return db.one("SELECT count(*) FROM chunks WHERE kv_seg IS NOT NULL")[0]


def files(db: IndexDB) -> dict:
    """source -> {"sha256", "tokens", "chunk_ids"} of every file in the database's generation."""
    return {s: {"sha256": h, "tokens": t, "chunk_ids": json.loads(ids)}
            for s, h, t, ids in db.rows("SELECT source, sha256, tokens, chunk_ids FROM files")}


def rows_per_source(db: IndexDB) -> dict[str, int]:
    return dict(db.rows("SELECT source, count(*) FROM chunks GROUP BY source"))


def live_bytes(db: IndexDB) -> dict[int, int]:
    """Segment -> bytes of the records the chunk table refers to (headers included)."""
    return dict(db.rows(f"SELECT kv_seg, sum(kv_len) + {RECORD_HEADER.size} * count(*) FROM chunks "
                        "WHERE kv_seg IS NOT NULL GROUP BY kv_seg"))


def integrity_check(db: IndexDB) -> list[str]:
    """SQLite's own check of the database file (["ok"] when it finds nothing)."""
    return [r[0] for r in db.rows("PRAGMA integrity_check")]


def rows_with_vectors(db: IndexDB) -> Iterator[tuple[ChunkRecord | DamagedIndexError, bytes | None, int | None]]:
    """Every row in rowid order as (record, vector blob, vector CRC); a row that does not match
    its checksum gives the error in place of its record."""
    for row in db.iterate(f"SELECT {_RECORD_COLS}, vector, vector_crc FROM chunks ORDER BY rowid"):
        try:
            rec = _record(db, row[:8])
        except DamagedIndexError as e:
            rec = e
        yield rec, row[8], row[9]


def vector_matches(blob: bytes | None, crc: int | None, dim: int) -> bool:
    return blob is not None and zlib.crc32(blob) == crc and len(blob) == 4 * dim


def file_chunk_counts(db: IndexDB) -> list[tuple[str, int]]:
    """(source, how many chunks its files-table entry lists) of every file."""
    return [(source, len(json.loads(ids))) for source, ids in db.rows("SELECT source, chunk_ids FROM files")]


# -- a build's commit (inside its transaction) ---------------------------------------------------------

def replace_rows(cur, *, everything: bool, drop_sources, records: list, locs: list, vecs) -> tuple:
    """Delete the rows and file entries of ``drop_sources`` (``everything``: all of them), then
    insert ``records`` with their KV locations and vectors under new rowids (never reused: they are
    vector ids). Returns (new rowids, removed rowids, tokens removed)."""
    removed, removed_tokens = [], 0
    if everything:
        removed = [r[0] for r in cur.execute("SELECT rowid FROM chunks")]
        cur.execute("DELETE FROM chunks")
        cur.execute("DELETE FROM files")
    else:
        for source in sorted(drop_sources):
            for rowid, n in cur.execute("SELECT rowid, n_tokens FROM chunks WHERE source = ?", (source,)):
                removed.append(rowid)
                removed_tokens += n
            cur.execute("DELETE FROM chunks WHERE source = ?", (source,))
            cur.execute("DELETE FROM files WHERE source = ?", (source,))
    seq = cur.execute("SELECT seq FROM sqlite_sequence WHERE name = 'chunks'").fetchone()
    top = cur.execute("SELECT max(rowid) FROM chunks").fetchone()[0]
    base = max(seq[0] if seq else 0, top or 0)
    rowids = np.arange(base + 1, base + 1 + len(records), dtype=np.int64)
    cur.executemany(
        "INSERT INTO chunks (rowid, id, kv_seg, kv_off, kv_len, kv_crc, row_crc, vector_crc, source, ordinal, "
        "n_tokens, meta, token_ids, text, vector) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (_row(int(rid), r, loc, None if vecs is None else vecs[i])
         for i, (rid, r, loc) in enumerate(zip(rowids, records, locs))))
    return rowids, removed, removed_tokens


def put_files(cur, entries: dict) -> None:
    """The files table's entries (source -> {"sha256", "tokens", "chunk_ids"})."""
    cur.executemany("INSERT OR REPLACE INTO files (source, sha256, tokens, chunk_ids) VALUES (?, ?, ?, ?)",
                    [(s, e["sha256"], e["tokens"], json.dumps(e["chunk_ids"], ensure_ascii=False))
                     for s, e in entries.items()])


def count_rows_in(cur) -> int:
    return cur.execute("SELECT count(*) FROM chunks").fetchone()[0]


def every_vector(cur, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(rowids, vectors) of every row of the generation being committed (inside its transaction)."""
    ids, out = [], []
    for rid, blob in cur.execute("SELECT rowid, vector FROM chunks WHERE vector IS NOT NULL ORDER BY rowid"):
        ids.append(rid)
        out.append(np.frombuffer(blob, dtype="<f4"))
    return np.asarray(ids, dtype=np.int64), np.stack(out) if out else np.zeros((0, dim), np.float32)


def point_kv_at(cur, staged: list) -> None:
    """Every row's KV is the record staged for its chunk id ((chunk id, KVLocation)), or none."""
    cur.execute("UPDATE chunks SET kv_seg = NULL, kv_off = NULL, kv_len = NULL, kv_crc = NULL")
    cur.executemany("UPDATE chunks SET kv_seg = ?, kv_off = ?, kv_len = ?, kv_crc = ? WHERE id = ?",
                    [(loc.seg, loc.off, loc.length, loc.crc, cid) for cid, loc in staged])


def forget_other_kv_folders(cur, folder: str) -> None:
    """KV folders other than ``folder`` (another wrapper's, a failed rewrap's) are no part of the
    generation being committed."""
    cur.execute("DELETE FROM segments WHERE folder != ?", (folder,))


def checkpoint_log(db: IndexDB) -> None:
    """Copy the write-ahead log into the main file where readers allow (never waits for them)."""
    db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
