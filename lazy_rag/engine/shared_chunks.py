"""Which chunks a decode step reads once for all its sequences (``kernels/shared_chunks.py``).

Per decode step the sequences' cached runs (chunks, reused prefix pages) are keyed by the pages
they cover: two sequences holding the same pages hold the same KV, whatever their offsets. When
the step shares anything (``EngineConfig.shared_chunks="auto"``: some pages held by two or more
sequences; "on": any cached run at all), every cached run becomes a (sequence, chunk) pair of the
grouped kernel, even a chunk only one sequence holds: on an H100 that beat leaving those in each
sequence's own table at every batch measured (``benchmarks/attention_kernels.py --only shared``,
min_share 1 vs 2), because the private kernel then has only the requests' own pages and the
grouped launch sees all chunk traffic at once. The rest of each sequence (its own tokens) goes
to ``lazy_decode``. A step with explicit slot positions (boundary recompute, APE) is not grouped.

Captured decode graphs need fixed shapes: ``SharedDecode.packed`` pads every array to a bucket
(tiles with no pairs, pairs no sequence lists, chunks of no pages) and rounds the largest chunk's
page count up, so a graph is reused across steps whose sharing differs a little.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..kernels import PageTable
from ..kernels.shared_chunks import FIELDS, SharedChunks, group_pairs
from .page_table import runs_rows

# query rows per work tile (pairs_per_tile = ROWS // GQA group rounded up to a power of two): the
# H100 sweep's best, with 64 keys per tile and 4 warps
ROWS = 64
# sizes a captured graph's arrays are padded up to (at most 1.5x)
BUCKETS = tuple(sorted({b for k in range(4, 20) for b in (1 << k, 3 << (k - 1))}))


def bucket(n: int) -> int:
    """The smallest bucket holding n (n itself above the largest)."""
    return next((b for b in BUCKETS if n <= b), n)


@dataclass
class SharedDecode:
    """One decode step split into each sequence's private rows and its grouped chunks (host lists)."""

    private: list          # per sequence: runs_rows(...) of its runs that are not grouped
    chunks: list           # per grouped chunk: (pages, tokens)
    pairs: list            # (sequence, chunk index, rot_shift, first logical position)
    pairs_per_tile: int

    def tensors(self, device) -> tuple[PageTable, SharedChunks]:
        """The kernel's inputs for an eager step."""
        ids, pos, lens, shift = (list(col) for col in zip(*(r[:4] for r in self.private)))
        table = PageTable.from_lists(ids, pos, lens, shift, device=device)
        shared = SharedChunks.from_pairs(self.chunks, self.pairs, len(self.private), self.pairs_per_tile, device)
        return table, shared

    def shape(self, page_step: int) -> tuple[int, int, int, int, int]:
        """(pairs, tiles, chunks, chunk pages, largest chunk's pages) buckets: a graph's key."""
        count = {}
        for _, c, _, _ in self.pairs:
            count[c] = count.get(c, 0) + 1
        tiles = sum(-(-n // self.pairs_per_tile) for n in count.values())
        nnz = sum(len(p) for p, _ in self.chunks)
        widest = max((len(p) for p, _ in self.chunks), default=1)
        return (bucket(len(self.pairs)), bucket(tiles), bucket(len(self.chunks)), bucket(nnz),
                -(-widest // page_step) * page_step)

    def packed(self, key: tuple, batch: int) -> list[int]:
        """The SharedChunks arrays of this step padded to ``key`` (``shape``'s buckets) for ``batch``
        sequences, concatenated (``unpack`` reads them back in the graph)."""
        lists = group_pairs(self.chunks, self.pairs, batch, self.pairs_per_tile)
        ci = lists["chunk_indptr"]
        lists["chunk_indptr"] = ci + [ci[-1]] * (key[2] + 1 - len(ci))
        out = []
        for f, n in zip(FIELDS, packed_sizes(key, batch)):
            out += lists[f] + [0] * (n - len(lists[f]))
        return out


def packed_sizes(key: tuple, batch: int) -> list[int]:
    """Each SharedChunks field's padded length, in FIELDS order."""
    NP, T, C, NNZ = key[:4]
    return [C + 1, NNZ, C, T, T, T, NP, NP, NP, batch + 1, NP]


def unpack(buf: torch.Tensor, key: tuple, batch: int, pairs_per_tile: int) -> SharedChunks:
    """SharedChunks views of a packed int32 buffer (the captured graph's inputs)."""
    parts, at = [], 0
    for n in packed_sizes(key, batch):
        parts.append(buf[at:at + n])
        at += n
    return SharedChunks(*parts, max_chunk_pages=key[4], pairs_per_tile=pairs_per_tile)


def plan_shared_decode(seqs, page_size: int, mode: str, num_heads: int, num_kv_heads: int) -> SharedDecode | None:
    """The step's grouping, or None when it is not grouped (mode "off", nothing shared under
    "auto", explicit slot positions, no cached run at all)."""
    if mode == "off":
        return None
    keys, holders, private, pairs = {}, {}, [], []
    for b, seq in enumerate(seqs):
        q_pos = seq.num_tokens - 1
        own = []
        for run in seq.cached_runs:
            if run.hidden or run.positions is not None:
                return None
            if run.pos + run.length > q_pos or run.length == 0:
                own.append(run)      # not wholly before the query: the causal mask is needed
                continue
            key = (tuple(run.pages[:-(-run.length // page_size)]), run.length)
            c = keys.setdefault(key, len(keys))
            holders[c] = holders.get(c, 0) + 1
            pairs.append((b, c, run.rot_shift, run.pos))
        if any(r.hidden or r.positions is not None for r in seq.private_runs):
            return None
        rows = runs_rows(own + list(seq.private_runs), page_size)
        private.append(rows)
    if not pairs or (mode == "auto" and len(holders) == len(pairs)):
        return None
    chunks = [(list(pages), n) for (pages, n) in keys]
    gp = triton.next_power_of_2(num_heads // num_kv_heads)
    return SharedDecode(private, chunks, pairs, max(1, ROWS // gp))
