"""``LazyIndex``: chunks, their vectors and their position-free KV, built once, queried often.

The package: ``lazy_index`` (the ``LazyIndex`` a user loads, builds and queries), ``build`` (a
build and its ``BuildOptions``), ``commit`` (what a build starts from and its commit), ``table``
(the chunk and files tables, with every SQL statement the index makes on them), ``folder`` (the
folder's files and settings), ``format1`` (an old index, converted in place), ``verify``
(describe and verify a folder without a model).

Layout of an index folder (format 2)::

    index.sqlite            the commit point (SQLite, WAL): settings (format, fingerprints, embedder,
                            chunking, shared prefix, wrapper, prompt, query defaults, generation),
                            the chunk table (one row per chunk: id, source, ordinal, text, token
                            ids, metadata, KV location, embedding, checksums), the files, the KV
                            segments
    vectors-<gen>.faiss     the vector index (``vector_index.VectorIndex``), ids = chunk rowids
    kv/seg-<n>.kvseg        the chunks' KV records (kv_record.py, store.py); kv-w<digest>/ with a
                            chunk wrapper
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
every KV record carries its own checksums (kv_record.py); ``verify_index`` checks all of it and
SQLite's integrity. A damaged one is an error naming the file and the fix, ``lazy-rag index
--repair``. Nothing on the load path unpickles: SQLite, JSON, the vector index's own format and
safetensors only. A format-1 folder (``manifest.json``, ``chunks-<gen>.jsonl``, one KV file per
chunk) is refused on load and converted in place by the next build, its KV copied into segments.
"""
from __future__ import annotations

from .build import BuildOptions, BuildReport
from .folder import kv_subdir
from .lazy_index import LazyIndex, QueryResult, Source
from .verify import describe_index, verify_index

__all__ = ["BuildOptions", "BuildReport", "LazyIndex", "QueryResult", "Source", "describe_index", "kv_subdir",
           "verify_index"]
