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

from ..kernels.triton_import import triton
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

    private: list | None   # per sequence: runs_rows(...) of its runs that are not grouped; None: none
    chunks: list           # per grouped chunk: (pages, tokens)
    pairs: list            # (sequence, chunk index, rot_shift, first logical position)
    pairs_per_tile: int

    def tensors(self, device, num_seqs: int) -> tuple[PageTable | None, SharedChunks]:
        """The kernel's inputs for an eager step."""
        table = None
        if self.private is not None:
            ids, pos, lens, shift = (list(col) for col in zip(*(r[:4] for r in self.private)))
            table = PageTable.from_lists(ids, pos, lens, shift, device=device)
        shared = SharedChunks.from_pairs(self.chunks, self.pairs, num_seqs, self.pairs_per_tile, device)
        return table, shared

    def grouped(self, batch: int) -> dict[str, list]:
        """SharedChunks' fields as lists for ``batch`` sequences (``group_pairs``), once per step:
        ``shape`` and ``packed`` both read them."""
        return group_pairs(self.chunks, self.pairs, batch, self.pairs_per_tile)

    @staticmethod
    def shape(lists: dict, page_step: int) -> tuple[int, int, int, int, int]:
        """(pairs, tiles, chunks, chunk pages, largest chunk's pages) buckets of ``grouped``'s
        lists: a graph's key."""
        ci = lists["chunk_indptr"]
        widest = max((b - a for a, b in zip(ci, ci[1:])), default=1)
        return (bucket(len(lists["pair_seq"])), bucket(len(lists["tile_chunk"])), bucket(len(ci) - 1),
                bucket(len(lists["chunk_pages"])), -(-widest // page_step) * page_step)

    @staticmethod
    def packed(lists: dict, key: tuple, batch: int) -> list[int]:
        """``grouped``'s lists padded to ``key`` (``shape``'s buckets) for ``batch`` sequences,
        concatenated (``unpack`` reads them back in the graph)."""
        ci = lists["chunk_indptr"]
        padded = dict(lists, chunk_indptr=ci + [ci[-1]] * (key[2] + 1 - len(ci)))
        out = []
        for f, n in zip(FIELDS, packed_sizes(key, batch)):
            out += padded[f] + [0] * (n - len(padded[f]))
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
    "auto", explicit slot positions, no cached run at all). Every run wholly at or before the
    query's position (all of them in a decode step) becomes a pair, the sequence's own pages too,
    so that one launch reads everything and the private part is empty (``private`` None)."""
    if mode == "off":
        return None
    keys, holders, private, pairs = {}, {}, [], []
    for b, seq in enumerate(seqs):
        q_pos = seq.num_tokens - 1
        own = []
        n_cached = len(seq.cached_runs)
        for i, run in enumerate(seq.cached_runs + seq.private_runs):
            if run.hidden or run.positions is not None:
                return None
            if run.pos + run.length - 1 > q_pos or run.length == 0:
                own.append(run)      # a key after the query: this run needs the causal mask
                continue
            key = (tuple(run.pages[:-(-run.length // page_size)]), run.length)
            c = keys.setdefault(key, len(keys))
            if i < n_cached:
                holders[c] = holders.get(c, 0) + 1
            pairs.append((b, c, run.rot_shift, run.pos))
        private.append(runs_rows(own, page_size) if own else None)
    if not holders or (mode == "auto" and max(holders.values()) < 2):
        return None
    chunks = [(list(pages), n) for (pages, n) in keys]
    gp = triton.next_power_of_2(num_heads // num_kv_heads)
    # rows per work tile: 64 when the cached chunks are shared widely (fewer reads of each), 32
    # when few sequences share each (less padding, more programs); H100 decode_shared: B128 Zipf
    # (14 pairs per chunk) 252 vs 283 us, B32 Zipf (5 per chunk) 141 vs 122 us
    rows = 64 if sum(holders.values()) * gp >= 32 * len(holders) else 32
    if all(r is None for r in private):
        private = None
    else:
        private = [r if r is not None else ([], [], [], [], None) for r in private]
    return SharedDecode(private, chunks, pairs, max(1, rows // gp))
