"""LlamaIndex adapter: lazy-rag as an LLM, an embedding model, a retriever and a synthesizer.

Two ways to reuse chunk KV:

- Transparent: ``LazyRAGLLM(index=lazy_index)`` as ``Settings.llm`` or ``as_query_engine(llm=...)``.
  Every prompt is searched for the verbatim text of the index's chunks (``lazy_rag.span_match``);
  those spans come from stored KV, the rest (template, metadata headers, question) is computed.
- Exact: ``LazyRAGSynthesizer`` / ``LazyRAGQueryEngine`` pass the retrieved node ids to the
  runtime, which assembles the prompt from the chunks' token ids (lazy-rag's RAG template).

``index_from_documents`` / ``index_from_nodes`` build a ``LazyIndex`` whose chunk ids are the
nodes' ids, so a ``VectorStoreIndex`` over the same nodes retrieves exactly the cached chunks.
Per-call stats (``cached_tokens`` etc.) are in ``llm.last_stats`` and in each response's
``additional_kwargs["lazy_rag"]``.
"""
from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any, Sequence

from lazy_rag.deps import require

require("llama_index.core")  # an optional extra: say what to install instead of a bare ImportError

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.generic_utils import (
    astream_completion_response_to_chat_response,
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TextNode
from pydantic import AliasChoices

from lazy_rag.chunking import CHUNK_OVERLAP, CHUNK_SIZE
from lazy_rag.errors import LazyRagError

from ._runtime import MAX_NEW_TOKENS, LazyRuntime, Plan, RuntimeBacked, aiter_in_thread

__all__ = ["LazyRAGLLM", "LazyRAGEmbedding", "LazyRAGRetriever", "LazyRAGSynthesizer", "LazyRAGQueryEngine",
           "nodes_from_documents", "index_from_nodes", "index_from_documents"]


class LazyRAGLLM(RuntimeBacked, CustomLLM):
    """A lazy-rag model as a LlamaIndex LLM. ``LazyRAGLLM(index=lazy_index)`` reuses the index's
    chunk KV wherever their text appears in a prompt; ``LazyRAGLLM(llm=lazy_llm)`` reuses chunks
    registered with ``register(texts)``. Prompts go through the model's chat template.

    Extra kwargs of ``complete``/``chat``: ``chunk_ids`` (search only these chunks),
    ``reuse=False`` (compute everything), and generation options (``max_new_tokens``, ``mode``...).
    ``model="qwen2.5-0.5b"`` (a bundled name, an HF folder or a .gguf file) loads the model when
    neither ``llm`` nor ``index`` is given. A keyword that is no option is refused.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", populate_by_name=True)
    mode: str = Field(default="lazy", description="lazy | block | prefix | full")
    max_new_tokens: int = Field(default=MAX_NEW_TOKENS, validation_alias=AliasChoices("max_new_tokens", "max_tokens"),
                                description="Most tokens generated per call (max_tokens is the same).")
    temperature: float = Field(default=0.0, description="0 = greedy.")
    top_p: float = Field(default=1.0)
    context_window: int | None = Field(default=None, description="Defaults to the model's.")
    _runtime: LazyRuntime = PrivateAttr()

    def __init__(self, llm=None, index=None, model: str | None = None, **kwargs: Any) -> None:
        if llm is None and index is None and model:
            from lazy_rag import LazyLLM

            llm = LazyLLM.from_pretrained(model)
        runtime = LazyRuntime(llm=llm, index=index)
        kwargs.setdefault("messages_to_prompt",
                          lambda messages: runtime.chat_prompt([(m.role.value, m.content or "") for m in messages]))
        kwargs.setdefault("completion_to_prompt", lambda prompt: runtime.chat_prompt([("user", prompt)]))
        super().__init__(**kwargs)
        self._runtime = runtime

    @classmethod
    def class_name(cls) -> str:
        return "LazyRAGLLM"

    @property
    def metadata(self) -> LLMMetadata:
        llm = self._runtime.llm
        return LLMMetadata(context_window=self.context_window or llm.context_window, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=llm.model_name or type(llm.model).__name__)

    # -- internals shared by every entry point --------------------------------------------------
    def _gen(self, kwargs: dict) -> dict:
        return {"mode": self.mode, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, **kwargs}

    def _plan(self, prompt: str, formatted: bool, kwargs: dict) -> Plan:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return self._runtime.plan_prompt(prompt, kwargs.pop("chunk_ids", None), kwargs.pop("reuse", True))

    def _run(self, plan: Plan, kwargs: dict) -> CompletionResponse:
        result, stats = self._runtime.run(plan, **self._gen(kwargs))
        return CompletionResponse(text=result.text, additional_kwargs={"lazy_rag": stats})

    def _stream(self, plan: Plan, kwargs: dict) -> CompletionResponseGen:
        s = self._runtime.stream(plan, **self._gen(kwargs))
        text = ""
        for piece in s:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
        # a last, empty delta carries the call's stats (known only once generation ends)
        yield CompletionResponse(text=text, delta="", additional_kwargs={"lazy_rag": s.stats})

    def _complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._run(self._plan(prompt, formatted, kwargs), kwargs)

    def _stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        yield from self._stream(self._plan(prompt, formatted, kwargs), kwargs)

    # -- completion -----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return aiter_in_thread(self._stream_complete(prompt, formatted, **kwargs))

    # -- chat (the model's chat template, then the completion path) ------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return completion_response_to_chat_response(self._complete(self.messages_to_prompt(messages), True, **kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return stream_completion_response_to_chat_response(
            self._stream_complete(self.messages_to_prompt(messages), True, **kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = self.messages_to_prompt(messages)
        return completion_response_to_chat_response(await asyncio.to_thread(self._complete, prompt, True, **kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = self.messages_to_prompt(messages)
        return astream_completion_response_to_chat_response(
            aiter_in_thread(self._stream_complete(prompt, True, **kwargs)))

    # -- exact path: the question over known nodes ----------------------------------------------
    def plan_nodes(self, query_str: str, nodes: Sequence[NodeWithScore | BaseNode | str],
                   system_prompt: str | None = None) -> Plan:
        """Segments for ``query_str`` over nodes, from token ids: a node whose id the index knows,
        with unchanged text, is served from the store; any other node is encoded from its text."""
        pairs = []
        for n in nodes:
            if isinstance(n, str):
                pairs.append((None, n))
                continue
            node = n.node if isinstance(n, NodeWithScore) else n
            pairs.append((node.node_id, node.get_content(metadata_mode=MetadataMode.NONE)))
        return self._runtime.plan_question(query_str, pairs, system_prompt)


class LazyRAGEmbedding(BaseEmbedding):
    """lazy-rag's bundled sentence embedder (all-MiniLM-L6-v2, offline) as a LlamaIndex embedding.
    Pass ``embedder=index.embedder`` to share the one a ``LazyIndex`` already loaded."""

    _embedder: Any = PrivateAttr()

    def __init__(self, embedder=None, model_name: str | None = None, **kwargs: Any) -> None:
        from lazy_rag.embedder import DEFAULT_EMBEDDER, Embedder

        embedder = embedder or Embedder(model_name or DEFAULT_EMBEDDER)
        super().__init__(model_name=embedder.name, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "LazyRAGEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.encode([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.encode([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.encode(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return await asyncio.to_thread(self._get_text_embedding, text)


class LazyRAGRetriever(BaseRetriever):
    """Retrieve from a ``LazyIndex``: nodes are ``TextNode(id_=chunk_id, text=chunk text)``."""

    def __init__(self, index, similarity_top_k: int = 4, callback_manager: CallbackManager | None = None) -> None:
        self._index = index
        self._top_k = similarity_top_k
        super().__init__(callback_manager=callback_manager)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        out = []
        for s in self._index.retrieve(query_bundle.query_str, self._top_k):
            rec = self._index.by_id[s.chunk_id]
            node = TextNode(id_=rec.id, text=rec.text, metadata=dict(rec.metadata))
            out.append(NodeWithScore(node=node, score=s.score))
        return out

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class LazyRAGSynthesizer(BaseSynthesizer):
    """A response synthesizer that hands the retrieved node ids to the runtime: no string
    matching, the prompt is assembled from the chunks' token ids (lazy-rag's RAG template).
    Use it in any query engine: ``vs_index.as_query_engine(response_synthesizer=...)``."""

    def __init__(self, llm: LazyRAGLLM, streaming: bool = False, system_prompt: str | None = None,
                 callback_manager: CallbackManager | None = None) -> None:
        if not isinstance(llm, LazyRAGLLM):
            raise LazyRagError("LazyRAGSynthesizer needs a LazyRAGLLM (it passes node ids to lazy-rag).")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._system_prompt = system_prompt

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        pass

    # The base class formats node text for get_response; pass the nodes along as well.
    def synthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        response = super().synthesize(query, nodes, additional_source_nodes, lazy_rag_nodes=nodes, **response_kwargs)
        return self._attach_stats(response)

    async def asynthesize(self, query, nodes, additional_source_nodes=None, **response_kwargs):
        response = await super().asynthesize(query, nodes, additional_source_nodes, lazy_rag_nodes=nodes,
                                             **response_kwargs)
        return self._attach_stats(response)

    def _attach_stats(self, response):
        if not self._streaming and getattr(response, "metadata", None) is not None and self._llm.last_stats:
            response.metadata["lazy_rag"] = self._llm.last_stats
        return response

    def _plan(self, query_str, text_chunks, lazy_rag_nodes) -> Plan:
        return self._llm.plan_nodes(query_str, lazy_rag_nodes if lazy_rag_nodes is not None else list(text_chunks),
                                    self._system_prompt)

    def get_response(self, query_str: str, text_chunks: Sequence[str], lazy_rag_nodes=None, **kwargs: Any):
        plan = self._plan(query_str, text_chunks, lazy_rag_nodes)
        gen = self._llm._gen(kwargs)
        if self._streaming:
            return iter(self._llm.runtime.stream(plan, **gen))
        result, _ = self._llm.runtime.run(plan, **gen)
        return result.text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], lazy_rag_nodes=None, **kwargs: Any):
        plan = self._plan(query_str, text_chunks, lazy_rag_nodes)
        gen = self._llm._gen(kwargs)
        if self._streaming:
            return aiter_in_thread(self._llm.runtime.stream(plan, **gen))
        result, _ = await asyncio.to_thread(self._llm.runtime.run, plan, **gen)
        return result.text


class LazyRAGQueryEngine(RetrieverQueryEngine):
    """``RetrieverQueryEngine`` with ``LazyRAGSynthesizer``: the exact path, end to end."""

    def __init__(self, retriever: BaseRetriever, llm: LazyRAGLLM, streaming: bool = False,
                 node_postprocessors=None, system_prompt: str | None = None,
                 callback_manager: CallbackManager | None = None) -> None:
        synth = LazyRAGSynthesizer(llm, streaming=streaming, system_prompt=system_prompt,
                                   callback_manager=callback_manager)
        super().__init__(retriever, response_synthesizer=synth, node_postprocessors=node_postprocessors,
                         callback_manager=callback_manager)

    @classmethod
    def from_index(cls, index, similarity_top_k: int = 4, **kwargs: Any) -> "LazyRAGQueryEngine":
        """Over a ``LazyIndex``: its retriever and a ``LazyRAGLLM`` on its store."""
        return cls(LazyRAGRetriever(index, similarity_top_k), LazyRAGLLM(index=index), **kwargs)


# -- building a LazyIndex from LlamaIndex documents / nodes ------------------------------------------
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def nodes_from_documents(documents: Sequence[Document], llm, chunk_size: int = CHUNK_SIZE,
                         chunk_overlap: int = CHUNK_OVERLAP) -> list[TextNode]:
    """Split with LlamaIndex's ``SentenceSplitter`` sized in the model's own tokens, with node ids
    derived from the document and the position (stable across runs, safe as file names)."""
    from llama_index.core.node_parser import SentenceSplitter

    tok = llm.tokenizer

    def node_id(i: int, doc: BaseNode) -> str:
        return hashlib.sha256(f"{doc.node_id}\0{doc.hash}\0{i}".encode()).hexdigest()[:20]

    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=chunk_overlap, id_func=node_id,
                                tokenizer=lambda s: tok(s, add_special_tokens=False).input_ids)
    return splitter.get_nodes_from_documents(list(documents))


def index_from_nodes(nodes: Sequence[BaseNode], out, llm, **kwargs: Any):
    """A ``LazyIndex`` with one chunk per node (chunk id = node id, text = the node's text), so KV
    is precomputed for exactly the nodes LlamaIndex retrieves. ``kwargs`` go to ``from_texts``."""
    from lazy_rag.index import LazyIndex

    nodes = [n for n in nodes if n.get_content(metadata_mode=MetadataMode.NONE).strip()]
    for n in nodes:
        if not _SAFE_ID.match(n.node_id):
            raise LazyRagError(f"Node id {n.node_id!r} cannot name a KV file; use ids of letters, digits, '.', "
                               "'_' and '-' (nodes_from_documents makes such ids).")
    return LazyIndex.from_texts([n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes], out, llm=llm,
                                ids=[n.node_id for n in nodes], metadatas=[dict(n.metadata) for n in nodes],
                                split=False, **kwargs)


def index_from_documents(documents: Sequence[Document], out, llm, chunk_size: int = CHUNK_SIZE,
                         chunk_overlap: int = CHUNK_OVERLAP, **kwargs: Any):
    """Split documents into nodes and index them: returns ``(lazy_index, nodes)``; build a
    ``VectorStoreIndex(nodes, embed_model=LazyRAGEmbedding(...))`` over the same nodes."""
    nodes = nodes_from_documents(documents, llm, chunk_size, chunk_overlap)
    return index_from_nodes(nodes, out, llm, **kwargs), nodes
