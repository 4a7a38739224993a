"""Prompts tokenized in the HTTP process: ``tokenize_segments`` turns a prompt's text segments
into the token-id segments the engine takes as they are, so the engine (in its own process, or
its stepping thread) never tokenizes; ``DocumentTokens`` remembers the token ids of document
texts, so a document that comes back (the point of caching its KV) is not tokenized again.

Both give exactly the ids the engine's own assembly would (``segments.assemble``): text alone,
the prompt's first segment with the tokenizer's BOS, a chunk's text without specials.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from ..lru import ByteLRU
from ..segments import Chunk, Segment, tokenize_text

# int32 ids: 8 KiB per 2048-token document, so the default keeps ~8,000 such documents
DEFAULT_CACHE_BYTES = 64 << 20
_ENTRY_OVERHEAD = 200  # the key, the array header and the LRU's bookkeeping, roughly


class DocumentTokens:
    """Token ids of chunk texts (no specials) by the SHA-256 of the text and the requesting
    tenant's cache salt, bounded by bytes (LRU): one tenant's document is not tokenized faster
    for having been sent by another. Not thread-safe for the tokenizer: callers hold their
    tokenizer's lock."""

    def __init__(self, tokenizer, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self._lru: ByteLRU[np.ndarray] = ByteLRU(max_bytes, lambda a: a.nbytes + _ENTRY_OVERHEAD)
        self.hits = self.misses = 0

    def ids(self, text: str, salt: str = "") -> list[int]:
        # surrogatepass: JSON may carry lone surrogates ("\ud800"), which plain UTF-8 refuses
        key = hashlib.sha256(salt.encode() + b"\0" + text.encode("utf-8", "surrogatepass")).digest()
        found = self._lru.get(key)
        if found is not None:
            self.hits += 1
            return found.tolist()
        self.misses += 1
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        self._lru.put(key, np.asarray(ids, dtype=np.int32))
        return list(ids)


def tokenize_segments(tokenizer, segments: Sequence[Segment], documents: DocumentTokens | None = None,
                      salt: str = "") -> list[Segment]:
    """Text -> token ids (the first segment with BOS, as ``assemble`` does); ``Chunk`` texts ->
    ``Chunk`` of ids (through ``documents`` when given), keeping their ``chunk_id``; ids stay."""
    out: list[Segment] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, str):
            out.append(tokenize_text(tokenizer, seg, first=(i == 0)))
        elif isinstance(seg, Chunk) and isinstance(seg.content, str):
            ids = documents.ids(seg.content, salt) if documents is not None else \
                tokenizer(seg.content, add_special_tokens=False).input_ids
            out.append(Chunk(ids, seg.chunk_id))
        else:
            out.append(seg)
    return out
