"""An index folder's files and settings: the database's settings checked on open, the pointer
for tools that read no SQLite, the KV store, chunk wrapper and vector files the settings name
(each checked against its recorded sha256), and what a folder that holds no index holds instead."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import LazyIndexError
from ..kv_record import KV_DTYPES
from ..store import DB_NAME, ChunkStore, DamagedIndexError, IndexDB
from ..tempfiles import atomic_write_bytes
from ..vector_index import VectorIndex
from ..version import __version__
from ..wrapper import ChunkWrapper, WrapperError

FORMAT_VERSION = 2
POINTER = "manifest.json"  # format 2: a pointer for tools; format 1: the index's commit point
SETTINGS_KEYS = ("model", "kv_dtype", "embedder", "chunking", "generation", "commit_id", "num_chunks", "num_tokens")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def remove_debris(out: Path) -> int:
    """Temp files of writers that were killed (only ever called under the writer lock)."""
    n = 0
    for folder in (out, *out.glob("kv*")):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                p.unlink(missing_ok=True)
                n += 1
    return n


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


def check_settings(settings: dict, db: IndexDB) -> dict:
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


def _refuse_lost_database(path: Path) -> None:
    """An index whose database was deleted or emptied of its settings (its pointer or KV segments
    are there): damaged, and ``--repair`` rebuilds it, reusing the KV."""
    lost = f"its database {DB_NAME} is missing" if not (path / DB_NAME).exists() else \
        f"its database {DB_NAME} holds no settings"
    raise DamagedIndexError(
        f"The index at {path} is damaged: {lost}. Rebuild it from the sources with `lazy-rag index SOURCES "
        f"--out {path} --repair` (SOURCES: the files and folders it was built from); the intact KV in its "
        "segments is found and reused, not encoded again.")


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
        if version == FORMAT_VERSION:  # written after a commit only: the database was lost since
            _refuse_lost_database(path)
        raise LazyIndexError(f"{path} is not a loadable lazy-rag index: it has a {POINTER} but {DB_NAME} holds no "
                             "committed build (if a build was interrupted, run `lazy-rag index` again).")
    if not (path / DB_NAME).exists() and any(path.glob("kv*/seg-*.kvseg")):
        _refuse_lost_database(path)
    if (path / DB_NAME).exists():
        raise LazyIndexError(f"{path} is not a lazy-rag index: no committed {DB_NAME} (if a build was "
                             "interrupted, run `lazy-rag index` again).")
    what = "does not exist" if not path.exists() else "holds no lazy-rag index"
    raise LazyIndexError(f"{path} {what}: build one with `lazy-rag index SOURCES --out {path}` "
                         "(or `LazyIndex.build(sources, out)`).")


def open_index_db(path, snapshot: bool = True) -> tuple[IndexDB, dict]:
    """The index database of ``path`` and its checked settings (a snapshot by default); raises a
    ``LazyIndexError`` naming what the folder holds instead."""
    path = Path(path)
    if (path / DB_NAME).exists():
        db = IndexDB(path, snapshot=snapshot)
        try:
            settings = db.settings()
            if "format_version" in settings:
                return db, check_settings(settings, db)
        except BaseException:
            db.close()
            raise
        db.close()
    _refuse_folder(path)


def latest_commit(path: Path):
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


def indexed_setting(path: Path, key: str):
    """The setting ``key`` of the index at ``path`` (None: no readable index there, or no such setting)."""
    try:
        db = IndexDB(path)
    except (LazyIndexError, OSError):
        return None
    try:
        return db.setting(key)
    except (LazyIndexError, OSError):
        return None
    finally:
        db.close()


def indexed_model(path: Path) -> str | None:
    """The model name the index at ``path`` was built with (None: no readable index there, or one
    built from an in-memory model)."""
    model = indexed_setting(path, "model")
    return model.get("name") if isinstance(model, dict) else None


def write_pointer(out: Path, settings: dict) -> None:
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
    atomic_write_bytes(out / POINTER, data)


def read_checked(path: Path, manifest: dict, key: str) -> bytes:
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
    if want is not None and sha256(data) != want:
        raise LazyIndexError(f"{f} is damaged (its sha256 differs from the one the index recorded); {fix}.")
    return data


def read_wrapper(path: Path, manifest: dict) -> ChunkWrapper:
    """The index's chunk wrapper, checked against the settings' checksum and digest."""
    read_checked(path, manifest, "wrapper_file")
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


def save_wrapper(out: Path, manifest: dict, wrapper: ChunkWrapper) -> Path | None:
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
    manifest.setdefault("checksums", {})["wrapper_file"] = sha256(path.read_bytes())
    return None if present else path


def read_vectors(path: Path, manifest: dict, num_chunks: int | None = None) -> VectorIndex:
    data = read_checked(path, manifest, "vectors_file")
    f = Path(path) / manifest["vectors_file"]
    fix = f"rebuild it with `lazy-rag index SOURCES --out {path} --repair`"
    try:
        vectors = VectorIndex.from_bytes(data)
    except LazyIndexError as e:
        raise LazyIndexError(f"{f} is damaged ({e}); {fix}.") from e
    if num_chunks is not None and vectors.ntotal != num_chunks:
        raise LazyIndexError(f"{f} holds {vectors.ntotal} vectors for {num_chunks} chunks; {fix}.")
    return vectors
