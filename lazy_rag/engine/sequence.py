"""``Sequence``: one request inside the engine, its tokens, sampling rule and KV footprint.

The KV fields (``held``, ``private``, ``table`` ...) are filled by ``KVPlanner.admit`` and
cleared by ``KVPlanner.release``; after a preemption the sequence keeps its generated tokens and
is recomputed (prompt + output so far) when it is admitted again.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, auto

from ..segments import PromptLayout


class Status(Enum):
    WAITING = auto()    # no KV reserved
    RUNNING = auto()    # KV reserved; prefill pending (needs_prefill) or decoding
    FINISHED = auto()


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Run:
    """A run of tokens at contiguous logical positions whose KV lives in one list of pages."""

    pos: int          # logical position of the first token
    length: int       # tokens in the run
    pages: tuple      # physical pages holding them, in order (slot i -> pages[i // page_size])
    rot_shift: int    # rotation origin of the stored keys (chunk start; 0 for private runs)


_ids = itertools.count()


class Sequence:
    def __init__(self, layout: PromptLayout, mode: str = "lazy", params: SamplingParams | None = None,
                 shared_prefix: tuple = (), store=None, keep_first_logits: bool = False):
        self.id = next(_ids)
        self.store = store                # the request's chunk store (its index's), if any
        self.keep_first_logits = keep_first_logits
        self.layout = layout
        self.mode = mode
        self.params = params or SamplingParams()
        self.shared_prefix = tuple(shared_prefix)
        self.output: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.chunk_sources_seen: list[str] = []  # where its chunks came from at its last admission
        self.prefix_hit_tokens = 0               # prefix mode: prompt tokens reused at admission
        self.placed_by_refused: dict = {}        # chunk key -> its sources, placed by a refused admission
        self.clear_kv()

    def clear_kv(self) -> None:
        self.held: list = []             # CachedEntry references (chunks, prefix blocks)
        self.private: list[int] = []     # private pages
        self.cached_runs: list[Run] = []  # shared KV this sequence reads (chunks, prefix blocks)
        self.private_runs: list[Run] = []  # its own tokens, the last one grows while decoding
        self.compute_pos: list[int] = []  # positions the pending prefill computes
        self.transfers: list = []
        self.needs_prefill = False
        self.kv_len = 0                   # tokens whose KV is in the pool

    # -- tokens ---------------------------------------------------------------------------------
    @property
    def prompt(self) -> list[int]:
        return self.layout.token_ids

    @property
    def tokens(self) -> list[int]:
        return self.layout.token_ids + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.layout.token_ids) + len(self.output)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.compute_pos)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, mode={self.mode}, status={self.status.name}, out={len(self.output)})"
