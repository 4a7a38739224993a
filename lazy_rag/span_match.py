"""Transparent reuse: find known chunks inside a finished prompt string and serve them from KV.

Frameworks (LlamaIndex query engines, LangChain chains) hand the LLM one rendered string: the
retrieved chunks' text wrapped in a template, metadata headers and a question. ``ChunkMatcher``
finds every known chunk whose text occurs *verbatim* in that string and splits the prompt into
segments ``[text, Chunk(token_ids, chunk_id), text, ...]``. Text segments are tokenized alone, so
the result is an ordinary, well-defined lazy-rag prompt; chunk spans use the chunk's own token ids
(exactly what its stored KV was computed from).

The rule is exact, never fuzzy: a span is reused only if the chunk's stored text occurs verbatim,
or its whitespace-stripped form occurs and tokenizing that form alone gives exactly the stored
ids. A chunk whose text was altered is simply uncached text: less reuse, never a wrong chunk.

Search: chunks are bucketed by their first ``HEAD`` characters, and the prompt is scanned once,
looking up each window in that dict (chunks shorter than ``HEAD`` are found with ``str.find``).
When the caller knows which chunks were retrieved (``chunk_ids=``), only those are searched.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .errors import LazyRagError
from .segments import Chunk, Segment, leading_bos, tokenize_text

HEAD = 32  # characters of a chunk's text used as its bucket key


@dataclass(frozen=True)
class KnownChunk:
    """A chunk the matcher can reuse. ``indexed``: its KV lives in a ``LazyIndex`` under
    ``chunk_id``; otherwise the LLM's own chunk cache serves it by token ids."""

    chunk_id: str
    text: str
    token_ids: tuple[int, ...]
    indexed: bool = False

    def segment(self) -> Chunk:
        return Chunk(list(self.token_ids), chunk_id=self.chunk_id if self.indexed else None)


@dataclass(frozen=True)
class SpanMatch:
    start: int  # character offsets in the prompt
    end: int
    chunk: KnownChunk


@dataclass
class MatchedPrompt:
    """The prompt split into segments; ``matches`` are the reused spans in prompt order."""

    segments: list[Segment]
    matches: list[SpanMatch] = field(default_factory=list)
    note: str | None = None  # why nothing could be reused, when that is not simply "no match"

    @property
    def chunk_ids(self) -> list[str]:
        return [m.chunk.chunk_id for m in self.matches]

    @property
    def chunk_tokens(self) -> int:
        return sum(len(m.chunk.token_ids) for m in self.matches)

    @property
    def uses_index(self) -> bool:
        return any(m.chunk.indexed for m in self.matches)


class ChunkMatcher:
    """Known chunks (from a ``LazyIndex`` and/or registered texts) and the exact span search.

    ``min_tokens``: shorter chunks are never matched (a few common words are not worth a span).
    ``shared_prefix_ids``: the index's shared prefix; a prompt that does not start with it cannot
    use the index's chunks (they were encoded after it), so nothing is matched.
    """

    def __init__(self, tokenizer, shared_prefix_ids: Sequence[int] = (), min_tokens: int = 4):
        self.tokenizer = tokenizer
        self.shared_prefix_ids = tuple(shared_prefix_ids)
        self.min_tokens = min_tokens
        self.chunks: dict[str, KnownChunk] = {}
        self._variants: dict[str, list[str]] = {}  # chunk_id -> texts that count as the chunk
        self._heads: dict[str, list[tuple[str, str]]] = {}  # text[:HEAD] -> [(variant, chunk_id)]
        self._short: list[tuple[str, str]] = []
        self._bos_added = leading_bos(tokenizer) is not None

    @classmethod
    def from_index(cls, index, min_tokens: int = 4) -> "ChunkMatcher":
        m = cls(index.llm.tokenizer, index.shared_prefix_ids, min_tokens)
        for r in index.records:
            m._add(KnownChunk(r.id, r.text, tuple(r.token_ids), indexed=True))
        return m

    def add(self, text: str, chunk_id: str | None = None, token_ids: Sequence[int] | None = None) -> KnownChunk:
        """Register a chunk served from the LLM's own chunk cache (encoded on first use)."""
        ids = tuple(self.tokenizer(text, add_special_tokens=False).input_ids)
        if token_ids is not None and tuple(int(t) for t in token_ids) != ids:
            raise LazyRagError(f"The token ids given for chunk {chunk_id!r} are not the tokenization of its "
                               "text alone (without specials); pass the text only, or its exact ids.")
        chunk_id = chunk_id or "text:" + hashlib.sha256(text.encode()).hexdigest()[:16]
        existing = self.chunks.get(chunk_id)
        if existing is not None and existing.indexed:
            return existing  # the index already serves it, from disk
        chunk = KnownChunk(chunk_id, text, ids, indexed=False)
        self._add(chunk)
        return chunk

    def add_many(self, texts: Iterable[str], ids: Iterable[str] | None = None) -> list[KnownChunk]:
        texts = list(texts)
        ids = list(ids) if ids is not None else [None] * len(texts)
        return [self.add(t, i) for t, i in zip(texts, ids)]

    def _add(self, chunk: KnownChunk) -> None:
        if len(chunk.token_ids) < self.min_tokens:
            return
        if chunk.chunk_id in self.chunks:
            self._forget(chunk.chunk_id)
        variants = [chunk.text]
        stripped = chunk.text.strip()
        if stripped and stripped != chunk.text and \
                tuple(self.tokenizer(stripped, add_special_tokens=False).input_ids) == chunk.token_ids:
            variants.append(stripped)
        self.chunks[chunk.chunk_id] = chunk
        self._variants[chunk.chunk_id] = variants
        for v in variants:
            if len(v) >= HEAD:
                self._heads.setdefault(v[:HEAD], []).append((v, chunk.chunk_id))
            else:
                self._short.append((v, chunk.chunk_id))

    def _forget(self, chunk_id: str) -> None:
        for v in self._variants.pop(chunk_id, []):
            bucket = self._heads.get(v[:HEAD], []) if len(v) >= HEAD else self._short
            bucket[:] = [e for e in bucket if e[1] != chunk_id]
        self.chunks.pop(chunk_id, None)

    # -- search -------------------------------------------------------------------------------
    def find(self, prompt: str, chunk_ids: Sequence[str] | None = None) -> list[SpanMatch]:
        """Every verbatim occurrence of a known chunk (all known, or only ``chunk_ids``), then a
        non-overlapping selection preferring longer spans."""
        found: list[SpanMatch] = []
        if chunk_ids is not None:
            pairs = [(v, cid) for cid in dict.fromkeys(chunk_ids) for v in self._variants.get(cid, ())]
            found = self._find_each(prompt, pairs)
        else:
            found = self._find_each(prompt, self._short)
            for i in range(len(prompt) - HEAD + 1):
                bucket = self._heads.get(prompt[i:i + HEAD])
                if bucket:
                    for v, cid in bucket:
                        if prompt.startswith(v, i):
                            found.append(SpanMatch(i, i + len(v), self.chunks[cid]))
        chosen: list[SpanMatch] = []
        for m in sorted(found, key=lambda m: (m.start - m.end, m.start)):
            if all(m.end <= c.start or m.start >= c.end for c in chosen):
                chosen.append(m)
        return sorted(chosen, key=lambda m: m.start)

    def _find_each(self, prompt: str, pairs) -> list[SpanMatch]:
        out = []
        for v, cid in pairs:
            at = prompt.find(v)
            while at >= 0:
                out.append(SpanMatch(at, at + len(v), self.chunks[cid]))
                at = prompt.find(v, at + len(v))
        return out

    def split(self, prompt: str, chunk_ids: Sequence[str] | None = None) -> MatchedPrompt:
        """Segments for ``prompt``: matched spans become ``Chunk``s, the rest stays text."""
        if not isinstance(prompt, str) or not prompt:
            raise LazyRagError("The prompt must be a non-empty string.")
        matches = self.find(prompt, chunk_ids)
        # The next token must be computed with attention to every chunk, so a span that ends the
        # prompt stays text; a span at the very start would lose the BOS the first text gets.
        matches = [m for m in matches if m.end < len(prompt) and not (m.start == 0 and self._bos_added)]
        if not matches:
            return MatchedPrompt([prompt])
        segments: list[Segment] = []
        pos = 0
        for m in matches:
            if m.start > pos:
                segments.append(prompt[pos:m.start])
            segments.append(m.chunk.segment())
            pos = m.end
        segments.append(prompt[pos:])
        if self.shared_prefix_ids and any(m.chunk.indexed for m in matches):
            p = len(self.shared_prefix_ids)
            head = segments[0] if isinstance(segments[0], str) else ""
            if tuple(tokenize_text(self.tokenizer, head, first=True)[:p]) != self.shared_prefix_ids:
                return MatchedPrompt([prompt], note="the index's chunks were encoded after a shared prefix "
                                                    "that this prompt does not start with")
        return MatchedPrompt(segments, matches)
