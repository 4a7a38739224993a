"""What a build starts from and how it ends: the previous index in its folder (``Previous``:
format 2, a format-1 index to convert, or none), the build's resources and what to undo if it
fails (``BuildRun``), and its commit, one SQLite transaction that makes the new generation
visible at once, after which what it retired is removed (``collect_garbage``)."""
from __future__ import annotations

import datetime as _dt
import logging
import shutil
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from ..errors import LazyIndexError
from ..file_writes import fsync_dir
from ..store import DB_NAME, ChunkStore, DamagedIndexError, IndexDB
from ..tempfiles import atomic_write_bytes  # a module global: tests fail it on purpose
from ..vector_index import VectorIndex
from . import table
from .folder import POINTER, check_settings, sha256, write_pointer
from .format1 import read_format1
from .table import ChunkRecord

log = logging.getLogger("lazy_rag.index")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class Previous:
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
    def open(cls, out: Path, repair: bool) -> "Previous":
        p = cls()
        if (out / DB_NAME).exists():
            try:
                p.db = IndexDB(out)
                settings = p.db.settings()
                if "format_version" in settings:
                    p.settings, p.format = check_settings(settings, p.db), 2
                    n = table.count_rows(p.db)
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
        elif any(out.glob("kv*/seg-*.kvseg")):
            # KV segments without their database (index.sqlite deleted): the segments' records
            # name their chunks and check themselves, so they are found and reused as above
            log.warning("%s has KV segments but no %s: the chunk table is rebuilt from the sources and the KV "
                        "the segments hold is reused.", out, DB_NAME)
            p.salvage = True
        if p.db is None:
            p.db = IndexDB(out, create=True)
        v1 = read_format1(out, repair)
        if v1 is not None:
            p.format = 1
            p.settings, p.v1_records, p.v1_vectors = v1
        return p

    def files(self, repair: bool) -> dict:
        """source -> {"sha256", "tokens", "chunk_ids"} of the files the previous index holds."""
        if self.format == 1:
            return dict(self.settings["files"])
        if self.format != 2:
            return {}
        try:
            return table.files(self.db)
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
                self._counts = table.rows_per_source(self.db)
            else:
                self._counts = Counter(r.source for r in self.v1_records or ())
                self._ids = {r.id for r in self.v1_records or ()}
        if self.format == 1:
            return all(c in self._ids for c in chunk_ids)
        return self._counts.get(source) == len(chunk_ids)


class BuildRun:
    """A build's resources and what to undo if it fails before its commit."""

    def __init__(self):
        self.db: IndexDB | None = None
        self.store: ChunkStore | None = None
        self.had_index = False
        self.committed = False
        self.new_files: list[Path] = []  # files this run created that only its commit refers to
        self.written: list = []          # chunk ids whose KV this run appended

    def fail(self, keep_encoded: bool = False) -> None:
        """Undo this run's appends. ``keep_encoded`` (the user pressed Ctrl-C): first commit the KV
        encoded so far as pending (``ChunkStore.checkpoint``), which the next build of the folder
        reads instead of encoding it again; a checkpoint that fails leaves the last one."""
        if self.committed:
            return
        if self.store is not None:
            if keep_encoded:
                try:
                    self.store.checkpoint()
                except Exception as e:  # noqa: BLE001 - the interrupt is what the user sees
                    log.warning("Could not keep the KV encoded before the interrupt (%s); the next build "
                                "encodes it again.", e)
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


def commit(out: Path, run: BuildRun, prev: Previous, settings: dict, records: list, vecs, new_files: dict,
           drop_sources: set, repair: bool, old_vectors, report) -> VectorIndex | None:
    """The build's commit: one SQLite transaction that deletes the rows of changed and removed
    files, inserts the new rows (their KV where the store has it), compacts sparse segments
    and writes the segments' lengths, the vectors file's name and the settings. The segments
    and the vectors file are durable before it; what it retired is removed after it. Returns the
    new generation's vector index (None without vectors); ``settings`` are the committed ones."""
    store, db = run.store, prev.db
    old = prev.settings
    # where each new row's KV is: staged by this build, or the previous row of the same chunk
    locs = [store.location(r.id) for r in records]
    store.flush()
    gen = settings["generation"]
    with db.transaction() as cur:
        rowids, removed, removed_tokens = table.replace_rows(
            cur, everything=prev.format != 2 or repair, drop_sources=drop_sources, records=records, locs=locs,
            vecs=vecs)
        if prev.format != 2:  # a new index, or a format-1 one converted: nothing committed here before
            removed = []
        table.put_files(cur, new_files)
        report.rows_written = len(removed) + len(records)
        report.kv_records_moved, report.kv_bytes_moved = store.compact(cur)
        store.commit_build(cur)
        table.forget_other_kv_folders(cur, store.folder)
        num_chunks = table.count_rows_in(cur)
        added_tokens = sum(len(r.token_ids) for r in records)
        num_tokens = added_tokens if prev.format != 2 or repair else old["num_tokens"] - removed_tokens + added_tokens
        settings.update(num_chunks=num_chunks, num_tokens=num_tokens, commit_id=uuid.uuid4().hex, updated=_now(),
                        vectors_file=None, vectors=None)
        settings.setdefault("checksums", {}).pop("vectors_file", None)
        if settings["embedder"] is not None:
            dim = settings["embedder"]["dim"]

            def every_vector():  # every row this build wrote is at hand when it wrote them all
                if old_vectors is None:
                    return rowids, (vecs if vecs is not None else np.zeros((0, dim), np.float32))
                return table.every_vector(cur, dim)

            vindex = _vectors_after(old_vectors, removed, rowids, vecs, every_vector)
            data = vindex.to_bytes()
            name = f"vectors-{gen}.faiss"
            atomic_write_bytes(out / name, data)
            run.new_files.append(out / name)
            fsync_dir(out)  # its name durable before the commit that names it
            settings["vectors_file"] = name
            settings["checksums"]["vectors_file"] = sha256(data)
            settings["vectors"] = {"kind": vindex.kind, "ntotal": vindex.ntotal, "bytes": len(data)}
        else:
            vindex = None
        IndexDB.put_settings(cur, settings, old if prev.format == 2 else None)
    run.committed = True
    store.end_build(committed=True)
    collect_garbage(out, settings, store, db)
    try:
        write_pointer(out, settings)
        table.checkpoint_log(db)  # keep the main file current where readers allow
    except Exception as e:  # the commit stands; a tool reading manifest.json sees the previous one
        log.warning("The index at %s is committed, but its %s could not be written (%s).", out, POINTER, e)
    return vindex


def commit_rewrap(db: IndexDB, store: ChunkStore, settings: dict, current: dict) -> None:
    """A re-encode's commit: every row's KV is the new folder's record, or none (encoded on first
    use), and the settings name the new wrapper."""
    staged = store.staged_items()
    store.flush()
    with db.transaction() as cur:
        table.point_kv_at(cur, staged)
        store.commit_build(cur)
        table.forget_other_kv_folders(cur, store.folder)
        settings.update(commit_id=uuid.uuid4().hex, updated=_now())
        IndexDB.put_settings(cur, settings, current)


def collect_garbage(out: Path, settings: dict, store: ChunkStore, db: IndexDB) -> None:
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
