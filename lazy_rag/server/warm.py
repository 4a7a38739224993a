"""Documents a server encodes before it answers (`lazy-rag serve --warm-documents FILE`), so that
the first requests naming them read their KV from the engine's memory tiers instead of encoding
it: a known hot set of documents that clients send as ``documents``, or every replica of a
scaled-out server holding the same documents in its host tier from the start.

The file holds what a request body's ``documents`` holds (strings, or ``{text, title?}``
objects), as one JSON list or as JSON Lines; each becomes the chunk text a request would send
(``Document.chunk_text``), so the warmed KV is the one those requests look up.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import LazyRagError
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
