"""From a parsed request to the engine's prompt: token-id segments, whether their chunks are the
served index's, and the retrieved sources. Three ways a request's documents become cached chunks:

- transparent: the rendered prompt is searched for the served index's chunks (``ChunkMatcher``);
  a chunk found verbatim is read from its stored KV instead of being computed;
- explicit: ``documents`` in the body become ``Chunk`` segments; the engine encodes each once and
  keeps its KV by content hash in its bounded memory tiers, for any later position;
- retrieval: ``rag`` retrieves for the last user message and prompts as ``lazy-rag query`` does.

The plans are ``lazy_rag.planning``'s, as for ``LazyIndex.query`` and the framework adapters.

Everything is tokenized here, in the HTTP process's worker threads, so the engine (often in its
own process) takes token ids and never tokenizes; documents' ids are remembered by content.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from ..chat import render_messages
from ..errors import LazyRagError
from ..planning import Plan, choose_recovery, plan_prompt, plan_retrieval
from ..engine.recovery import Recovery
from ..segments import Chunk, Segment
from .protocol import APIError, Document, GenerationRequest, bad
from .tokens import DocumentTokens, tokenize_segments

DOCUMENTS_HEADER = "Documents:\n\n"
_SENTINEL = "@@LAZY_RAG_LAST_USER_TURN@@"


@dataclass
class PreparedPrompt:
    """``segments``: token ids and ``Chunk``s of ids. ``uses_index``: its chunks are the served
    index's (their KV is read from its store), else the engine's own chunk cache serves them."""

    segments: list[Segment]
    uses_index: bool = False
    recovery: Recovery | None = None
    sources: list[dict] = field(default_factory=list)   # retrieved chunks (rag), for the response
    matched_chunks: list[str] = field(default_factory=list)  # index chunks found in the prompt

    @classmethod
    def of(cls, plan: Plan) -> "PreparedPrompt":
        sources = [s.as_dict() for s in plan.retrieved]
        matched = list(plan.chunk_ids) if plan.reuse == "span_match" else []
        return cls(plan.segments, plan.source is not None, plan.recovery, sources, matched)


def document_segments(documents: Sequence[Document]) -> list[Segment]:
    """The documents block: a header, then each document as a cached chunk, blank lines between."""
    segs: list[Segment] = [DOCUMENTS_HEADER]
    for i, d in enumerate(documents):
        if i:
            segs.append("\n\n")
        segs.append(Chunk(d.chunk_text))
    segs.append("\n\n")
    return segs


TOOL_RESULT = "Tool result:\n"


def template_messages(tokenizer, messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``messages`` as the chat template takes them: a tool result (role "tool") stays one where the
    template has a branch for tool messages (its text names "tool"), else it becomes a user turn
    "Tool result:\n<content>" (templates without one render unknown roles verbatim or refuse them)."""
    if not any(r == "tool" for r, _ in messages) or "tool" in (getattr(tokenizer, "chat_template", None) or ""):
        return list(messages)
    return [("user", TOOL_RESULT + c) if r == "tool" else (r, c) for r, c in messages]


def chat_with_documents(tokenizer, messages: Sequence[tuple[str, str]], documents: Sequence[Document]) -> list[Segment]:
    """The conversation with the documents block at the start of the last user turn (where RAG
    templates put retrieved context), so the question follows the chunks."""
    messages = template_messages(tokenizer, messages)
    rendered = render_messages(tokenizer, [*messages[:-1], (messages[-1][0], _SENTINEL)])
    head, tail = rendered.split(_SENTINEL)
    return [head, *document_segments(documents), messages[-1][1] + tail]


def completion_with_documents(prompt: str, documents: Sequence[Document]) -> list[Segment]:
    return [*document_segments(documents), prompt]


class PromptBuilder:
    """Builds prompts for one served model and, optionally, one index. ``tokenizer`` is this
    builder's own: the engine decodes with its tokenizer during steps without this builder's lock
    (the HTTP process's copy when the engine runs elsewhere, a copy of the engine's otherwise)."""

    def __init__(self, tokenizer, index=None):
        self.tokenizer, self.index = tokenizer, index
        self._lock = threading.Lock()           # the tokenizer is not safe to share between threads
        self.embedder_lock = threading.Lock()  # the embedder's tokenizer is not thread-safe either
        self.documents = DocumentTokens(tokenizer)
        self._token_text: dict[int, str] = {}  # logprobs' token texts, by id
        self.matcher = None
        if index is not None:
            from ..span_match import ChunkMatcher

            self.matcher = ChunkMatcher.from_index(index)
            self.matcher.tokenizer = tokenizer  # the same vocabulary; this builder's lock guards it

    def build(self, req: GenerationRequest, mode: str, salt: str = "") -> PreparedPrompt:
        """Blocking (retrieval embeds, span matching and tokenizing take milliseconds): call it
        from a worker thread. ``salt``: the requesting tenant's cache salt (its documents' token
        ids are remembered apart from other tenants')."""
        prepared = self._retrieval(req, mode) if req.rag_top_k else self._plan(req, mode)
        with self._lock:
            prepared.segments = tokenize_segments(self.tokenizer, prepared.segments, self.documents, salt)
        return prepared

    def _plan(self, req: GenerationRequest, mode: str) -> PreparedPrompt:
        tok = self.tokenizer
        if req.documents:
            segs = (chat_with_documents(tok, req.messages, req.documents) if req.kind == "chat"
                    else completion_with_documents(req.prompt, req.documents))
            return PreparedPrompt.of(Plan(segs, recovery=choose_recovery(mode, req.recovery)))
        text = render_messages(tok, template_messages(tok, req.messages)) if req.kind == "chat" else req.prompt
        if self.matcher is None:
            return PreparedPrompt.of(Plan([text], recovery=choose_recovery(mode, req.recovery)))
        with self._lock:
            plan = plan_prompt(self.matcher, text, index=self.index, mode=mode, recovery=req.recovery)
        return PreparedPrompt.of(plan)

    def token_texts(self, ids) -> list[str]:
        """Each token id's text (OpenAI's logprobs ``token``; a byte of a longer character is "\ufffd")."""
        missing = [i for i in set(ids) if i not in self._token_text]
        if missing:
            with self._lock:
                for i in missing:
                    self._token_text[i] = self.tokenizer.decode([i])
        return [self._token_text[i] for i in ids]

    def _retrieval(self, req: GenerationRequest, mode: str) -> PreparedPrompt:
        if self.index is None:
            raise APIError(400, "'rag' needs an index: start the server with one (`lazy-rag serve INDEX_DIR`).",
                           param="rag")
        question = req.messages[-1][1]
        system = [c for r, c in req.messages if r == "system"]
        recovery = choose_recovery(mode, req.recovery, default=self.index.recovery)  # its errors name no param
        try:
            with self.embedder_lock:
                plan = plan_retrieval(self.index, question, req.rag_top_k, system_prompt=system[-1] if system else None,
                                      mode=mode, recovery=recovery)
        except LazyRagError as e:
            raise bad(str(e), "rag") from None
        return PreparedPrompt.of(plan)
