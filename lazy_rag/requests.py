"""What a request is and what it returns: the four modes, sampling parameters, where a request's
chunks come from, stats, results and streams. Shared by the engine and the ``LazyLLM`` facade.

Modes (same model, same sampling; only KV reuse and attention differ):
- ``lazy``  chunk KV stored position-free, read in place, RoPE applied at attention time.
- ``block`` Block-Attention: chunk KV copied per request with keys re-rotated. Same function.
- ``prefix`` exact token-prefix reuse (vLLM-style); the rest recomputed with causal attention.
- ``full``  no reuse, causal attention over everything. ``prefix`` computes the same function.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from .errors import InvalidRequestError, LazyRagError

if TYPE_CHECKING:
    import torch

    from .chunk_kv import ChunkKVStore
    from .wrapper import ChunkWrapper

MODES = ("lazy", "block", "prefix", "full")
CHUNK_MODES = ("lazy", "block")  # the modes that reuse chunks encoded alone


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}.")
    return mode


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples its answer: the one place these options and their defaults live.
    ``LazyLLM.generate``, ``LazyIndex.query`` and ``Engine.submit`` take one (``sampling=``), and
    their keywords of the same names are shorthand for it (``SamplingParams.of``).

    Greedy when temperature is 0; ``stop`` strings end the answer (not included); ``seed``: the
    sampler's (temperature > 0), None for a random one. ``presence_penalty`` /
    ``frequency_penalty`` (OpenAI's, in [-2, 2]): each token already generated has its logit
    lowered by the first once and by the second per time it occurred."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @classmethod
    def of(cls, sampling: "SamplingParams | None" = None, **options) -> "SamplingParams":
        """``sampling`` (None: the defaults) with the ``options`` given (not None) in place of its."""
        given = {k: v for k, v in options.items() if v is not None}
        base = sampling if sampling is not None else cls()
        return dataclasses.replace(base, **given) if given else base


@dataclass(frozen=True)
class ChunkSource:
    """Where a request's cached chunks were encoded and where their KV is stored.

    ``shared_prefix_ids``: the tokens every chunk was encoded after (an attention sink; the
    prompt must start with them), empty for chunks encoded alone. ``store``: the disk store
    holding the chunks' KV files (an index's), or None: chunks are then encoded on first use
    and kept in the engine's memory tiers only. ``wrapper``: the chunk wrapper every chunk was
    encoded inside (``wrapper.ChunkWrapper``; its slots surround each chunk in lazy and block
    modes), or None. ``LazyIndex.chunk_source`` gives an index's.
    """

    shared_prefix_ids: tuple[int, ...] = ()
    store: "ChunkKVStore | None" = None
    wrapper: "ChunkWrapper | None" = None


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
    recovery: str = ""          # Recovery.name() of the request ("" for none)
    recomputed_tokens: int = 0  # chunk tokens recomputed at query time (boundary and selected)
    encoded_tokens: int = 0     # chunk tokens encoded for this request (no tier held them); in cached_tokens
    # reuse risk (lazy_rag.reuse_risk) of requests over cached chunks: the entropy (nats) of the
    # first token under reuse, and the calibrated probability that the answer differs from full
    # re-encoding's (None where the model and wrapper have no calibration)
    first_token_entropy: float | None = None
    reuse_risk: float | None = None
    served_again: bool = False  # recovery auto found it risky and served it again, recomputing (recovery_applied)
    recovery_applied: str = ""  # Recovery.name() it was finally served with (auto: what the risk chose)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV existed before this request (the OpenAI usage's cached_tokens)."""
        return max(self.cached_tokens - self.encoded_tokens, 0)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    first_logits: "torch.Tensor | None" = None  # [vocab] fp32, with output_first_logits=True
    score: object = None  # what the request's score_fn returned (teacher-forced scoring), else None


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
