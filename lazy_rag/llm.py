"""``LazyLLM``: the public face of the runtime, a facade over a ``ModelHost`` (checkpoint,
tokenizer, prompt layout and checks) and its ``Engine`` (the one runtime that serves every
request, on CUDA and on the CPU). Modes and result types: ``lazy_rag.requests``.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from .engine import Engine, EngineConfig, engine_for
from .model_host import ModelHost
from .engine.recovery import Recovery
from .requests import ChunkSource, GenerationResult, GenerationStream, SamplingParams
from .segments import Chunk, PromptLayout, Segment, chunk_token_ids
from .structured import OutputFormat
from .chunk_kv import ChunkKV


class LazyLLM:
    """A transformers causal LM that answers from cached, position-free chunk KV.

    ``LazyLLM(model, tokenizer)`` wraps a loaded model; ``LazyLLM.from_pretrained(name)`` loads a
    bundled name, a local folder, a GGUF file or a hub id. ``shared_prefix`` (text or ids): chunks
    that are not an index's are encoded after it, and prompts must start with it (off by default).
    ``wrapper``: the chunk wrapper those chunks are encoded inside (``from_pretrained`` default
    "auto": the bundled wrapper of a bundled model; "none" for none; an index brings its own).
    ``engine_config`` / keyword options (``kv_bytes``, ``page_size``, ``max_num_seqs``, ``policy``,
    ``tensor_parallel``, ...: ``EngineConfig``) size the engine, which is created on first use;
    ``tensor_parallel=N`` splits the model over N processes (``engine/tp_engine.py``).
    """

    def __init__(self, model, tokenizer, *, shared_prefix: str | Sequence[int] | None = None,
                 engine_config: EngineConfig | None = None, wrapper=None, **engine_options):
        self.host = ModelHost(model, tokenizer, shared_prefix=shared_prefix, wrapper=wrapper)
        self.engine_config = (engine_config or EngineConfig()).with_options(**engine_options)
        self._engine: Engine | None = None
        self._engine_guard = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", device: str = "auto", dtype: str = "auto",
                        wrapper="auto", experts: str | None = None, **kwargs) -> "LazyLLM":
        """``experts``: what runs a mixture-of-experts model's routed experts (``lazy_rag.experts``:
        "auto", the default: the Triton experts kernel on CUDA; "grouped_mm": transformers';
        "triton")."""
        from .models import load_model_and_tokenizer

        # over N ranks, this process loads rank 0's share of the model alone (the others theirs)
        config = (kwargs.pop("engine_config", None) or EngineConfig()).with_options(
            **{k: kwargs.pop(k) for k in list(kwargs) if k in EngineConfig.__dataclass_fields__})
        model, tokenizer = load_model_and_tokenizer(name_or_path, device=device, dtype=dtype,
                                                    tensor_parallel=config.tensor_parallel, experts=experts)
        llm = cls(model, tokenizer, engine_config=config, **kwargs)
        llm.model_name = name_or_path
        if wrapper is not None:  # after the name: "auto" finds the bundled wrapper by it
            llm.host.use_default_wrapper(wrapper)
        return llm

    @property
    def engine(self) -> Engine:
        """The serving engine of this model, created on first use."""
        if self._engine is None:
            with self._engine_guard:
                if self._engine is None:
                    self._engine = engine_for(self.host, self.engine_config)
        return self._engine

    @property
    def lock(self) -> threading.RLock:
        """The one lock of this model's runtime (the engine's): hold it to use the tokenizer
        from several threads."""
        return self.engine.lock

    # -- what the host knows ----------------------------------------------------------------------
    model = property(lambda self: self.host.model)
    tokenizer = property(lambda self: self.host.tokenizer)
    device = property(lambda self: self.host.device)
    dtype = property(lambda self: self.host.dtype)
    shape = property(lambda self: self.host.shape)
    context_window = property(lambda self: self.host.context_window)
    fingerprint = property(lambda self: self.host.fingerprint)
    default_source = property(lambda self: self.host.default_source)

    @property
    def model_name(self) -> str | None:
        return self.host.model_name

    @model_name.setter
    def model_name(self, name: str | None) -> None:
        self.host.model_name = name

    @property
    def eos_ids(self) -> set[int]:
        return self.host.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.host.eos_ids = set(ids)

    def prepare(self, segments: Sequence[Segment] | Segment, source: ChunkSource | None = None,
                boundary_recompute: int = 0, mode: str | None = None) -> PromptLayout:
        """The token layout of a prompt (what the oracle and the engine both consume); ``mode``
        full or prefix leaves chunk wrapper slots out."""
        return self.host.prepare(segments, source, boundary_recompute, mode)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, segments, max_new_tokens: int | None = None, mode: str = "lazy",
                 temperature: float | None = None, top_p: float | None = None, stop: list[str] | str | None = None,
                 stream: bool = False, seed: int | None = None, source: ChunkSource | None = None,
                 boundary_recompute: int = 0, recovery: Recovery | str | None = None,
                 output_first_logits: bool = False, output_format: OutputFormat | None = None,
                 presence_penalty: float | None = None, frequency_penalty: float | None = None,
                 sampling: SamplingParams | None = None):
        """Generate from a prompt of segments. Returns a ``GenerationResult``, or with
        ``stream=True`` a ``GenerationStream`` of text pieces (its ``.result`` set at the end).
        ``sampling``: ``SamplingParams`` (default 128 new tokens, greedy); ``max_new_tokens``,
        ``temperature``, ``top_p``, ``stop``, ``seed`` and the penalties are shorthand for its fields.
        ``source``: where the chunks' KV is stored (``LazyIndex.chunk_source``).
        ``output_format``: the output must match it (``OutputFormat.json(schema)``, any JSON object
        with ``OutputFormat.json()``, a regex or a Lark grammar), enforced token by token.
        ``presence_penalty`` / ``frequency_penalty``: OpenAI's, over the tokens generated.
        ``recovery``: quality recovery for the reused chunks, e.g. "prophet20" (``Recovery``);
        ``boundary_recompute=N`` is short for recovery "epicN" (lazy/block modes)."""
        engine = self.engine
        sampling = SamplingParams.of(sampling, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     stop=stop, seed=seed, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty)
        handle = engine.submit(segments, mode=mode, sampling=sampling, source=source,
                               boundary_recompute=boundary_recompute, recovery=recovery,
                               output_first_logits=output_first_logits, output_format=output_format)
        out = GenerationStream(engine.pieces(handle), lambda: handle.result)
        if stream:
            return out
        for _ in out:
            pass
        return handle.result

    def next_token_logits(self, segments, mode: str = "lazy", source: ChunkSource | None = None,
                          boundary_recompute: int = 0, recovery: Recovery | str | None = None) -> torch.Tensor:
        """Logits [vocab] (fp32, on the host) for the token after the assembled prompt."""
        return self.generate(segments, max_new_tokens=1, mode=mode, source=source, recovery=recovery,
                             boundary_recompute=boundary_recompute, output_first_logits=True).first_logits

    def encode_chunk(self, token_ids: Sequence[int], shared_prefix: Sequence[int] | None = None) -> ChunkKV:
        """Position-free KV of one chunk (keys unrotated): its tokens attend only to themselves
        (and the shared prefix, default this model's; inside the default wrapper, whose slots'
        KV it includes)."""
        prefix = self.default_source.shared_prefix_ids if shared_prefix is None else shared_prefix
        return self.engine.encode_chunks([list(token_ids)], prefix, self.default_source.wrapper)[0]

    def warm_documents(self, texts: Sequence[str]) -> int:
        """Encode documents given as text into the engine's memory tiers (its GPU pool, then its
        host tier, as far as their budgets go), as a request that names them as chunks encodes
        them on first use: tokenized alone without specials, after the default shared prefix,
        inside the default wrapper. A server warmed this way (``lazy-rag serve
        --warm-documents``) serves their first requests from cache. Returns the tokens encoded."""
        source, pool = self.default_source, self.engine.pool
        with self.lock:  # the tokenizer is not safe to share between threads
            ids = [list(chunk_token_ids(self.tokenizer, Chunk(t))) for t in texts]  # as assemble() does
        slots = len(self.host.wrap_chunk([], source.wrapper))
        # a forward's chunks hold their pages at once: up to half the pool per call, so that the
        # chunks cached before are evicted to the host tier to make room
        room = max(1, pool.num_pages // 2)
        batch: list[list[int]] = []
        pages = 0
        for chunk in ids:
            need = pool.pages_for(len(chunk) + slots)
            if batch and pages + need > room:
                self.engine.encode_chunks(batch, source.shared_prefix_ids, source.wrapper)
                batch, pages = [], 0
            batch.append(chunk)
            pages += need
        if batch:
            self.engine.encode_chunks(batch, source.shared_prefix_ids, source.wrapper)
        return sum(map(len, ids))

    def stats(self) -> dict:
        """The engine's counters: pages, chunk hits per tier, steps, timers."""
        return self.engine.stats()


__all__ = ["LazyLLM", "GenerationResult", "GenerationStream"]
