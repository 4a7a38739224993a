"""``LazyIndex``: chunks, their vectors and their position-free KV, built once, queried often.

Layout of an index folder (format 2)::

    index.sqlite            the commit point (SQLite, WAL): settings (format, fingerprints, embedder,
                            chunking, shared prefix, wrapper, prompt, query defaults, generation),
                            the chunk table (one row per chunk: id, source, ordinal, text, token
                            ids, metadata, KV location, embedding, checksums), the files, the KV
                            segments
    vectors-<gen>.faiss     the vector index (``vector_index.VectorIndex``), ids = chunk rowids
    kv/seg-<n>.kvseg        the chunks' KV records (see store.py); kv-w<digest>/ with a chunk wrapper
    wrapper-<digest>.safetensors  the chunk wrapper every chunk was encoded inside, if any
    manifest.json           a pointer for tools that read no SQLite (format, model, embedder)

A build appends the KV of new chunks to the segments, writes the next generation's vectors file,
then commits one SQLite transaction: the rows of changed files deleted, the new rows inserted,
the segments' lengths, the settings. An interrupted build leaves the previous generation intact
(or no index at all); an update touches only the rows of changed files and appends only their
KV. One writer at a time per folder (``index_lock``); a loaded index reads one SQLite snapshot,
the generation it loaded, whatever builds commit meanwhile. Records are read from SQLite when
asked for (``ChunkTable``), so loading a million-chunk index reads no text.

Checks: every row carries a CRC32 of its content (and one of its vector), checked whenever the
row is read; the settings hold the sha256 of the vectors and wrapper files, checked on load;
every KV record carries its own checksums (store.py); ``verify_index`` checks all of it and
SQLite's integrity. A damaged one is an error naming the file and the fix, ``lazy-rag index
--repair``. Nothing on the load path unpickles: SQLite, JSON, the vector index's own format and
safetensors only. A format-1 folder (``manifest.json``, ``chunks-<gen>.jsonl``, one KV file per
chunk) is refused on load and converted in place by the next build, its KV copied into segments.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
import uuid
import weakref
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence as SequenceABC
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .version import __version__
from . import build_estimate
from .chat import DEFAULT_INSTRUCTION, build_rag_segments, rag_prefix
from .build_pipeline import EncodeWarmup, encode_and_write
from .chunking import TokenChunker, discover_files, read_text
from .deps import require
from .embedder import DEFAULT_EMBEDDER, Embedder, build_device
from .errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from .file_writes import fsync_dir
from .index_lock import try_writer_lock, writer_lock
from .kv_record import KV_DTYPE_NAMES, KV_DTYPES, RECORD_HEADER, kv_dtype_named
from .llm import LazyLLM
from .progress import Progress, resolved_style
from .requests import CHUNK_MODES, ChunkSource, Recovery, resolve_recovery
from .segments import Chunk, tokenize_text
from .store import DB_NAME, REPAIR_FIX, SEGMENT_RE, ChunkStore, DamagedIndexError, IndexDB, segment_name
from .tempfiles import atomic_write_bytes as _atomic_write_bytes  # a module global: tests fail it on purpose
from .vector_index import VectorIndex
from .wrapper import ChunkWrapper, WrapperError

log = logging.getLogger(__name__)
FORMAT_VERSION = 2
POINTER = "manifest.json"  # format 2: a pointer for tools; format 1: the index's commit point
SETTINGS_KEYS = ("model", "kv_dtype", "embedder", "chunking", "generation", "commit_id", "num_chunks", "num_tokens")
FORMAT1_KEYS = ("model", "kv_dtype", "files", "generation", "chunks_file", "num_chunks", "embedder")
EMBED_BATCH = 64


def _token_ids_batched(tokenizer, texts: list[str], batch: int = 1024) -> Iterator[list[int]]:
    """Each text's token ids without special tokens (as ``tokenizer(text)`` gives them), a
    batch of texts per call to a fast tokenizer's own backend where it pads and truncates nothing
    (what transformers' call does then; the call's conversion of every encoding into a dict of
    lists cost more than the encoding itself). Any other tokenizer: one call per text."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        yield from (tokenizer(t, add_special_tokens=False).input_ids for t in texts)
        return
    for i in range(0, len(texts), batch):
        yield from (e.ids for e in backend.encode_batch(texts[i:i + batch], add_special_tokens=False))


def _keep_encode_calibration(llm, report: "BuildReport") -> None:
    """Fit the engine's encode costs (its read-or-encode choice for cold chunks) in a build that
    encodes KV, where a machine-wide calibration file keeps the fit for a day: the first
    `lazy-rag query` then loads it instead of timing probe encodes inside its TTFT. It runs while
    the build's writer writes (build_pipeline.encode_and_write's ``beside_writes``: on a fresh
    machine its probes compile kernels of their own, seconds that after the commit were the
    build's), or after the commit where every chunk's KV was stored already. With no file to keep
    it in (``LAZY_RAG_CALIBRATION=off``) the query process would probe anyway, so nothing runs. A
    failure here costs only that query its probes, never the build."""
    from .engine.read_or_encode import calibration_path

    if calibration_path() is None:
        return
    t0 = time.perf_counter()
    try:
        how = llm.engine.calibrate_read_or_encode()
    except Exception as e:  # noqa: BLE001 - an optional warm-up
        log.warning("Could not measure the engine's encode costs in the build (%s: %s); the first query "
                    "measures them.", type(e).__name__, e)
        return
    seconds = time.perf_counter() - t0
    report.stages["encode_calibration_s"] = round(seconds, 3)
    log.info("encode costs for cold chunks: %s (%.1f s)", how, seconds)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _remove_debris(out: Path) -> int:
    """Temp files of writers that were killed (only ever called under the writer lock)."""
    n = 0
    for folder in (out, *out.glob("kv*")):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                p.unlink(missing_ok=True)
                n += 1
    return n


def _faiss():
    # imported on use: the core runtime (and the GPU image) works without faiss installed
    return require("faiss")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def store_fingerprint(manifest: dict) -> str:
    """What an index's KV records are tied to: the model's fingerprint, and the wrapper's digest."""
    fp = manifest["model"]["fingerprint"]["id"]
    w = manifest.get("wrapper")
    return f"{fp}-w{w['digest']}" if w else fp


def kv_subdir(wrapper: "ChunkWrapper | dict | None") -> str:
    """The KV folder of an index whose chunks are encoded inside ``wrapper`` (a new wrapper gets a
    new folder, so re-encoding every chunk commits atomically with the settings)."""
    if wrapper is None:
        return "kv"
    return f"kv-w{wrapper['digest'] if isinstance(wrapper, dict) else wrapper.digest}"


def wrapper_file(wrapper: ChunkWrapper) -> str:
    return f"wrapper-{wrapper.digest}.safetensors"


def open_store(path: Path, manifest: dict, vocab_rows: int | None = None, db: IndexDB | None = None) -> ChunkStore:
    """The KV store of the index at ``path`` with settings ``manifest``, located through ``db``
    (a loaded index's snapshot or a build's connection)."""
    prefix = manifest["shared_prefix"]["token_ids"] if manifest.get("shared_prefix") else ()
    return ChunkStore(path, store_fingerprint(manifest), prefix, KV_DTYPES.get(manifest["kv_dtype"]),
                      precomputed=manifest.get("kv_precomputed", True), kv_subdir=kv_subdir(manifest.get("wrapper")),
                      vocab_rows=vocab_rows, db=db)


def _embed_records(embedder: Embedder, records, style: str) -> np.ndarray:
    """The embeddings of ``records``' texts, EMBED_BATCH at a time (float32 [n, dim])."""
    parts = []
    with Progress(len(records), "embedding chunks", style) as bar:
        for s in range(0, len(records), EMBED_BATCH):
            parts.append(embedder.encode([r.text for r in records[s:s + EMBED_BATCH]]))
            bar.advance(len(parts[-1]))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def _encode_records(llm, store: ChunkStore, records, wrapper, bar, written: list, stats: dict | None = None,
                    beside_writes=None) -> int:
    """Encode the KV of ``records`` inside ``wrapper`` into ``store`` (build_pipeline: many chunks
    per forward, appended by a background thread, on a CPU by this one: ``store.write`` is
    thread-safe and stages the records until the build commits), advancing ``bar`` by tokens;
    returns the bytes written.
    ``stats`` receives the stage times. (A segment store keeps its own account of what it
    appended: nothing is listed in ``written``.) ``beside_writes``: encode_and_write's."""
    result = encode_and_write(llm, store, records, wrapper, bar, written, beside_writes=beside_writes)
    if stats is not None:
        stats.update(result.as_dict())
    return result.kv_bytes


def _tokens(records) -> int:
    return sum(len(r.token_ids) for r in records)


def _save_wrapper(out: Path, manifest: dict, wrapper: ChunkWrapper) -> Path | None:
    """Write the index's wrapper file (named in the settings) and record its checksum there;
    returns the path if this call created it.

    A file already holding this wrapper (same digest) is kept as it is: safetensors writes its
    metadata in no fixed order, so rewriting it would change the bytes under the checksum of the
    committed settings, and the previous generation (after a failed update, or for a reader
    loading it meanwhile) would look damaged."""
    path = out / manifest["wrapper_file"]
    try:
        present = ChunkWrapper.load(path).digest == wrapper.digest
    except WrapperError:  # absent or damaged: write it
        present = False
    if not present:
        wrapper.save(path)
    manifest.setdefault("checksums", {})["wrapper_file"] = _sha256(path.read_bytes())
    return None if present else path


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _under_roots(source: str, roots: Sequence[str]) -> bool:
    """``source`` (a resolved file path) is one of ``roots`` or inside one of them."""
    return any(source == r or source.startswith(r.rstrip("/") + "/") for r in roots)


def _stamp(path) -> tuple | None:
    """What changes when a file is written or replaced (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _chunk_id(source: str, ordinal: int, text: str) -> str:
    return hashlib.sha256(f"{source}\0{ordinal}\0{text}".encode()).hexdigest()[:20]


def progress_style(progress) -> str:
    """A build's progress: True = a bar on a terminal, plain lines anywhere else (a log file, CI);
    False = none; or a style name of ``lazy_rag.progress``."""
    return {True: "auto", False: "none"}.get(progress, progress) if isinstance(progress, bool) else str(progress)


@dataclass
class ChunkRecord:
    id: str
    source: str
    ordinal: int
    text: str
    token_ids: list[int]
    metadata: dict = field(default_factory=dict)
    rowid: int | None = None  # the chunk's row in the index's table (and its id in the vector index)


@dataclass
class Source:
    chunk_id: str
    source: str
    score: float
    text: str

    def as_dict(self) -> dict:
        return {"chunk_id": self.chunk_id, "source": self.source, "score": round(self.score, 4), "text": self.text}


@dataclass
class QueryResult:
    answer: str
    sources: list[Source]
    stats: dict

    def as_dict(self) -> dict:
        return {"answer": self.answer, "sources": [s.as_dict() for s in self.sources], "stats": self.stats}


@dataclass
class BuildReport:
    files_indexed: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_files: list = field(default_factory=list)   # (path, why) of files that could not be read
    # files that changed after they were read: the index holds the text read, the next run re-indexes them
    changed_files: list = field(default_factory=list)
    chunks_added: int = 0
    # of those (and of chunks whose KV an earlier build left unwritten), the ones whose KV this
    # build encoded: a chunk whose text an index already holds keeps its stored KV
    chunks_encoded: int = 0
    chunks_total: int = 0
    tokens_total: int = 0
    kv_bytes_written: int = 0     # KV encoded by this build (appended to the segments)
    rows_written: int = 0         # chunk rows inserted or deleted by the commit
    kv_records_moved: int = 0     # by compaction: live records copied out of sparse segments
    kv_bytes_moved: int = 0
    seconds: float = 0.0
    stages: dict = field(default_factory=dict)  # the KV pipeline's stage times (build_pipeline.PipelineStats)


# -- the chunk table as rows ---------------------------------------------------------------------------

_RECORD_COLS = "rowid, id, source, ordinal, text, token_ids, meta, row_crc"


def _row_crc(chunk_id: str, source: str, ordinal: int, text: str, token_ids: bytes, meta: str) -> int:
    """CRC32 over a row's content, each field length-prefixed (SQLite keeps no checksums)."""
    crc = 0
    for part in (chunk_id.encode(), source.encode(), str(ordinal).encode(), text.encode(), bytes(token_ids),
                 meta.encode()):
        crc = zlib.crc32(part, zlib.crc32(len(part).to_bytes(8, "little"), crc))
    return crc


def _row_values(r: ChunkRecord, vec) -> tuple:
    """(token ids blob, metadata JSON, vector blob, row CRC, vector CRC) of a record to insert."""
    tokens = np.asarray(r.token_ids, dtype="<i4").tobytes()
    meta = json.dumps(r.metadata, ensure_ascii=False, sort_keys=True)
    vblob = None if vec is None else np.ascontiguousarray(vec, dtype="<f4").tobytes()
    return (tokens, meta, vblob, _row_crc(r.id, r.source, r.ordinal, r.text, tokens, meta),
            None if vblob is None else zlib.crc32(vblob))


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


def _check_settings(settings: dict, db: IndexDB) -> dict:
    version = settings.get("format_version")
    if version != FORMAT_VERSION:
        raise LazyIndexError(f"{db.folder} has index format {version!r}, this lazy-rag reads {FORMAT_VERSION}; "
                             "rebuild the index (or upgrade lazy-rag if a newer one wrote it).")
    missing = [k for k in SETTINGS_KEYS if k not in settings]
    fp = settings.get("model")
    if not missing and not (isinstance(fp, dict) and isinstance(fp.get("fingerprint"), dict)
                            and "id" in fp["fingerprint"]):
        missing = ["model.fingerprint"]
    if missing:
        raise db.damaged(f"its settings lack {', '.join(missing)}")
    return settings


def _refuse_folder(path: Path) -> None:
    """Why ``path`` holds no committed format-2 index: a format-1 index (converted by the next
    build), a damaged pointer, or nothing."""
    mf = path / POINTER
    if mf.exists():
        try:
            version = json.loads(mf.read_bytes().decode("utf-8")).get("format_version")
        except (ValueError, UnicodeDecodeError, AttributeError, OSError):
            version = None
        if version == 1:
            raise LazyIndexError(
                f"{path} holds a lazy-rag index in format 1 (one KV file per chunk), which this lazy-rag (format "
                f"{FORMAT_VERSION}) does not load. Convert it in place, keeping every chunk's KV: `lazy-rag index "
                f"SOURCES --out {path}` with the sources it was built from (or index into a new folder).")
        raise LazyIndexError(f"{path} is not a loadable lazy-rag index: it has a {POINTER} but {DB_NAME} holds no "
                             "committed build (if a build was interrupted, run `lazy-rag index` again).")
    hint = " (if a build was interrupted, run `lazy-rag index` again)" if (path / DB_NAME).exists() else ""
    raise LazyIndexError(f"{path} is not a lazy-rag index: no committed {DB_NAME}{hint}.")


def open_index_db(path, snapshot: bool = True) -> tuple[IndexDB, dict]:
    """The index database of ``path`` and its checked settings (a snapshot by default); raises a
    ``LazyIndexError`` naming what the folder holds instead."""
    path = Path(path)
    if (path / DB_NAME).exists():
        db = IndexDB(path, snapshot=snapshot)
        try:
            settings = db.settings()
            if "format_version" in settings:
                return db, _check_settings(settings, db)
        except BaseException:
            db.close()
            raise
        db.close()
    _refuse_folder(path)


def _latest_commit(path: Path):
    """The commit id of the latest build of ``path`` (None if it cannot be read)."""
    try:
        db = IndexDB(path)
    except (LazyIndexError, OSError):
        return None
    try:
        return db.setting("commit_id")
    except LazyIndexError:
        return None
    finally:
        db.close()


def _write_pointer(out: Path, settings: dict) -> None:
    """manifest.json for tools that read no SQLite: the format, the model and the embedder. Not
    the commit point (index.sqlite is); rewritten only when it would change."""
    data = json.dumps({"format_version": FORMAT_VERSION, "database": DB_NAME, "lazy_rag_version": __version__,
                       "model": settings["model"], "embedder": settings["embedder"],
                       "about": f"lazy-rag index: settings, chunk table and files in {DB_NAME}, KV in the "
                                "kv*/ segments, vectors in the vectors file it names; this file only points."},
                      indent=2, ensure_ascii=False).encode()
    try:
        if (out / POINTER).read_bytes() == data:
            return
    except OSError:
        pass
    _atomic_write_bytes(out / POINTER, data)


# -- format 1 (read for conversion only) ---------------------------------------------------------------

def _read_checked(path: Path, manifest: dict, key: str) -> bytes:
    """The bytes of the file the settings name under ``key``, checked against their sha256."""
    f = Path(path) / manifest[key]
    fix = f"rebuild it from the sources with `lazy-rag index SOURCES --out {path} --repair`"
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise LazyIndexError(f"The index at {path} lacks its {f.name}; {fix}.") from None
    except OSError as e:
        raise LazyIndexError(f"Cannot read {f} ({e.strerror}).") from e
    want = (manifest.get("checksums") or {}).get(key)
    if want is not None and _sha256(data) != want:
        raise LazyIndexError(f"{f} is damaged (its sha256 differs from the one the index recorded); {fix}.")
    return data


def _read_format1_records(path: Path, manifest: dict) -> list[ChunkRecord]:
    data = _read_checked(path, manifest, "chunks_file")
    fix = f"convert it with `lazy-rag index SOURCES --out {path} --repair`"
    try:
        records = [ChunkRecord(**json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip()]
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} is damaged ({e}); {fix}.") from e
    if len(records) != manifest["num_chunks"]:
        raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} holds {len(records)} chunks, the manifest "
                             f"{manifest['num_chunks']}: it is damaged; {fix}.")
    return records


def _read_format1_vectors(path: Path, manifest: dict, n: int) -> np.ndarray:
    """A format-1 vectors file (faiss's own format, row i = chunk i) as a float32 array."""
    data = _read_checked(path, manifest, "vectors_file")
    try:
        index = _faiss().deserialize_index(np.frombuffer(data, dtype=np.uint8))
        vecs = index.reconstruct_n(0, index.ntotal)  # one call, not one per row
    except RuntimeError as e:
        raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} is damaged (faiss cannot read it); convert it "
                             f"with `lazy-rag index SOURCES --out {path} --repair`.") from e
    if len(vecs) != n:
        raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} holds {len(vecs)} vectors for {n} chunks; "
                             f"convert it with `lazy-rag index SOURCES --out {path} --repair`.")
    return np.ascontiguousarray(vecs, dtype=np.float32)


class _Previous:
    """What a build starts from: the committed index of ``out`` (``format`` 2), a format-1 index
    to convert (1), or none (None); and the build's own connection to ``out``'s database (created
    if there is none)."""

    def __init__(self):
        self.format: int | None = None
        self.settings: dict | None = None
        self.db: IndexDB | None = None
        self.salvage = False  # --repair of an unreadable database: KV is found by scanning the segments
        self.v1_records: list[ChunkRecord] | None = None
        self.v1_vectors: np.ndarray | None = None
        self._counts: dict | None = None

    @classmethod
    def open(cls, out: Path, repair: bool) -> "_Previous":
        p = cls()
        if (out / DB_NAME).exists():
            try:
                p.db = IndexDB(out)
                settings = p.db.settings()
                if "format_version" in settings:
                    p.settings, p.format = _check_settings(settings, p.db), 2
                    n = p.db.one("SELECT count(*) FROM chunks")[0]
                    if n != settings["num_chunks"] and not repair:  # as load: no update builds on it
                        raise p.db.damaged(f"it holds {n} chunk rows, its settings say {settings['num_chunks']}")
                    return p
            except DamagedIndexError as e:
                if not repair:
                    raise
                # nothing in it can be trusted or even read: rebuilt from the sources, the KV
                # salvaged from the segments (every record names its chunk and checks itself)
                log.warning("--repair: %s; it is replaced, and the KV its segments hold is reused.", e)
                if p.db is not None:
                    p.db.close()
                    p.db = None
                for suffix in ("", "-wal", "-shm"):
                    (out / (DB_NAME + suffix)).unlink(missing_ok=True)
                p.salvage = True
        if p.db is None:
            p.db = IndexDB(out, create=True)
        p._read_format1(out, repair)
        return p

    def _read_format1(self, out: Path, repair: bool) -> None:
        mf = out / POINTER
        try:
            m = json.loads(mf.read_bytes().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return  # none, or not a format-1 manifest: a fresh build replaces it
        if not isinstance(m, dict) or m.get("format_version") != 1:
            return
        fp = m.get("model")
        missing = [k for k in FORMAT1_KEYS if k not in m] or \
            ([] if isinstance(fp, dict) and isinstance(fp.get("fingerprint"), dict) else ["model.fingerprint"])
        if missing:
            raise LazyIndexError(f"{mf} (a format-1 index) is damaged: it lacks {', '.join(missing)}; index into a "
                                 "new folder.")
        self.format, self.settings = 1, m
        try:
            self.v1_records = _read_format1_records(out, m)
            if m.get("vectors_file"):
                self.v1_vectors = _read_format1_vectors(out, m, len(self.v1_records))
        except LazyIndexError:
            if not repair:
                raise
            self.v1_records = self.v1_vectors = None

    def files(self, repair: bool) -> dict:
        """source -> {"sha256", "tokens", "chunk_ids"} of the files the previous index holds."""
        if self.format == 1:
            return dict(self.settings["files"])
        if self.format != 2:
            return {}
        try:
            return {s: {"sha256": h, "tokens": t, "chunk_ids": json.loads(ids)}
                    for s, h, t, ids in self.db.rows("SELECT source, sha256, tokens, chunk_ids FROM files")}
        except (DamagedIndexError, ValueError):
            if not repair:
                raise
            log.warning("--repair: the files table of %s cannot be read; files indexed from sources not named "
                        "here cannot be kept.", self.db.path)
            return {}

    def has_chunks(self, source: str, chunk_ids) -> bool:
        """Every chunk of the file's entry is in the previous index."""
        if self._counts is None:
            if self.format == 2:
                self._counts = dict(self.db.rows("SELECT source, count(*) FROM chunks GROUP BY source"))
            else:
                self._counts = Counter(r.source for r in self.v1_records or ())
                self._ids = {r.id for r in self.v1_records or ()}
        if self.format == 1:
            return all(c in self._ids for c in chunk_ids)
        return self._counts.get(source) == len(chunk_ids)


class _BuildRun:
    """A build's resources and what to undo if it fails before its commit."""

    def __init__(self):
        self.db: IndexDB | None = None
        self.store: ChunkStore | None = None
        self.had_index = False
        self.committed = False
        self.new_files: list[Path] = []  # files this run created that only its commit refers to
        self.written: list = []          # chunk ids whose KV this run appended

    def fail(self) -> None:
        if self.committed:
            return
        if self.store is not None:
            self.store.end_build(committed=False)
        for p in self.new_files:
            p.unlink(missing_ok=True)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.db is not None:
            self.db.close()


def _vectors_after(old: VectorIndex | None, removed: list[int], ids: np.ndarray, vecs: np.ndarray | None,
                   every_vector) -> VectorIndex:
    """The next generation's vector index: the previous one with the removed rows' vectors taken
    out and the new ones added by rowid, or (none before, or it asks for it) built anew from every
    vector (``every_vector()`` -> (ids, vecs))."""
    if old is None:
        return VectorIndex.rebuild(*every_vector())
    old.remove(np.asarray(removed, dtype=np.int64))
    if len(ids):
        old.add(ids, vecs)
    if old.needs_rebuild():
        return VectorIndex.rebuild(*every_vector())
    return old


def _guard_of(index: "LazyIndex"):
    """``index._write_guard`` for its store, held weakly: a store that refers to its index would
    keep both (and the index's SQLite snapshot) alive until the next garbage collection."""
    ref = weakref.WeakMethod(index._write_guard)

    @contextmanager
    def guard():
        method = ref()
        if method is None:
            yield "the index was closed"
            return
        with method() as refused:
            yield refused

    return guard


class LazyIndex:
    def __init__(self, path: Path, llm: LazyLLM, embedder: Embedder, manifest: dict, records, vectors,
                 wrapper: ChunkWrapper | None = None, db: IndexDB | None = None):
        """An index over ``records`` (a ``ChunkTable`` of ``db``, the snapshot of the generation
        ``manifest`` describes) and ``vectors`` (a ``VectorIndex``, None without vectors). Use
        ``load`` or ``build``."""
        self.path = Path(path)
        self.llm = llm
        self.embedder = embedder
        self.manifest = manifest  # the index's settings (format, fingerprints, embedder, chunking, ...)
        self.db = db
        self.records = records
        self.by_id = records.by_id if isinstance(records, ChunkTable) else {r.id: r for r in records}
        self.vectors = vectors
        if wrapper is None and manifest.get("wrapper"):
            wrapper = self._read_wrapper(self.path, manifest)
        self.wrapper = wrapper  # every chunk's KV was encoded inside it (None: plain chunks)
        self.store = open_store(self.path, manifest, llm.host.parts.vocab_rows, db=db)
        self.store.write_guard = _guard_of(self)  # a query writes KV only under the writer lock

    @contextmanager
    def _write_guard(self):
        """For a query's KV write-back: the writer lock if free now, and only while the folder still
        holds the generation this index loaded (a newer build may have dropped the chunk). Yields
        None when writing is safe, else why not."""
        with try_writer_lock(self.path) as refused:
            if refused:
                yield refused
                return
            current = _latest_commit(self.path)
            yield None if current == self.manifest.get("commit_id") else "the index was rebuilt since it was loaded"

    def close(self) -> None:
        """Release the snapshot (SQLite checkpoints its log past a snapshot only once it closes)."""
        self.store.close()
        if self.db is not None:
            self.db.close()

    @property
    def files(self) -> dict:
        """source -> {"sha256", "tokens", "chunk_ids"} of every file in the loaded generation."""
        if self.db is None:
            return {}
        return {s: {"sha256": h, "tokens": t, "chunk_ids": json.loads(ids)}
                for s, h, t, ids in self.db.rows("SELECT source, sha256, tokens, chunk_ids FROM files")}

    @property
    def recovery(self) -> Recovery:
        """The index's default quality recovery for queries (an index built before recovery
        options existed may record only ``boundary_recompute``)."""
        defaults = self.manifest.get("query_defaults", {})
        return resolve_recovery(defaults.get("recovery"), int(defaults.get("boundary_recompute", 0)))

    @property
    def shared_prefix_ids(self) -> tuple[int, ...]:
        return self.store.shared_prefix_ids

    @property
    def chunk_source(self) -> ChunkSource:
        """What a request over this index's chunks passes to ``LazyLLM.generate(source=...)``:
        the prefix its chunks were encoded after, and the store holding their KV."""
        return ChunkSource(self.store.shared_prefix_ids, self.store, self.wrapper)

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, sources: Sequence[str | os.PathLike], out: str | os.PathLike, llm: LazyLLM | None = None,
              embedder: Embedder | None = None, *, model: str = "smollm2", chunk_size: int = 256,
              chunk_overlap: int = 32, shared_prefix: bool = False, system_prompt: str | None = None,
              kv_dtype: str = "auto", progress: bool = True, device: str = "auto", precompute_kv: bool = True,
              boundary_recompute: int = 0, recovery: Recovery | str | None = None,
              instruction: str = DEFAULT_INSTRUCTION, repair: bool = False, drop_missing: bool = False,
              wait_lock: float = 0.0, wrapper="auto") -> tuple["LazyIndex", BuildReport]:
        """Index files and folders (.txt, .md) into ``out``; re-running skips unchanged files.

        Mitigations for checkpoints not fine-tuned for independent chunks (stored in the settings):
        ``shared_prefix`` encodes every chunk after the prompt's fixed head (an attention sink);
        ``recovery`` (e.g. "prophet20", "epic16"; ``Recovery``) is the queries' default quality recovery
        at query time (``boundary_recompute=N`` is short for "epicN").
        ``precompute_kv=False`` defers each chunk's KV to its first retrieval (large corpora).
        ``system_prompt`` and ``instruction`` shape the RAG prompt of every query (chat.py).
        ``progress``: True (a bar on a terminal, else a plain line every 30 s or 5%), False, or
        a style: "bar", "lines", "none".
        A file indexed before that is now empty or unreadable loses its chunks (it is named in
        ``report.skipped_files``). Each file's chunks, KV and recorded sha256 are one read of it
        (``chunking.read_text``); one written after that read is named in ``report.changed_files``,
        and the next run re-indexes it. ``repair=True`` rebuilds the chunk table and vectors from the
        sources without reading the old ones (after damage), reusing every KV record whose stored
        token ids match; files the index holds from sources not named here are read again at their
        recorded paths, and one that cannot be read stops the repair (naming it) unless
        ``drop_missing``. ``drop_missing=True`` drops the chunks of indexed files that are gone,
        wherever they were indexed from (by default an update drops only files gone from the
        sources it names). ``wait_lock``: seconds to wait for another writer of ``out``.
        ``wrapper``: the chunk wrapper every chunk is encoded inside (a bundled name, a file from
        `lazy-rag tune`, or "none"); "auto" keeps an existing index's and otherwise takes the model's
        bundled wrapper, if it has one. A format-1 index in ``out`` is converted in place, every
        intact KV file copied into the segments."""
        files, skipped = discover_files(sources)
        docs, report, stamps = [], BuildReport(skipped=skipped), {}
        for f in files:
            name = os.fsencode(f)
            if not _is_utf8(name):  # a chunk table and a terminal hold text: the path must be text
                why = "file name is not UTF-8 (rename the file)"
                report.skipped[why] += 1
                report.skipped_files.append((name.decode("utf-8", "backslashreplace"), why))
                continue
            stamps[str(f)] = _stamp(f)  # before the read: a write after it shows at the end
            text, why = read_text(f)
            if text is None:
                report.skipped[why] += 1
                report.skipped_files.append((str(f), why))
                continue
            docs.append((str(f), text, {"file_path": str(f)}))
        if not docs:
            raise LazyRagError(f"None of the {len(files)} files could be read as UTF-8 text "
                               f"(skipped: {dict(report.skipped)}).")
        roots = [str(Path(s).expanduser().resolve()) for s in sources]
        index, report = cls._build_docs(
            docs, out, llm, embedder, model=model, chunk_size=chunk_size, chunk_overlap=chunk_overlap,
            shared_prefix=shared_prefix, system_prompt=system_prompt, kv_dtype=kv_dtype, progress=progress,
            device=device, report=report, roots=roots, precompute_kv=precompute_kv,
            boundary_recompute=boundary_recompute, recovery=recovery, instruction=instruction, repair=repair,
            drop_missing=drop_missing, wait_lock=wait_lock, wrapper=wrapper,
            unreadable={path for path, _ in report.skipped_files})
        # Each file's chunks, KV and recorded sha256 are one read of it. One written since (by
        # then or while the build ran) is named: the next run sees its new sha256 and re-indexes it.
        for source, text, _ in docs:
            if _stamp(source) != stamps[source] and read_text(Path(source))[0] != text:
                report.changed_files.append(source)
                log.warning("%s changed while it was indexed: the index holds the text read; run `lazy-rag "
                            "index` again to index the new version.", source)
        return index, report

    @classmethod
    def from_texts(cls, texts: Iterable[str], out, llm: LazyLLM | None = None, embedder: Embedder | None = None, *,
                   ids: Sequence[str] | None = None, metadatas: Sequence[dict] | None = None, split: bool = True,
                   **kwargs) -> "LazyIndex":
        """Index in-memory documents. ``ids`` name the documents; with ``split=False`` each text
        is one chunk and its chunk id is exactly the given id (for frameworks' node ids).
        ``vectors=False``: no embeddings and no vector index (nor their packages): chunks are then
        named by id (``segments(question, chunk_ids)``), e.g. when retrieval happens elsewhere."""
        texts = list(texts)
        ids = list(ids) if ids is not None else [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]
        metadatas = list(metadatas) if metadatas is not None else [{} for _ in texts]
        if not (len(ids) == len(texts) == len(metadatas)):
            raise LazyRagError("texts, ids and metadatas must have the same length.")
        if len(set(ids)) != len(ids):
            raise LazyRagError("Document ids must be unique.")
        docs = [(i, t, m) for i, t, m in zip(ids, texts, metadatas) if t.strip()]
        if not docs:
            raise LazyRagError("No non-empty texts to index.")
        index, _ = cls._build_docs(docs, out, llm, embedder, split=split, **kwargs)
        return index

    @classmethod
    def _build_docs(cls, docs, out, llm, embedder, *, wait_lock: float = 0.0, **kwargs):
        """Check ``out``, take its writer lock, build; a failure to write (full disk, read-only
        folder) is an error with the numbers and the fix, and leaves the previous index as it was."""
        out = Path(out).expanduser()
        if out.exists() and not out.is_dir():
            raise LazyIndexError(f"--out {out} is a file, not a folder; name a folder for the index.")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LazyIndexError(f"Cannot create the index folder {out} ({e.strerror}); choose another --out.") from e
        with writer_lock(out, wait=wait_lock):
            _remove_debris(out)
            run = _BuildRun()
            try:
                return cls._build_locked(docs, out, llm, embedder, run=run, **kwargs)
            except BaseException as e:
                # whatever stopped it (a full disk, Ctrl-C): this run's appends and files go; the
                # committed generation never referred to them
                run.fail()
                if not isinstance(e, OSError):
                    raise
                why = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                       errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exceeded"}.get(
                    e.errno, e.strerror or type(e).__name__)
                state = "the previous index is unchanged" if run.had_index else "no index was written"
                raise LazyIndexError(f"Writing the index at {out} failed: {why} ({e.filename or out}); {state} and "
                                     "this run's partial files were removed. Free space or choose another --out, "
                                     "then run `lazy-rag index` again.") from e
            finally:
                run.close()

    @staticmethod
    def _reread_other_roots(old_files: dict, given: set[str], roots: list[str], report: BuildReport,
                            unreadable: set, drop_missing: bool) -> list:
        """For --repair (which cannot trust the old chunk table): the documents of the files the
        index holds from sources not named on this command line, read again at their recorded
        paths, so that the repair keeps them. One still there but no longer text is dropped, as by
        any re-index (added to ``unreadable``); one that cannot be read at all (moved, deleted, an
        unmounted disk) stops the repair before anything is written, naming it, unless
        ``drop_missing``: its chunks could only be rebuilt from the file."""
        docs, missing = [], []
        for source in old_files:
            if source in given or not Path(source).is_absolute() or _under_roots(source, roots):
                continue  # read already, an id of in-memory texts, or gone from a folder named again
            text, why = read_text(Path(source))
            if text is not None:
                docs.append((source, text, {"file_path": source}))
            elif why.startswith("unreadable"):
                missing.append((source, why))
            else:
                report.skipped[why] += 1
                report.skipped_files.append((source, why))
                unreadable.add(source)
        if missing and not drop_missing:
            named = "; ".join(f"{path} ({why})" for path, why in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise LazyIndexError(
                f"--repair rebuilds the index from its source files, and {len(missing)} file(s) it holds from "
                f"sources not named here cannot be read at their recorded paths: {named}{more}. Nothing was "
                "changed. Put them back (or mount their disk) and run the repair again, or add --drop-missing to "
                "drop their chunks from the index.")
        for source, why in missing:
            report.skipped_files.append((source, why))
        return docs

    @classmethod
    def _build_locked(cls, docs, out: Path, llm, embedder, *, run: _BuildRun, model="smollm2", chunk_size=256,
                      chunk_overlap=32, shared_prefix=False, system_prompt=None, kv_dtype="auto", progress=True,
                      device="auto", report: BuildReport | None = None, roots=None, split=True, precompute_kv=True,
                      boundary_recompute=0, recovery=None, instruction=DEFAULT_INSTRUCTION, vectors=True,
                      repair=False, drop_missing=False, unreadable=frozenset(), wrapper="auto"):
        t0 = time.perf_counter()
        report = report or BuildReport()
        if llm is None:
            llm = LazyLLM.from_pretrained(model, device=device)
            model_name = model
        else:
            model_name = getattr(llm, "model_name", None)
        chunker = TokenChunker(llm.tokenizer, chunk_size, chunk_overlap) if split else None
        kv_dt = kv_dtype_named(kv_dtype, llm.dtype)
        if kv_dt is None:
            raise LazyIndexError(f"Unknown KV dtype {kv_dtype!r}; choose auto, {', '.join(KV_DTYPE_NAMES)}, or "
                                 f"{', '.join(KV_DTYPES)}.")
        prefix = None
        if shared_prefix:
            text = rag_prefix(llm.tokenizer, system_prompt, instruction)
            prefix = {"text": text, "token_ids": tokenize_text(llm.tokenizer, text, first=True)}
        chunking = {"chunk_size": chunk_size, "chunk_overlap": chunk_overlap, "split": split,
                    "splitter": "llama_index.SentenceSplitter"}
        prev = _Previous.open(out, repair)
        run.db, run.had_index = prev.db, prev.format is not None
        old = prev.settings
        if isinstance(wrapper, str) and wrapper.lower() == "auto" and old is not None:
            wrapper = cls._read_wrapper(out, old) if old.get("wrapper") else None  # the index's choice stands
        else:
            wrapper = llm.host.resolve_wrapper(wrapper)
        warmup = None

        def warm_up():  # the encode's kernels compiled beside the chunking and the embedding
            if not (precompute_kv and EncodeWarmup.wanted(llm)):
                return None
            return EncodeWarmup(llm, prefix["token_ids"] if prefix else (), wrapper, kv_dt)

        if prev.format is None:  # a new index: all of it will be encoded
            warmup = warm_up()
        if vectors:  # (after the warm-up starts: loading the embedder is seconds of its compile)
            embedder = embedder or Embedder(DEFAULT_EMBEDDER, device=build_device(llm.device))
        settings = {
            "format_version": FORMAT_VERSION, "lazy_rag_version": __version__,
            "model": {"name": model_name, "fingerprint": llm.fingerprint, "dtype": str(llm.dtype).removeprefix("torch.")},
            "kv_dtype": str(kv_dt).removeprefix("torch."),
            # None: an index without vectors (retrieval happens elsewhere; chunks are named by id)
            "embedder": {"name": embedder.name, "dim": embedder.dim} if vectors else None,
            "chunking": chunking, "shared_prefix": prefix, "generation": 0,
            "kv_precomputed": bool(precompute_kv),
            "query_defaults": {"recovery": resolve_recovery(recovery, boundary_recompute).name()},
            "prompt": {"system_prompt": system_prompt, "instruction": instruction},
            "wrapper": wrapper.describe() if wrapper is not None else None,
            "wrapper_file": wrapper_file(wrapper) if wrapper is not None else None,
        }
        old_vectors = None
        if old is not None:
            cls._check_compatible(old, settings, out)
            settings["generation"] = old["generation"] + 1
            if prev.format == 2 and not repair and old.get("vectors_file"):
                old_vectors = cls._read_vectors(out, old, old["num_chunks"])  # damaged: refused before any work
        old_files = prev.files(repair) if old is not None else {}
        if repair and old is not None and roots is not None:
            unreadable = set(unreadable)
            docs = list(docs) + cls._reread_other_roots(old_files, {d[0] for d in docs}, roots, report, unreadable,
                                                        drop_missing)
        # Decide per document: keep (unchanged), re-chunk (new or changed), drop (vanished).
        keep_sources, new_records, new_files, drop_sources = set(), [], {}, set()
        seen_sources, changed = set(), []
        for source, text, meta in docs:
            seen_sources.add(source)
            digest = hashlib.sha256(text.encode()).hexdigest()
            prev_entry = old_files.get(source)
            if not repair and prev_entry and prev_entry["sha256"] == digest and \
                    prev.has_chunks(source, prev_entry["chunk_ids"]):
                keep_sources.add(source)
                report.files_unchanged += 1
                continue
            changed.append((source, text, meta, digest, prev_entry))
        # texts taken whole as chunks: tokenized in batches (the fast tokenizer spreads a batch
        # over the cores; one call per text was a machine's first build's longest wait before
        # its first encode)
        whole_ids = (itertools.repeat(None) if split
                     else _token_ids_batched(llm.tokenizer, [text for _, text, *_ in changed]))
        for (source, text, meta, digest, prev_entry), text_ids in zip(changed, whole_ids):
            parts = chunker.split(text) if split else [(text, text_ids)]
            recs = [ChunkRecord(_chunk_id(source, i, t) if split else source, source, i, t, ids, dict(meta))
                    for i, (t, ids) in enumerate(parts)]
            new_records.extend(recs)
            new_files[source] = {"sha256": digest, "chunk_ids": [r.id for r in recs],
                                 "tokens": sum(len(r.token_ids) for r in recs)}
            if prev_entry:
                drop_sources.add(source)  # changed: its old rows go
            report.files_indexed += 1
        for source, entry in old_files.items():
            if source in seen_sources:
                continue
            if source in unreadable:  # emptied or replaced by bytes that are not text: its chunks go
                report.files_removed += 1
                log.warning("%s can no longer be read as text; its chunks were removed from the index.", source)
            elif repair:  # gone from a folder named again, or (--drop-missing) from anywhere
                report.files_removed += 1
                log.warning("--repair: %s cannot be read; its chunks were dropped.", source)
            elif roots is not None and Path(source).is_absolute() and (drop_missing or _under_roots(source, roots)) \
                    and not Path(source).exists():
                report.files_removed += 1  # vanished from a folder we were asked to index again
            else:
                keep_sources.add(source)
                continue
            drop_sources.add(source)
        # a format-1 index's rows are all written now: those of unchanged files carried over as they are
        carried, carried_vecs = [], None
        if prev.format == 1 and prev.v1_records is not None:
            rows = [i for i, r in enumerate(prev.v1_records) if r.source in keep_sources]
            carried = [prev.v1_records[i] for i in rows]
            if prev.v1_vectors is not None and vectors:
                carried_vecs = prev.v1_vectors[rows]
            for source in keep_sources:
                new_files.setdefault(source, old_files[source])
        store = open_store(out, settings, llm.host.parts.vocab_rows, db=prev.db)
        run.store = store
        store.write_guard = None  # this build holds the writer lock itself
        if prev.salvage:  # the segments' lengths were in the lost database: taken from the files
            n = store.adopt_segments()
            log.warning("--repair: %d KV records found in the segments of %s.", n, store.kv_dir)
        store.begin_build()
        if repair and prev.format == 2 or prev.salvage:
            # KV is found by what the records say, not by what the table says
            store.salvage({r.id: r.token_ids for r in new_records})
        if prev.format == 1:
            n = store.import_format1(out / kv_subdir(old.get("wrapper")),
                                     {r.id: r.token_ids for r in carried + new_records})
            log.info("Converting the format-1 index at %s: %d KV files copied into segments.", out, n)
        todo_records = new_records + ([r for r in carried if store.location(r.id) is None] if precompute_kv else [])
        if warmup is None and todo_records:
            warmup = warm_up()
        if precompute_kv and todo_records:
            cls._check_free_space(out, llm, store, todo_records, wrapper.slots if wrapper else 0,
                                  new_index=not run.had_index)
        # Embed and encode only what is new.
        style = progress_style(progress)
        # from the build's start to the embedding and encoding: the model where it is loaded here,
        # the previous index, chunking and tokenizing
        report.stages["prepare_s"] = round(time.perf_counter() - t0, 3)
        vecs_new = None

        def embed(style):
            nonlocal vecs_new
            t_embed = time.perf_counter()
            if new_records and vectors:
                vecs_new = _embed_records(embedder, new_records, style)
            report.stages["embed_s"] = round(time.perf_counter() - t_embed, 3)
            report.stages["embed_start_s"] = round(t_embed - t0, 3)

        # while the writer writes: the embedding (before the first encode it held the first write
        # back by its seconds, the disk idle; the vectors are needed at the commit), then the
        # calibration, each beside a full queue of its own. Its progress in lines between the
        # encode's, not as a second live bar beside the encode's
        beside_style = "none" if resolved_style(style) == "bar" else style
        beside_writes = (lambda: embed(beside_style), lambda: _keep_encode_calibration(llm, report))

        if todo_records and precompute_kv:
            with Progress(_tokens(todo_records), "encoding chunk KV", style) as bar:
                # chunks whose KV is there already (the same chunk before, or written by an
                # interrupted build) are kept as they are
                todo = [r for r in todo_records if store.read(r.id, r.token_ids)[0] is None]
                bar.advance(_tokens(todo_records) - _tokens(todo))
                report.chunks_encoded = len(todo)
                report.stages["encode_start_s"] = round(time.perf_counter() - t0, 3)
                # the embedding and the engine's encode costs beside the writer's writes (encode_and_write)
                if todo:
                    report.kv_bytes_written += _encode_records(llm, store, todo, wrapper, bar, run.written,
                                                               report.stages, beside_writes=beside_writes)
        if "embed_s" not in report.stages:  # nothing encoded (vectors alone, or every chunk's KV was there)
            embed(style)
        if warmup is not None:  # joined before the commit (an encode above waited for it on the engine's lock)
            report.stages["warmup_s"] = round(warmup.wait(), 3)
            # the build's timeline: the warm-up's compiles against the chunking, embedding and encode
            report.stages["warmup_start_s"] = round(warmup.started - t0, 3)
            report.stages["warmup_end_s"] = round(warmup.ended - t0, 3)
        if wrapper is not None:
            created = _save_wrapper(out, settings, wrapper)
            if created is not None:
                run.new_files.append(created)
        records = carried + new_records
        vecs = None
        if vectors and records:
            vecs = np.concatenate([v for v in (carried_vecs, vecs_new) if v is not None]) \
                if carried_vecs is not None or vecs_new is not None else None
        t_commit = time.perf_counter()
        index = cls._commit(out, llm, embedder, run, prev, settings, records, vecs, new_files, drop_sources, repair,
                            old_vectors, wrapper, report)
        report.stages["commit_s"] = round(time.perf_counter() - t_commit, 3)
        if todo_records and precompute_kv and report.stages.get("beside_at_batch", -1) < 0:
            # not fitted beside the writes: every chunk's KV was there already
            _keep_encode_calibration(llm, report)
        report.chunks_added = len(new_records)
        report.chunks_total = index.manifest["num_chunks"]
        report.tokens_total = index.manifest["num_tokens"]
        report.seconds = time.perf_counter() - t0
        index.build_report = report  # (from_texts returns the index alone)
        return index, report

    @classmethod
    def _commit(cls, out: Path, llm, embedder, run: _BuildRun, prev: _Previous, settings: dict, records: list,
                vecs, new_files: dict, drop_sources: set, repair: bool, old_vectors, wrapper,
                report: BuildReport) -> "LazyIndex":
        """The build's commit: one SQLite transaction that deletes the rows of changed and removed
        files, inserts the new rows (their KV where the store has it), compacts sparse segments
        and writes the segments' lengths, the vectors file's name and the settings. The segments
        and the vectors file are durable before it; what it retired is removed after it."""
        store, db = run.store, prev.db
        old = prev.settings
        # where each new row's KV is: staged by this build, or the previous row of the same chunk
        locs = [store.location(r.id) for r in records]
        store.flush()
        gen = settings["generation"]
        with db.transaction() as cur:
            removed, removed_tokens = [], 0
            if prev.format == 2 and repair:
                removed = [r[0] for r in cur.execute("SELECT rowid FROM chunks")]
                cur.execute("DELETE FROM chunks")
                cur.execute("DELETE FROM files")
            elif prev.format == 2:
                for source in sorted(drop_sources):
                    for rowid, n in cur.execute("SELECT rowid, n_tokens FROM chunks WHERE source = ?", (source,)):
                        removed.append(rowid)
                        removed_tokens += n
                    cur.execute("DELETE FROM chunks WHERE source = ?", (source,))
                    cur.execute("DELETE FROM files WHERE source = ?", (source,))
            else:  # a new index, or a format-1 one converted: nothing committed here before
                cur.execute("DELETE FROM chunks")
                cur.execute("DELETE FROM files")
            seq = cur.execute("SELECT seq FROM sqlite_sequence WHERE name = 'chunks'").fetchone()
            top = cur.execute("SELECT max(rowid) FROM chunks").fetchone()[0]
            base = max(seq[0] if seq else 0, top or 0)  # rowids are never reused: they are vector ids
            rowids = np.arange(base + 1, base + 1 + len(records), dtype=np.int64)
            cur.executemany(
                "INSERT INTO chunks (rowid, id, kv_seg, kv_off, kv_len, kv_crc, row_crc, vector_crc, source, ordinal, "
                "n_tokens, meta, token_ids, text, vector) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cls._row(int(rid), r, loc, None if vecs is None else vecs[i])
                 for i, (rid, r, loc) in enumerate(zip(rowids, records, locs))))
            cur.executemany("INSERT OR REPLACE INTO files (source, sha256, tokens, chunk_ids) VALUES (?, ?, ?, ?)",
                            [(s, e["sha256"], e["tokens"], json.dumps(e["chunk_ids"], ensure_ascii=False))
                             for s, e in new_files.items()])
            report.rows_written = len(removed) + len(records)
            report.kv_records_moved, report.kv_bytes_moved = store.compact(cur)
            store.commit_build(cur)
            # KV folders of another wrapper (a failed rewrap's) are no part of this generation
            cur.execute("DELETE FROM segments WHERE folder != ?", (store.folder,))
            num_chunks = cur.execute("SELECT count(*) FROM chunks").fetchone()[0]
            added_tokens = sum(len(r.token_ids) for r in records)
            num_tokens = added_tokens if prev.format != 2 or repair else old["num_tokens"] - removed_tokens + added_tokens
            settings.update(num_chunks=num_chunks, num_tokens=num_tokens, commit_id=uuid.uuid4().hex, updated=_now(),
                            vectors_file=None, vectors=None)
            settings.setdefault("checksums", {}).pop("vectors_file", None)
            if settings["embedder"] is not None:
                dim = settings["embedder"]["dim"]
                vindex = _vectors_after(old_vectors, removed, rowids, vecs,
                                        lambda: cls._every_vector(cur, rowids, vecs, old_vectors is None, dim))
                data = vindex.to_bytes()
                name = f"vectors-{gen}.faiss"
                _atomic_write_bytes(out / name, data)
                run.new_files.append(out / name)
                fsync_dir(out)  # its name durable before the commit that names it
                settings["vectors_file"] = name
                settings["checksums"]["vectors_file"] = _sha256(data)
                settings["vectors"] = {"kind": vindex.kind, "ntotal": vindex.ntotal, "bytes": len(data)}
            else:
                vindex = None
            IndexDB.put_settings(cur, settings, old if prev.format == 2 else None)
        run.committed = True
        store.end_build(committed=True)
        cls._collect_garbage(out, settings, store, db)
        try:
            _write_pointer(out, settings)
            db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # keep the main file current where readers allow
        except Exception as e:  # the commit stands; a tool reading manifest.json sees the previous one
            log.warning("The index at %s is committed, but its %s could not be written (%s).", out, POINTER, e)
        snapshot, settings = open_index_db(out)
        table = ChunkTable(snapshot, settings["num_chunks"])
        return cls(out, llm, embedder, settings, table, vindex, wrapper, db=snapshot)

    @staticmethod
    def _row(rowid: int, r: ChunkRecord, loc, vec) -> tuple:
        tokens, meta, vblob, crc, vcrc = _row_values(r, vec)
        kv = (None, None, None, None) if loc is None else (loc.seg, loc.off, loc.length, loc.crc)
        return (rowid, r.id, *kv, crc, vcrc, r.source, r.ordinal, len(r.token_ids), meta, tokens, r.text, vblob)

    @staticmethod
    def _every_vector(cur, rowids, vecs, all_new: bool, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every row of the generation being committed (read inside its transaction)."""
        if all_new:  # every row is one this build wrote: they are at hand
            return rowids, (vecs if vecs is not None else np.zeros((0, dim), np.float32))
        ids, out = [], []
        for rid, blob in cur.execute("SELECT rowid, vector FROM chunks WHERE vector IS NOT NULL ORDER BY rowid"):
            ids.append(rid)
            out.append(np.frombuffer(blob, dtype="<f4"))
        return np.asarray(ids, dtype=np.int64), np.stack(out) if out else np.zeros((0, dim), np.float32)

    @staticmethod
    def _check_free_space(out: Path, llm, store: ChunkStore, records, slots: int = 0, *, new_index: bool) -> None:
        """Refuse a build whose KV cannot fit on the disk, before writing any, with the numbers
        (``slots``: a chunk wrapper's, stored with every chunk). A smaller KV dtype is suggested
        where it applies: an index keeps the dtype it was built with."""
        per_token = build_estimate.kv_bytes_per_token(llm, store.kv_dtype)  # fp8's scales included
        need = sum(len(r.token_ids) + slots for r in records) * per_token
        free = shutil.disk_usage(out).free
        if need > free * 0.95:
            smaller = {4: "store KV in bf16 or fp8 (--kv-dtype bf16: half the bytes; fp8: about a quarter)",
                       2: "store KV in fp8 (--kv-dtype fp8: about half the bytes)"}.get(
                (store.kv_dtype or llm.dtype).itemsize, "")
            if smaller:
                smaller += ", " if new_index else " in a new index (another --out), "
            fix = smaller + "index fewer files, defer KV to first use (--no-precompute), use a smaller model, or " \
                "choose another --out."
            raise LazyIndexError(
                f"The KV of {len(records)} new chunks ({sum(len(r.token_ids) for r in records):,} tokens x "
                f"{per_token:,.0f} bytes) needs {need / 2**30:.2f} GiB, but {out} has {free / 2**30:.2f} GiB free. "
                + fix[0].upper() + fix[1:])

    @staticmethod
    def _collect_garbage(out: Path, settings: dict, store: ChunkStore, db: IndexDB) -> None:
        """After a commit: older generations' vectors files, other wrappers, KV folders of another
        wrapper, a converted format-1 index's files, and segment files no commit refers to."""
        keep = {settings.get("vectors_file"), settings.get("wrapper_file")}
        try:
            for p in [*out.glob("vectors-*.faiss"), *out.glob("wrapper-*.safetensors"), *out.glob("chunks-*.jsonl")]:
                if p.name not in keep:
                    p.unlink(missing_ok=True)
            for other in out.glob("kv*"):
                if other.is_dir() and other.name != store.folder:  # KV encoded inside another (or no) wrapper
                    shutil.rmtree(other, ignore_errors=True)
            if store.kv_dir.is_dir():
                for p in store.kv_dir.glob("*.safetensors"):  # format 1's KV files, copied into segments
                    p.unlink(missing_ok=True)
                store.remove_stray_segments(db)
        except (OSError, LazyIndexError) as e:  # the commit stands; the next build collects the rest
            log.warning("Could not remove every file the index at %s no longer needs (%s).", out, e)

    @staticmethod
    def _check_compatible(old: dict, new: dict, out: Path) -> None:
        a, b = old["model"]["fingerprint"], new["model"]["fingerprint"]
        if a["id"] != b["id"]:
            raise FingerprintMismatchError(
                f"The index at {out} was built with another model/tokenizer/RoPE (fingerprint {a['id']}: "
                f"{a.get('model_type')} weights {a['weights']}, tokenizer {a['tokenizer']}, rope {a['rope']}) "
                f"than the one loaded now (fingerprint {b['id']}: {b.get('model_type')} weights {b['weights']}, "
                f"tokenizer {b['tokenizer']}, rope {b['rope']}). Use the index's model, or index into a new --out folder."
            )
        wa, wb = old.get("wrapper"), new.get("wrapper")
        if (wa or {}).get("digest") != (wb or {}).get("digest"):
            name = lambda w: f"wrapper {w['name'] or '?'} (digest {w['digest']})" if w else "no wrapper"  # noqa: E731
            raise FingerprintMismatchError(
                f"The index at {out} encoded its chunks inside {name(wa)}, this build asks for {name(wb)}. Re-index "
                "with the index's wrapper (the default, --wrapper auto, keeps it), re-encode the index for a new one "
                f"with `lazy-rag tune {out}`, or index into a new --out folder.")
        for key in ("embedder", "chunking", "shared_prefix", "kv_dtype", "kv_precomputed") + \
                (("prompt",) if new.get("shared_prefix") else ()):
            if old.get(key) != new.get(key):
                raise LazyIndexError(
                    f"The index at {out} was built with {key} = {old.get(key)!r}, not {new.get(key)!r}; "
                    "index into a new --out folder (or delete the old one) to change it."
                )

    # -- a new chunk wrapper ----------------------------------------------------------------------
    def rewrap(self, wrapper: ChunkWrapper | None, progress=True, wait_lock: float = 0.0) -> int:
        """Encode every chunk inside ``wrapper`` (``lazy-rag tune INDEX_DIR``; None: plain chunks)
        and commit it as the index's next generation: the new KV goes to segments in its own
        folder and one transaction points every row at it, so a crash leaves the previous index
        whole. Returns the KV bytes written."""
        if wrapper is not None:
            wrapper.check_model(self.llm.fingerprint, self.llm.model_name)
        vocab_rows = self.llm.host.parts.vocab_rows
        with writer_lock(self.path, wait=wait_lock):
            _remove_debris(self.path)
            run = _BuildRun()
            try:
                run.db = db = IndexDB(self.path)
                current = _check_settings(db.settings(), db)
                if current.get("commit_id") != self.manifest.get("commit_id"):
                    raise LazyIndexError(f"The index at {self.path} was rebuilt since it was loaded; load it again.")
                settings = dict(current)
                settings["wrapper"] = wrapper.describe() if wrapper is not None else None
                settings["wrapper_file"] = wrapper_file(wrapper) if wrapper is not None else None
                settings["generation"] = current["generation"] + 1
                settings["checksums"] = {k: v for k, v in (current.get("checksums") or {}).items()
                                         if k != "wrapper_file"}
                store = run.store = open_store(self.path, settings, vocab_rows, db=db)
                store.begin_build()  # an interrupted re-encode into this folder resumes
                nbytes = 0
                if settings.get("kv_precomputed", True):
                    records = list(self.records)
                    self._check_free_space(self.path, self.llm, store, records, wrapper.slots if wrapper else 0,
                                           new_index=False)
                    with Progress(_tokens(records), "encoding chunk KV", progress_style(progress)) as bar:
                        todo = [r for r in records
                                if store.staged_location(r.id) is None or store.read(r.id, r.token_ids)[0] is None]
                        bar.advance(_tokens(records) - _tokens(todo))
                        nbytes = _encode_records(self.llm, store, todo, wrapper, bar, run.written)
                if wrapper is not None:
                    created = _save_wrapper(self.path, settings, wrapper)
                    if created is not None:
                        run.new_files.append(created)
                staged = store.staged_items()
                store.flush()
                with db.transaction() as cur:
                    # every row's KV is the new folder's record, or none (encoded on first use)
                    cur.execute("UPDATE chunks SET kv_seg = NULL, kv_off = NULL, kv_len = NULL, kv_crc = NULL")
                    cur.executemany("UPDATE chunks SET kv_seg = ?, kv_off = ?, kv_len = ?, kv_crc = ? WHERE id = ?",
                                    [(loc.seg, loc.off, loc.length, loc.crc, cid) for cid, loc in staged])
                    store.commit_build(cur)
                    cur.execute("DELETE FROM segments WHERE folder != ?", (store.folder,))
                    settings.update(commit_id=uuid.uuid4().hex, updated=_now())
                    IndexDB.put_settings(cur, settings, current)
                run.committed = True
                store.end_build(committed=True)
                self._collect_garbage(self.path, settings, store, db)
            except BaseException:
                run.fail()
                new_dir = self.path / kv_subdir(wrapper)
                if not run.committed and new_dir != self.store.kv_dir and new_dir.is_dir() and \
                        not any(new_dir.iterdir()):
                    new_dir.rmdir()  # (one holding checkpointed KV stays: a new attempt resumes from it)
                raise
            finally:
                run.close()
        # from now on this index reads the new generation
        old_db, old_store = self.db, self.store
        self.db, self.manifest = open_index_db(self.path)
        self.records = ChunkTable(self.db, self.manifest["num_chunks"])
        self.by_id = self.records.by_id
        self.wrapper = wrapper
        self.store = open_store(self.path, self.manifest, vocab_rows, db=self.db)
        self.store.write_guard = _guard_of(self)
        old_store.close()
        if old_db is not None:
            old_db.close()
        return nbytes

    # -- loading ------------------------------------------------------------------------------
    @staticmethod
    def _read_wrapper(path: Path, manifest: dict) -> ChunkWrapper:
        """The index's chunk wrapper, checked against the settings' checksum and digest."""
        _read_checked(path, manifest, "wrapper_file")
        want = manifest["wrapper"]
        try:
            wrapper = ChunkWrapper.load(Path(path) / manifest["wrapper_file"], name=want.get("name"))
        except WrapperError as e:
            raise LazyIndexError(f"{e} (the index at {path}; re-encode it with `lazy-rag tune {path}` or index "
                                 "into a new folder)") from e
        if wrapper.digest != want["digest"]:
            raise LazyIndexError(f"{Path(path) / manifest['wrapper_file']} holds wrapper {wrapper.digest}, the "
                                 f"index names {want['digest']}: the index is damaged; rebuild it.")
        wrapper.check_model(manifest["model"]["fingerprint"], manifest["model"].get("name"))
        return wrapper

    @staticmethod
    def _read_vectors(path: Path, manifest: dict, num_chunks: int | None = None) -> VectorIndex:
        data = _read_checked(path, manifest, "vectors_file")
        f = Path(path) / manifest["vectors_file"]
        fix = f"rebuild it with `lazy-rag index SOURCES --out {path} --repair`"
        try:
            vectors = VectorIndex.from_bytes(data)
        except LazyIndexError as e:
            raise LazyIndexError(f"{f} is damaged ({e}); {fix}.") from e
        if num_chunks is not None and vectors.ntotal != num_chunks:
            raise LazyIndexError(f"{f} holds {vectors.ntotal} vectors for {num_chunks} chunks; {fix}.")
        return vectors

    @classmethod
    def load(cls, path, llm: LazyLLM | None = None, embedder: Embedder | None = None, *,
             device: str = "auto") -> "LazyIndex":
        path = Path(path).expanduser()
        for attempt in range(3):
            db, manifest = open_index_db(path)
            try:
                if llm is None:
                    name = manifest["model"].get("name")
                    if not name:
                        raise LazyIndexError(f"The index at {path} was built from an in-memory model; pass llm=... "
                                             "to load it.")
                    llm = LazyLLM.from_pretrained(name, device=device)
                want, have = manifest["model"]["fingerprint"], llm.fingerprint
                if want["id"] != have["id"]:
                    raise FingerprintMismatchError(
                        f"The index at {path} was built with model fingerprint {want['id']} ({want.get('model_type')}, "
                        f"weights {want['weights']}, tokenizer {want['tokenizer']}, rope {want['rope']}) but the loaded "
                        f"model has {have['id']} ({have.get('model_type')}, weights {have['weights']}, tokenizer "
                        f"{have['tokenizer']}, rope {have['rope']}). Load the index's model "
                        f"({manifest['model'].get('name') or 'the one it was built with'}) or rebuild the index."
                    )
                if manifest["embedder"] is None:  # an index without vectors needs no embedder
                    embedder = None
                elif embedder is None:
                    embedder = Embedder(manifest["embedder"]["name"])
                elif embedder.name != manifest["embedder"]["name"]:
                    raise LazyIndexError(f"The index was embedded with {manifest['embedder']['name']}, not "
                                         f"{embedder.name}.")
                n = db.one("SELECT count(*) FROM chunks")[0]
                if n != manifest["num_chunks"]:
                    raise db.damaged(f"it holds {n} chunk rows, its settings say {manifest['num_chunks']}")
                vectors = None
                if manifest.get("vectors_file"):
                    if attempt < 2 and not (path / manifest["vectors_file"]).exists() \
                            and _latest_commit(path) != manifest["commit_id"]:
                        db.close()  # a build committed (and removed this file) after the snapshot: load that one
                        continue
                    vectors = cls._read_vectors(path, manifest, n)
                return cls(path, llm, embedder, manifest, ChunkTable(db, n), vectors, db=db)
            except BaseException:
                db.close()
                raise
        raise LazyIndexError(f"The index at {path} changed while it was loaded, three times; try again.")

    # -- querying -----------------------------------------------------------------------------
    def retrieve(self, question: str, top_k: int = 4) -> list[Source]:
        if not question or not question.strip():
            raise LazyRagError("The question is empty; ask something.")
        if top_k < 1:
            raise LazyRagError(f"top_k must be at least 1, got {top_k}.")
        if self.vectors is None:
            raise LazyRagError(f"The index at {self.path} was built without vectors (vectors=False), so it cannot "
                               "retrieve; name its chunks instead (index.segments(question, chunk_ids)) or "
                               "rebuild it with vectors.")
        if not len(self.records):
            return []
        vec = np.asarray(self.embedder.encode([question]), dtype=np.float32)
        scores, rows = self.vectors.search(vec, min(top_k, len(self.records)))
        out = []
        for score, rowid in zip(scores[0], rows[0]):
            if rowid < 0:
                continue
            rec = self.records.row(int(rowid))
            if rec is None:
                raise LazyIndexError(f"{self.path / self.manifest['vectors_file']} names chunk row {rowid}, which the "
                                     f"index does not hold: it is damaged; {REPAIR_FIX.format(folder=self.path)}.")
            out.append(Source(rec.id, rec.source, float(score), rec.text))
        return out

    def segments(self, question: str, sources: Sequence[Source] | Sequence[str], system_prompt: str | None = None):
        """Prompt segments for ``question`` over the given chunks (Source objects or chunk ids),
        with the index's system prompt and instruction (a per-query ``system_prompt`` only where
        chunks were not encoded after a shared prefix)."""
        system_prompt, instruction = self.prompt_settings(system_prompt)
        chunks = []
        for s in sources:
            cid = s if isinstance(s, str) else s.chunk_id
            rec = self.by_id.get(cid)
            if rec is None:
                raise LazyRagError(f"Unknown chunk id {cid!r} for the index at {self.path}.")
            chunks.append(Chunk(rec.token_ids, chunk_id=rec.id))
        return build_rag_segments(self.llm.tokenizer, question, chunks, system_prompt, instruction)

    def prompt_settings(self, system_prompt: str | None = None) -> tuple[str | None, str]:
        """(system prompt, instruction) for a query: the index's, or a per-query system prompt
        where chunks were not encoded after a shared prefix (which fixes the prompt's head)."""
        prompt = self.manifest.get("prompt") or {"system_prompt": None, "instruction": DEFAULT_INSTRUCTION}
        if self.manifest.get("shared_prefix") and system_prompt not in (None, prompt["system_prompt"]):
            raise LazyRagError("This index encoded chunks after a fixed system prompt; it cannot be changed "
                               "per query. Rebuild the index with the new system prompt.")
        return (prompt["system_prompt"] if system_prompt is None else system_prompt), prompt["instruction"]

    def query(self, question: str, top_k: int = 4, mode: str = "lazy", max_new_tokens: int = 128,
              temperature: float = 0.0, top_p: float = 1.0, stop=None, stream: bool = False,
              system_prompt: str | None = None, seed: int | None = None, boundary_recompute: int | None = None,
              recovery: Recovery | str | None = None):
        """Retrieve, assemble, generate. Returns a ``QueryResult``; with ``stream=True`` a
        ``(sources, GenerationStream)`` pair whose stream yields text pieces.
        ``recovery`` / ``boundary_recompute`` override the index's default recovery for this query."""
        t0 = time.perf_counter()
        sources = self.retrieve(question, top_k)
        segs = self.segments(question, sources, system_prompt)
        retrieve_ms = (time.perf_counter() - t0) * 1e3
        gen = self.llm.generate(segs, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                                top_p=top_p, stop=stop, stream=stream, seed=seed, source=self.chunk_source,
                                recovery=self.query_recovery(mode, recovery, boundary_recompute))
        if stream:
            return sources, gen
        stats = gen.stats.as_dict()
        stats["retrieve_ms"] = retrieve_ms
        return QueryResult(gen.text, sources, stats)

    def query_recovery(self, mode: str, recovery=None, boundary_recompute: int | None = None) -> Recovery:
        """The recovery of one query: the one it names, else the index's default where the mode
        reuses chunks (full and prefix recompute everything anyway)."""
        if recovery is None and boundary_recompute is None:
            return self.recovery if mode in CHUNK_MODES else Recovery()
        return resolve_recovery(recovery, boundary_recompute)

    def describe(self) -> dict:
        return describe_index(self.path)


# -- inspect and verify ----------------------------------------------------------------------------------

def _live_bytes(db: IndexDB) -> dict[int, int]:
    """Segment -> bytes of the records the chunk table refers to (headers included)."""
    return dict(db.rows(f"SELECT kv_seg, sum(kv_len) + {RECORD_HEADER.size} * count(*) FROM chunks "
                        "WHERE kv_seg IS NOT NULL GROUP BY kv_seg"))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def describe_index(path) -> dict:
    """Chunks, tokens, KV bytes on disk, segments, vector index and fingerprint of an index folder,
    without loading any model."""
    path = Path(path)
    db, m = open_index_db(path)
    try:
        folder = kv_subdir(m.get("wrapper"))
        segs = db.segments(folder)
        live = _live_bytes(db)
        committed = sum(segs.values())
        live_bytes = sum(min(live.get(s, 0), c) for s, c in segs.items())
        return {
            "path": str(path), "model": m["model"]["name"], "fingerprint": m["model"]["fingerprint"],
            "kv_dtype": m["kv_dtype"], "embedder": (m["embedder"] or {}).get("name"), "chunking": m["chunking"],
            "shared_prefix": bool(m.get("shared_prefix")), "files": db.one("SELECT count(*) FROM files")[0],
            "chunks": m["num_chunks"], "tokens": m["num_tokens"], "wrapper": m.get("wrapper"),
            "chunks_with_kv": db.one("SELECT count(*) FROM chunks WHERE kv_seg IS NOT NULL")[0],
            "kv_bytes": sum(_size(path / folder / segment_name(s)) for s in segs),
            "segments": {"count": len(segs), "live_fraction": round(live_bytes / committed, 4) if committed else None,
                         "dead_bytes": committed - live_bytes},
            "vector_index": m.get("vectors"), "generation": m["generation"], "updated": m.get("updated"),
            "damage": _table_damage(path, m, db),
        }
    finally:
        db.close()


def _table_damage(path: Path, manifest: dict, db: IndexDB) -> str | None:
    """What is wrong with the database's size or the vectors and wrapper files (their checksums;
    no row is read), or None."""
    n = db.one("SELECT count(*) FROM chunks")[0]
    if n != manifest["num_chunks"]:
        return str(db.damaged(f"it holds {n} chunk rows, its settings say {manifest['num_chunks']}"))
    for key in ("vectors_file", "wrapper_file"):
        name = manifest.get(key)
        if not name:
            continue
        fix = REPAIR_FIX.format(folder=path)
        want = (manifest.get("checksums") or {}).get(key)
        try:
            if _file_sha256(path / name) != want:
                return f"{path / name} is damaged (its sha256 differs from the one the index recorded); {fix}."
        except OSError:
            return f"The index at {path} lacks its {name}; {fix}."
    return None


def verify_index(path) -> dict:
    """Check everything of an index without loading a model: SQLite's integrity, the settings, the
    vectors and wrapper files against their checksums, every row against its checksums, the files
    table against the rows, and every chunk's KV record against its checksums, its token ids and
    the model fingerprint. Returns counts and the problems found (``ok`` if none)."""
    path = Path(path)
    try:
        db, m = open_index_db(path)
    except DamagedIndexError as e:
        return {"path": str(path), "ok": False, "problems": [str(e)], "chunks": 0, "kv_ok": 0}
    try:
        return _verify(path, db, m)
    finally:
        db.close()


def _verify(path: Path, db: IndexDB, m: dict) -> dict:
    problems: list[str] = []
    fix = REPAIR_FIX.format(folder=path)
    try:
        check = [r[0] for r in db.rows("PRAGMA integrity_check")]
        if check != ["ok"]:
            problems.append(f"{db.path} fails SQLite's integrity check ({'; '.join(check[:3])}); {fix}")
    except DamagedIndexError as e:
        return {"path": str(path), "ok": False, "problems": [str(e)], "chunks": m["num_chunks"], "kv_ok": 0}
    vector_ids = None
    if m.get("vectors_file"):
        try:
            vector_ids = set(LazyIndex._read_vectors(path, m, m["num_chunks"]).ids().tolist())
        except LazyRagError as e:  # damaged, or faiss missing here
            problems.append(str(e))
    if m.get("wrapper"):
        try:
            LazyIndex._read_wrapper(path, m)
        except LazyRagError as e:
            problems.append(str(e))
    store = open_store(path, m, db=db)
    kv, per_source, rowids, n = Counter(), Counter(), set(), 0
    try:
        for row in db.iterate(f"SELECT {_RECORD_COLS}, vector, vector_crc FROM chunks ORDER BY rowid"):
            n += 1
            try:
                rec = _record(db, row[:8])
            except DamagedIndexError as e:
                problems.append(str(e))
                continue
            vec, vcrc = row[8], row[9]
            if m["embedder"] is not None and (vec is None or zlib.crc32(vec) != vcrc
                                              or len(vec) != 4 * m["embedder"]["dim"]):
                problems.append(str(db.damaged(f"the vector of chunk {rec.id!r} does not match its checksum")))
            rowids.add(rec.rowid)
            per_source[rec.source] += 1
            _, why = store.read(rec.id, rec.token_ids)
            if why is None:
                kv["ok"] += 1
            elif why == "missing" and not store.precomputed:
                kv["deferred"] += 1  # encoded on first retrieval
            else:
                kv[why] += 1
                problems.append(f"KV of chunk {rec.id} ({rec.source}): {why}")
    except DamagedIndexError as e:
        problems.append(str(e))
    finally:
        store.close()
    if n != m["num_chunks"]:
        problems.append(str(db.damaged(f"it holds {n} chunk rows, its settings say {m['num_chunks']}")))
    if vector_ids is not None and vector_ids != rowids:
        problems.append(f"{path / m['vectors_file']} holds vectors of {len(vector_ids - rowids)} rows the table lacks "
                        f"and lacks {len(rowids - vector_ids)} of its rows; {fix}")
    files = db.rows("SELECT source, chunk_ids FROM files")
    for source, ids in files:
        if per_source.pop(source, 0) != len(json.loads(ids)):
            problems.append(str(db.damaged(f"file {source} lists chunks the table does not hold")))
    if per_source:
        problems.append(str(db.damaged(f"{len(per_source)} source(s) of chunk rows have no file entry")))
    folder = kv_subdir(m.get("wrapper"))
    segs = db.segments(folder)
    # cut short or gone: each chunk still in one is reported above; one that no chunk uses any
    # more (they were recomputed elsewhere) is dead space the next build's compaction removes
    short = [s for s, committed in segs.items() if _size(path / folder / segment_name(s)) < committed]
    live = _live_bytes(db)
    known = set(db.segments())
    stray = []
    for kv_folder in path.glob("kv*"):
        if kv_folder.is_dir():
            stray += [p for p in kv_folder.iterdir() if p.suffix == ".safetensors" or kv_folder.name != folder
                      or (SEGMENT_RE.fullmatch(p.name) and int(SEGMENT_RE.fullmatch(p.name).group(1)) not in known)]
    debris = [p.name for p in path.glob(".*.tmp")] + [p.name for d in path.glob("kv*") if d.is_dir()
                                                      for p in d.glob(".*.tmp")]
    return {"path": str(path), "ok": not problems, "chunks": n, "kv_ok": kv.pop("ok", 0),
            "kv_deferred": kv.pop("deferred", 0), "kv_damaged": dict(kv), "segments": len(segs),
            "short_segments": len(short),
            "dead_bytes": sum(segs.values()) - sum(min(live.get(s, 0), c) for s, c in segs.items()),
            "stray_kv_files": len(stray), "temp_files": len(debris), "problems": problems}
