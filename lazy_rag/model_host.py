"""``ModelHost``: one loaded checkpoint and everything about it a request needs before any
attention runs: the tokenizer and its EOS ids, the context window, the fingerprint that ties
stored KV to this model, and the assembly of a prompt's segments into a token layout with the
checks every request must pass. The engine takes a host; ``LazyLLM`` is a facade over both.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .architecture import ModelParts
from .errors import LazyRagError, PromptTooLongError
from .fingerprint import model_fingerprint
from .kernels import compiler_setup
from .requests import CHUNK_MODES, ChunkSource, check_mode
from .segments import PromptLayout, Segment, assemble, tokenize_text
from .wrapper import ChunkWrapper, WrapperTable, resolve_wrapper


def resolve_eos(model, tokenizer) -> set[int]:
    eos = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            eos.add(val)
        elif isinstance(val, (list, tuple)):
            eos.update(int(v) for v in val)
    # chat models end a turn with these even when the config names another EOS
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in vocab else None
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            eos.add(tid)
    return eos


class ModelHost:
    """A transformers causal LM of a supported family (``architecture.SUPPORTED_MODEL_TYPES``)
    with its tokenizer. ``shared_prefix`` (text or ids): the default chunk source's prefix, for
    chunks that are not an index's (an index brings its own, ``LazyIndex.chunk_source``).
    ``wrapper``: the default source's chunk wrapper ("auto": the bundled one of a bundled model;
    ``from_pretrained`` uses "auto"; None or "none": no wrapper)."""

    def __init__(self, model, tokenizer, *, shared_prefix: str | Sequence[int] | None = None,
                 model_name: str | None = None, wrapper=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.parts = ModelParts(model)
        compiler_setup.start(self.parts.device)   # (a model loaded elsewhere: from here)
        self.shape = self.parts.shape
        # the RoPE the engine's pool keeps keys rotated by (each layer's own table where they
        # differ); the fingerprint's is the global table, parts.rope_table
        self.pool_rope = self.parts.pool_rope
        if isinstance(shared_prefix, str):
            shared_prefix = tokenize_text(tokenizer, shared_prefix, first=True)
        self.default_source = ChunkSource(tuple(int(t) for t in shared_prefix or ()))
        self.eos_ids = resolve_eos(model, tokenizer)
        self.model_name = model_name  # recorded in indexes so `lazy-rag query` reloads the same model
        self._fingerprint = None
        self.wrappers = WrapperTable(self.parts)
        if wrapper is not None:
            self.use_default_wrapper(wrapper)

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", device: str = "auto", dtype: str = "auto",
                        wrapper="auto", **kwargs) -> "ModelHost":
        """A bundled name, a local HF folder, a .gguf file or a hub id (see ``lazy_rag.models``)."""
        from .models import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(name_or_path, device=device, dtype=dtype)
        return cls(model, tokenizer, model_name=name_or_path, wrapper=wrapper, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.dtype

    @property
    def context_window(self) -> int:
        return self.shape.max_positions

    @property
    def fingerprint(self) -> dict:
        """What stored KV depends on: model weights, tokenizer and RoPE (dtype recorded apart)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, self.tokenizer, self.parts.rope_table)
        return self._fingerprint

    # -- prompts ----------------------------------------------------------------------------------
    def prepare(self, segments: Sequence[Segment] | Segment | PromptLayout, source: ChunkSource | None = None,
               boundary_recompute: int = 0, mode: str | None = None) -> PromptLayout:
        """The token layout of a prompt: every token, its logical position, and which spans are
        cached chunks (encoded after ``source``'s shared prefix, inside its wrapper). ``full`` and
        ``prefix`` prompts never carry wrapper slots: they are the plain prompt. A layout already
        prepared for the same source, recovery and mode is used as it is (a tensor-parallel
        worker gets rank 0's: tokenizing and checking the prompt again would delay its step)."""
        if isinstance(segments, PromptLayout):
            return segments
        source = source or self.default_source
        wrap = ((), ())
        if source.wrapper is not None and (mode is None or mode in CHUNK_MODES):
            wrap = self.wrapper_ids(source.wrapper)
        return assemble(self.tokenizer, segments, source.shared_prefix_ids, boundary_recompute, wrap)

    def wrapper_ids(self, wrapper: ChunkWrapper) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(header, trailer) virtual token ids of ``wrapper`` in this host."""
        return self.wrappers.ids(wrapper)

    def wrap_chunk(self, token_ids: Sequence[int], wrapper: ChunkWrapper | None) -> list[int]:
        """A chunk's ids as it is encoded: inside the wrapper's slots when it has one."""
        if wrapper is None:
            return [int(t) for t in token_ids]
        head, tail = self.wrapper_ids(wrapper)
        return [*head, *(int(t) for t in token_ids), *tail]

    def resolve_wrapper(self, spec) -> ChunkWrapper | None:
        """A wrapper by spec ("auto", "none", a bundled name, a path), checked against this model."""
        return resolve_wrapper(spec, self.model_name, self.fingerprint)

    def use_default_wrapper(self, spec="auto") -> None:
        """Chunks given as text (no index) are encoded inside this wrapper (the bundled one by
        default for a bundled model)."""
        self.default_source = ChunkSource(self.default_source.shared_prefix_ids, None, self.resolve_wrapper(spec))

    def check_request(self, layout: PromptLayout, mode: str, max_new_tokens: int) -> None:
        """The rules every request must pass, whatever serves it."""
        check_mode(mode)
        if mode in CHUNK_MODES:
            T = len(layout.token_ids)
            if not layout.uncached or layout.uncached[-1] != T - 1:
                raise LazyRagError(
                    "The prompt ends with a cached chunk; put the question (or any text) after the last "
                    "Chunk so the next token is computed with attention to every chunk."
                )
        self.check_fits(layout, max_new_tokens)

    def check_fits(self, layout: PromptLayout, max_new_tokens: int) -> None:
        """PromptTooLongError unless the prompt and max_new_tokens fit the context window."""
        T = len(layout.token_ids)
        if T + max_new_tokens > self.context_window:
            raise PromptTooLongError(
                f"The prompt has {T} tokens and {max_new_tokens} more were requested, {T + max_new_tokens} "
                f"in all, but the model's context window is {self.context_window}. Retrieve fewer or "
                "smaller chunks, shorten the question, or lower max_new_tokens."
            )

    def check_chunk(self, token_ids: Sequence[int], shared_prefix: Sequence[int]) -> None:
        if not token_ids:
            raise LazyRagError("Cannot encode an empty chunk.")
        if len(shared_prefix) + len(token_ids) > self.context_window:
            raise PromptTooLongError(
                f"A chunk of {len(token_ids)} tokens (after a {len(shared_prefix)}-token prefix) exceeds the "
                f"context window of {self.context_window}; use a smaller chunk size."
            )
