"""``LazyIndex``: chunks, their FAISS vectors and their position-free KV, built once, queried often.

Layout of an index folder::

    manifest.json           the commit point: format, fingerprints, settings, files, generation
    chunks-<gen>.jsonl      one record per chunk: id, source, ordinal, text, token ids
    vectors-<gen>.faiss     inner-product index over normalised embeddings, row i = chunk i
    kv/<chunk_id>.safetensors   the chunk's KV (see store.py); kv-w<digest>/ with a chunk wrapper
    wrapper-<digest>.safetensors  the chunk wrapper every chunk was encoded inside, if any

A build writes KV files and the new generation's chunk table and vectors first, and the manifest
last (atomically), so an interrupted build leaves the previous index intact, or no index at all.
One writer at a time per folder (``index_lock``). The manifest records the sha256 of the chunk
table and the vectors, checked on every load (a damaged one is an error naming the file and the
fix, ``lazy-rag index --repair``); every KV file carries its own checksums (store.py);
``verify_index`` checks everything. Nothing on the load path unpickles: JSON, faiss's own
format and safetensors only.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .version import __version__
from .chat import DEFAULT_INSTRUCTION, build_rag_segments, rag_prefix
from .build_pipeline import encode_and_write
from .chunking import TokenChunker, discover_files, read_text
from .deps import require
from .embedder import DEFAULT_EMBEDDER, Embedder
from .errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from .index_lock import try_writer_lock, writer_lock
from .llm import LazyLLM
from .progress import Progress
from .requests import CHUNK_MODES, ChunkSource, Recovery, resolve_recovery
from .segments import Chunk, tokenize_text
from .store import ChunkStore, _DTYPES
from .wrapper import ChunkWrapper, WrapperError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MANIFEST_KEYS = ("model", "kv_dtype", "files", "generation", "chunks_file", "num_chunks", "embedder")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


def store_fingerprint(manifest: dict) -> str:
    """What an index's KV files are tied to: the model's fingerprint, and the wrapper's digest."""
    fp = manifest["model"]["fingerprint"]["id"]
    w = manifest.get("wrapper")
    return f"{fp}-w{w['digest']}" if w else fp


def kv_subdir(wrapper: "ChunkWrapper | dict | None") -> str:
    """The KV folder of an index whose chunks are encoded inside ``wrapper`` (a new wrapper gets a
    new folder, so re-encoding every chunk commits atomically with the manifest)."""
    if wrapper is None:
        return "kv"
    return f"kv-w{wrapper['digest'] if isinstance(wrapper, dict) else wrapper.digest}"


def wrapper_file(wrapper: ChunkWrapper) -> str:
    return f"wrapper-{wrapper.digest}.safetensors"


def open_store(path: Path, manifest: dict, vocab_rows: int | None = None) -> ChunkStore:
    prefix = manifest["shared_prefix"]["token_ids"] if manifest.get("shared_prefix") else ()
    return ChunkStore(path, store_fingerprint(manifest), prefix, _DTYPES.get(manifest["kv_dtype"]),
                      precomputed=manifest.get("kv_precomputed", True), kv_subdir=kv_subdir(manifest.get("wrapper")),
                      vocab_rows=vocab_rows)


def _encode_records(llm, store: ChunkStore, records, wrapper, bar, written: list, stats: dict | None = None) -> int:
    """Encode the KV of ``records`` inside ``wrapper`` into ``store`` (build_pipeline: many chunks
    per forward, written by a background thread), advancing ``bar`` by tokens and listing each
    file in ``written``; returns the bytes written. ``stats`` receives the stage times."""
    result = encode_and_write(llm, store, records, wrapper, bar, written)
    if stats is not None:
        stats.update(result.as_dict())
    return result.kv_bytes


def _save_wrapper(out: Path, manifest: dict, wrapper: ChunkWrapper) -> Path:
    """Write the index's wrapper file (named in the manifest) and record its checksum there.

    A file already holding this wrapper (same digest) is kept as it is: safetensors writes its
    metadata in no fixed order, so rewriting it would change the bytes under the checksum of the
    committed manifest, and the previous generation (after a failed update, or for a reader
    loading it meanwhile) would look damaged."""
    path = out / manifest["wrapper_file"]
    try:
        present = ChunkWrapper.load(path).digest == wrapper.digest
    except WrapperError:  # absent or damaged: write it
        present = False
    if not present:
        wrapper.save(path)
    manifest["checksums"]["wrapper_file"] = _sha256(path.read_bytes())
    return path


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
    chunks_total: int = 0
    tokens_total: int = 0
    kv_bytes_written: int = 0
    seconds: float = 0.0
    stages: dict = field(default_factory=dict)  # the KV pipeline's stage times (build_pipeline.PipelineStats)


class LazyIndex:
    def __init__(self, path: Path, llm: LazyLLM, embedder: Embedder, manifest: dict, records: list[ChunkRecord],
                 vectors, wrapper: ChunkWrapper | None = None):
        self.path = Path(path)
        self.llm = llm
        self.embedder = embedder
        self.manifest = manifest
        self.records = records
        self.by_id = {r.id: r for r in records}
        self.vectors = vectors  # a faiss index
        if wrapper is None and manifest.get("wrapper"):
            wrapper = self._read_wrapper(self.path, manifest)
        self.wrapper = wrapper  # every chunk's KV was encoded inside it (None: plain chunks)
        self.store = open_store(self.path, manifest, llm.host.parts.vocab_rows)
        self.store.write_guard = self._write_guard  # a query writes KV only under the writer lock

    @contextmanager
    def _write_guard(self):
        """For a query's KV write-back: the writer lock if free now, and only while the folder still
        holds the generation this index loaded (a newer build may have dropped the chunk). Yields
        None when writing is safe, else why not."""
        with try_writer_lock(self.path) as refused:
            if refused:
                yield refused
                return
            try:
                current = json.loads((self.path / "manifest.json").read_text()).get("generation")
            except (OSError, ValueError):
                current = None
            yield None if current == self.manifest.get("generation") else "the index was rebuilt since it was loaded"

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
        the prefix its chunks were encoded after, and the store holding their KV files."""
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

        Mitigations for checkpoints not fine-tuned for independent chunks (stored in the manifest):
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
        sources without reading the old ones (after damage), reusing every KV file whose stored
        token ids match; files the index holds from sources not named here are read again at their
        recorded paths, and one that cannot be read stops the repair (naming it) unless
        ``drop_missing``. ``drop_missing=True`` drops the chunks of indexed files that are gone,
        wherever they were indexed from (by default an update drops only files gone from the
        sources it names). ``wait_lock``: seconds to wait for another writer of ``out``.
        ``wrapper``: the chunk wrapper every chunk is encoded inside (a bundled name, a file from
        `lazy-rag tune`, or "none"); "auto" keeps an existing index's and otherwise takes the model's
        bundled wrapper, if it has one."""
        files, skipped = discover_files(sources)
        docs, report, stamps = [], BuildReport(skipped=skipped), {}
        for f in files:
            name = os.fsencode(f)
            if not _is_utf8(name):  # a chunk table, a manifest and a terminal hold text: the path must be text
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
        written: list[Path] = []
        with writer_lock(out, wait=wait_lock):
            _remove_debris(out)
            try:
                return cls._build_locked(docs, out, llm, embedder, written=written, **kwargs)
            except OSError as e:
                committed = (out / "manifest.json").exists()
                live = cls._live_kv_paths(out) if committed else set()
                tables = list(out.glob("chunks-*.jsonl")) + list(out.glob("vectors-*.faiss"))
                if committed:
                    try:
                        m = cls._read_manifest(out)
                        current = {m["chunks_file"], m.get("vectors_file")}
                    except LazyRagError:  # not ours to judge: leave every table where it is
                        current = {p.name for p in tables}
                else:
                    current = set()
                # what this run wrote that no committed index refers to: KV files, a new table
                for p in written + tables:
                    if p not in live and p.name not in current:
                        p.unlink(missing_ok=True)
                _remove_debris(out)
                why = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                       errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exceeded"}.get(
                    e.errno, e.strerror or type(e).__name__)
                state = "the previous index is unchanged" if committed else "no index was written"
                raise LazyIndexError(f"Writing the index at {out} failed: {why} ({e.filename or out}); {state} and "
                                     "this run's partial files were removed. Free space or choose another --out, "
                                     "then run `lazy-rag index` again.") from e

    @staticmethod
    def _reread_other_roots(old: dict, given: set[str], roots: list[str], report: BuildReport, unreadable: set,
                            drop_missing: bool) -> list:
        """For --repair (which cannot trust the old chunk table): the documents of the files the
        index holds from sources not named on this command line, read again at their recorded
        paths, so that the repair keeps them. One still there but no longer text is dropped, as by
        any re-index (added to ``unreadable``); one that cannot be read at all (moved, deleted, an
        unmounted disk) stops the repair before anything is written, naming it, unless
        ``drop_missing``: its chunks could only be rebuilt from the file."""
        docs, missing = [], []
        for source in old["files"]:
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

    @staticmethod
    def _live_kv_paths(out: Path) -> set[Path]:
        try:
            manifest = LazyIndex._read_manifest(out)
            records = LazyIndex._read_records(out, manifest)
        except LazyRagError:
            return set()
        store = open_store(out, manifest)
        return {store.path(r.id) for r in records} | ({out / manifest["wrapper_file"]} if manifest.get("wrapper_file")
                                                       else set())

    @classmethod
    def _build_locked(cls, docs, out: Path, llm, embedder, *, written: list, model="smollm2", chunk_size=256,
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
        if vectors:
            embedder = embedder or Embedder(DEFAULT_EMBEDDER)
        chunker = TokenChunker(llm.tokenizer, chunk_size, chunk_overlap) if split else None
        kv_dt = llm.dtype if kv_dtype == "auto" else _DTYPES[kv_dtype]
        prefix = None
        if shared_prefix:
            text = rag_prefix(llm.tokenizer, system_prompt, instruction)
            prefix = {"text": text, "token_ids": tokenize_text(llm.tokenizer, text, first=True)}
        settings = {"chunk_size": chunk_size, "chunk_overlap": chunk_overlap, "split": split,
                    "splitter": "llama_index.SentenceSplitter"}
        old = cls._read_manifest(out) if (out / "manifest.json").exists() else None
        if isinstance(wrapper, str) and wrapper.lower() == "auto" and old is not None:
            wrapper = cls._read_wrapper(out, old) if old.get("wrapper") else None  # the index's choice stands
        else:
            wrapper = llm.host.resolve_wrapper(wrapper)
        manifest = {
            "format_version": FORMAT_VERSION, "lazy_rag_version": __version__,
            "model": {"name": model_name, "fingerprint": llm.fingerprint, "dtype": str(llm.dtype).removeprefix("torch.")},
            "kv_dtype": str(kv_dt).removeprefix("torch."),
            # None: an index without vectors (retrieval happens elsewhere; chunks are named by id)
            "embedder": {"name": embedder.name, "dim": embedder.dim} if vectors else None,
            "chunking": settings, "shared_prefix": prefix, "files": {}, "generation": 0,
            "kv_precomputed": bool(precompute_kv),
            "query_defaults": {"recovery": resolve_recovery(recovery, boundary_recompute).name()},
            "prompt": {"system_prompt": system_prompt, "instruction": instruction},
            "wrapper": wrapper.describe() if wrapper is not None else None,
            "wrapper_file": wrapper_file(wrapper) if wrapper is not None else None,
        }
        old_records: dict[str, ChunkRecord] = {}
        old_vectors = None
        if old is not None:
            cls._check_compatible(old, manifest, out)
            manifest["generation"] = old["generation"] + 1
            if not repair:  # --repair: the old table and vectors are not read (they may be damaged)
                recs = cls._read_records(out, old)
                old_vectors = cls._read_vectors(out, old, len(recs)) if old.get("vectors_file") else None
                old_records = {r.id: (r, i) for i, r in enumerate(recs)}
        if repair and old is not None and roots is not None:
            unreadable = set(unreadable)
            docs = list(docs) + cls._reread_other_roots(old, {d[0] for d in docs}, roots, report, unreadable,
                                                        drop_missing)
        # Decide per document: keep (unchanged), re-chunk (new or changed), drop (vanished).
        keep_ids, new_records = [], []
        seen_sources = set()
        for source, text, meta in docs:
            seen_sources.add(source)
            digest = hashlib.sha256(text.encode()).hexdigest()
            prev = old["files"].get(source) if old else None
            if prev and prev["sha256"] == digest and all(c in old_records for c in prev["chunk_ids"]):
                keep_ids.extend(prev["chunk_ids"])
                manifest["files"][source] = prev
                report.files_unchanged += 1
                continue
            parts = chunker.split(text) if split else [(text, llm.tokenizer(text, add_special_tokens=False).input_ids)]
            recs = [ChunkRecord(_chunk_id(source, i, t) if split else source, source, i, t, ids, dict(meta))
                    for i, (t, ids) in enumerate(parts)]
            new_records.extend(recs)
            manifest["files"][source] = {"sha256": digest, "chunk_ids": [r.id for r in recs],
                                         "tokens": sum(len(r.token_ids) for r in recs)}
            report.files_indexed += 1
        if old:
            for source, entry in old["files"].items():
                if source in seen_sources:
                    continue
                if source in unreadable:  # emptied or replaced by bytes that are not text: its chunks go
                    report.files_removed += 1
                    log.warning("%s can no longer be read as text; its chunks were removed from the index.", source)
                    continue
                if repair:  # gone from a folder named again, or (--drop-missing) from anywhere
                    report.files_removed += 1
                    log.warning("--repair: %s cannot be read; its chunks were dropped.", source)
                    continue
                is_file = roots is not None and Path(source).is_absolute()  # not a from_texts id
                if is_file and (drop_missing or _under_roots(source, roots)) and not Path(source).exists():
                    report.files_removed += 1  # vanished from a folder we were asked to index again
                    continue
                keep_ids.extend(entry["chunk_ids"])
                manifest["files"][source] = entry
        index = cls(out, llm, embedder, manifest, [], None, wrapper)
        store = index.store
        store.write_guard = None  # this build holds the writer lock itself
        if precompute_kv and new_records:
            cls._check_free_space(out, llm, store, new_records, wrapper.slots if wrapper else 0)
        # Embed and encode only what is new.
        style = progress_style(progress)
        vecs_new = None
        if new_records and vectors:
            with Progress(len(new_records), "embedding chunks", style) as bar:
                parts = []
                for s in range(0, len(new_records), 64):
                    parts.append(embedder.encode([r.text for r in new_records[s:s + 64]]))
                    bar.advance(len(parts[-1]))
            vecs_new = np.concatenate(parts)
        if new_records and precompute_kv:
            with Progress(sum(len(r.token_ids) for r in new_records), "encoding chunk KV", style) as bar:
                # chunks whose KV an interrupted build already wrote are kept as they are
                todo = [r for r in new_records if store.read(r.id, r.token_ids)[0] is None]
                bar.advance(sum(len(r.token_ids) for r in new_records) - sum(len(r.token_ids) for r in todo))
                report.kv_bytes_written += _encode_records(llm, store, todo, wrapper, bar, written, report.stages)
        records = [old_records[c][0] for c in keep_ids] + new_records
        vindex = None
        if vectors:
            faiss = _faiss()
            vindex = faiss.IndexFlatIP(embedder.dim)
            if keep_ids:
                rows = np.array([old_records[c][1] for c in keep_ids], dtype=np.int64)
                vindex.add(np.stack([old_vectors.reconstruct(int(i)) for i in rows]).astype(np.float32))
            if new_records:
                vindex.add(vecs_new)
        gen = manifest["generation"]
        manifest["chunks_file"] = f"chunks-{gen}.jsonl"
        manifest["vectors_file"] = f"vectors-{gen}.faiss" if vectors else None
        manifest["num_chunks"] = len(records)
        manifest["num_tokens"] = sum(len(r.token_ids) for r in records)
        manifest["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        table = "".join(json.dumps(r.__dict__, ensure_ascii=False) + "\n" for r in records).encode()
        _atomic_write_bytes(out / manifest["chunks_file"], table)
        manifest["checksums"] = {"chunks_file": _sha256(table)}
        if wrapper is not None:
            written.append(_save_wrapper(out, manifest, wrapper))
        if vectors:
            data = faiss.serialize_index(vindex).tobytes()
            _atomic_write_bytes(out / manifest["vectors_file"], data)
            manifest["checksums"]["vectors_file"] = _sha256(data)
        _atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False).encode())
        cls._collect_garbage(out, manifest, {ChunkStore.file_name(r.id) for r in records})
        index.manifest, index.records, index.vectors = manifest, records, vindex
        store.write_guard = index._write_guard
        index.by_id = {r.id: r for r in records}
        report.chunks_added = len(new_records)
        report.chunks_total = len(records)
        report.tokens_total = manifest["num_tokens"]
        report.seconds = time.perf_counter() - t0
        return index, report

    @staticmethod
    def _check_free_space(out: Path, llm, store: ChunkStore, records, slots: int = 0) -> None:
        """Refuse a build whose KV cannot fit on the disk, before writing any, with the numbers
        (``slots``: a chunk wrapper's, stored with every chunk)."""
        item = (store.kv_dtype or llm.dtype).itemsize
        per_token = llm.shape.kv_bytes_per_token * item
        need = sum(len(r.token_ids) + slots for r in records) * per_token
        free = shutil.disk_usage(out).free
        if need > free * 0.95:
            raise LazyIndexError(
                f"The KV of {len(records)} new chunks ({sum(len(r.token_ids) for r in records):,} tokens x "
                f"{per_token:,} bytes) needs {need / 2**30:.2f} GiB, but {out} has {free / 2**30:.2f} GiB free. "
                "Store KV in bfloat16 (--kv-dtype bfloat16), index fewer files, defer KV to first use "
                "(--no-precompute), use a smaller model, or choose another --out.")

    @staticmethod
    def _collect_garbage(out: Path, manifest: dict, live_names: set[str]) -> None:
        """Remove older generations' tables, wrappers, KV folders and KV files no chunk refers to
        (after the commit)."""
        for p in list(out.glob("chunks-*.jsonl")) + list(out.glob("vectors-*.faiss")) + \
                list(out.glob("wrapper-*.safetensors")):
            if p.name not in (manifest["chunks_file"], manifest.get("vectors_file"), manifest.get("wrapper_file")):
                p.unlink(missing_ok=True)
        kv_dir = out / kv_subdir(manifest.get("wrapper"))
        for other in out.glob("kv*"):
            if other.is_dir() and other != kv_dir:  # KV encoded inside another (or no) wrapper
                shutil.rmtree(other, ignore_errors=True)
        if kv_dir.exists():
            for p in kv_dir.iterdir():
                if p.suffix == ".safetensors" and p.name not in live_names:
                    p.unlink(missing_ok=True)

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
        and commit it as the index's next generation: the new KV goes to its own folder and the
        manifest switches to it atomically, so a crash leaves the previous index whole. Returns
        the KV bytes written."""
        if wrapper is not None:
            wrapper.check_model(self.llm.fingerprint, self.llm.model_name)
        with writer_lock(self.path, wait=wait_lock):
            _remove_debris(self.path)
            current = self._read_manifest(self.path)
            if current.get("generation") != self.manifest.get("generation"):
                raise LazyIndexError(f"The index at {self.path} was rebuilt since it was loaded; load it again.")
            manifest = dict(current)
            manifest["wrapper"] = wrapper.describe() if wrapper is not None else None
            manifest["wrapper_file"] = wrapper_file(wrapper) if wrapper is not None else None
            manifest["generation"] = current["generation"] + 1
            store = open_store(self.path, manifest, self.llm.host.parts.vocab_rows)
            nbytes = 0
            try:
                if manifest.get("kv_precomputed", True):
                    self._check_free_space(self.path, self.llm, store, self.records, wrapper.slots if wrapper else 0)
                    with Progress(sum(len(r.token_ids) for r in self.records), "encoding chunk KV",
                                  progress_style(progress)) as bar:
                        # a failure removes the whole new KV folder below, not file by file
                        nbytes = _encode_records(self.llm, store, self.records, wrapper, bar, [])
                manifest["checksums"] = {k: v for k, v in (current.get("checksums") or {}).items()
                                         if k != "wrapper_file"}
                if wrapper is not None:
                    _save_wrapper(self.path, manifest, wrapper)
                manifest["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
                _atomic_write_bytes(self.path / "manifest.json",
                                    json.dumps(manifest, indent=2, ensure_ascii=False).encode())
            except BaseException:
                if store.kv_dir != self.store.kv_dir:  # only this run's own new folder goes
                    shutil.rmtree(store.kv_dir, ignore_errors=True)
                raise
            self._collect_garbage(self.path, manifest, {ChunkStore.file_name(r.id) for r in self.records})
        self.manifest, self.wrapper = manifest, wrapper
        self.store = store
        store.write_guard = self._write_guard
        return nbytes

    # -- loading ------------------------------------------------------------------------------
    @staticmethod
    def _read_manifest(path: Path) -> dict:
        mf = Path(path) / "manifest.json"
        if not mf.exists():
            hint = " (if a build was interrupted, run `lazy-rag index` again)" if Path(path).exists() else ""
            raise LazyIndexError(f"{path} is not a lazy-rag index: no manifest.json{hint}.")
        try:
            manifest = json.loads(mf.read_bytes().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise LazyIndexError(f"{mf} is damaged (not valid UTF-8 JSON: {e}); rebuild the index "
                                 "(`lazy-rag index SOURCES --out DIR --repair`).") from e
        except OSError as e:
            raise LazyIndexError(f"Cannot read {mf} ({e.strerror}).") from e
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version") if isinstance(manifest, dict) else None
            raise LazyIndexError(f"{path} has index format {version}, this lazy-rag reads "
                                 f"{FORMAT_VERSION}; rebuild the index.")
        missing = [k for k in MANIFEST_KEYS if k not in manifest]
        fingerprint = manifest.get("model")
        if not missing and not (isinstance(fingerprint, dict) and isinstance(fingerprint.get("fingerprint"), dict)
                                and "id" in fingerprint["fingerprint"]):
            missing = ["model.fingerprint"]
        if missing:
            raise LazyIndexError(f"{mf} is damaged: it lacks {', '.join(missing)}; rebuild the index "
                                 "(`lazy-rag index SOURCES --out DIR --repair`).")
        return manifest

    @staticmethod
    def _read_checked(path: Path, manifest: dict, key: str) -> bytes:
        """The bytes of the file the manifest names under ``key``, checked against its sha256."""
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
            raise LazyIndexError(f"{f} is damaged (its sha256 differs from the manifest's); {fix}.")
        return data

    @staticmethod
    def _read_wrapper(path: Path, manifest: dict) -> ChunkWrapper:
        """The index's chunk wrapper, checked against the manifest's checksum and digest."""
        LazyIndex._read_checked(path, manifest, "wrapper_file")
        want = manifest["wrapper"]
        try:
            wrapper = ChunkWrapper.load(Path(path) / manifest["wrapper_file"], name=want.get("name"))
        except WrapperError as e:
            raise LazyIndexError(f"{e} (the index at {path}; re-encode it with `lazy-rag tune {path}` or index "
                                 "into a new folder)") from e
        if wrapper.digest != want["digest"]:
            raise LazyIndexError(f"{Path(path) / manifest['wrapper_file']} holds wrapper {wrapper.digest}, the "
                                 f"manifest names {want['digest']}: the index is damaged; rebuild it.")
        wrapper.check_model(manifest["model"]["fingerprint"], manifest["model"].get("name"))
        return wrapper

    @staticmethod
    def _read_records(path: Path, manifest: dict) -> list[ChunkRecord]:
        data = LazyIndex._read_checked(path, manifest, "chunks_file")
        fix = f"rebuild it with `lazy-rag index SOURCES --out {path} --repair`"
        try:
            records = [ChunkRecord(**json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip()]
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} is damaged ({e}); {fix}.") from e
        if len(records) != manifest["num_chunks"]:
            raise LazyIndexError(f"{Path(path) / manifest['chunks_file']} holds {len(records)} chunks, the manifest "
                                 f"{manifest['num_chunks']}: it is damaged; {fix}.")
        return records

    @staticmethod
    def _read_vectors(path: Path, manifest: dict, num_chunks: int | None = None):
        data = LazyIndex._read_checked(path, manifest, "vectors_file")
        try:
            vectors = _faiss().deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as e:
            raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} is damaged (faiss cannot read it); rebuild "
                                 f"it with `lazy-rag index SOURCES --out {path} --repair`.") from e
        if num_chunks is not None and vectors.ntotal != num_chunks:
            raise LazyIndexError(f"{Path(path) / manifest['vectors_file']} holds {vectors.ntotal} vectors for "
                                 f"{num_chunks} chunks; rebuild it with `lazy-rag index SOURCES --out {path} --repair`.")
        return vectors

    @classmethod
    def load(cls, path, llm: LazyLLM | None = None, embedder: Embedder | None = None, *,
             device: str = "auto") -> "LazyIndex":
        path = Path(path).expanduser()
        manifest = cls._read_manifest(path)
        if llm is None:
            name = manifest["model"].get("name")
            if not name:
                raise LazyIndexError(f"The index at {path} was built from an in-memory model; pass llm=... to load it.")
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
            raise LazyIndexError(f"The index was embedded with {manifest['embedder']['name']}, not {embedder.name}.")
        records = cls._read_records(path, manifest)
        vectors = cls._read_vectors(path, manifest, len(records)) if manifest.get("vectors_file") else None
        return cls(path, llm, embedder, manifest, records, vectors)

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
        vec = self.embedder.encode([question])
        scores, rows = self.vectors.search(vec, min(top_k, len(self.records)))
        return [Source(self.records[r].id, self.records[r].source, float(s), self.records[r].text)
                for s, r in zip(scores[0], rows[0]) if r >= 0]

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


def describe_index(path) -> dict:
    """Chunks, tokens, KV bytes and fingerprint of an index folder, without loading any model."""
    path = Path(path)
    m = LazyIndex._read_manifest(path)
    kv_dir = path / kv_subdir(m.get("wrapper"))
    kv_files = list(kv_dir.glob("*.safetensors")) if kv_dir.exists() else []
    return {
        "path": str(path), "model": m["model"]["name"], "fingerprint": m["model"]["fingerprint"],
        "kv_dtype": m["kv_dtype"], "embedder": (m["embedder"] or {}).get("name"), "chunking": m["chunking"],
        "shared_prefix": bool(m.get("shared_prefix")), "files": len(m["files"]), "chunks": m["num_chunks"],
        "tokens": m["num_tokens"], "wrapper": m.get("wrapper"), "kv_files": len(kv_files), "kv_bytes": sum(p.stat().st_size for p in kv_files),
        "updated": m.get("updated"), "damage": _table_damage(path, m),
    }


def _table_damage(path: Path, manifest: dict) -> str | None:
    """What is wrong with the chunk table or the vectors file (their checksums; cheap), or None."""
    try:
        LazyIndex._read_records(path, manifest)
        if manifest.get("vectors_file"):
            LazyIndex._read_checked(path, manifest, "vectors_file")
    except LazyIndexError as e:
        return str(e)
    return None


def verify_index(path) -> dict:
    """Check every file of an index without loading a model: the manifest, the chunk table and the
    vectors against the manifest's checksums, and every chunk's KV file against its checksums, its
    token ids and the model fingerprint. Returns counts and the problems found (``ok`` if none)."""
    path = Path(path)
    problems: list[str] = []
    m = LazyIndex._read_manifest(path)
    try:
        records = LazyIndex._read_records(path, m)
    except LazyIndexError as e:
        return {"path": str(path), "ok": False, "problems": [str(e)], "chunks": m["num_chunks"], "kv_ok": 0}
    if m.get("vectors_file"):
        try:
            LazyIndex._read_vectors(path, m, len(records))
        except LazyRagError as e:  # damaged, or faiss missing here
            problems.append(str(e))
    if not m.get("checksums"):
        problems.append("the manifest has no checksums (built by an older lazy-rag): the chunk table and vectors "
                        "cannot be verified; re-index once to add them")
    if m.get("wrapper"):
        try:
            LazyIndex._read_wrapper(path, m)
        except LazyRagError as e:
            problems.append(str(e))
    store = open_store(path, m)
    kv = Counter()
    for r in records:
        _, why = store.read(r.id, r.token_ids)
        if why is None:
            kv["ok"] += 1
        elif why == "missing" and not store.precomputed:
            kv["deferred"] += 1  # encoded on first retrieval
        else:
            kv[why] += 1
            problems.append(f"KV of chunk {r.id} ({r.source}): {why}")
    live = {ChunkStore.file_name(r.id) for r in records}
    kv_dir = store.kv_dir
    stray = [p.name for p in kv_dir.glob("*.safetensors") if p.name not in live] if kv_dir.exists() else []
    debris = [p.name for p in path.glob(".*.tmp")] + ([p.name for p in kv_dir.glob(".*.tmp")] if kv_dir.exists() else [])
    return {"path": str(path), "ok": not problems, "chunks": len(records), "kv_ok": kv.pop("ok", 0),
            "kv_deferred": kv.pop("deferred", 0), "kv_damaged": dict(kv), "stray_kv_files": len(stray),
            "temp_files": len(debris), "problems": problems}

