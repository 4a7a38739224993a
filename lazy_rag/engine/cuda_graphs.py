"""``DecodeGraphs``: decode steps replayed from CUDA graphs.

A decode step of an 8B model is ~32 layers x ~15 kernels; launched from Python that is several
milliseconds of CPU time per step, more than the GPU needs at small batches. Each graph is
captured once per (batch bucket, pages-per-sequence bucket) and replayed with new inputs:

- every input of the step (token ids, positions, KV write slots, the CSR page table) lives in one
  static int64 device buffer, filled with one host-to-device copy per step; the graph itself
  slices it and casts the table to int32;
- the batch is padded up to its bucket with rows that read and write only the pool's scratch page
  (``PagePool.scratch_page``), and the page table is sized ``bucket x pages bucket`` so the
  kernel's split-K grid (sized from ``max_pages`` on the host) is fixed at capture time;
- graphs share one memory pool: they never run concurrently;
- an fp8 pool's scale tensors are static buffers like its pages: the captured write quantises
  into them and the captured kernels read them.

``AppendGraphs`` does the same for prefill / append steps (question and template tokens after
reused chunks, a few tokens of many requests, decodes mixed in) whose every sequence takes the
Triton prefill kernel: captured per (token bucket, batch bucket, pages bucket, query tile size),
the step's tokens padded with tokens of one padding sequence that reads and writes only the
scratch page, and the kernel's query-tile plan padded with tiles that own no query row. The
token count varies far more than a decode batch does, so the buckets are coarser (at most ~1.5x
padding) and the number of graphs is bounded (least recently used dropped). A step longer than
the largest bucket is GPU-bound anyway and stays eager. A fresh sequence (full mode, a prefix
miss, a request served again as full re-encoding) takes the Triton kernel over its own pages in
a step of up to ``max_encode_tokens`` tokens (an fp8 pool's stays eager: its SDPA attends to the
exact new K/V); steps with a prefix tail, APE or explicit slot positions stay eager.

A cold lazy request's step, which encodes the request's missing chunks as extra sequences ahead of
its own tokens (``kv_planner``), replays an append graph as well (``AppendGraphs.run_encoding``):
the chunks and any tail go through the Triton kernel as the eager step runs them, and every token's
unrotated K/V is captured into one static buffer of ``max_encode_tokens`` rows, copied out per chunk
right after the replay. Eager, that step's kernel launches cost a small model more than ``full``
re-encoding the same tokens through one flash call per layer (BENCHMARKS.md, "Indexing at scale").
"""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..kernels import PageTable, PrefillPlan, lazy_decode
from ..kernels.prefill import default_block_m, plan_split_target, query_tiles
from ..kernels.shared_chunks import shared_chunk_decode
from .page_table import attention_path, page_rows, step_tokens, write_targets
from .sequence import Sequence
from .shared_chunks import SharedDecode, packed_sizes, plan_shared_decode, unpack

log = logging.getLogger(__name__)

# token counts an append step is padded up to (at most 1.5x; 8B-shaped steps are weight-bound
# below a few hundred tokens, so the padding costs little there)
TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def token_bucket(n: int, max_tokens: int = TOKEN_BUCKETS[-1]) -> int | None:
    """The smallest bucket holding n tokens; None above ``max_tokens`` or the largest bucket (the
    step stays eager)."""
    b = next((b for b in TOKEN_BUCKETS if n <= b), None)
    return b if b is not None and n <= max_tokens else None


def batch_bucket(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (as vLLM): few graphs, little padding."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


class DecodeAttention:
    """One new token per sequence through the Triton decode kernel (the captured decode step), or,
    with ``shared`` (``SharedChunks``), through the shared-chunk kernel: ``table`` then lists only
    what each sequence does not share."""

    def __init__(self, runner, table, q_pos, shared=None):
        self.runner, self.table, self.q_pos, self.shared = runner, table, q_pos, shared

    def __call__(self, i: int, q, k_stored, v):
        r = self.runner
        if self.shared is not None:
            return shared_chunk_decode(q, r.pool.k[i], r.pool.v[i], self.table, self.shared, self.q_pos,
                                       sm_scale=r.parts.scaling, **r.pool.scales(i), **r.layer_options[i])
        return lazy_decode(q, r.pool.k[i], r.pool.v[i], self.table, self.q_pos, rope_mode="rotate_q",
                           sm_scale=r.parts.scaling, **r.pool.scales(i), **r.layer_options[i])


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    buf: torch.Tensor   # the static packed inputs
    out: torch.Tensor   # the static logits


class DecodeGraphs:
    def __init__(self, runner, max_batch: int = 256, page_step: int = 32, shared_chunks: str = "off",
                 max_graphs: int = 64):
        # a weak reference: the runner owns its graphs, and a cycle would keep a dropped engine's
        # page pool (gigabytes of GPU memory) alive until the next garbage collection
        self.runner = weakref.proxy(runner)
        self.max_batch = max_batch
        self.page_step = page_step       # pages-per-sequence buckets are multiples of this
        self.shared_chunks = shared_chunks   # EngineConfig.shared_chunks
        # keyed (batch bucket, pages bucket, shared-chunk buckets or None); grouped steps vary in
        # more ways, so the least recently used graph is dropped past max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.failed: set[tuple] = set()   # keys whose capture failed: their steps stay eager
        self.max_graphs = max_graphs
        self.replays = 0
        self.shared_replays = 0          # replays whose attention read shared chunks once

    def run(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] of one decode step, or None when the batch is too large or a
        sequence hides slots of a shared page (boundary recompute: the eager step serves it)."""
        B = len(seqs)
        if B > self.max_batch or any(s.recovery.ape for s in seqs):  # APE: two groups, merged eagerly
            return None
        packed = self.pack(seqs)
        if packed is None:
            return None
        host, key = packed
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(key)
            if cap is None:
                return None
        self.graphs.move_to_end(key)
        self.runner.check_replay(host)
        cap.buf.copy_(host)
        cap.graph.replay()
        self.replays += 1
        self.shared_replays += key[2] is not None
        return cap.out[:B]

    # -- inputs: one int64 vector [ids | pos | slot_page | slot_off | indptr | ids | pos | len | shift]
    def _pack(self, Bb: int, P: int, seqs, tables, grouped_lists=None, shared_key=None) -> torch.Tensor:
        scratch = self.runner.pool.scratch_page
        ps = self.runner.pool.page_size
        ids, pos, spage, soff = [], [], [], []
        indptr, pid, ppos, plen, shift = [0], [], [], [], []
        for i, seq in enumerate(seqs):
            a, b, c, d, _ = tables[i] if P else ([], [], [], [], None)
            p = seq.num_tokens - 1
            ids.append(seq.output[-1] if seq.output else seq.prompt[p])
            pos.append(p)
            (page, off, _),  = write_targets(seq, [p], ps)
            spage.append(page)
            soff.append(off)
            pid += a
            ppos += b
            plen += c
            shift += d
            indptr.append(len(pid))
        for _ in range(len(seqs), Bb):  # padding rows: the scratch page, position 0
            ids.append(0)
            pos.append(0)
            spage.append(scratch)
            soff.append(0)
            if P:
                pid.append(scratch)
                ppos.append(0)
                plen.append(1)
                shift.append(0)
            indptr.append(len(pid))
        fill = [0] * (Bb * P - len(pid))
        grouped = []
        if shared_key is not None:   # the shared-chunk arrays (all padding at capture)
            grouped = (SharedDecode.packed(grouped_lists, shared_key, Bb) if grouped_lists is not None
                       else [0] * sum(packed_sizes(shared_key, Bb)))
        return torch.tensor(ids + pos + spage + soff + indptr + pid + fill + ppos + fill + plen + fill
                            + shift + fill + grouped, dtype=torch.int64)

    def packed_forward(self, buf: torch.Tensor, key: tuple, num_layers: int | None = None) -> torch.Tensor:
        """The captured computation: decode logits [B, vocab] from a packed input buffer."""
        B, P, shared_key = key
        ids, pos, spage, soff = (buf[i * B:(i + 1) * B] for i in range(4))
        t = buf[4 * B:].to(torch.int32)
        indptr, rest = t[:B + 1], t[B + 1:]
        pid, ppos, plen, shift = (rest[i * B * P:(i + 1) * B * P] for i in range(4))
        table = PageTable(indptr, pid, ppos, plen, shift, max_pages=P) if P else None
        shared = None
        if shared_key is not None:
            shared = unpack(rest[4 * B * P:], shared_key[:5], B, shared_key[5])
        attention = DecodeAttention(self.runner, table, pos.to(torch.int32), shared)
        logits, _ = self.runner.forward(ids, pos, spage, soff, attention, logits_rows=slice(None), virtual=False,
                                        num_layers=num_layers)
        return logits

    def pack(self, seqs: list[Sequence]) -> tuple[torch.Tensor, tuple] | None:
        """(packed inputs on the host, graph key) of a decode step; None when a sequence's table
        needs explicit slot positions. The key is (batch bucket, pages bucket, None) or, when the
        step reads shared chunks once (``shared_chunks.plan_shared_decode``), its third item is the
        shared arrays' buckets and the work tile's pairs."""
        r = self.runner
        ps = r.pool.page_size
        shared = plan_shared_decode(seqs, ps, self.shared_chunks, r.parts.shape.num_heads,
                                    r.parts.shape.num_kv_heads)
        tables = [page_rows(s, ps) for s in seqs] if shared is None else shared.private or []
        if any(t[4] is not None for t in tables):
            return None
        B = batch_bucket(len(seqs))
        # P 0: no private table (every key of the step is in the shared-chunk arrays)
        P = -(-max(len(t[0]) for t in tables) // self.page_step) * self.page_step if tables else 0
        lists = shared_key = None
        if shared is not None:
            lists = shared.grouped(B)
            shared_key = (*SharedDecode.shape(lists, self.page_step), shared.pairs_per_tile)
        return self._pack(B, P, seqs, tables, lists, shared_key), (B, P, shared_key)

    def _capture(self, key: tuple) -> _Captured | None:
        B, P, shared_key = key
        if key in self.failed:
            return None
        # all padding: the warm-up touches the scratch page only
        cap = capture(self.runner, self._pack(B, P, [], [], None, shared_key),
                      lambda buf, num_layers=None: self.packed_forward(buf, key, num_layers))
        if cap is None:
            self.failed.add(key)
            return None
        self.graphs[key] = cap
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return cap


def capture(runner, padding: torch.Tensor, forward) -> _Captured | None:
    """Capture ``forward(buf, num_layers=None)`` over a static device copy of ``padding`` (inputs
    that touch only the scratch page). Every graph of the runner shares one memory pool (they
    never run at once). None when the capture fails: the step then runs eagerly (logged), and
    the next capture takes a fresh pool, since a failed capture leaves its pool marked as
    recording (every later capture into it would fail: "already recording to mempool_id").

    A tensor-parallel rank (``runner.group``) captures the same graphs as the other ranks, in the
    same order (every rank runs the same steps), its NCCL all-reduces inside them (warmed up
    eagerly first, so that no communicator is set up during the capture). Whether a capture
    worked is agreed over the ranks: a graph one rank could not capture is dropped by all of them
    and the step runs eagerly everywhere, since a rank that replays a graph runs no host code and
    a rank that runs the step eagerly does."""
    cap = _capture(runner, padding, forward)
    if runner.group is not None and not runner.group.agree(cap is not None):
        return None
    return cap


def _capture(runner, padding: torch.Tensor, forward) -> _Captured | None:
    dev = runner.pool.device
    buf = padding.to(dev)
    # warm up outside the capture: Triton compiles and caches its launchers, cuBLAS picks its
    # kernels. Every layer launches the same kernels, so one layer (and the head) is enough: a
    # new shape then costs about one eager step, not two.
    stream = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        forward(buf, num_layers=1)
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: another thread's CUDA calls (an index build's pinned-memory
        # registration, a dropped engine's graphs) do not invalidate this capture
        with _no_garbage_collection(), torch.cuda.graph(graph, pool=runner.graph_mempool,
                                                        capture_error_mode="thread_local"):
            out = forward(buf)
    except Exception as e:   # noqa: BLE001  (any failure: the step runs eagerly instead)
        log.warning("CUDA graph capture failed, the step runs eagerly: %s: %s",
                    type(e).__name__, e)
        torch.cuda.set_stream(stream)   # a failed capture_end skips the capture stream's exit
        runner.graph_mempool = None
        return None
    runner.graph_mempool = graph.pool()
    return _Captured(graph, buf, out)


@contextlib.contextmanager
def _no_garbage_collection():
    """No automatic garbage collection while a graph is captured: torch no longer collects
    before a capture, and a collection inside one that frees a graph held in a reference cycle
    (a dropped engine's) destroys it mid-capture, which CUDA refuses and which invalidates the
    capture (the GPU fault soak met it: "operation not permitted when stream is capturing
    (function reset)", then every later capture failed)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class AppendAttention:
    """The captured append step's attention: every sequence through the Triton prefill kernel."""

    def __init__(self, runner, qo, q_pos, table, plan):
        self.runner, self.qo, self.q_pos, self.table, self.plan = runner, qo, q_pos, table, plan

    def __call__(self, i: int, q, k_stored, v):
        return self.runner.paged_prefill(i, q, self.qo, self.q_pos, self.table, self.plan)


@dataclass(frozen=True)
class AppendKey:
    tokens: int    # token bucket
    batch: int     # batch bucket (+1 padding sequence in the graph)
    pages: int     # page entries per sequence (a multiple of page_step)
    block_m: int   # query tokens per kernel tile
    virtual: bool  # ids may be chunk-wrapper slots (the wrapper rows are read in the graph)
    split_target: float = 2.0   # the kernel's split-KV programs per SM (the plan's)
    encodes: bool = False       # the step encodes chunks: every token's unrotated K/V is captured

    @property
    def seqs(self) -> int:
        return self.batch + 1

    @property
    def tiles(self) -> int:
        """Query tiles of the plan: enough for any split of ``tokens`` over ``seqs`` sequences."""
        return -(-self.tokens // self.block_m) + self.seqs

    def sizes(self) -> list[int]:
        T, S, P, NT = self.tokens, self.seqs, self.pages, self.tiles
        # ids pos key_pos write_page write_slot | last | qo_indptr | indptr | pid ppos plen shift | tiles
        return [T] * 5 + [self.batch, S + 1, S + 1] + [S * P] * 4 + [NT] * 2


class AppendGraphs:
    """Prefill / append steps replayed from CUDA graphs (module docstring)."""

    def __init__(self, runner, max_batch: int = 256, page_step: int = 32, max_graphs: int = 48,
                 max_tokens: int = TOKEN_BUCKETS[-1], max_encode_tokens: int = 2048):
        # a weak reference: the runner owns its graphs, and a cycle would keep a dropped engine's
        # page pool (gigabytes of GPU memory) alive until the next garbage collection
        self.runner = weakref.proxy(runner)
        self.max_batch, self.page_step, self.max_graphs = max_batch, page_step, max_graphs
        self.max_tokens = max_tokens
        # steps that encode chunks capture their K/V into one static buffer of this many tokens
        # (allocated at the first such step: 268 MB for an 8B shape, 25 MB for Qwen2.5-0.5B);
        # a longer one is GPU-bound, so eager costs it little
        self.max_encode_tokens = min(max_tokens, max_encode_tokens)
        self.captured_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graphs: OrderedDict[AppendKey, _Captured] = OrderedDict()
        self.failed: set[AppendKey] = set()   # keys whose capture failed: their steps stay eager
        self.replays = 0
        self.encode_replays = 0

    def run(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] of the step, or None when it must run eagerly."""
        out = self._replay(seqs, encodes=False)
        return None if out is None else out[:len(seqs)]

    def run_encoding(self, jobs, seqs: list[Sequence]):
        """A step whose sequences encode chunks in their prefill (``jobs``, ``EncodeJob``s packed
        ahead of ``seqs`` as ``ModelRunner.run`` packs them): (logits [len(seqs), vocab], the
        jobs' unrotated K and V [layers, their tokens, Hkv, D], each job's (start, end) rows in
        them), or None when the step must run eagerly. The logits and the K/V are views of the
        graphs' static buffers: valid until the next replay."""
        out = self._replay(list(jobs) + list(seqs), encodes=True)
        if out is None:
            return None
        self.encode_replays += 1
        spans, at = [], 0
        for job in jobs:   # packed first, in order (step_tokens)
            n = len(job.compute_pos)
            spans.append((at, at + n))
            at += n
        k, v = self.captured_kv
        return out[len(jobs):len(jobs) + len(seqs)], (k[:, :at], v[:, :at]), spans

    def _replay(self, seqs, encodes: bool) -> torch.Tensor | None:
        packed = self.pack(seqs, encodes)
        if packed is None:
            return None
        host, key = packed
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(key)
            if cap is None:
                return None
        self.graphs.move_to_end(key)
        self.runner.check_replay(host)
        cap.buf.copy_(host)
        cap.graph.replay()
        self.replays += 1
        return cap.out

    def pack(self, seqs: list[Sequence], encodes: bool = False) -> tuple[torch.Tensor, AppendKey] | None:
        """(packed inputs on the host, graph key), or None when the step stays eager. ``encodes``:
        the first sequences are chunk encodes; like the eager step of ``ModelRunner.run``, fresh
        sequences and tails then take the Triton kernel too, and every token's K/V is captured."""
        r = self.runner
        ps = r.pool.page_size
        if not seqs or len(seqs) > self.max_batch:
            return None
        n = sum(len(s.compute_pos) for s in seqs)
        paths = [attention_path(s, True, ps)[0] for s in seqs]
        # fresh sequences (full mode, a request served again as full re-encoding) take the Triton
        # kernel over their own pages as in an encoding step, up to that step's token limit, where
        # a small model's eager step is launch-bound. Not from a lossy (fp8) pool: full's eager
        # SDPA attends to the exact new K/V, the kernel would read them quantised.
        fresh = "fresh" in paths and not r.pool.lossy
        T = token_bucket(n, self.max_encode_tokens if encodes or fresh else self.max_tokens)
        paged = ("paged", "fresh", "tail") if encodes else ("paged", "fresh") if fresh else ("paged",)
        if T is None or any(path not in paged for path in paths):
            return None
        tables = [page_rows(s, ps) for s in seqs]
        if any(t[4] is not None for t in tables):
            return None
        shp = r.parts.shape
        longest = max(len(s.compute_pos) for s in seqs)
        P = max(1, -(-max(len(t[0]) for t in tables) // self.page_step)) * self.page_step
        H, Hkv = shp.num_heads, shp.num_kv_heads
        key = AppendKey(T, batch_bucket(len(seqs)), P, default_block_m(longest, H, Hkv, r.pool.device, total=n,
                                                                   dtype=r.parts.dtype, head_dim=shp.head_dim),
                        r.parts.virtual_rows is not None, plan_split_target(longest, H, Hkv), encodes)
        return self._pack(key, seqs, tables), key

    def _pack(self, key: AppendKey, seqs, tables) -> torch.Tensor:
        """The step's inputs in one int64 vector (``AppendKey.sizes`` order); with no sequences,
        all padding."""
        r = self.runner
        ps, scratch = r.pool.page_size, r.pool.scratch_page
        T, S, P = key.tokens, key.seqs, key.pages
        tok = step_tokens(seqs, ps)
        n = len(tok.ids)
        last = [b - 1 for _, b in tok.spans] + [0] * (key.batch - len(seqs))
        # empty sequences, then the padding one (all padding tokens)
        qo = [0] + [b for _, b in tok.spans] + [n] * (S - 1 - len(seqs)) + [T]
        indptr, pid, ppos, plen, shift = [0], [], [], [], []
        # the empty and padding sequences read one scratch-page entry each
        for a, c, d, e, _ in tables + [([scratch], [0], [1], [0], None)] * (S - len(seqs)):
            pid += a
            ppos += c
            plen += d
            shift += e
            indptr.append(len(pid))
        tseq, tq0 = query_tiles(qo, key.block_m)
        fill_tiles = key.tiles - len(tseq)   # tiles past the padding sequence's end own no row
        tseq += [S - 1] * fill_tiles
        tq0 += [T] * fill_tiles
        pad = T - n
        fill = [0] * (S * P - len(pid))
        parts = (tok.ids + [0] * pad, tok.pos + [0] * pad, tok.key_pos + [0] * pad, tok.pages + [scratch] * pad,
                 tok.slots + [0] * pad, last, qo, indptr, pid + fill, ppos + fill, plen + fill, shift + fill, tseq, tq0)
        flat = [v for part in parts for v in part]
        assert [len(x) for x in parts] == key.sizes()
        return torch.tensor(flat, dtype=torch.int64)

    def packed_forward(self, buf: torch.Tensor, key: AppendKey, num_layers: int | None = None) -> torch.Tensor:
        """The captured computation: logits [batch bucket, vocab] from a packed input buffer."""
        views, at = [], 0
        for size in key.sizes():
            views.append(buf[at:at + size])
            at += size
        ids, pos, kpos, wpage, wslot, last = views[:6]
        qo, indptr, pid, ppos, plen, shift, tseq, tq0 = (v.to(torch.int32) for v in views[6:])
        table = PageTable(indptr, pid, ppos, plen, shift, max_pages=key.pages)
        plan = PrefillPlan(tseq, tq0, key.block_m, key.split_target)
        attention = AppendAttention(self.runner, qo, pos.to(torch.int32), table, plan)
        capture = False
        if key.encodes:
            k, v = self._captured_kv()
            capture = (k[:, :key.tokens], v[:, :key.tokens])
        logits, _ = self.runner.forward(ids, pos, wpage, wslot, attention, key_pos=kpos, logits_rows=last,
                                        virtual=key.virtual, num_layers=num_layers, capture=capture)
        return logits

    def _captured_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The static K and V capture buffers of the encoding graphs, [layers, max_encode_tokens,
        Hkv, D] each, made at the first capture that needs them (outside the graph's pool)."""
        if self.captured_kv is None:
            r = self.runner
            shp = r.parts.shape
            shape = (shp.num_layers, self.max_encode_tokens, shp.num_kv_heads, shp.head_dim)
            self.captured_kv = tuple(torch.empty(shape, dtype=r.parts.dtype, device=r.pool.device) for _ in range(2))
        return self.captured_kv

    def _capture(self, key: AppendKey) -> _Captured | None:
        if key in self.failed:
            return None
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)   # its memory returns to the shared pool
        cap = capture(self.runner, self._pack(key, [], []),
                      lambda buf, num_layers=None: self.packed_forward(buf, key, num_layers))
        if cap is None:
            self.failed.add(key)
        else:
            self.graphs[key] = cap
        return cap
