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
- graphs share one memory pool: they never run concurrently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import PageTable, lazy_decode
from .page_table import page_rows, write_targets
from .sequence import Sequence


def batch_bucket(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (as vLLM): few graphs, little padding."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


class DecodeAttention:
    """One new token per sequence through the Triton decode kernel (the captured decode step)."""

    def __init__(self, runner, table, q_pos):
        self.runner, self.table, self.q_pos = runner, table, q_pos

    def __call__(self, i: int, q, k_stored, v):
        r = self.runner
        return lazy_decode(q, r.pool.k[i], r.pool.v[i], self.table, self.q_pos, r.inv_freq, rope_mode="rotate_q",
                           attention_scaling=r.parts.rope_table.attention_scaling, sm_scale=r.parts.scaling)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    buf: torch.Tensor   # the static packed inputs
    out: torch.Tensor   # the static logits


class DecodeGraphs:
    def __init__(self, runner, max_batch: int = 256, page_step: int = 32):
        self.runner = runner
        self.max_batch = max_batch
        self.page_step = page_step       # pages-per-sequence buckets are multiples of this
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.mempool = None
        self.replays = 0

    def run(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] of one decode step, or None when the batch is too large or a
        sequence hides slots of a shared page (boundary recompute: the eager step serves it)."""
        B = len(seqs)
        if B > self.max_batch or any(s.recovery.ape for s in seqs):  # APE: two groups, merged eagerly
            return None
        packed = self.pack(seqs)
        if packed is None:
            return None
        host, Bb, P = packed
        cap = self.graphs.get((Bb, P)) or self._capture(Bb, P)
        cap.buf.copy_(host)
        cap.graph.replay()
        self.replays += 1
        return cap.out[:B]

    # -- inputs: one int64 vector [ids | pos | slot_page | slot_off | indptr | ids | pos | len | shift]
    def _pack(self, Bb: int, P: int, seqs, tables) -> torch.Tensor:
        scratch = self.runner.pool.scratch_page
        ps = self.runner.pool.page_size
        ids, pos, spage, soff = [], [], [], []
        indptr, pid, ppos, plen, shift = [0], [], [], [], []
        for seq, (a, b, c, d, _) in zip(seqs, tables):
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
            pid.append(scratch)
            ppos.append(0)
            plen.append(1)
            shift.append(0)
            indptr.append(len(pid))
        fill = [0] * (Bb * P - len(pid))
        return torch.tensor(ids + pos + spage + soff + indptr + pid + fill + ppos + fill + plen + fill
                            + shift + fill, dtype=torch.int64)

    def packed_forward(self, buf: torch.Tensor, B: int, P: int) -> torch.Tensor:
        """The captured computation: decode logits [B, vocab] from a packed input buffer."""
        ids, pos, spage, soff = (buf[i * B:(i + 1) * B] for i in range(4))
        t = buf[4 * B:].to(torch.int32)
        indptr, rest = t[:B + 1], t[B + 1:]
        pid, ppos, plen, shift = (rest[i * B * P:(i + 1) * B * P] for i in range(4))
        table = PageTable(indptr, pid, ppos, plen, shift, max_pages=P)
        attention = DecodeAttention(self.runner, table, pos.to(torch.int32))
        logits, _ = self.runner.forward(ids, pos, spage, soff, attention, logits_rows=slice(None), virtual=False)
        return logits

    def pack(self, seqs: list[Sequence]) -> tuple[torch.Tensor, int, int] | None:
        """(packed inputs on the host, batch bucket, pages bucket) of a decode step; None when a
        sequence's table needs explicit slot positions."""
        tables = [page_rows(s, self.runner.pool.page_size) for s in seqs]
        if any(t[4] is not None for t in tables):
            return None
        B = batch_bucket(len(seqs))
        P = -(-max(len(t[0]) for t in tables) // self.page_step) * self.page_step
        return self._pack(B, P, seqs, tables), B, P

    def _capture(self, B: int, P: int) -> _Captured:
        dev = self.runner.pool.device
        n = 5 * B + 1 + 4 * B * P
        buf = torch.zeros(n, dtype=torch.int64, device=dev)
        buf.copy_(self._pack(B, P, [], []))  # all padding: warm-up touches the scratch page only
        # warm up outside the capture (Triton compiles and caches its launchers here)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self.packed_forward(buf, B, P)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.packed_forward(buf, B, P)
        self.mempool = graph.pool()
        cap = _Captured(graph, buf, out)
        self.graphs[(B, P)] = cap
        return cap
