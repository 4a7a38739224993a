"""What a request is and what it returns: the four modes, sampling parameters, where a request's
chunks come from, stats, results and streams. Shared by the engine and the ``LazyLLM`` facade.

Modes (same model, same sampling; only KV reuse and attention differ):
- ``lazy``  chunk KV stored position-free, read in place, RoPE applied at attention time.
- ``block`` Block-Attention: chunk KV copied per request with keys re-rotated. Same function.
- ``prefix`` exact token-prefix reuse (vLLM-style); the rest recomputed with causal attention.
- ``full``  no reuse, causal attention over everything. ``prefix`` computes the same function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from .errors import LazyRagError

if TYPE_CHECKING:
    import torch

    from .store import ChunkStore

MODES = ("lazy", "block", "prefix", "full")
CHUNK_MODES = ("lazy", "block")  # the modes that reuse chunks encoded alone


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}.")
    return mode


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature is 0; ``stop`` strings end the answer (not included)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class ChunkSource:
    """Where a request's cached chunks were encoded and where their KV is stored.

    ``shared_prefix_ids``: the tokens every chunk was encoded after (an attention sink; the
    prompt must start with them), empty for chunks encoded alone. ``store``: the disk store
    holding the chunks' KV files (an index's), or None: chunks are then encoded on first use
    and kept in the engine's memory tiers only. ``LazyIndex.chunk_source`` gives an index's.
    """

    shared_prefix_ids: tuple[int, ...] = ()
    store: "ChunkStore | None" = None


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
    chunk_sources: dict = field(default_factory=dict)  # tier -> chunks served from it (pool, host, disk, encoded)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    first_logits: "torch.Tensor | None" = None  # [vocab] fp32, with output_first_logits=True


class GenerationStream:
    """Iterate for text pieces as they are generated; ``.result`` is set once exhausted.
    ``close()`` stops early: the request is dropped and its KV freed."""

    def __init__(self, pieces: Iterator[str], result: Callable[[], GenerationResult | None]):
        self._pieces = pieces
        self._result = result

    @property
    def result(self) -> GenerationResult | None:
        return self._result()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()
