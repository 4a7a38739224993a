"""``Sequence``: one request inside the engine, its tokens, sampling rule and KV footprint;
``EncodeJob``: one chunk being encoded; ``Run``: where a stretch of either's KV lives.

The KV fields (``held``, ``private``, runs ...) are filled by ``KVPlanner.admit`` and cleared by
``KVPlanner.release``; after a preemption the sequence keeps its generated tokens and is
recomputed (prompt + output so far) when it is admitted again.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

from ..requests import ChunkSource, SamplingParams
from ..segments import PromptLayout
from .recovery import Recovery


class Status(Enum):
    WAITING = auto()    # no KV reserved
    RUNNING = auto()    # KV reserved; prefill pending (needs_prefill) or decoding
    FINISHED = auto()


@dataclass(frozen=True)
class Run:
    """Tokens at contiguous logical positions whose KV lives in one list of pages.

    Keys are stored rotated at (logical position - rot_shift): 0 for a request's own tokens, the
    chunk's start for a chunk's pages (rotated at chunk-local positions). ``hidden``: offsets
    within the run this sequence must not see (the cached copies of a chunk's tokens that it
    recomputes privately); the pages themselves are shared and never written. ``positions``:
    a compact private run of scattered tokens (recomputed chunk tokens): slot i holds the token
    at ``positions[i]`` (sorted) instead of pos + i."""

    pos: int          # logical position of the first token
    length: int       # tokens in the run
    pages: tuple      # physical pages holding them, in order (slot i -> pages[i // page_size])
    rot_shift: int    # rotation origin of the stored keys
    hidden: frozenset = frozenset()
    positions: tuple | None = None

    def position(self, i: int) -> int:
        return self.positions[i] if self.positions is not None else self.pos + i


_ids = itertools.count()


class Sequence:
    def __init__(self, layout: PromptLayout, mode: str = "lazy", params: SamplingParams | None = None,
                 source: ChunkSource | None = None, keep_first_logits: bool = False,
                 recovery: Recovery | None = None, score_rows: int = 0, score_fn=None, cache_salt: str = "",
                 tenant: str | None = None):
        self.id = next(_ids)
        self.cache_salt = cache_salt  # keys its own chunks' and prompt pages' KV (Engine.submit)
        self.tenant = tenant          # whose request it is: the scheduler admits tenants in turn
        self.layout = layout
        self.mode = mode
        self.params = params or SamplingParams()
        self.source = source or ChunkSource()
        self.recovery = recovery or Recovery()
        self.keep_first_logits = keep_first_logits
        # teacher-forced scoring: the fp32 logits of the prompt's last ``score_rows`` rows (the
        # last predicts the first new token) go through ``score_fn`` once, in the prefill's step
        self.score_rows = score_rows
        self.score_fn = score_fn
        self.scored_logits = None         # set by ModelRunner.run for score_fn, then dropped
        self.output: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.chunk_sources_seen: list[str] = []  # where its chunks came from at its last admission
        self.encoded_tokens = 0                  # chunk tokens encoded for it (no tier held them), last admission
        self.prefix_hit_tokens = 0               # prefix mode: prompt tokens reused at admission
        self.placed_by_refused: dict = {}        # chunk key -> its sources, placed by a refused admission
        self.selected = 0                        # chunk tokens the selector chose (at the last admission)
        # reuse risk, measured on its first prefill's first token (reuse_risk; None: not measured)
        self.first_token_entropy: float | None = None
        self.reuse_risk: float | None = None
        self.asked_recovery = self.recovery      # what the request asked; ``recovery`` is what serves it
        self.clear_kv()

    def clear_kv(self) -> None:
        self.held: list = []              # CachedEntry references (chunks, prefix pages)
        self.private: list[int] = []      # private pages
        self.cached_runs: list[Run] = []  # shared KV this sequence reads (chunks, prefix pages)
        self.private_runs: list[Run] = []  # its own tokens, the last one grows while decoding
        self.compute_pos: list[int] = []  # positions the pending prefill computes
        self.block_copies: list = []      # block mode: (chunk entry, start) to copy before prefill
        self.recompute_pages: list[int] = []  # reserved for the selected tokens' compact private run
        self.recompute_budget = 0         # how many chunk tokens the selector recomputes
        # lazy mode: chunks no tier held (or slower to read than to encode), encoded by this
        # request's own prefill forward (kv_planner._place_missing_chunks), then cached (publish)
        self.encode_jobs: list = []       # their EncodeJobs, computed ahead of the request's tokens
        self.pending_chunks: dict = {}    # key -> (pages, token ids, chunk id, record valid on disk), per job
        self.encoded_kv: list = []        # their captured KV after the prefill (ModelRunner.run)
        self.needs_selection = False      # selection of the tokens to recompute is pending
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
        """Tokens its prefill forward computes: its own and those of the chunks it encodes."""
        return len(self.compute_pos) + sum(len(j.tokens) for j in self.encode_jobs)

    @property
    def recomputed(self) -> int:
        """Chunk tokens computed at query time: the boundary heads and the selected tokens."""
        return sum(min(span.skip, len(span.token_ids)) for span in self.layout.spans) + self.selected

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, mode={self.mode}, status={self.status.name}, out={len(self.output)})"


@dataclass
class EncodeJob:
    """A chunk being encoded: its tokens computed at positions p.. after the shared prefix's run
    (p = the prefix's length, 0 without one), attending to the prefix and causally to
    themselves; their keys written into the chunk's own pages rotated at chunk-local positions
    (the private run's rot_shift is p), i.e. exactly the pool's convention for chunk pages."""

    tokens: list[int]                      # prefix + chunk token ids
    cached_runs: list[Run] = field(default_factory=list)
    private_runs: list[Run] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def compute_pos(self) -> list[int]:
        run = self.private_runs[0]
        return list(range(run.pos, run.pos + run.length))
