"""``KVPlanner``: where each sequence's KV lives in the pool, per mode. The only mode-specific
memory logic of the engine; the scheduler and the model runner are the same for all modes.

Every sequence is described by *runs* (``sequence.Run``): tokens at contiguous logical
positions stored in a list of pages, with the rotation origin of their keys. A run starts on a
page boundary, so each contiguous stretch of a request's own tokens gets its own pages.

- ``lazy``:   chunk runs point at the shared chunk pages (rot_shift = chunk start, keys at
              chunk-local rotation); private runs for template/question/generated tokens. With
              boundary recompute the chunk's first tokens are hidden from this request in the
              shared run (``Run.hidden``) and computed again in a private run at the same positions.
- ``block``:  one private run over the whole prompt; chunks are placed in the pool as in lazy
              (so they are cached and shared between requests), then *copied* into the run with
              keys re-rotated to their logical positions (Block-Attention), and released. The copy
              occupies the request's pages for its whole life. Recomputed chunk heads overwrite
              their copied slots.
- ``prefix``: reused prefix pages (hash chain, keys rotated at absolute positions) + one private
              run for the rest; after prefill the request's full prompt pages are handed to the
              cache (``publish``).
- ``full``:   one private run over everything.

Selective recompute (``Recovery.select``): admission reserves pages for the tokens a selector
will pick (how many: ``recovery.recompute_budget``; which: ``recovery.choose_recomputed``); once
picked (``recompute``), lazy hides them in the shared chunk runs and computes
them into one compact private run with explicit positions; block overwrites their copied slots.

A chunk's KV comes from the first of: the pool, the host tier, the request's disk store, and
encoding by the model (straight into the chunk's pool pages, then kept in the host tier and
written back to the store). One key scheme throughout (``chunk_tiers.chunk_key``).

A lazy request encodes its missing chunks in its own prefill forward: each is an ``EncodeJob``
packed ahead of the request's tokens (``seq.encode_jobs``), written in every layer before the
request's attention reads it, into pages the request owns until ``publish`` hands them to the
cache. An encode then costs its tokens' share of a forward the request runs anyway, not a forward
of its own (on an 8B model a separate encode forward cost ~31 ms before the prefill's own: a cold
query was 3x slower than re-encoding everything in ``full``). Block mode copies its chunks before
the prefill and a selector reads them before it, so both still encode in a forward of their own.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from ..kernels.rope import LayerRopes, RopeTable
from ..requests import CHUNK_MODES
from .chunk_tiers import ChunkTiers, chunk_key, span_key
from .page_manager import PageManager
from .page_pool import OutOfPages
from .read_or_encode import ReadOrEncode
from .recovery import cached_chunk_tokens, recompute_budget, recomputes_every_chunk_token
from .sequence import EncodeJob, Run, Sequence


class ChunkBeingEncoded(OutOfPages):
    """A chunk this admission needs is being encoded by another admitted request's prefill: the
    admission is refused like one short of pages, and retried after that prefill has cached the
    chunk (one step later), rather than encoding it a second time in the same forward."""


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
    def __init__(self, pm: PageManager, tiers: ChunkTiers, pool_rope: RopeTable | LayerRopes, runner):
        # the rotation of the pool's keys (each layer's own table: ModelParts.pool_rope)
        self.pm, self.tiers, self.pool_rope, self.runner = pm, tiers, pool_rope, runner
        self.pool = pm.pool
        self.inv_freq = pool_rope.inv_freq.to(self.pool.device, torch.float32)
        self.chooser = ReadOrEncode()  # read a cold chunk's KV from the disk, or encode it again
        self.encoding: dict = {}       # chunk key -> the admitted request whose prefill encodes it
        # a tensor-parallel rank (rank_worker.attach): a chunk's copy into the pool counts as done
        # once queued, since whether a CUDA copy has finished yet differs per process and ranks
        # that admitted different requests would leave lockstep; the step's kernels wait for it
        # on the GPU (Transfer.wait) instead of the host for it
        self.lockstep = False

    # -- scheduler protocol ---------------------------------------------------------------------
    def admit(self, seq: Sequence) -> bool:
        seq.chunk_sources = []
        seq.placed_now = {}
        seq.encoded_now = 0
        seq.prefetched = {}
        try:
            if recomputes_every_chunk_token(seq):
                self._admit_recomputed(seq)
            else:
                self._place_missing_chunks(seq)
                getattr(self, f"_admit_{seq.mode}")(seq)
        except OutOfPages:
            self._drop_prefetched(seq)
            self.release(seq)
            seq.placed_by_refused.update(seq.placed_now)
            return False
        except BaseException:
            self._drop_prefetched(seq)
            self.release(seq)
            raise
        self._drop_prefetched(seq)
        seq.placed_by_refused.clear()
        # counted once per admission (a refused admission is retried and must not count twice)
        for src in seq.chunk_sources:
            self.pm.counters[f"chunk_{src}"] += 1
        seq.chunk_sources_seen = list(seq.chunk_sources)
        seq.encoded_tokens = seq.encoded_now
        seq.needs_prefill = True
        return True

    def ready(self, seq: Sequence) -> bool:
        for e in seq.held:
            t = e.meta.get("transfer")
            if t is not None:
                if not (self.lockstep or t.ready()):
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
                page = self.pm.allocate(1)
            except OutOfPages:
                return False
            seq.private += page
            run = Run(run.pos, run.length, run.pages + tuple(page), run.rot_shift)
        seq.private_runs[-1] = Run(run.pos, run.length + 1, run.pages, run.rot_shift)
        seq.compute_pos = [seq.num_tokens - 1]
        return True

    def release(self, seq: Sequence) -> None:
        self.publish_encoded(seq)  # chunks its prefill computed are cached (none if it never ran)
        for key in seq.pending_chunks:
            self.encoding.pop(key, None)
        self.pm.release_all(seq.held)
        self.pm.free(seq.private)
        seq.clear_kv()

    # -- chunks ---------------------------------------------------------------------------------
    def _chunks(self, seq: Sequence):
        """(start, token_ids, chunk_id, shared_prefix, skip, cache key) of every cached piece of
        the prompt: the shared prefix first (itself a chunk encoded alone), then the chunks in
        prompt order. Chunks recomputed whole (skip == length) have nothing to read and are left
        out. A chunk without an id is the caller's own text: keyed under the request's cache salt
        (an index's chunks, which have ids, and the shared prefix are shared by every caller)."""
        lay = seq.layout
        if lay.prefix_len:
            ids = tuple(lay.token_ids[:lay.prefix_len])
            yield 0, ids, None, (), 0, chunk_key(ids)
        prefix = seq.source.shared_prefix_ids
        for span in lay.spans:
            if span.cached_tokens:
                yield span.start, span.token_ids, span.chunk_id, prefix, span.skip, span_key(seq, span)

    def place_chunk(self, ids, chunk_id, prefix, store, key=None):
        """The chunk's pool entry, acquired once: resident already, or placed from the host tier
        or the disk store, or encoded. Returns (entry, tier: "pool", "host", "disk" or "encoded").
        With a shared prefix, its entry must be held by the caller (encoding reads it). ``key``:
        its cache key (default: unsalted, ``chunk_key(ids, prefix)``)."""
        key = chunk_key(ids, prefix) if key is None else key
        e = self.pm.lookup(key)
        if e is not None:
            return self.pm.acquire(e), "pool"
        kv, tier = self.tiers.fetch(key, ids, chunk_id, store, kv_dtype=self.pool.dtype)
        e = self.pm.insert(key, len(ids), cost=len(ids))
        try:
            if kv is not None:
                e.meta["transfer"] = self.tiers.place(self.pool, e.pages, kv, self.pool_rope)
            else:
                tier = "encoded"
                self.tiers.keep(key, self._encode_into(e, ids, prefix), ids, chunk_id, store)
        except BaseException:
            self.pm.discard(e)  # its pages were never filled: no one may find it
            raise
        return e, tier

    # -- a request's missing chunks, encoded together ----------------------------------------------
    def _place_missing_chunks(self, seq: Sequence) -> None:
        """Place every chunk of ``seq`` (after no shared prefix) that is not in the pool: from the
        host tier or the disk, or, for those no tier has and those whose stored KV is faster to
        encode than to read from the disk (``read_or_encode``), encoded all in one forward
        instead of one forward each. The entries wait in ``seq.prefetched`` (held) for the mode's
        admission to take them (``_acquire_chunk``)."""
        store = seq.source.store
        if seq.mode not in CHUNK_MODES or seq.source.shared_prefix_ids or not seq.layout.spans:
            # prefix and full reuse no chunk; chunks after a shared prefix are encoded one by one
            # with it held (place_chunk)
            return
        # lazy: encoded in the request's own prefill forward (module docstring), whose fixed cost
        # is paid anyway: the chooser weighs only the chunk's tokens against its read
        in_prefill = seq.mode == "lazy" and not seq.recovery.selects
        own = len(self._new_positions(seq)) if in_prefill else 0
        # ...unless encoding a chunk moves the step out of its captured graph (a chunk adapter's
        # chunk): the first such chunk pays an eager forward's fixed cost
        eager = False
        pending, tokens, short = [], 0, None
        # a quantised store's records are read whatever they cost: all of them at once
        self.tiers.read_ahead(store, [(key, ids, cid) for _, ids, cid, _, _, key in self._chunks(seq)
                                      if not self._placed(seq, key)])
        try:
            for _, ids, cid, prefix, _, key in self._chunks(seq):
                if self._placed(seq, key):
                    continue  # resident (or listed twice): the admission acquires it
                if key in self.encoding:
                    raise ChunkBeingEncoded(f"chunk {cid or key[-1][:12]} is being encoded by request "
                                            f"{self.encoding[key].id}")
                if not self.chooser.calibrated and store is not None and hasattr(store, "read_nowait"):
                    self._calibrate()
                leaves = in_prefill and not eager and self.runner.encode_leaves_graph(ids)
                kv, tier = self.tiers.fetch(key, ids, cid, store, kv_dtype=self.pool.dtype, chooser=self.chooser,
                                            batch_tokens=0 if leaves else tokens + own)
                if kv is None and in_prefill:
                    eager = eager or leaves
                    pages = tuple(self.pm.allocate(self.pool.pages_for(len(ids))))  # OutOfPages: refused
                    seq.private += pages
                    seq.pending_chunks[key] = (pages, ids, cid, tier == "recompute")
                    self.encoding[key] = seq
                    seq.encode_jobs.append(EncodeJob(list(ids), [], [Run(0, len(ids), pages, 0)]))
                    tokens += len(ids)
                    continue
                try:
                    e = self.pm.insert(key, len(ids), cost=len(ids))
                except OutOfPages as err:  # encode what fits (it stays cached), then refuse
                    short = err
                    break
                if kv is not None:
                    e.meta["transfer"] = self.tiers.place(self.pool, e.pages, kv, self.pool_rope)
                    seq.prefetched[key] = (e, tier)
                else:
                    pending.append((key, e, ids, cid, tier == "recompute"))
                    tokens += len(ids)
            if pending:
                jobs = [EncodeJob(list(ids), [], [Run(0, len(ids), tuple(e.pages), 0)]) for _, e, ids, _, _ in pending]
                t0 = self._clock()
                kvs = self.runner.encode(jobs)
                self.chooser.observe_encode(tokens, self._clock() - t0)
                for (key, e, ids, cid, valid_on_disk), kv in zip(pending, kvs):
                    # a chunk recomputed because reading it was slower keeps its record as it is
                    self.tiers.keep(key, kv, ids, cid, None if valid_on_disk else store)
                    seq.prefetched[key] = (e, "recomputed" if valid_on_disk else "encoded")
                pending = []
        except BaseException:
            for _, e, *_ in pending:
                self.pm.discard(e)  # never filled: no one may find it
            raise
        finally:
            self.tiers.drop_read_ahead()   # those not taken (a request refused part-way)
        if short is not None:
            raise short

    def _placed(self, seq: Sequence, key) -> bool:
        """Whether the chunk under ``key`` is resident, or already placed or pending for ``seq``."""
        return key in seq.prefetched or key in seq.pending_chunks or self.pm.lookup(key) is not None

    def _drop_prefetched(self, seq: Sequence) -> None:
        """Release the placed chunks the admission did not take (it failed before them); a retry
        still counts them as placed by this request."""
        for key, (e, tier) in seq.prefetched.items():
            seq.placed_now[key] = ["misses", f"from_{tier}"]
            self.pm.release(e)
        seq.prefetched = {}

    def _clock(self) -> float:
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        return time.perf_counter()

    def _calibrate(self) -> None:
        """Time probe encodes of a short and a long dummy chunk (``ReadOrEncode.calibrate``). On a
        GPU the probes are long enough that their difference is the per-token cost, not launch
        noise (32 vs 512 tokens gave 1e-9 s per token on an H100 for Qwen2.5-0.5B)."""
        def encode(n: int) -> None:
            pages = self.pm.allocate(self.pool.pages_for(n))
            try:
                self.runner.encode([EncodeJob([0] * n, [], [Run(0, n, tuple(pages), 0)])])
                self._clock()
            finally:
                self.pm.free(pages)
        cuda = self.pool.device.type == "cuda"
        small, large = (256, 2048) if cuda else (32, 512)
        room = (self.pool.num_free + self.pm.evictable_pages) * self.pool.page_size
        large = min(large, max(small + 1, room // 2))  # a probe fits in the pool
        # a CPU forward is slow and about linear in its tokens: one timing each (the first query
        # of a `lazy-rag query` on this machine pays the probes; later processes reuse the fit),
        # the average a floor on the per-token cost
        self.chooser.calibrate_kept(self._calibration_key(), encode, small=small, large=large,
                                    repeats=2 if cuda else 1, linear=not cuda)

    def calibrate(self) -> str:
        """Fit the read-or-encode chooser's encode costs now, unless it has a fit: a build calls
        this so that the probes (seconds on a CPU, tens of seconds for a 1.5B model) are paid while
        indexing and kept, not in the first query's TTFT. Returns where the fit came from."""
        if not self.chooser.calibrated:
            self._calibrate()
        return self.chooser.calibration

    def _calibration_key(self) -> str:
        """What an encode's speed depends on: the device, torch and its threads, the model's shape
        and dtype, the pool's dtype and page size (not the weights' values)."""
        dev = self.pool.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x{os.cpu_count()}"
        shp = self.runner.parts.shape
        return (f"{name} | torch {torch.__version__} threads {torch.get_num_threads()} | "
                f"layers {shp.num_layers} hidden {shp.hidden_size} heads {shp.num_heads}/{shp.num_kv_heads} "
                f"head_dim {shp.head_dim} vocab {shp.vocab_size} {self.runner.parts.dtype} | "
                f"pool {self.pool.dtype} page {self.pool.page_size}")

    def _acquire_chunk(self, seq: Sequence, key, ids, chunk_id, prefix):
        taken = seq.prefetched.pop(key, None)
        if taken is not None:  # placed by _place_missing_chunks, held for this admission
            e, tier = taken
        else:
            e, tier = self.place_chunk(ids, chunk_id, prefix, seq.source.store, key)
        seq.held.append(e)
        if tier == "pool":
            # a hit, unless this request placed it itself in an admission that was then refused
            # for lack of pages (it still came from a lower tier)
            sources = seq.placed_by_refused.pop(e.key, ["hits"])
        else:
            sources = seq.placed_now[e.key] = ["misses", f"from_{tier}"]
        seq.chunk_sources += sources
        if "from_encoded" in sources or "from_recomputed" in sources:
            seq.encoded_now += len(ids)
        return e

    def _encode_into(self, e, ids, prefix):
        """Encode a chunk into its (just allocated) pool pages after the shared prefix, whose
        entry the caller holds; returns the captured unrotated KV."""
        p = len(prefix)
        cached = []
        if p:
            pre = self.pm.lookup(chunk_key(prefix, ()))
            assert pre is not None and pre.refs > 0, "the shared prefix must be held while its chunks are encoded"
            cached = [Run(0, p, tuple(pre.pages), 0)]
        job = EncodeJob(list(prefix) + list(ids), cached, [Run(p, len(ids), tuple(e.pages), p)])
        (kv,) = self.runner.encode([job])
        return kv

    # -- admission per mode ---------------------------------------------------------------------
    def _private_run(self, seq: Sequence, pos: int, length: int) -> Run:
        pages = self.pm.allocate(self.pool.pages_for(length))
        seq.private += pages
        run = Run(pos, length, tuple(pages), 0)
        seq.private_runs.append(run)
        return run

    def _new_positions(self, seq: Sequence) -> list[int]:
        return list(seq.layout.uncached) + list(range(len(seq.prompt), seq.num_tokens))

    def _admit_lazy(self, seq: Sequence) -> None:
        counted = set()
        for start, ids, cid, prefix, skip, key in self._chunks(seq):
            pending = seq.pending_chunks.get(key)
            if pending is None:
                pages = tuple(self._acquire_chunk(seq, key, ids, cid, prefix).pages)
            else:  # encoded by this request's prefill
                pages = pending[0]
                if key not in counted:
                    counted.add(key)
                    seq.chunk_sources += ["misses", "from_recomputed" if pending[3] else "from_encoded"]
                    seq.encoded_now += len(ids)
            seq.cached_runs.append(Run(start, len(ids), pages, start, frozenset(range(skip))))
        seq.compute_pos = self._new_positions(seq)
        for pos, n in contiguous_runs(seq.compute_pos):
            self._private_run(seq, pos, n)
        self._reserve_recompute(seq)

    def _admit_block(self, seq: Sequence) -> None:
        self._private_run(seq, 0, seq.num_tokens)
        for start, ids, cid, prefix, _skip, key in self._chunks(seq):
            # a recomputed head is copied too, then overwritten by the prefill's own KV
            seq.block_copies.append((self._acquire_chunk(seq, key, ids, cid, prefix), start))
        seq.compute_pos = self._new_positions(seq)
        self._reserve_recompute(seq)

    # -- recovery: recomputing chunk tokens -----------------------------------------------------
    def _reserve_recompute(self, seq: Sequence) -> None:
        """For a selector, fix how many tokens it recomputes (``recovery.recompute_budget``) and
        (lazy) reserve their compact run's pages now, so that the selection can never run out of pages."""
        if not seq.recovery.selects:
            return
        seq.recompute_budget = recompute_budget(seq)
        if seq.recompute_budget and seq.mode == "lazy":
            seq.recompute_pages = self.pm.allocate(self.pool.pages_for(seq.recompute_budget))
            seq.private += seq.recompute_pages
        seq.needs_selection = seq.recompute_budget > 0

    def recompute(self, seq: Sequence, positions: list[int]) -> None:
        """Recompute these chunk tokens in this request's prefill, with attention to everything
        before them: hidden from this request in the shared chunk runs (lazy) and written to one
        compact private run at their own positions, or overwriting their copies (block)."""
        positions = sorted(positions)
        seq.needs_selection = False
        seq.selected = len(positions)
        seq.compute_pos = sorted(set(seq.compute_pos).union(positions))
        if seq.mode != "lazy":
            return
        runs = []
        for run in seq.cached_runs:  # the shared prefix's run holds no candidate: it stays as it is
            mine = {p - run.pos for p in positions if run.pos <= p < run.pos + run.length}
            runs.append(replace(run, hidden=run.hidden | mine) if mine else run)
        seq.cached_runs = runs
        used = self.pool.pages_for(len(positions))
        pages, spare = seq.recompute_pages[:used], seq.recompute_pages[used:]
        self.pm.free(spare)
        seq.private = [p for p in seq.private if p not in spare]
        seq.recompute_pages = pages
        if positions:  # first: the last private run stays the one decoding appends to
            seq.private_runs.insert(0, Run(positions[0], len(positions), tuple(pages), 0, positions=tuple(positions)))

    def materialize(self, seq: Sequence) -> None:
        """Block mode, before prefill: copy each chunk into the request's run with keys re-rotated
        from chunk-local to logical positions, then drop the chunk references."""
        if not seq.block_copies:
            return
        run = seq.private_runs[0]
        dev = self.pool.device
        dst = torch.tensor(run.pages, device=dev)
        for e, start in seq.block_copies:
            # one fused kernel per chunk: read its pages once, keys rotated by `start`, written
            # into the request's run (CPU: the same in torch)
            self.pool.copy_rotate(torch.tensor(e.pages, device=dev), e.num_tokens, dst, start, start, self.inv_freq)
            self.pm.counters["block_copied_bytes"] += e.num_tokens * self.pool.bytes_per_page // self.pool.page_size
        self.pm.release_all(seq.held)
        seq.held, seq.block_copies = [], []

    def _admit_prefix(self, seq: Sequence) -> None:
        ps = self.pool.page_size
        pages = self.pm.match_prefix(seq.tokens, seq.num_tokens - 1, seq.cache_salt)
        seq.held.extend(pages)
        for i, e in enumerate(pages):
            seq.cached_runs.append(Run(i * ps, ps, tuple(e.pages), 0))
        reused = len(pages) * ps
        seq.prefix_hit_tokens = reused
        self._private_run(seq, reused, seq.num_tokens - reused)
        seq.compute_pos = list(range(reused, seq.num_tokens))

    def _admit_full(self, seq: Sequence) -> None:
        self._private_run(seq, 0, seq.num_tokens)
        seq.compute_pos = list(range(seq.num_tokens))

    def _admit_recomputed(self, seq: Sequence) -> None:
        """A selector that recomputes every cached chunk token (``auto`` serving a risky answer
        again as full re-encoding): the whole prompt computed at its own positions, as ``full``
        admits it (recompute-all equals full), so no chunk is read, no scoring pass chooses, and
        the step is an ordinary causal prefill that a captured graph can replay."""
        self._admit_full(seq)
        seq.selected = cached_chunk_tokens(seq)

    def publish(self, seq: Sequence) -> None:
        """Prefix mode, after prefill: hand the request's full prompt pages to the prefix cache."""
        if seq.mode != "prefix":
            return
        ps = self.pool.page_size
        run = seq.private_runs[0]
        keys = self.pm.prefix_keys(seq.prompt, seq.cache_salt)
        for b in range(run.pos // ps, len(keys)):
            page = run.pages[b - run.pos // ps]
            if self.pm.lookup(keys[b]) is None:
                seq.private.remove(page)
                seq.held.append(self.pm.adopt(keys[b], [page], ps))

    def publish_encoded(self, seq: Sequence) -> None:
        """After the prefill: the chunks it encoded go to the cache (pool pages adopted, KV to the
        host tier and, if new, to the store). Nothing to do before the prefill has run (a request
        released before it: its pages are simply freed) or after a first call."""
        if not seq.encoded_kv:
            return
        store = seq.source.store
        assert len(seq.encoded_kv) == len(seq.pending_chunks), "the prefill did not capture every chunk it encoded"
        for (key, (pages, ids, cid, valid_on_disk)), kv in zip(seq.pending_chunks.items(), seq.encoded_kv):
            self.encoding.pop(key, None)
            # a chunk recomputed because reading it was slower keeps its record as it is; without a
            # write the host copy need not be waited for (the first token is out already)
            self.tiers.keep(key, kv, ids, cid, None if valid_on_disk else store, wait=False)
            if self.pm.lookup(key) is None:  # else another request cached it first: ours stay private
                mine = set(pages)
                seq.private = [p for p in seq.private if p not in mine]
                seq.held.append(self.pm.adopt(key, list(pages), len(ids), cost=len(ids)))
        seq.pending_chunks, seq.encode_jobs, seq.encoded_kv = {}, [], []
