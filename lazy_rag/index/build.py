"""Building an index: ``BuildOptions`` (every option of a build and its default, once), reading
the sources, deciding per file what to keep, re-chunk or drop, embedding and encoding only what
is new, and the commit (``commit``); and ``rewrap``, a re-encode of every chunk inside a new
chunk wrapper committed as the next generation."""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import itertools
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .. import build_estimate
from ..build_pipeline import EncodeWarmup, encode_and_write
from ..chat import DEFAULT_INSTRUCTION, rag_prefix
from ..chunking import CHUNK_OVERLAP, CHUNK_SIZE, TokenChunker, discover_files
from ..deps import require
from ..documents import Skip, check_encoding, read_text
from ..embedder import DEFAULT_EMBEDDER, Embedder, build_device
from ..errors import FingerprintMismatchError, LazyIndexError, LazyRagError
from ..index_lock import LOCK_NAME, remove_lock_file, writer_lock
from ..kv_record import check_kv_dtype, kv_dtype_name, kv_dtype_named
from ..llm import LazyLLM
from ..models import DEFAULT_MODEL
from ..progress import Progress, resolved_style
from ..engine.recovery import DEFAULT_RECOVERY, Recovery, resolve_recovery
from ..segments import tokenize_text
from ..store import DB_NAME, ChunkStore, IndexDB
from ..vector_index import VectorIndex
from ..version import __version__
from ..wrapper import ChunkWrapper
from .commit import BuildRun, Previous, collect_garbage, commit, commit_rewrap
from .folder import (FORMAT_VERSION, check_settings, indexed_model, kv_subdir, open_index_db, open_store,
                     read_vectors, read_wrapper, remove_debris, save_wrapper, wrapper_file)
from .format1 import import_kv
from .table import ChunkRecord

log = logging.getLogger("lazy_rag.index")
EMBED_BATCH = 64


@dataclass(frozen=True)
class BuildOptions:
    """How an index is built: the one place each option of ``LazyIndex.build``/``from_texts`` (and
    their keywords, which are shorthand for these) has its default.

    Stored in the index's settings, and checked against an existing index's (``model``'s
    fingerprint, ``chunk_size``/``chunk_overlap``/``split``, ``shared_prefix``, ``kv_dtype``,
    ``precompute_kv``, the wrapper; the prompt where ``shared_prefix``):

    - ``model``: the model to load when no ``llm`` is given (``device``: where); None: an existing
      index's model, else the default (``models.DEFAULT_MODEL``).
    - ``chunk_size``/``chunk_overlap``: in model tokens; ``split=False`` takes each text whole as
      one chunk whose id is the text's id (``from_texts``: frameworks' node ids).
    - ``shared_prefix``: every chunk is encoded after the prompt's fixed head (an attention sink),
      which fixes ``system_prompt`` and ``instruction`` (the RAG prompt of every query, chat.py).
    - ``kv_dtype``: the stored KV's dtype ("auto": the model's; fp8, int4, bf16, fp16, fp32).
    - ``precompute_kv=False`` defers each chunk's KV to its first retrieval (large corpora).
    - ``recovery`` (e.g. "auto", "prophet20", "epic16", "none"; ``Recovery``): the queries' default
      quality recovery (``boundary_recompute=N`` is short for "epicN"); "auto" measures each
      answer's reuse risk and recomputes risky ones as the model's calibration says.
    - ``encoding``: the encoding of source text files that are not UTF-8 (a Python codec name, e.g.
      "cp1252"; "auto": each file's as charset-normalizer detects it); None: the index's, kept
      from the build that gave one, else "auto".
    - ``wrapper``: the chunk wrapper every chunk is encoded inside (a bundled name, a file from
      `lazy-rag tune`, or "none"); "auto" keeps an existing index's and otherwise takes the
      model's bundled wrapper, if it has one.
    - ``vectors=False``: no embeddings and no vector index (nor their packages): chunks are then
      named by id (``segments(question, chunk_ids)``), e.g. when retrieval happens elsewhere.

    How this build runs (not stored):

    - ``progress``: True (a bar on a terminal, else a plain line every 30 s or 5%), False, or a
      style: "bar", "lines", "none".
    - ``repair=True`` rebuilds the chunk table and vectors from the sources without reading the
      old ones (after damage), reusing every KV record whose stored token ids match; files the
      index holds from sources not named here are read again at their recorded paths, and one
      that cannot be read stops the repair (naming it) unless ``drop_missing``.
    - ``drop_missing=True`` drops the chunks of indexed files that are gone, wherever they were
      indexed from (by default an update drops only files gone from the sources it names).
    - ``wait_lock``: seconds to wait for another writer of the folder.
    """

    model: str | None = None
    device: str = "auto"
    chunk_size: int = CHUNK_SIZE
    chunk_overlap: int = CHUNK_OVERLAP
    split: bool = True
    shared_prefix: bool = False
    system_prompt: str | None = None
    instruction: str = DEFAULT_INSTRUCTION
    kv_dtype: str = "auto"
    precompute_kv: bool = True
    recovery: Recovery | str | None = DEFAULT_RECOVERY
    boundary_recompute: int = 0
    wrapper: ChunkWrapper | str | None = "auto"
    encoding: str | None = None
    vectors: bool = True
    progress: bool | str = True
    repair: bool = False
    drop_missing: bool = False
    wait_lock: float = 0.0

    @classmethod
    def of(cls, options: "BuildOptions | None" = None, **keywords) -> "BuildOptions":
        """``options`` (the defaults if None) with the given keywords changed."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise TypeError(f"Unknown build option(s) {', '.join(map(repr, unknown))}; the options are "
                            f"{', '.join(sorted(names))} (BuildOptions).")
        return dataclasses.replace(options or cls(), **keywords)


@dataclass
class BuildReport:
    files_indexed: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    skipped: Counter = field(default_factory=Counter)   # files skipped, by reason
    skipped_files: list = field(default_factory=list)   # (path, "reason: what to do") of each file skipped
    decoded: list = field(default_factory=list)         # (path, how) of text files read in another encoding than UTF-8
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


@dataclass
class Built:
    """A committed build, for ``LazyIndex`` to open: the snapshot of the new generation and its
    settings, its vector index (None without vectors), the wrapper, and the models it used."""

    db: IndexDB
    settings: dict
    vectors: VectorIndex | None
    wrapper: ChunkWrapper | None
    llm: LazyLLM
    embedder: Embedder | None
    report: BuildReport


# -- reading the sources ---------------------------------------------------------------------------

def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stamp(path) -> tuple | None:
    """What changes when a file is written or replaced (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _skip(report: BuildReport, source: str, skip: Skip) -> None:
    report.skipped[skip.reason] += 1
    report.skipped_files.append((source, str(skip)))


def read_sources(sources: Sequence[str | os.PathLike], encoding: str | None = None
                 ) -> tuple[list, BuildReport, dict, set]:
    """(documents, a report naming each file skipped and why, each file's stamp before it was
    read, the files whose content can no longer be indexed) of the files and folders
    ``sources``; ``encoding``: that of text files that are not UTF-8 (None: detected)."""
    files, unsupported = discover_files(sources)
    docs, report, stamps, unreadable = [], BuildReport(), {}, set()
    for f, skip in unsupported:
        _skip(report, str(f), skip)
    for f in files:
        name = os.fsencode(f)
        if not _is_utf8(name):  # a chunk table and a terminal hold text: the path must be text
            _skip(report, name.decode("utf-8", "backslashreplace"),
                  Skip("file name is not UTF-8", "rename the file"))
            continue
        stamps[str(f)] = _stamp(f)  # before the read: a write after it shows at the end
        read = read_text(f, encoding)
        if read.text is None:
            _skip(report, str(f), read.skip)
            if not read.skip.keeps_chunks:
                unreadable.add(str(f))
            continue
        if read.encoding:
            report.decoded.append((str(f), read.encoding))
        docs.append((str(f), read.text, {"file_path": str(f)}))
    if not docs:
        named = "; ".join(f"{path}: {why}" for path, why in report.skipped_files[:5])
        raise LazyRagError(f"None of the {len(files)} files could be read ({named}"
                           f"{'; ...' if len(report.skipped_files) > 5 else ''}).")
    return docs, report, stamps, unreadable


def name_changed_files(docs: list, stamps: dict, report: BuildReport, encoding: str | None = None) -> None:
    """Each file's chunks, KV and recorded sha256 are one read of it. One written since (by then
    or while the build ran) is named: the next run sees its new sha256 and re-indexes it."""
    for source, text, _ in docs:
        if _stamp(source) != stamps[source] and read_text(Path(source), encoding).text != text:
            report.changed_files.append(source)
            log.warning("%s changed while it was indexed: the index holds the text read; run `lazy-rag "
                        "index` again to index the new version.", source)


def _under_roots(source: str, roots: Sequence[str]) -> bool:
    """``source`` (a resolved file path) is one of ``roots`` or inside one of them."""
    return any(source == r or source.startswith(r.rstrip("/") + "/") for r in roots)


def _reread_other_roots(old_files: dict, given: set[str], roots: list[str], report: BuildReport,
                        unreadable: set, drop_missing: bool, encoding: str | None) -> list:
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
        read = read_text(Path(source), encoding)
        if read.text is not None:
            docs.append((source, read.text, {"file_path": source}))
        elif read.skip.reason.startswith("unreadable"):
            missing.append((source, str(read.skip)))
        else:
            _skip(report, source, read.skip)
            if not read.skip.keeps_chunks:
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


def _chunk_id(source: str, ordinal: int, text: str) -> str:
    return hashlib.sha256(f"{source}\0{ordinal}\0{text}".encode()).hexdigest()[:20]


def progress_style(progress) -> str:
    """A build's progress: True = a bar on a terminal, plain lines anywhere else (a log file, CI);
    False = none; or a style name of ``lazy_rag.progress``."""
    return {True: "auto", False: "none"}.get(progress, progress) if isinstance(progress, bool) else str(progress)


# -- embedding and encoding ------------------------------------------------------------------------

def _keep_encode_calibration(llm, report: BuildReport) -> None:
    """Fit the engine's encode costs (its read-or-encode choice for cold chunks) in a build that
    encodes KV, where a machine-wide calibration file keeps the fit for a day: the first
    `lazy-rag query` then loads it instead of timing probe encodes inside its TTFT. It runs while
    the build's writer writes (build_pipeline.encode_and_write's ``beside_writes``: on a fresh
    machine its probes compile kernels of their own, seconds that after the commit were the
    build's), or after the commit where every chunk's KV was stored already. With no file to keep
    it in (``LAZY_RAG_CALIBRATION=off``) the query process would probe anyway, so nothing runs. A
    failure here costs only that query its probes, never the build."""
    from ..engine.read_or_encode import calibration_path

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


def check_free_space(out: Path, llm, store: ChunkStore, records, slots: int = 0, *, new_index: bool) -> None:
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
        wrapped = f" + {slots} chunk wrapper slots per chunk" if slots else ""
        raise LazyIndexError(
            f"The KV of {len(records)} new chunks ({sum(len(r.token_ids) for r in records):,} tokens{wrapped} x "
            f"{per_token:,.0f} bytes) needs {need / 2**30:.2f} GiB, but {out} has {free / 2**30:.2f} GiB free. "
            + fix[0].upper() + fix[1:])


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


# -- a build ---------------------------------------------------------------------------------------

# OSErrors of writing the index folder: of the storage itself, whatever file they name ...
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}
# ... and of a path, when the path is in the index folder (a model file or a source that cannot
# be read, a network timeout, a library's OSError without errno: not the index's disk)
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
                errno.EMFILE, errno.ENFILE, errno.ESTALE}


def _is_write_failure(e: BaseException, out: Path) -> bool:
    """Whether ``e`` is a failure to write the index folder ``out`` (a full disk, a read-only or
    unwritable folder) rather than another error that happens to be an OSError (TimeoutError,
    ConnectionError, a model that cannot be loaded)."""
    if not isinstance(e, OSError) or isinstance(e, (TimeoutError, ConnectionError)):
        return False
    if e.errno in _STORAGE_ERRNOS:
        return True
    if e.errno not in _PATH_ERRNOS or not e.filename:
        return False
    try:
        Path(os.fsdecode(e.filename)).resolve().relative_to(out.resolve())
    except (ValueError, OSError, TypeError):
        return False
    return True


def _remove_new_debris(out: Path, before: set[str], lock_was_there: bool, created_folder: bool) -> None:
    """After a failed build into a folder that held no index: what this run created there (its
    database, an empty KV folder, the lock file, the folder itself if it made it and it is empty)
    goes, so that a refused build leaves the folder as it found it. Called under the lock."""
    for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", DB_NAME + "-journal"):
        if name not in before:
            (out / name).unlink(missing_ok=True)
    for d in out.glob("kv*"):
        if d.name not in before and d.is_dir():
            try:
                d.rmdir()  # only if empty (this run's segments were removed by run.fail)
            except OSError:
                pass
    if not lock_was_there:
        remove_lock_file(out)
    if created_folder:
        try:
            out.rmdir()
        except OSError:
            pass


def build_docs(docs, out, llm, embedder, options: BuildOptions, *, report: BuildReport | None = None,
               roots=None, unreadable=frozenset()) -> Built:
    """Check ``out``, take its writer lock, build; a failure to write (full disk, read-only
    folder) is an error with the numbers and the fix, and leaves the previous index as it was
    (a folder that held no index: as it was before, no lock file, database or KV folder left).
    ``docs``: (source, text, metadata) of each document; ``roots``: the resolved sources they
    were read from (None: in-memory texts); ``unreadable``: files that can no longer be read."""
    out = Path(out).expanduser()
    check_kv_dtype(options.kv_dtype)
    if options.vectors:   # before the model loads and the KV is encoded, not after
        require("faiss")
    if out.exists() and not out.is_dir():
        raise LazyIndexError(f"--out {out} is a file, not a folder; name a folder for the index.")
    created_folder = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LazyIndexError(f"Cannot create the index folder {out} ({e.strerror}); choose another --out.") from e
    lock_was_there = (out / LOCK_NAME).exists()
    with writer_lock(out, wait=options.wait_lock):
        before = set(os.listdir(out))  # (under the lock: another writer's files are there by now)
        remove_debris(out)
        run = BuildRun()
        try:
            return _build_locked(docs, out, llm, embedder, options, run, report or BuildReport(), roots, unreadable)
        except BaseException as e:
            # whatever stopped it (a full disk, Ctrl-C): this run's appends and files go; the
            # committed generation never referred to them. After Ctrl-C the KV encoded so far is
            # kept as pending: running the same build again resumes from it
            run.fail(keep_encoded=isinstance(e, KeyboardInterrupt))
            if not run.had_index and not run.committed and not isinstance(e, KeyboardInterrupt):
                run.close()  # (its database closed before it is removed)
                _remove_new_debris(out, before, lock_was_there, created_folder)
            if not _is_write_failure(e, out):
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


def source_encoding(encoding: str | None, indexed: str | None) -> str | None:
    """The encoding a build reads source text that is not UTF-8 in (None: detected): ``encoding``
    (``BuildOptions.encoding``, checked; "auto": None), else the index's (``indexed``)."""
    return check_encoding(encoding) if encoding is not None else indexed


def model_for(out: Path, model: str | None) -> str:
    """The model a build into ``out`` loads: ``model``, else the index's there (an update keeps
    its model), else the default."""
    return model or indexed_model(Path(out)) or DEFAULT_MODEL


def _build_locked(docs, out: Path, llm, embedder, o: BuildOptions, run: BuildRun, report: BuildReport, roots,
                  unreadable) -> Built:
    t0 = time.perf_counter()
    if llm is None:
        model_name = model_for(out, o.model)
        llm = LazyLLM.from_pretrained(model_name, device=o.device)
    else:
        model_name = getattr(llm, "model_name", None)
    chunker = TokenChunker(llm.tokenizer, o.chunk_size, o.chunk_overlap) if o.split else None
    check_kv_dtype(o.kv_dtype)
    kv_dt = kv_dtype_named(o.kv_dtype, llm.dtype)
    prefix = None
    if o.shared_prefix:
        text = rag_prefix(llm.tokenizer, o.system_prompt, o.instruction)
        prefix = {"text": text, "token_ids": tokenize_text(llm.tokenizer, text, first=True)}
    chunking = {"chunk_size": o.chunk_size, "chunk_overlap": o.chunk_overlap, "split": o.split,
                "splitter": "llama_index.SentenceSplitter"}
    prev = Previous.open(out, o.repair)
    run.db, run.had_index = prev.db, prev.format is not None
    old = prev.settings
    encoding = source_encoding(o.encoding, (old or {}).get("source_encoding"))
    wrapper = o.wrapper
    if isinstance(wrapper, str) and wrapper.lower() == "auto" and old is not None:
        wrapper = read_wrapper(out, old) if old.get("wrapper") else None  # the index's choice stands
    else:
        wrapper = llm.host.resolve_wrapper(wrapper)
    warmup = None

    def warm_up():  # the encode's kernels compiled beside the chunking and the embedding
        if not (o.precompute_kv and EncodeWarmup.wanted(llm)):
            return None
        return EncodeWarmup(llm, prefix["token_ids"] if prefix else (), wrapper, kv_dt)

    if prev.format is None:  # a new index: all of it will be encoded
        warmup = warm_up()
    if o.vectors:  # (after the warm-up starts: loading the embedder is seconds of its compile)
        embedder = embedder or Embedder(DEFAULT_EMBEDDER, device=build_device(llm.device))
    settings = {
        "format_version": FORMAT_VERSION, "lazy_rag_version": __version__,
        "model": {"name": model_name, "fingerprint": llm.fingerprint, "dtype": str(llm.dtype).removeprefix("torch.")},
        "kv_dtype": kv_dtype_name(kv_dt),
        # None: an index without vectors (retrieval happens elsewhere; chunks are named by id)
        "embedder": {"name": embedder.name, "dim": embedder.dim} if o.vectors else None,
        "chunking": chunking, "shared_prefix": prefix, "generation": 0,
        "kv_precomputed": bool(o.precompute_kv),
        "query_defaults": {"recovery": resolve_recovery(o.recovery, o.boundary_recompute).name()},
        "prompt": {"system_prompt": o.system_prompt, "instruction": o.instruction},
        "wrapper": wrapper.describe() if wrapper is not None else None,
        "wrapper_file": wrapper_file(wrapper) if wrapper is not None else None,
        "source_encoding": encoding,  # of source text that is not UTF-8 (None: detected per file)
    }
    old_vectors = None
    if old is not None:
        _check_compatible(old, settings, out)
        settings["generation"] = old["generation"] + 1
        if prev.format == 2 and not o.repair and old.get("vectors_file"):
            old_vectors = read_vectors(out, old, old["num_chunks"])  # damaged: refused before any work
    old_files = prev.files(o.repair) if old is not None else {}
    if o.repair and old is not None and roots is not None:
        unreadable = set(unreadable)
        docs = list(docs) + _reread_other_roots(old_files, {d[0] for d in docs}, roots, report, unreadable,
                                                o.drop_missing, encoding)
    # Decide per document: keep (unchanged), re-chunk (new or changed), drop (vanished).
    keep_sources, new_records, new_files, drop_sources = set(), [], {}, set()
    seen_sources, changed = set(), []
    for source, text, meta in docs:
        seen_sources.add(source)
        digest = hashlib.sha256(text.encode()).hexdigest()
        prev_entry = old_files.get(source)
        if not o.repair and prev_entry and prev_entry["sha256"] == digest and \
                prev.has_chunks(source, prev_entry["chunk_ids"]):
            keep_sources.add(source)
            report.files_unchanged += 1
            continue
        changed.append((source, text, meta, digest, prev_entry))
    # texts taken whole as chunks: tokenized in batches (the fast tokenizer spreads a batch
    # over the cores; one call per text was a machine's first build's longest wait before
    # its first encode)
    whole_ids = (itertools.repeat(None) if o.split
                 else _token_ids_batched(llm.tokenizer, [text for _, text, *_ in changed]))
    for (source, text, meta, digest, prev_entry), text_ids in zip(changed, whole_ids):
        parts = chunker.split(text) if o.split else [(text, text_ids)]
        recs = [ChunkRecord(_chunk_id(source, i, t) if o.split else source, source, i, t, ids, dict(meta))
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
        elif o.repair:  # gone from a folder named again, or (--drop-missing) from anywhere
            report.files_removed += 1
            log.warning("--repair: %s cannot be read; its chunks were dropped.", source)
        elif roots is not None and Path(source).is_absolute() and (o.drop_missing or _under_roots(source, roots)) \
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
        if prev.v1_vectors is not None and o.vectors:
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
    if o.repair and prev.format == 2 or prev.salvage:
        # KV is found by what the records say, not by what the table says
        store.salvage({r.id: r.token_ids for r in new_records})
    if prev.format == 1:
        n = import_kv(store, out / kv_subdir(old.get("wrapper")), {r.id: r.token_ids for r in carried + new_records})
        log.info("Converting the format-1 index at %s: %d KV files copied into segments.", out, n)
    todo_records = new_records + ([r for r in carried if store.location(r.id) is None] if o.precompute_kv else [])
    if warmup is None and todo_records:
        warmup = warm_up()
    if o.precompute_kv and todo_records:
        check_free_space(out, llm, store, todo_records, wrapper.slots if wrapper else 0,
                         new_index=not run.had_index)
    # Embed and encode only what is new.
    style = progress_style(o.progress)
    # from the build's start to the embedding and encoding: the model where it is loaded here,
    # the previous index, chunking and tokenizing
    report.stages["prepare_s"] = round(time.perf_counter() - t0, 3)
    vecs_new = None

    def embed(style):
        nonlocal vecs_new
        t_embed = time.perf_counter()
        if new_records and o.vectors:
            vecs_new = _embed_records(embedder, new_records, style)
        report.stages["embed_s"] = round(time.perf_counter() - t_embed, 3)
        report.stages["embed_start_s"] = round(t_embed - t0, 3)

    # while the writer writes: the embedding (before the first encode it held the first write
    # back by its seconds, the disk idle; the vectors are needed at the commit), then the
    # calibration, each beside a full queue of its own. Its progress in lines between the
    # encode's, not as a second live bar beside the encode's
    beside_style = "none" if resolved_style(style) == "bar" else style
    beside_writes = (lambda: embed(beside_style), lambda: _keep_encode_calibration(llm, report))

    if todo_records and o.precompute_kv:
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
        created = save_wrapper(out, settings, wrapper)
        if created is not None:
            run.new_files.append(created)
    records = carried + new_records
    vecs = None
    if o.vectors and records:
        vecs = np.concatenate([v for v in (carried_vecs, vecs_new) if v is not None]) \
            if carried_vecs is not None or vecs_new is not None else None
    t_commit = time.perf_counter()
    vindex = commit(out, run, prev, settings, records, vecs, new_files, drop_sources, o.repair, old_vectors, report)
    snapshot, settings = open_index_db(out)
    report.stages["commit_s"] = round(time.perf_counter() - t_commit, 3)
    if todo_records and o.precompute_kv and report.stages.get("beside_at_batch", -1) < 0:
        # not fitted beside the writes: every chunk's KV was there already
        _keep_encode_calibration(llm, report)
    report.chunks_added = len(new_records)
    report.chunks_total = settings["num_chunks"]
    report.tokens_total = settings["num_tokens"]
    report.seconds = time.perf_counter() - t0
    return Built(snapshot, settings, vindex, wrapper, llm, embedder, report)


def rewrap(path: Path, llm, manifest: dict, records, kv_dir: Path, wrapper: ChunkWrapper | None,
           progress=True, wait_lock: float = 0.0) -> int:
    """Encode every chunk of ``records`` (the loaded generation ``manifest`` describes, whose KV is
    in ``kv_dir``) inside ``wrapper`` (None: plain chunks) and commit it as the index's next
    generation: the new KV goes to segments in its own folder and one transaction points every
    row at it, so a crash leaves the previous index whole. Returns the KV bytes written."""
    if wrapper is not None:
        wrapper.check_model(llm.fingerprint, llm.model_name)
    with writer_lock(path, wait=wait_lock):
        remove_debris(path)
        run = BuildRun()
        try:
            run.db = db = IndexDB(path)
            current = check_settings(db.settings(), db)
            if current.get("commit_id") != manifest.get("commit_id"):
                raise LazyIndexError(f"The index at {path} was rebuilt since it was loaded; load it again.")
            settings = dict(current)
            settings["wrapper"] = wrapper.describe() if wrapper is not None else None
            settings["wrapper_file"] = wrapper_file(wrapper) if wrapper is not None else None
            settings["generation"] = current["generation"] + 1
            settings["checksums"] = {k: v for k, v in (current.get("checksums") or {}).items()
                                     if k != "wrapper_file"}
            store = run.store = open_store(path, settings, llm.host.parts.vocab_rows, db=db)
            store.begin_build()  # an interrupted re-encode into this folder resumes
            nbytes = 0
            if settings.get("kv_precomputed", True):
                records = list(records)
                check_free_space(path, llm, store, records, wrapper.slots if wrapper else 0, new_index=False)
                with Progress(_tokens(records), "encoding chunk KV", progress_style(progress)) as bar:
                    todo = [r for r in records
                            if store.staged_location(r.id) is None or store.read(r.id, r.token_ids)[0] is None]
                    bar.advance(_tokens(records) - _tokens(todo))
                    nbytes = _encode_records(llm, store, todo, wrapper, bar, run.written)
            if wrapper is not None:
                created = save_wrapper(path, settings, wrapper)
                if created is not None:
                    run.new_files.append(created)
            commit_rewrap(db, store, settings, current)
            run.committed = True
            store.end_build(committed=True)
            collect_garbage(path, settings, store, db)
        except BaseException:
            run.fail()
            new_dir = path / kv_subdir(wrapper)
            if not run.committed and new_dir != kv_dir and new_dir.is_dir() and not any(new_dir.iterdir()):
                new_dir.rmdir()  # (one holding checkpointed KV stays: a new attempt resumes from it)
            raise
        finally:
            run.close()
    return nbytes
