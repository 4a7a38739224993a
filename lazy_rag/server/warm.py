"""Documents a server encodes before it answers (`lazy-rag serve --warm-documents FILE`), so that
the first requests naming them read their KV from the engine's memory tiers instead of encoding
it: a known hot set of documents that clients send as ``documents``, or every replica of a
scaled-out server holding the same documents in its host tier from the start.

The file holds what a request body's ``documents`` holds (strings, or ``{text, title?}``
objects), as one JSON list or as JSON Lines; each becomes the chunk text a request would send
(``Document.chunk_text``), so the warmed KV is the one those requests look up.

Warm documents are the operator's, public like an index's chunks: a tenant's request that sends
one reads the warmed KV (``PublicDocuments``), where any other document it sends is cached under
its tenant's salt.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from ..errors import LazyRagError
from ..segments import Chunk, Segment
from .protocol import APIError, _documents


def read_warm_documents(path: str | Path) -> tuple[str, ...]:
    """The chunk texts of the documents in ``path`` (a JSON list, or JSON Lines)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LazyRagError(f"Cannot read the warm documents file {p}: {e}. Give a UTF-8 JSON file holding a list of "
                           "documents (strings or {\"text\": ...} objects), or JSON Lines of them.") from None
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else None
    except ValueError:
        items = None
    if items is None:  # JSON Lines: one document per non-empty line
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except ValueError as e:
                raise LazyRagError(f"{p}, line {n}: not JSON ({e.msg}). The warm documents file is a JSON list of "
                                   "documents, or JSON Lines with one document (a string or {\"text\": ...}) per "
                                   "line.") from None
    if not items:
        raise LazyRagError(f"The warm documents file {p} holds no documents.")
    try:
        documents = _documents({"documents": items})
    except APIError as e:
        raise LazyRagError(f"{p}: {e.message}") from None
    return tuple(d.chunk_text for d in documents)


class PublicDocuments:
    """The warm documents' token ids, to tell them among a prompt's chunks: ``mark`` gives each
    an id ("warm:" and a hash of its text), and the engine's cache salt leaves chunks with an id
    alone, so every tenant reads the KV the engine warmed (the same key as the warm-up's)."""

    def __init__(self, tokenizer, texts: Sequence[str] = ()):
        self._ids = {tuple(tokenizer(t, add_special_tokens=False).input_ids):
                     "warm:" + hashlib.sha256(t.encode("utf-8", "surrogatepass")).hexdigest()[:16] for t in texts}

    def mark(self, segments: list[Segment]) -> list[Segment]:
        if not self._ids:
            return segments
        out = []
        for seg in segments:
            if isinstance(seg, Chunk) and seg.chunk_id is None and not isinstance(seg.content, str):
                found = self._ids.get(tuple(seg.content))
                if found is not None:
                    seg = Chunk(seg.content, found)
            out.append(seg)
        return out
