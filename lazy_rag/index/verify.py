"""An index folder inspected without loading a model: ``describe_index`` (sizes, segments,
fingerprints, damage that shows without reading rows) and ``verify_index`` (everything: SQLite's
integrity, the settings, the vectors and wrapper files against their checksums, every row and
every chunk's KV record against theirs)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import LazyRagError
from ..store import REPAIR_FIX, SEGMENT_RE, DamagedIndexError, IndexDB, segment_name
from . import table
from .folder import file_sha256, kv_subdir, open_index_db, open_store, read_vectors, read_wrapper


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
        live = table.live_bytes(db)
        committed = sum(segs.values())
        live_bytes = sum(min(live.get(s, 0), c) for s, c in segs.items())
        return {
            "path": str(path), "model": m["model"]["name"], "fingerprint": m["model"]["fingerprint"],
            "kv_dtype": m["kv_dtype"], "embedder": (m["embedder"] or {}).get("name"), "chunking": m["chunking"],
            "shared_prefix": bool(m.get("shared_prefix")), "files": table.count_files(db),
            "chunks": m["num_chunks"], "tokens": m["num_tokens"], "wrapper": m.get("wrapper"),
            "chunks_with_kv": table.count_rows_with_kv(db),
            "kv_bytes": (kv_bytes := sum(_size(path / folder / segment_name(s)) for s in segs)),
            # (the segments' bytes over the indexed tokens: record headers, dead records and a chunk
            # wrapper's slots, stored with every chunk, included)
            "kv_bytes_per_token": round(kv_bytes / m["num_tokens"], 1) if m["num_tokens"] else None,
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
    n = table.count_rows(db)
    if n != manifest["num_chunks"]:
        return str(db.damaged(f"it holds {n} chunk rows, its settings say {manifest['num_chunks']}"))
    for key in ("vectors_file", "wrapper_file"):
        name = manifest.get(key)
        if not name:
            continue
        fix = REPAIR_FIX.format(folder=path)
        want = (manifest.get("checksums") or {}).get(key)
        try:
            if file_sha256(path / name) != want:
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
        check = table.integrity_check(db)
        if check != ["ok"]:
            problems.append(f"{db.path} fails SQLite's integrity check ({'; '.join(check[:3])}); {fix}")
    except DamagedIndexError as e:
        return {"path": str(path), "ok": False, "problems": [str(e)], "chunks": m["num_chunks"], "kv_ok": 0}
    vector_ids = None
    if m.get("vectors_file"):
        try:
            vector_ids = set(read_vectors(path, m, m["num_chunks"]).ids().tolist())
        except LazyRagError as e:  # damaged, or faiss missing here
            problems.append(str(e))
    if m.get("wrapper"):
        try:
            read_wrapper(path, m)
        except LazyRagError as e:
            problems.append(str(e))
    store = open_store(path, m, db=db)
    kv, per_source, rowids, n = Counter(), Counter(), set(), 0
    try:
        for rec, vec, vcrc in table.rows_with_vectors(db):
            n += 1
            if isinstance(rec, DamagedIndexError):
                problems.append(str(rec))
                continue
            if m["embedder"] is not None and not table.vector_matches(vec, vcrc, m["embedder"]["dim"]):
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
    for source, listed in table.file_chunk_counts(db):
        if per_source.pop(source, 0) != listed:
            problems.append(str(db.damaged(f"file {source} lists chunks the table does not hold")))
    if per_source:
        problems.append(str(db.damaged(f"{len(per_source)} source(s) of chunk rows have no file entry")))
    folder = kv_subdir(m.get("wrapper"))
    segs = db.segments(folder)
    # cut short or gone: each chunk still in one is reported above; one that no chunk uses any
    # more (they were recomputed elsewhere) is dead space the next build's compaction removes
    short = [s for s, committed in segs.items() if _size(path / folder / segment_name(s)) < committed]
    live = table.live_bytes(db)
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
