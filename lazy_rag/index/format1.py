"""Format 1 of an index folder, read only to convert it in place: ``manifest.json`` as the commit
point, the chunks in ``chunks-<gen>.jsonl``, the vectors in a faiss file, and one safetensors KV
file per chunk, each copied into the segments of the format-2 store if it is intact."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..chunk_kv import ChunkKV
from ..deps import require
from ..errors import LazyIndexError
from ..kv_record import TENSOR_NAMES, tensor_crc
from ..store import ChunkStore
from .folder import POINTER, read_checked
from .table import ChunkRecord

FORMAT1_KEYS = ("model", "kv_dtype", "files", "generation", "chunks_file", "num_chunks", "embedder")


def faiss():
    # imported on use: the core runtime (and the GPU image) works without faiss installed
    return require("faiss")


def format1_file_name(chunk_id: str) -> str:
    """The KV file of ``chunk_id`` in a format-1 index (one file per chunk): the id itself when it
    is a plain name, else its hash (no id could name a path outside the KV folder)."""
    if re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}", chunk_id):
        return f"{chunk_id}.safetensors"
    return f"id-{hashlib.sha256(chunk_id.encode()).hexdigest()[:40]}.safetensors"


def _read_records(path: Path, manifest: dict) -> list[ChunkRecord]:
    data = read_checked(path, manifest, "chunks_file")
    fix = f"convert it with `lazy-rag index SOURCES --out {path} --repair`"
    try:
        records = [ChunkRecord(**json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip()]
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} is damaged ({e}); {fix}.") from e
    if len(records) != manifest["num_chunks"]:
        raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} holds {len(records)} chunks, the manifest "
                             f"{manifest['num_chunks']}: it is damaged; {fix}.")
    return records


def _read_vectors(path: Path, manifest: dict, n: int) -> np.ndarray:
    """A format-1 vectors file (faiss's own format, row i = chunk i) as a float32 array."""
    data = read_checked(path, manifest, "vectors_file")
    try:
        index = faiss().deserialize_index(np.frombuffer(data, dtype=np.uint8))
        vecs = index.reconstruct_n(0, index.ntotal)  # one call, not one per row
    except RuntimeError as e:
        raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} is damaged (faiss cannot read it); convert it "
                             f"with `lazy-rag index SOURCES --out {path} --repair`.") from e
    if len(vecs) != n:
        raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} holds {len(vecs)} vectors for {n} chunks; "
                             f"convert it with `lazy-rag index SOURCES --out {path} --repair`.")
    return np.ascontiguousarray(vecs, dtype=np.float32)


def read_format1(out: Path, repair: bool) -> tuple[dict, list[ChunkRecord] | None, np.ndarray | None] | None:
    """(settings, records, vectors) of the format-1 index in ``out``, or None if there is none;
    with ``repair``, records and vectors that cannot be read are None (rebuilt from the sources)."""
    mf = out / POINTER
    try:
        m = json.loads(mf.read_bytes().decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # none, or not a format-1 manifest: a fresh build replaces it
    if not isinstance(m, dict) or m.get("format_version") != 1:
        return None
    fp = m.get("model")
    missing = [k for k in FORMAT1_KEYS if k not in m] or \
        ([] if isinstance(fp, dict) and isinstance(fp.get("fingerprint"), dict) else ["model.fingerprint"])
    if missing:
        raise LazyIndexError(f"{mf} (a format-1 index) is damaged: it lacks {', '.join(missing)}; index into a "
                             "new folder.")
    records = vectors = None
    try:
        records = _read_records(out, m)
        if m.get("vectors_file"):
            vectors = _read_vectors(out, m, len(records))
    except LazyIndexError:
        if not repair:
            raise
        records = vectors = None
    return m, records, vectors


def import_kv(store: ChunkStore, kv_dir: Path, token_ids: dict) -> int:
    """Stage the KV of a format-1 index (``kv*/<chunk id>.safetensors``, one file per chunk) as
    records of ``store``'s build, for the chunks named in ``token_ids`` whose file is intact and
    matches their token ids and the store's fingerprint. Returns how many were copied."""
    n = 0
    for cid, ids in token_ids.items():
        path = Path(kv_dir) / format1_file_name(cid)
        if store.staged_location(cid) is not None:  # copied by an interrupted conversion already
            continue
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception:  # truncated or garbled: the chunk is encoded again
            continue
        if meta.get("fingerprint") != store.fingerprint_id or meta.get("tokens") != store.tokens_key(ids) \
                or not {"k", "v"} <= set(tensors) <= set(TENSOR_NAMES) \
                or any(meta.get(f"{name}_crc32") != tensor_crc(t) for name, t in tensors.items()):
            continue
        store.write_record(cid, store.pack(cid, ids, ChunkKV.from_tensors(tensors)))
        n += 1
    return n
