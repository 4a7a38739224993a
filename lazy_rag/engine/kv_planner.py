"""``KVPlanner``: where each sequence's KV lives in the pool, per mode. The only mode-specific
memory logic of the engine; the scheduler and the model runner are the same for all modes.

Every sequence is described by *runs* (``sequence.Run``): tokens at contiguous logical
positions stored in a list of pages, with the rotation origin of their keys. A run starts on a
page boundary (the kernels' page table has no in-page offset), so each contiguous stretch of a
request's own tokens gets its own pages.

- ``lazy``:   chunk runs point at the shared chunk pages (rot_shift = chunk start, keys at
              chunk-local rotation); private runs for template/question/generated tokens.
- ``block``:  one private run over the whole prompt; chunks are placed in the pool as in lazy
              (so they are cached and shared between requests), then *copied* into the run with
              keys re-rotated to their logical positions (Block-Attention), and released. The copy
              occupies the request's pages for its whole life.
- ``prefix``: reused prefix blocks (hash chain, keys rotated at absolute positions) + one
              private run for the rest; after prefill the request's full prompt blocks are
              handed to the cache (``publish``).
- ``full``:   one private run over everything.
"""
from __future__ import annotations

import torch

from ..errors import LazyRagError
from ..kernels import copy_rotate_run
from .block_manager import BlockManager
from .page_pool import OutOfPages
from .sequence import Run, Sequence
from .tiers import ChunkTiers, chunk_key

MODES = ("lazy", "block", "prefix", "full")


def contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """[(start, length)] of maximal runs of consecutive positions (input sorted)."""
    runs = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(a, n) for a, n in runs]


class KVPlanner:
    def __init__(self, bm: BlockManager, tiers: ChunkTiers, rope, convention: str = "rotate_q"):
        if convention != "rotate_q":
            raise NotImplementedError("the engine stores keys in the rotate_q convention only")
        self.bm, self.tiers, self.rope, self.convention = bm, tiers, rope, convention
        self.pool = bm.pool
        self.inv_freq = rope.inv_freq.to(self.pool.device, torch.float32)

    # -- scheduler protocol ---------------------------------------------------------------------
    def admit(self, seq: Sequence) -> bool:
        seq.chunk_sources = []
        seq.placed_now = {}
        try:
            getattr(self, f"_admit_{seq.mode}")(seq)
        except OutOfPages:
            self.release(seq)
            seq.placed_by_refused.update(seq.placed_now)
            return False
        seq.placed_by_refused.clear()
        # counted once per admission (a refused admission is retried and must not count twice)
        for src in seq.chunk_sources:
            self.bm.counters[f"chunk_{src}"] += 1
        seq.chunk_sources_seen = list(seq.chunk_sources)
        seq.needs_prefill = True
        return True

    def ready(self, seq: Sequence) -> bool:
        for e in seq.held:
            t = e.meta.get("transfer")
            if t is not None:
                if not t.ready():
                    return False
                t.wait()
                e.meta.pop("transfer", None)
        return True

    def append_slot(self, seq: Sequence) -> bool:
        """Room for the KV of the token at position seq.num_tokens - 1 at the end of the last run."""
        run = seq.private_runs[-1]
        assert run.pos + run.length == seq.num_tokens - 1, (run, seq.num_tokens)
        if run.length + 1 > len(run.pages) * self.pool.page_size:
            try:
                page = self.bm.allocate(1)
            except OutOfPages:
                return False
            seq.private += page
            run = Run(run.pos, run.length, run.pages + tuple(page), run.rot_shift)
        seq.private_runs[-1] = Run(run.pos, run.length + 1, run.pages, run.rot_shift)
        seq.compute_pos = [seq.num_tokens - 1]
        return True

    def release(self, seq: Sequence) -> None:
        self.bm.release_all(seq.held)
        self.bm.free(seq.private)
        seq.clear_kv()

    # -- admission per mode ---------------------------------------------------------------------
    def _private_run(self, seq: Sequence, pos: int, length: int) -> Run:
        pages = self.bm.allocate(self.pool.pages_for(length))
        seq.private += pages
        run = Run(pos, length, tuple(pages), 0)
        seq.private_runs.append(run)
        return run

    def _chunks(self, seq: Sequence):
        """(start, token_ids, chunk_id, shared_prefix) of every cached piece of the prompt."""
        lay = seq.layout
        if lay.prefix_len:
            yield 0, tuple(lay.token_ids[:lay.prefix_len]), None, ()
        for span in lay.pieces:
            if span.skip:
                raise LazyRagError("boundary_recompute is not supported by the serving engine yet")
            yield span.start, span.token_ids, span.chunk_id, seq.shared_prefix

    def _acquire_chunk(self, seq: Sequence, ids, chunk_id, prefix):
        key = chunk_key(ids, chunk_id, prefix)
        e = self.bm.lookup(key)
        if e is not None:
            self.bm.acquire(e)
            # resident in the pool: a hit, unless this request placed it itself in an admission
            # that was then refused for lack of pages (it still came from a lower tier)
            seq.chunk_sources += seq.placed_by_refused.pop(key, ["hits"])
        else:
            kv, tier = self.tiers.fetch(key, ids, chunk_id, prefix, store=seq.store)
            e = self.bm.insert(key, len(ids), cost=len(ids))
            e.meta["transfer"] = self.tiers.place(self.pool, e.pages, kv, self.rope, self.convention)
            seq.chunk_sources += ["misses", f"from_{tier}"]
            seq.placed_now[key] = ["misses", f"from_{tier}"]
        seq.held.append(e)
        return e

    def _new_positions(self, seq: Sequence) -> list[int]:
        return list(seq.layout.uncached) + list(range(len(seq.prompt), seq.num_tokens))

    def _check_ends_uncached(self, seq: Sequence) -> None:
        T = len(seq.prompt)
        if not seq.layout.uncached or seq.layout.uncached[-1] != T - 1:
            raise LazyRagError("The prompt ends with a cached chunk; put the question (or any text) "
                               "after the last Chunk.")

    def _admit_lazy(self, seq: Sequence) -> None:
        self._check_ends_uncached(seq)
        for start, ids, cid, prefix in self._chunks(seq):
            e = self._acquire_chunk(seq, ids, cid, prefix)
            seq.cached_runs.append(Run(start, len(ids), tuple(e.pages), start))
        seq.compute_pos = self._new_positions(seq)
        for pos, n in contiguous_runs(seq.compute_pos):
            self._private_run(seq, pos, n)

    def _admit_block(self, seq: Sequence) -> None:
        self._check_ends_uncached(seq)
        run = self._private_run(seq, 0, seq.num_tokens)
        seq.block_starts = []
        for start, ids, cid, prefix in self._chunks(seq):
            self._acquire_chunk(seq, ids, cid, prefix)
            seq.block_starts.append(start)
        seq.compute_pos = self._new_positions(seq)
        seq.block_run = run

    def materialize(self, seq: Sequence) -> None:
        """Block mode, before prefill: copy each chunk into the request's run with keys re-rotated
        from chunk-local to logical positions, then drop the chunk references."""
        if seq.mode != "block" or not seq.held:
            return
        run = seq.block_run
        dev = self.pool.device
        dst = torch.tensor(run.pages, device=dev)
        for e, start in zip(seq.held, seq.block_starts):
            # one fused kernel per chunk: read its pages once, keys rotated by `start`, written
            # into the request's run (CPU: the same in torch)
            copy_rotate_run(self.pool.k, self.pool.v, torch.tensor(e.pages, device=dev), e.num_tokens, dst,
                            start, start, self.inv_freq)
            self.bm.counters["block_copied_bytes"] += e.num_tokens * self.pool.bytes_per_page // self.pool.page_size
        self.bm.release_all(seq.held)
        seq.held = []

    def _admit_prefix(self, seq: Sequence) -> None:
        ps = self.pool.page_size
        blocks = self.bm.match_prefix(seq.tokens, seq.num_tokens - 1)
        seq.held.extend(blocks)
        for i, e in enumerate(blocks):
            seq.cached_runs.append(Run(i * ps, ps, tuple(e.pages), 0))
        reused = len(blocks) * ps
        seq.prefix_hit_tokens = reused
        self._private_run(seq, reused, seq.num_tokens - reused)
        seq.compute_pos = list(range(reused, seq.num_tokens))

    def _admit_full(self, seq: Sequence) -> None:
        self._private_run(seq, 0, seq.num_tokens)
        seq.compute_pos = list(range(seq.num_tokens))

    def publish(self, seq: Sequence) -> None:
        """Prefix mode, after prefill: hand the request's full prompt blocks to the prefix cache."""
        if seq.mode != "prefix":
            return
        ps = self.pool.page_size
        run = seq.private_runs[0]
        keys = self.bm.prefix_keys(seq.prompt)
        for b in range(run.pos // ps, len(keys)):
            page = run.pages[b - run.pos // ps]
            if self.bm.lookup(keys[b]) is None:
                seq.private.remove(page)
                seq.held.append(self.bm.adopt(keys[b], [page], ps))
