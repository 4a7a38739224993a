"""An index store as a tensor-parallel request carries it to the worker ranks (``tp_engine``).

A ``ChunkStore`` holds an SQLite connection and open segment files, which cannot cross a
process; every rank must nevertheless read the same records (each keeps its KV heads' slice,
``chunk_tiers``). ``StoreRef`` is what crosses: the store's folder and settings and the index
generation rank 0 loaded; a worker opens the same folder once (``open_ref``) and reads it. The
worker's copy never writes: rank 0 writes every rank's heads of a record (``HeadShard.writes``),
so the files on disk are the ones a single process would write.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import LazyRagError


@dataclass(frozen=True)
class StoreRef:
    root: str
    fingerprint_id: str
    shared_prefix_ids: tuple
    kv_dtype: object
    precomputed: bool
    kv_subdir: str
    vocab_rows: "int | None"
    commit: object   # the generation rank 0 reads (None: a store used alone, no snapshot)


def ref_of(store) -> StoreRef:
    """``store`` as a worker can open it; only ``ChunkStore`` (an index's, or one used alone)."""
    from ..store import ChunkStore

    if not isinstance(store, ChunkStore):
        raise LazyRagError(f"tensor_parallel serves chunk KV from an index's store (ChunkStore), not from a "
                           f"{type(store).__name__}; use tensor_parallel=1 with this store.")
    db = store.db
    commit = getattr(db, "_snapshot_commit", None) if db is not None and db.snapshot else None
    return StoreRef(str(store.root), store.fingerprint_id, store.shared_prefix_ids, store.kv_dtype,
                    store.precomputed, store.folder, store.vocab_rows, commit)


def open_ref(ref: StoreRef, opened: dict):
    """The worker's store for ``ref`` (opened once, kept in ``opened``): the same folder at the
    same generation, read only."""
    store = opened.get(ref)
    if store is not None:
        return store
    from ..store import ChunkStore, IndexDB

    db = None
    if ref.commit is not None:   # a loaded index: the generation rank 0 loaded, or an error
        db = IndexDB(ref.root, snapshot=True)
        if db._snapshot_commit != ref.commit:
            raise LazyRagError(f"The index at {ref.root} was rebuilt after rank 0 loaded it, so tensor-parallel "
                               "ranks would read different records; load the index again.")
    store = ChunkStore(ref.root, ref.fingerprint_id, ref.shared_prefix_ids, ref.kv_dtype, precomputed=ref.precomputed,
                       kv_subdir=ref.kv_subdir, vocab_rows=ref.vocab_rows, db=db)
    store.write_guard = _never_writes
    opened[ref] = store
    return store


@contextmanager
def _never_writes():
    # (keep() writes on rank 0 only; this guard makes a worker's write a refusal, not a second writer)
    yield "a tensor-parallel worker rank does not write the store (rank 0 does)"
