"""What both adapters share: a ``LazyLLM`` (and optionally a ``LazyIndex``), a ``ChunkMatcher``
over the chunks it knows, and per-call stats. Each adapter only translates its framework's types
to ``complete(prompt)`` (transparent reuse by span matching) or ``answer(question, chunks)``
(exact reuse by chunk ids); the prompts are planned by ``lazy_rag.planning``.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterable, Iterator, Sequence

from lazy_rag.chat import render_messages
from lazy_rag.errors import LazyRagError
from lazy_rag.planning import Plan, choose_recovery, plan_chunks, plan_prompt
from lazy_rag.span_match import ChunkMatcher

_DONE = object()

GENERATION_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "mode", "stop", "boundary_recompute", "recovery",
                   "output_format", "presence_penalty", "frequency_penalty")
_ALIASES = {"max_tokens": "max_new_tokens"}
# the adapters' LLMs' default max_new_tokens (alias max_tokens), LangChain's and LlamaIndex's alike
MAX_NEW_TOKENS = 256


class RunStream:
    """Text pieces as generated; ``result`` and ``stats`` are set once exhausted.

    The model's lock is taken per step inside the engine, not across yields, so a consumer may
    start another call while iterating, and async wrappers may resume the stream from any thread."""

    def __init__(self, runtime: "LazyRuntime", plan: Plan, gen: dict):
        self.result = None
        self.stats: dict | None = None
        self._runtime, self._plan, self._gen = runtime, plan, gen
        self._it = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._it

    def __next__(self) -> str:
        return next(self._it)

    def _run(self) -> Iterator[str]:
        rt = self._runtime
        stream = rt.llm.generate(self._plan.segments, stream=True, source=self._plan.source, **self._gen)
        yield from stream
        self.result = stream.result
        self.stats = rt._record(self.result, self._plan)


async def aiter_in_thread(it: Iterable) -> AsyncIterator:
    """Drive a blocking iterator from worker threads so the event loop stays free."""
    it = iter(it)
    while True:
        item = await asyncio.to_thread(next, it, _DONE)
        if item is _DONE:
            return
        yield item


class RuntimeBacked:
    """What every adapter class exposes of its ``LazyRuntime`` (kept in ``self._runtime``)."""

    @property
    def runtime(self) -> "LazyRuntime":
        return self._runtime

    @property
    def last_stats(self) -> dict | None:
        """Stats of the latest call: prompt_tokens, cached_tokens, computed_tokens, chunk_ids..."""
        return self._runtime.last_stats

    def register(self, texts, ids=None) -> list[str]:
        """Make these texts reusable from the LLM's chunk cache when they appear in prompts."""
        return self._runtime.register(texts, ids)


class LazyRuntime:
    """``LazyRuntime(llm=lazy_llm)`` (chunks registered with ``register``, KV encoded on first use
    and kept in the engine's memory tiers) or ``LazyRuntime(index=lazy_index)`` (the index's
    chunks, KV from its store). Frameworks call models from thread pools (LangChain batch, async
    executors): the matcher tokenizes under the model's one lock (``LazyLLM.lock``)."""

    def __init__(self, llm=None, index=None, mode: str = "lazy", defaults: dict | None = None):
        if index is None and llm is None:
            raise LazyRagError("Give a LazyLLM (llm=...) or a LazyIndex (index=...).")
        if index is not None and llm is not None and llm is not index.llm:
            raise LazyRagError("llm= and index= disagree: the index was loaded with another LazyLLM; pass "
                               "only index= (its LLM is used) or load the index with this LLM.")
        self.index = index
        self.llm = index.llm if index is not None else llm
        self.mode = mode
        self.defaults = dict(defaults or {})
        self.matcher = ChunkMatcher.from_index(index) if index is not None else ChunkMatcher(self.llm.tokenizer)
        self.last_stats: dict | None = None
        self.last_result = None  # the latest GenerationResult (token ids included)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def register(self, texts: Iterable[str], ids: Iterable[str] | None = None) -> list[str]:
        """Make these texts reusable when they appear in prompts (KV encoded on first use)."""
        with self.llm.lock:
            return [c.chunk_id for c in self.matcher.add_many(texts, ids)]

    def chat_prompt(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``(role, content)`` pairs with the model's chat template."""
        return render_messages(self.tokenizer, messages, add_generation_prompt)

    # -- planning -------------------------------------------------------------------------------
    def plan_prompt(self, prompt: str, chunk_ids: Sequence[str] | None = None, reuse: bool = True) -> Plan:
        """Transparent path: reuse every known chunk whose text occurs verbatim in ``prompt``
        (only ``chunk_ids`` when given)."""
        if not reuse:
            return Plan([prompt], None, reuse="none")
        with self.llm.lock:
            return plan_prompt(self.matcher, prompt, index=self.index, chunk_ids=chunk_ids)

    def plan_question(self, question: str, chunks: Sequence[tuple[str | None, str | None]],
                      system_prompt: str | None = None) -> Plan:
        """Exact path: the question over ``(chunk_id, text)`` pairs, assembled from token ids with
        lazy-rag's RAG template (as ``LazyIndex.query``; ``planning.plan_chunks``)."""
        return plan_chunks(self.tokenizer, question, chunks, index=self.index, system_prompt=system_prompt)

    # -- running --------------------------------------------------------------------------------
    def generation_kwargs(self, kwargs: dict) -> dict:
        """Defaults, then the call's generation options; other framework kwargs are ignored."""
        gen = {"mode": self.mode, **self.defaults}
        for k, v in kwargs.items():
            k = _ALIASES.get(k, k)
            if k in GENERATION_KEYS and v is not None:
                gen[k] = v
        if self.index is not None and "recovery" not in gen:  # the index's default recovery
            gen["recovery"] = choose_recovery(gen["mode"], None, gen.pop("boundary_recompute", None),
                                              default=self.index.recovery)
        return gen

    def stream(self, plan: Plan, **kwargs) -> RunStream:
        return RunStream(self, plan, self.generation_kwargs(kwargs))

    def run(self, plan: Plan, **kwargs):
        s = self.stream(plan, **kwargs)
        for _ in s:
            pass
        return s.result, s.stats

    def _record(self, result, plan: Plan) -> dict:
        stats = result.stats.as_dict()
        stats.update(chunk_ids=list(plan.chunk_ids), reuse=plan.reuse, finish_reason=result.finish_reason)
        if plan.note:
            stats["note"] = plan.note
        self.last_stats, self.last_result = stats, result
        return stats
