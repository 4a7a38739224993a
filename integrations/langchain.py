"""LangChain adapter: lazy-rag as an ``LLM``, a chat model, a retriever and a RAG runnable.

- ``LazyRAGLLM`` / ``ChatLazyRAG``: any prompt that contains the verbatim text of known chunks
  (a ``LazyIndex``'s, or texts passed to ``register``) has those spans served from KV. Extra
  kwargs pass through: ``chunk_ids=[...]`` (search only these), ``reuse=False``, and generation
  options (``max_new_tokens``, ``mode``, ``temperature``, ``seed``...). Stats of each call are in
  ``generation_info["lazy_rag"]`` / ``response_metadata["lazy_rag"]`` and ``model.last_stats``.
- ``LazyRAGRetriever``: a ``BaseRetriever`` over a ``LazyIndex``; ``Document.id`` is the chunk id.
- ``LazyRAGChain``: a runnable, question (or ``{"question", "docs"}``) in, ``{"question",
  "sources", "answer", "stats"}`` out, assembled from the chunks' token ids (no string matching);
  streams the answer token by token and composes with ``|``, ``RunnableParallel`` and ``.assign``.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Iterator, Optional

from lazy_rag.deps import require

require("langchain_core")  # an optional extra: say what to install instead of a bare ImportError

from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.llms import LLM
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import (ChatGeneration, ChatGenerationChunk, ChatResult, Generation, GenerationChunk,
                                    LLMResult)
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.utils import AddableDict
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr

from lazy_rag.errors import LazyRagError
from lazy_rag.models import canonical_name as _canonical

from ._runtime import MAX_NEW_TOKENS, LazyRuntime, Plan, RuntimeBacked, aiter_in_thread
from .tool_calls import parse_tool_call, plan_tools

__all__ = ["LazyRAGLLM", "ChatLazyRAG", "LazyRAGRetriever", "LazyRAGChain"]

# langchain-core >= 1.0 marks the final chunk of a stream (else it appends an empty one after ours)
_LAST = {"chunk_position": "last"} if "chunk_position" in AIMessageChunk.model_fields else {}
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}


# LangChain's names for the options, as ChatOpenAI takes them (``max_tokens``, ``model``), beside
# lazy-rag's own; a keyword that is neither is refused (a misspelt option must not pass unnoticed)
_MODEL_CONFIG = ConfigDict(arbitrary_types_allowed=True, extra="forbid", populate_by_name=True,
                           protected_namespaces=())
_MAX_TOKENS = dict(default=MAX_NEW_TOKENS, validation_alias=AliasChoices("max_new_tokens", "max_tokens"),
                   description="Most tokens generated per call (max_tokens is the same).")
_MODEL = dict(default=None, alias="model", description="The model: a bundled name, an HF folder or a .gguf file, "
                                                       "loaded when neither llm= nor index= is given; else the "
                                                       "name of the one they hold.")


class _LazyRAGModel(RuntimeBacked):
    """Fields and plumbing shared by the two model classes (a plain mixin: no pydantic fields)."""

    _runtime: LazyRuntime

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        llm = self.llm
        if llm is None and self.index is None and self.model_name:
            from lazy_rag import LazyLLM

            llm = LazyLLM.from_pretrained(self.model_name)
        self._runtime = LazyRuntime(llm=llm, index=self.index)
        loaded = self._runtime.llm.model_name
        if self.model_name is None:
            self.model_name = loaded
        elif (self.llm is not None or self.index is not None) and loaded and \
                _canonical(self.model_name) != _canonical(loaded):
            raise LazyRagError(f"model={self.model_name!r}, but the {'index' if self.index is not None else 'llm'} "
                               f"given holds {loaded!r}: drop model= or pass the matching one.")

    @property
    def _identifying_params(self) -> dict:
        return {"model_name": self.model_name, "mode": self.mode, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p}

    def _gen(self, stop, kwargs: dict) -> dict:
        return {"mode": self.mode, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "stop": stop, **kwargs}

    def _plan(self, prompt: str, kwargs: dict) -> Plan:
        return self._runtime.plan_prompt(prompt, kwargs.pop("chunk_ids", None), kwargs.pop("reuse", True))


class LazyRAGLLM(_LazyRAGModel, LLM):
    """A lazy-rag model as a LangChain text-completion ``LLM``: ``LazyRAGLLM(index=lazy_index)``
    or ``LazyRAGLLM(llm=lazy_llm)``. The prompt is used as-is unless ``apply_chat_template``."""

    model_config = _MODEL_CONFIG
    llm: Any = Field(default=None, exclude=True, description="A LazyLLM (or give index= or model=).")
    index: Any = Field(default=None, exclude=True, description="A LazyIndex whose chunks are reused.")
    model_name: Optional[str] = Field(**_MODEL)
    mode: str = "lazy"
    max_new_tokens: int = Field(**_MAX_TOKENS)
    temperature: float = 0.0
    top_p: float = 1.0
    apply_chat_template: bool = False
    _runtime: LazyRuntime = PrivateAttr()

    @property
    def _llm_type(self) -> str:
        return "lazy-rag"

    def _prompt(self, prompt: str) -> str:
        return self._runtime.chat_prompt([("user", prompt)]) if self.apply_chat_template else prompt

    def _call(self, prompt: str, stop: Optional[list[str]] = None,
              run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> str:
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text

    def _generate(self, prompts: list[str], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> LLMResult:
        generations = []
        for prompt in prompts:
            kw = dict(kwargs)
            result, stats = self._runtime.run(self._plan(self._prompt(prompt), kw), **self._gen(stop, kw))
            generations.append([Generation(text=result.text, generation_info={
                "finish_reason": result.finish_reason, "lazy_rag": stats})])
        return LLMResult(generations=generations)

    async def _agenerate(self, prompts: list[str], stop: Optional[list[str]] = None, run_manager=None,
                         **kwargs: Any) -> LLMResult:
        sync_rm = run_manager.get_sync() if run_manager else None
        return await asyncio.to_thread(self._generate, prompts, stop, sync_rm, **kwargs)

    def _stream(self, prompt: str, stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        s = self._runtime.stream(self._plan(self._prompt(prompt), kwargs), **self._gen(stop, kwargs))
        for piece in s:
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        # a last, empty chunk carries the call's stats (known only once generation ends)
        yield GenerationChunk(text="", generation_info={"finish_reason": s.result.finish_reason,
                                                         "lazy_rag": s.stats})


def _message_text(m: BaseMessage) -> str:
    if isinstance(m.content, str):
        return m.content
    text = m.text  # a property in langchain-core 1.x, a method in 0.3
    return text() if callable(text) else text


def _turn_text(m: BaseMessage) -> str:
    """A message as the chat template gets it: an assistant's tool calls as the JSON it wrote."""
    calls = getattr(m, "tool_calls", None)
    if calls:
        return "\n".join(json.dumps({"name": c["name"], "arguments": c["args"]}) for c in calls)
    return _message_text(m)


def _usage(stats: dict) -> dict:
    return {"input_tokens": stats["prompt_tokens"], "output_tokens": stats["new_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
            "input_token_details": {"cache_read": stats["cached_tokens"]}}


class ChatLazyRAG(_LazyRAGModel, BaseChatModel):
    """A lazy-rag model as a LangChain chat model; messages go through the model's chat template."""

    model_config = _MODEL_CONFIG
    llm: Any = Field(default=None, exclude=True, description="A LazyLLM (or give index= or model=).")
    index: Any = Field(default=None, exclude=True, description="A LazyIndex whose chunks are reused.")
    model_name: Optional[str] = Field(**_MODEL)
    mode: str = "lazy"
    max_new_tokens: int = Field(**_MAX_TOKENS)
    temperature: float = 0.0
    top_p: float = 1.0
    _runtime: LazyRuntime = PrivateAttr()

    @property
    def _llm_type(self) -> str:
        return "lazy-rag-chat"

    def bind_tools(self, tools, *, tool_choice=None, **kwargs: Any):
        """Tools (pydantic models, functions, LangChain tools or OpenAI function dicts) the model may
        call: its answer is constrained to a JSON call of one of them (``tool_choice`` "any" /
        "required" / a name), or a call or text ("auto", the default). Calls come back in
        ``AIMessage.tool_calls``; ``with_structured_output(Schema)`` works through this."""
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice, **kwargs)

    def _prompt(self, messages: list[BaseMessage], system_note: str | None = None) -> str:
        turns = [(getattr(m, "role", None) or _ROLES.get(m.type, m.type), _turn_text(m)) for m in messages]
        if system_note:  # the tools, told in the system message (merged into the caller's, if any)
            if turns and turns[0][0] == "system":
                turns[0] = ("system", f"{turns[0][1]}\n\n{system_note}")
            else:
                turns.insert(0, ("system", system_note))
        return self._runtime.chat_prompt(turns)

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        tools = plan_tools(kwargs.pop("tools", None), kwargs.pop("tool_choice", None))
        kwargs.pop("ls_structured_output_format", None)  # LangChain's tracing note of with_structured_output
        if tools is not None:
            kwargs["output_format"] = tools.output_format
        prompt = self._prompt(messages, tools.system_note if tools else None)
        result, stats = self._runtime.run(self._plan(prompt, kwargs), **self._gen(stop, kwargs))
        meta = {"finish_reason": result.finish_reason, "model_name": self.model_name, "lazy_rag": stats}
        call = parse_tool_call(result.text, tools) if tools is not None else None
        if call is not None:
            meta["finish_reason"] = "tool_calls"
            msg = AIMessage(content="", tool_calls=[{"name": call["name"], "args": call["arguments"], "id": call["id"],
                                                     "type": "tool_call"}],
                            response_metadata=meta, usage_metadata=_usage(stats))
        else:
            msg = AIMessage(content=result.text, response_metadata=meta, usage_metadata=_usage(stats))
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info=meta)])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        if kwargs.get("tools"):  # a call is known only whole: one chunk with the finished message
            message = self._generate(messages, stop, run_manager, **kwargs).generations[0].message
            yield ChatGenerationChunk(message=AIMessageChunk(content=message.content, tool_call_chunks=[
                {"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i}
                for i, c in enumerate(message.tool_calls)], response_metadata=message.response_metadata,
                usage_metadata=message.usage_metadata, **_LAST))
            return
        s = self._runtime.stream(self._plan(self._prompt(messages), kwargs), **self._gen(stop, kwargs))
        for piece in s:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        meta = {"finish_reason": s.result.finish_reason, "model_name": self.model_name, "lazy_rag": s.stats}
        yield ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata=meta,
                                                         usage_metadata=_usage(s.stats), **_LAST))


class LazyRAGRetriever(BaseRetriever):
    """Retrieve from a ``LazyIndex``: ``Document(page_content=chunk text, id=chunk_id)``, with
    ``chunk_id``, ``source`` and ``score`` (plus the chunk's stored metadata) in ``metadata``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    index: Any = Field(exclude=True)
    top_k: int = 4

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        docs = []
        for s in self.index.retrieve(query, self.top_k):
            rec = self.index.by_id[s.chunk_id]
            meta = {**rec.metadata, "chunk_id": s.chunk_id, "source": s.source, "score": s.score}
            docs.append(Document(page_content=rec.text, id=s.chunk_id, metadata=meta))
        return docs


def _doc_chunk_id(doc) -> str | None:
    if isinstance(doc, Document):
        return doc.id or doc.metadata.get("chunk_id")
    return None


class LazyRAGChain(Runnable):
    """Question in, answer and sources out, from the chunks' token ids (the exact path).

    Input: a question string (retrieved from ``index``), or a dict with ``question`` and
    optionally ``docs`` (``Document``s, e.g. from ``LazyRAGRetriever``; a document whose id the
    index knows is served from the store, any other is encoded from its text).
    Output: ``{"question", "sources", "answer", "stats"}``; ``stream`` yields ``{"answer": piece}``
    deltas between the sources and the stats (``AddableDict``s: they add up to the output).
    """

    def __init__(self, index=None, llm=None, top_k: int = 4, system_prompt: str | None = None, **generation: Any):
        runtime = getattr(llm, "runtime", None)
        self.runtime: LazyRuntime = runtime if isinstance(runtime, LazyRuntime) else LazyRuntime(llm=llm, index=index)
        if index is not None and self.runtime.index is None:
            raise LazyRagError("LazyRAGChain(index=..., llm=...): the model was built without the index; "
                               "build it with index= too, or pass only index=.")
        self.top_k = top_k
        self.system_prompt = system_prompt
        self.generation = generation

    @property
    def last_stats(self) -> dict | None:
        return self.runtime.last_stats

    def _parse(self, inp) -> tuple[str, list[Document]]:
        if isinstance(inp, str):
            question, docs = inp, None
        elif isinstance(inp, dict):
            question = inp.get("question") or inp.get("input") or inp.get("query")
            docs = inp.get("docs", inp.get("documents", inp.get("context")))
        else:
            raise LazyRagError(f"LazyRAGChain takes a question or a dict with 'question' (and 'docs'), "
                               f"not {type(inp).__name__}.")
        if not isinstance(question, str) or not question.strip():
            raise LazyRagError("LazyRAGChain needs a non-empty 'question'.")
        if docs is None:
            index = self.runtime.index
            if index is None:
                raise LazyRagError("No 'docs' given and no index to retrieve from: pass docs or build with index=.")
            docs = [Document(page_content=s.text, id=s.chunk_id, metadata={"chunk_id": s.chunk_id, "source": s.source,
                                                                             "score": s.score})
                    for s in index.retrieve(question, self.top_k)]
        return question, list(docs)

    def _outputs(self, inp) -> Iterator[AddableDict]:
        question, docs = self._parse(inp)
        pairs = [(_doc_chunk_id(d), d.page_content if isinstance(d, Document) else str(d)) for d in docs]
        plan = self.runtime.plan_question(question, pairs, self.system_prompt)
        yield AddableDict(question=question, sources=docs)
        s = self.runtime.stream(plan, **self.generation)
        for piece in s:
            yield AddableDict(answer=piece)
        yield AddableDict(answer="", stats=s.stats)  # "answer" present even if nothing was generated

    @staticmethod
    def _combine(final, chunk):
        if final is None:
            return chunk
        try:
            return final + chunk
        except TypeError:
            return chunk

    def _transform(self, inputs: Iterator) -> Iterator[AddableDict]:
        final = None
        for chunk in inputs:
            final = self._combine(final, chunk)
        yield from self._outputs(final)

    async def _atransform(self, inputs: AsyncIterator) -> AsyncIterator[AddableDict]:
        final = None
        async for chunk in inputs:
            final = self._combine(final, chunk)
        async for out in aiter_in_thread(self._outputs(final)):
            yield out

    def transform(self, input: Iterator, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[dict]:
        return self._transform_stream_with_config(input, self._transform, config, **kwargs)

    def stream(self, input, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[dict]:
        return self.transform(iter([input]), config, **kwargs)

    def invoke(self, input, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        final = None
        for out in self.stream(input, config, **kwargs):
            final = out if final is None else final + out
        return dict(final)

    def atransform(self, input: AsyncIterator, config: RunnableConfig | None = None, **kwargs: Any):
        return self._atransform_stream_with_config(input, self._atransform, config, **kwargs)

    def astream(self, input, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[dict]:
        async def one():
            yield input

        return self.atransform(one(), config, **kwargs)

    async def ainvoke(self, input, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        final = None
        async for out in self.astream(input, config, **kwargs):
            final = out if final is None else final + out
        return dict(final)
