"""``LazyLLM``: answer prompts made of uncached text and cached chunks, in four modes.

Modes (same model, same sampling; only KV reuse and attention differ):
- ``lazy``  chunk KV stored position-free, read in place, RoPE applied at attention time.
- ``block`` Block-Attention: chunk KV copied per request with keys re-rotated. Same function.
- ``prefix`` exact token-prefix reuse (vLLM-style); the rest recomputed with causal attention.
- ``full``  no reuse, causal attention over everything. ``prefix`` computes the same function.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .architecture import ModelHandles
from .decoder import Decoder
from .errors import LazyRagError, PromptTooLongError
from .fingerprint import model_fingerprint
from .kv import ChunkKV, ContiguousKV, LazyKV
from .lru import ByteLRU
from .prefix_cache import PrefixCache
from .sampling import TextAssembler, sample_next, validate_sampling
from .segments import PromptLayout, Segment, assemble, token_ids_key, tokenize_text

MODES = ("lazy", "block", "prefix", "full")
BACKENDS = ("auto", "engine", "torch")


@dataclass
class GenerationStats:
    mode: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    new_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    chunk_sources: dict = field(default_factory=dict)  # tier -> number of chunks served from it
    backend: str = "torch"  # "engine" (paged pool, Triton kernels on CUDA) or "torch" (one request)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    first_logits: torch.Tensor | None = None  # [vocab] fp32, with generate(..., output_first_logits=True)


class GenerationStream:
    """Iterate for text pieces as they are generated; ``.result`` is set once exhausted."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating (an engine request in flight is dropped and its KV freed)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


def default_cache_bytes(device: torch.device) -> int:
    """Budget of each in-memory KV cache when none is given: a fifth of the GPU's memory (the
    paper's 5 x 2048-token request is 1.25 GiB of KV for an 8B model), 2 GiB on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 5
    return 2 << 30


def _resolve_eos(model, tokenizer) -> set[int]:
    eos = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            eos.add(val)
        elif isinstance(val, (list, tuple)):
            eos.update(int(v) for v in val)
    # chat models end a turn with these even when the config names another EOS
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            eos.add(tid)
    return eos


class LazyLLM:
    """A transformers causal LM that answers from cached, position-free chunk KV.

    ``LazyLLM(model, tokenizer)`` wraps a loaded model; ``LazyLLM.from_pretrained(name)`` loads a
    bundled name, a local folder, a GGUF file or a hub id. ``shared_prefix`` (text or ids): every
    chunk is encoded after it, and prompts must start with it (off by default).

    ``backend``: ``"engine"`` serves requests through the paged serving engine (``lazy_rag.engine``:
    shared chunk pages, Triton lazy-RoPE kernels on CUDA, continuous batching across threads,
    CUDA-graph decode); ``"torch"`` is the one-request torch path (contiguous tensors, the CPU
    runtime); ``"auto"`` (default) picks the engine on CUDA when the kernels support the model
    (head_dim a multiple of 32) and torch otherwise. ``engine_options``: keyword arguments of
    ``Engine`` (e.g. ``kv_bytes``, ``page_size``, ``max_num_seqs``, ``policy``).
    """

    def __init__(self, model, tokenizer, *, shared_prefix: str | Sequence[int] | None = None,
                 chunk_cache_bytes: int | None = None, prefix_cache_bytes: int | None = None,
                 prefix_block_size: int = 16, backend: str = "auto", engine_options: dict | None = None):
        if backend not in BACKENDS:
            raise LazyRagError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
        self.backend = backend
        self.engine_options = dict(engine_options or {})
        self._engine = None
        self._engine_lock = threading.RLock()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.handles = ModelHandles(model)
        self.decoder = Decoder(self.handles)
        self.shape = self.handles.shape
        self.rope = self.handles.rope
        if isinstance(shared_prefix, str):
            shared_prefix = tokenize_text(tokenizer, shared_prefix, first=True)
        self.shared_prefix_ids: tuple[int, ...] = tuple(shared_prefix or ())
        default = default_cache_bytes(self.device)
        self.chunk_cache: ByteLRU[ChunkKV] = ByteLRU(chunk_cache_bytes or default, lambda c: c.nbytes)
        self.prefix_cache = PrefixCache(prefix_cache_bytes or default, prefix_block_size)
        self._prefix_kv: dict[tuple[int, ...], ChunkKV] = {}
        self.eos_ids = _resolve_eos(model, tokenizer)
        self._fingerprint = None
        self.model_name: str | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", device: str = "auto", dtype: str = "auto", **kwargs) -> "LazyLLM":
        from .models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(name_or_path, device=device, dtype=dtype)
        llm = cls(model, tokenizer, **kwargs)
        llm.model_name = name_or_path  # recorded in indexes so `lazy-rag query` reloads the same model
        return llm

    # -- serving engine ---------------------------------------------------------------------
    @property
    def uses_engine(self) -> bool:
        """Whether ``generate`` goes through the serving engine (see ``backend``)."""
        if self.backend != "auto":
            return self.backend == "engine"
        return self.device.type == "cuda" and self.shape.head_dim % 32 == 0

    @property
    def engine(self):
        """The serving engine of this model, created on first use. Its KV pool takes
        ``engine_options["kv_bytes"]``, default a fifth of the GPU's memory (2 GiB on the CPU)."""
        if self._engine is None:
            from .engine import Engine

            opts = {"kv_bytes": default_cache_bytes(self.device), "page_size": 16 if self.device.type == "cpu" else 64}
            opts.update(self.engine_options)
            self._engine = Engine(self, **opts)
        return self._engine

    # -- properties -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.handles.device

    @property
    def dtype(self) -> torch.dtype:
        return self.handles.dtype

    @property
    def context_window(self) -> int:
        return self.shape.max_positions

    @property
    def fingerprint(self) -> dict:
        """What stored KV depends on: model weights, tokenizer and RoPE (dtype recorded apart)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, self.tokenizer, self.rope)
        return self._fingerprint

    # -- chunk KV -----------------------------------------------------------------------------
    def _run_prefix(self, prefix: tuple[int, ...]) -> ChunkKV:
        kv = self._prefix_kv.get(prefix)
        if kv is None:
            kv = self._encode(list(prefix), ())
            self._prefix_kv[prefix] = kv
        return kv

    def _encode(self, ids: list[int], prefix: tuple[int, ...]) -> ChunkKV:
        p = len(prefix)
        work = ContiguousKV(self.rope, self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim,
                            p + len(ids), self.dtype, self.device, self.handles.scaling)
        if p:
            work.place_chunk(0, self._run_prefix(prefix))
        pos = torch.arange(p, p + len(ids), device=self.device)
        _, k, v = self.decoder.forward(torch.tensor(ids, device=self.device), pos, work,
                                       capture_kv=True, logits="none")
        return ChunkKV(k, v)

    def encode_chunk(self, token_ids: Sequence[int], shared_prefix: Sequence[int] | None = None) -> ChunkKV:
        """Position-free KV of one chunk: its tokens attend only to themselves (and the prefix)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise LazyRagError("Cannot encode an empty chunk.")
        prefix = self.shared_prefix_ids if shared_prefix is None else tuple(shared_prefix)
        if len(prefix) + len(ids) > self.context_window:
            raise PromptTooLongError(
                f"A chunk of {len(ids)} tokens (after a {len(prefix)}-token prefix) exceeds the "
                f"context window of {self.context_window}; use a smaller chunk size."
            )
        return self._encode(ids, prefix)

    def chunk_kv(self, token_ids: tuple[int, ...], chunk_id: str | None = None) -> tuple[ChunkKV, str]:
        """The default chunk KV source: an in-memory LRU, encoding on a miss."""
        key = (self.shared_prefix_ids, token_ids_key(token_ids))
        kv = self.chunk_cache.get(key)
        if kv is not None:
            return kv, "memory"
        kv = self.encode_chunk(token_ids)
        self.chunk_cache.put(key, kv)
        return kv, "encoded"

    # -- prompts ------------------------------------------------------------------------------
    def prepare(self, segments: Sequence[Segment] | Segment, kv_source=None, boundary_recompute: int = 0) -> PromptLayout:
        source = kv_source or self
        return assemble(self.tokenizer, segments, getattr(source, "shared_prefix_ids", ()), boundary_recompute)

    def check_fits(self, layout: PromptLayout, max_new_tokens: int) -> None:
        """PromptTooLongError unless the prompt and max_new_tokens fit the context window."""
        T = len(layout.token_ids)
        if T + max_new_tokens > self.context_window:
            raise PromptTooLongError(
                f"The prompt has {T} tokens and {max_new_tokens} more were requested, {T + max_new_tokens} "
                f"in all, but the model's context window is {self.context_window}. Retrieve fewer or "
                "smaller chunks, shorten the question, or lower max_new_tokens."
            )

    def _prefill(self, layout: PromptLayout, mode: str, max_new_tokens: int, kv_source):
        if mode not in MODES:
            raise LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}.")
        source = kv_source or self
        self.check_fits(layout, max_new_tokens)
        T = len(layout.token_ids)
        shp, dev = self.shape, self.device
        ids = torch.tensor(layout.token_ids, device=dev)
        stats = GenerationStats(mode=mode, prompt_tokens=T, cached_tokens=0, computed_tokens=T)
        dims = (shp.num_layers, shp.num_kv_heads, shp.head_dim)
        if mode in ("lazy", "block"):
            if not layout.uncached or layout.uncached[-1] != T - 1:
                raise LazyRagError(
                    "The prompt ends with a cached chunk; put the question (or any text) after the "
                    "last Chunk so the next token is computed with attention to every chunk."
                )
            pieces = []
            if layout.prefix_len:
                pieces.append((0, self._run_prefix(tuple(layout.token_ids[:layout.prefix_len]))))
                stats.chunk_sources["prefix"] = 1
            for span in layout.pieces:
                if not span.cached_tokens:
                    continue  # boundary recompute covers the whole chunk
                kv_c, tier = source.chunk_kv(span.token_ids, span.chunk_id)
                if kv_c.k.device != dev or kv_c.k.dtype != self.dtype:
                    kv_c = kv_c.to(dev, self.dtype)
                if span.skip:  # a view of the cached tail: the recomputed head replaces the rest
                    kv_c = ChunkKV(kv_c.k[:, span.skip:], kv_c.v[:, span.skip:])
                pieces.append((span.start + span.skip, kv_c))
                stats.chunk_sources[tier] = stats.chunk_sources.get(tier, 0) + 1
            new_pos = torch.tensor(layout.uncached, device=dev)
            if mode == "lazy":
                kv = LazyKV(self.rope, pieces, *dims, len(layout.uncached) + max_new_tokens, self.dtype, dev,
                            self.handles.scaling)
            else:
                kv = ContiguousKV(self.rope, *dims, T + max_new_tokens, self.dtype, dev, self.handles.scaling)
                for start, kv_c in pieces:
                    kv.place_chunk(start, kv_c)
        else:
            kv = ContiguousKV(self.rope, *dims, T + max_new_tokens, self.dtype, dev, self.handles.scaling)
            reused = 0
            if mode == "prefix":
                for blk_k, blk_v in self.prefix_cache.lookup(layout.token_ids, T - 1):
                    kv.place_rotated(reused, blk_k, blk_v)
                    reused += blk_k.shape[1]
            new_pos = torch.arange(reused, T, device=dev)
        logits, _, _ = self.decoder.forward(ids[new_pos], new_pos, kv)
        stats.computed_tokens = int(new_pos.numel())
        stats.cached_tokens = T - stats.computed_tokens
        return kv, logits[-1], stats

    def _remember_prefix(self, layout: PromptLayout, mode: str, kv) -> None:
        """Prefix mode keeps the prompt's KV blocks for later requests. Done after the first token:
        a paged engine writes KV into its blocks in place, so this copy is not part of TTFT."""
        if mode == "prefix":
            T = len(layout.token_ids)
            self.prefix_cache.insert(layout.token_ids, *kv.export(T))

    def next_token_logits(self, segments, mode: str = "lazy", kv_source=None, boundary_recompute: int = 0) -> torch.Tensor:
        """Logits [vocab] (fp32) for the token after the assembled prompt."""
        if self.uses_engine and not boundary_recompute:
            return self.generate(segments, max_new_tokens=1, mode=mode, kv_source=kv_source,
                                 output_first_logits=True).first_logits
        layout = self.prepare(segments, kv_source, boundary_recompute)
        kv, logits, _ = self._prefill(layout, mode, 0, kv_source)
        self._remember_prefix(layout, mode, kv)
        return logits

    def generate(self, segments, max_new_tokens: int = 128, mode: str = "lazy", temperature: float = 0.0,
                 top_p: float = 1.0, stop: list[str] | str | None = None, stream: bool = False,
                 seed: int | None = None, kv_source=None, boundary_recompute: int = 0,
                 output_first_logits: bool = False):
        """Generate from a prompt of segments. Returns a ``GenerationResult``, or with
        ``stream=True`` a ``GenerationStream`` of text pieces (its ``.result`` set at the end).
        ``boundary_recompute``: recompute the first N tokens of each chunk (lazy/block modes)."""
        validate_sampling(temperature, top_p, max_new_tokens)
        if isinstance(stop, str):
            stop = [stop]
        if mode not in MODES:
            raise LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}.")
        # the engine's pages start on page boundaries, so a chunk cannot start mid-page at its
        # first reused token: boundary recompute runs on the torch path
        if self.uses_engine and not boundary_recompute:
            return self._engine_generate(segments, max_new_tokens, mode, temperature, top_p, stop, stream,
                                         seed, kv_source, output_first_logits)
        t0 = time.perf_counter()
        layout = self.prepare(segments, kv_source, boundary_recompute)
        stream_obj = GenerationStream(iter(()))
        stream_obj._pieces = self._generate_pieces(layout, max_new_tokens, mode, temperature, top_p, stop,
                                                    seed, kv_source, t0, stream_obj, output_first_logits)
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def _engine_generate(self, segments, max_new_tokens, mode, temperature, top_p, stop, stream, seed,
                         kv_source, output_first_logits):
        with self._engine_lock:
            handle = self.engine.submit(segments, mode=mode, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                                        kv_source=kv_source, output_first_logits=output_first_logits)
        holder = GenerationStream(iter(()))
        holder._pieces = self._engine_pieces(handle, holder)
        if stream:
            return holder
        for _ in holder:
            pass
        return holder.result

    def _engine_pieces(self, handle, holder: GenerationStream):
        """Drive the engine until this request is done. Any thread's step advances every
        request in flight, so concurrent callers are batched together."""
        sent = 0
        try:
            while True:
                while sent < len(handle.pieces):
                    yield handle.pieces[sent]
                    sent += 1
                if handle.done:
                    break
                with self._engine_lock:
                    stepped = handle.done or self.engine.step()
                if not stepped:
                    time.sleep(0)  # chunk transfers in flight
        finally:
            if not handle.done:  # the consumer stopped early
                with self._engine_lock:
                    self.engine.abort(handle)
        holder.result = handle.result

    @torch.inference_mode()
    def _generate_pieces(self, layout, max_new_tokens, mode, temperature, top_p, stop, seed, kv_source,
                         t0, holder: GenerationStream, keep_first_logits: bool = False):
        gen = None
        if temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else torch.seed())
        kv, logits, stats = self._prefill(layout, mode, max_new_tokens, kv_source)
        first_logits = logits.cpu() if keep_first_logits else None
        tok = sample_next(logits.cpu(), temperature, top_p, gen)
        stats.ttft_ms = (time.perf_counter() - t0) * 1e3
        self._remember_prefix(layout, mode, kv)
        t_first = time.perf_counter()
        text = TextAssembler(self.tokenizer, stop)
        out: list[int] = []
        pos = len(layout.token_ids)
        finish = "length"
        while True:
            if tok in self.eos_ids:
                finish = "stop"
                break
            out.append(tok)
            piece = text.push(out)
            if piece:
                yield piece
            if text.stopped:
                finish = "stop"
                break
            if len(out) >= max_new_tokens:
                break
            p = torch.tensor([pos], device=self.device)
            logits, _, _ = self.decoder.forward(torch.tensor([tok], device=self.device), p, kv)
            pos += 1
            tok = sample_next(logits[-1].cpu(), temperature, top_p, gen)
        tail = text.flush()
        if tail:
            yield tail
        now = time.perf_counter()
        stats.total_ms = (now - t0) * 1e3
        stats.new_tokens = len(out)
        if len(out) > 1:
            stats.decode_tokens_per_s = (len(out) - 1) / max(now - t_first, 1e-9)
        holder.result = GenerationResult(text=text.text, token_ids=out, stats=stats, finish_reason=finish,
                                         first_logits=first_logits)
