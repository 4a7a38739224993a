"""``LazyIndex``: a loaded index (one generation of its folder, read through an SQLite snapshot)
and what a user does with it: load, build or update it, retrieve chunks, assemble a prompt and
query. How a build works is ``build``'s; the tables are ``table``'s."""
from __future__ import annotations

import hashlib
import os
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..chat import DEFAULT_INSTRUCTION
from ..embedder import Embedder
from ..errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from ..index_lock import try_writer_lock
from ..llm import LazyLLM
from ..planning import plan_chunks, plan_retrieval
from ..engine.recovery import Recovery, resolve_recovery
from ..requests import ChunkSource, SamplingParams
from ..store import REPAIR_FIX, IndexDB
from ..wrapper import ChunkWrapper
from . import build as _build
from . import table
from .build import BuildOptions, BuildReport, Built
from .folder import indexed_setting, latest_commit, open_index_db, open_store, read_vectors, read_wrapper
from .table import ChunkTable
from .verify import describe_index


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
            wrapper = read_wrapper(self.path, manifest)
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
            current = latest_commit(self.path)
            yield None if current == self.manifest.get("commit_id") else "the index was rebuilt since it was loaded"

    def close(self) -> None:
        """Release the snapshot (SQLite checkpoints its log past a snapshot only once it closes)."""
        self.store.close()
        if self.db is not None:
            self.db.close()

    @property
    def files(self) -> dict:
        """source -> {"sha256", "tokens", "chunk_ids"} of every file in the loaded generation."""
        return {} if self.db is None else table.files(self.db)

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
    def _opened(cls, out, built: Built) -> "LazyIndex":
        index = cls(Path(out).expanduser(), built.llm, built.embedder, built.settings,
                    ChunkTable(built.db, built.settings["num_chunks"]), built.vectors, built.wrapper, db=built.db)
        index.build_report = built.report  # (from_texts returns the index alone)
        return index

    @classmethod
    def build(cls, sources: Sequence[str | os.PathLike], out: str | os.PathLike, llm: LazyLLM | None = None,
              embedder: Embedder | None = None, options: BuildOptions | None = None,
              **keywords) -> tuple["LazyIndex", BuildReport]:
        """Index files and folders (text, markdown, PDF, HTML, DOCX, CSV, JSON: ``documents.READERS``)
        into ``out``; re-running skips unchanged files. ``options`` (``BuildOptions``; its fields as
        keywords are shorthand) say how.

        Each file skipped is named in ``report.skipped_files`` with why and what to do; a file
        indexed before that is now empty or no longer text loses its chunks. Each file's chunks, KV
        and recorded sha256 are one read of it (``documents.read_text``); one written after that
        read is named in ``report.changed_files``, and the next run re-indexes it. A format-1 index
        in ``out`` is converted in place, every intact KV file copied into the segments."""
        options = BuildOptions.of(options, **keywords)
        encoding = _build.source_encoding(options.encoding, indexed_setting(Path(out).expanduser(), "source_encoding"))
        docs, report, stamps, unreadable = _build.read_sources(sources, encoding)
        roots = [str(Path(s).expanduser().resolve()) for s in sources]
        built = _build.build_docs(docs, out, llm, embedder, options, report=report, roots=roots,
                                  unreadable=unreadable)
        _build.name_changed_files(docs, stamps, built.report, encoding)
        return cls._opened(out, built), built.report

    @classmethod
    def from_texts(cls, texts: Iterable[str], out, llm: LazyLLM | None = None, embedder: Embedder | None = None, *,
                   ids: Sequence[str] | None = None, metadatas: Sequence[dict] | None = None,
                   options: BuildOptions | None = None, **keywords) -> "LazyIndex":
        """Index in-memory documents. ``ids`` name the documents; with ``split=False`` each text
        is one chunk and its chunk id is exactly the given id (for frameworks' node ids).
        ``vectors=False``: no embeddings and no vector index (nor their packages): chunks are then
        named by id (``segments(question, chunk_ids)``), e.g. when retrieval happens elsewhere."""
        options = BuildOptions.of(options, **keywords)
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
        return cls._opened(out, _build.build_docs(docs, out, llm, embedder, options))

    def rewrap(self, wrapper: ChunkWrapper | None, progress=True, wait_lock: float = 0.0) -> int:
        """Encode every chunk inside ``wrapper`` (``lazy-rag tune INDEX_DIR``; None: plain chunks)
        and commit it as the index's next generation (``build.rewrap``); this index then reads it.
        Returns the KV bytes written."""
        nbytes = _build.rewrap(self.path, self.llm, self.manifest, self.records, self.store.kv_dir, wrapper,
                               progress, wait_lock)
        old_db, old_store = self.db, self.store
        self.db, self.manifest = open_index_db(self.path)
        self.records = ChunkTable(self.db, self.manifest["num_chunks"])
        self.by_id = self.records.by_id
        self.wrapper = wrapper
        self.store = open_store(self.path, self.manifest, self.llm.host.parts.vocab_rows, db=self.db)
        self.store.write_guard = _guard_of(self)
        old_store.close()
        if old_db is not None:
            old_db.close()
        return nbytes

    # -- loading ------------------------------------------------------------------------------
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
                n = table.count_rows(db)
                if n != manifest["num_chunks"]:
                    raise db.damaged(f"it holds {n} chunk rows, its settings say {manifest['num_chunks']}")
                vectors = None
                if manifest.get("vectors_file"):
                    if attempt < 2 and not (path / manifest["vectors_file"]).exists() \
                            and latest_commit(path) != manifest["commit_id"]:
                        db.close()  # a build committed (and removed this file) after the snapshot: load that one
                        continue
                    vectors = read_vectors(path, manifest, n)
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
        chunks = [(s if isinstance(s, str) else s.chunk_id, None) for s in sources]
        return plan_chunks(self.llm.tokenizer, question, chunks, index=self, system_prompt=system_prompt).segments

    def prompt_settings(self, system_prompt: str | None = None) -> tuple[str | None, str]:
        """(system prompt, instruction) for a query: the index's, or a per-query system prompt
        where chunks were not encoded after a shared prefix (which fixes the prompt's head)."""
        prompt = self.manifest.get("prompt") or {"system_prompt": None, "instruction": DEFAULT_INSTRUCTION}
        if self.manifest.get("shared_prefix") and system_prompt not in (None, prompt["system_prompt"]):
            raise LazyRagError("This index encoded chunks after a fixed system prompt; it cannot be changed "
                               "per query. Rebuild the index with the new system prompt.")
        return (prompt["system_prompt"] if system_prompt is None else system_prompt), prompt["instruction"]

    def query(self, question: str, top_k: int = 4, mode: str = "lazy", max_new_tokens: int | None = None,
              temperature: float | None = None, top_p: float | None = None, stop=None, stream: bool = False,
              system_prompt: str | None = None, seed: int | None = None, boundary_recompute: int | None = None,
              recovery: Recovery | str | None = None, sampling: SamplingParams | None = None):
        """Retrieve, assemble, generate. Returns a ``QueryResult``; with ``stream=True`` a
        ``(sources, GenerationStream)`` pair whose stream yields text pieces.
        ``sampling``: ``SamplingParams``; ``max_new_tokens``, ``temperature``, ``top_p``, ``stop``
        and ``seed`` are shorthand for its fields.
        ``recovery`` / ``boundary_recompute`` override the index's default recovery for this query."""
        t0 = time.perf_counter()
        plan = plan_retrieval(self, question, top_k, system_prompt=system_prompt, mode=mode, recovery=recovery,
                              boundary_recompute=boundary_recompute)
        retrieve_ms = (time.perf_counter() - t0) * 1e3
        sampling = SamplingParams.of(sampling, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     stop=stop, seed=seed)
        gen = self.llm.generate(plan.segments, mode=mode, stream=stream, source=plan.source, recovery=plan.recovery,
                                sampling=sampling)
        if stream:
            return plan.retrieved, gen
        stats = gen.stats.as_dict()
        stats["retrieve_ms"] = retrieve_ms
        return QueryResult(gen.text, plan.retrieved, stats)

    def describe(self) -> dict:
        return describe_index(self.path)
