"""From a parsed request to the engine's prompt: segments, where their chunks' KV lives, and
the retrieved sources. Three ways a request's documents become cached chunks:

- transparent: the rendered prompt is searched for the served index's chunks (``ChunkMatcher``);
  a chunk found verbatim is read from its stored KV instead of being computed;
- explicit: ``documents`` in the body become ``Chunk`` segments; the engine encodes each once and
  keeps its KV by content hash in its bounded memory tiers, for any later position;
- retrieval: ``rag`` retrieves for the last user message and prompts as ``lazy-rag query`` does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from ..chat import render_messages
from ..errors import LazyRagError
from ..requests import ChunkSource, Recovery
from ..segments import Chunk, Segment
from .protocol import APIError, Document, GenerationRequest, bad

DOCUMENTS_HEADER = "Documents:\n\n"
_SENTINEL = "@@LAZY_RAG_LAST_USER_TURN@@"


@dataclass
class PreparedPrompt:
    segments: list[Segment]
    source: ChunkSource | None = None
    recovery: Recovery | str | None = None
    sources: list[dict] = field(default_factory=list)   # retrieved chunks (rag), for the response
    matched_chunks: list[str] = field(default_factory=list)  # index chunks found in the prompt


def document_segments(documents: Sequence[Document]) -> list[Segment]:
    """The documents block: a header, then each document as a cached chunk, blank lines between."""
    segs: list[Segment] = [DOCUMENTS_HEADER]
    for i, d in enumerate(documents):
        if i:
            segs.append("\n\n")
        segs.append(Chunk(d.chunk_text))
    segs.append("\n\n")
    return segs


def chat_with_documents(tokenizer, messages: Sequence[tuple[str, str]], documents: Sequence[Document]) -> list[Segment]:
    """The conversation with the documents block at the start of the last user turn (where RAG
    templates put retrieved context), so the question follows the chunks."""
    rendered = render_messages(tokenizer, [*messages[:-1], (messages[-1][0], _SENTINEL)])
    head, tail = rendered.split(_SENTINEL)
    return [head, *document_segments(documents), messages[-1][1] + tail]


def completion_with_documents(prompt: str, documents: Sequence[Document]) -> list[Segment]:
    return [*document_segments(documents), prompt]


class PromptBuilder:
    """Builds prompts for one served model and, optionally, one index."""

    def __init__(self, llm, index=None):
        self.llm, self.index = llm, index
        self._embedder_lock = threading.Lock()  # the embedder's tokenizer is not thread-safe either
        self.matcher = None
        if index is not None:
            from ..span_match import ChunkMatcher

            self.matcher = ChunkMatcher.from_index(index)

    def build(self, req: GenerationRequest, mode: str) -> PreparedPrompt:
        """Blocking (retrieval embeds, span matching tokenizes): call it from a worker thread."""
        tok = self.llm.tokenizer
        if req.rag_top_k:
            return self._retrieval(req, mode)
        if req.documents:
            segs = (chat_with_documents(tok, req.messages, req.documents) if req.kind == "chat"
                    else completion_with_documents(req.prompt, req.documents))
            return PreparedPrompt(segs, None, req.recovery)
        text = render_messages(tok, req.messages) if req.kind == "chat" else req.prompt
        if self.matcher is None:
            return PreparedPrompt([text], None, req.recovery)
        with self.llm.lock:  # the tokenizer is not safe to share between threads
            m = self.matcher.split(text)
        source = self.index.chunk_source if m.uses_index else None
        recovery = req.recovery if req.recovery is not None else (
            self.index.query_recovery(mode) if m.uses_index else None)
        return PreparedPrompt(m.segments, source, recovery, matched_chunks=list(m.chunk_ids))

    def _retrieval(self, req: GenerationRequest, mode: str) -> PreparedPrompt:
        if self.index is None:
            raise APIError(400, "'rag' needs an index: start the server with one (`lazy-rag serve INDEX_DIR`).",
                           param="rag")
        question = req.messages[-1][1]
        system = [c for r, c in req.messages if r == "system"]
        try:
            with self._embedder_lock:
                found = self.index.retrieve(question, req.rag_top_k)
            segs = self.index.segments(question, found, system[-1] if system else None)
        except LazyRagError as e:
            raise bad(str(e), "rag") from None
        sources = [{"chunk_id": s.chunk_id, "source": s.source, "score": round(s.score, 4), "text": s.text}
                   for s in found]
        return PreparedPrompt(segs, self.index.chunk_source, self.index.query_recovery(mode, req.recovery), sources)
