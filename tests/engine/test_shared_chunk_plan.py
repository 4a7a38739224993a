"""The engine's choice of what a decode step reads once for all its sequences (engine/shared_chunks.py),
and the padded arrays the captured graphs take."""
import itertools
from types import SimpleNamespace

import torch

from lazy_rag.engine.sequence import Run
from lazy_rag.engine.shared_chunks import bucket, plan_shared_decode, unpack
from lazy_rag.kernels.shared_chunks import FIELDS, SharedChunks

PAGE = 4
_own_pages = itertools.count(900)


def seq(chunks, own_tokens=3, start=0):
    """A decoding sequence: chunk runs (pages, length) at consecutive positions, then its own run."""
    runs, pos = [], start
    for pages, n in chunks:
        runs.append(Run(pos=pos, length=n, pages=tuple(pages), rot_shift=pos))
        pos += n
    own = Run(pos=pos, length=own_tokens, pages=(next(_own_pages),), rot_shift=0)   # a page of its own
    return SimpleNamespace(cached_runs=runs, private_runs=[own], num_tokens=pos + own_tokens)


A, B, C = ([1, 2], 7), ([3, 4, 5], 12), ([6], 2)


def test_auto_groups_only_a_step_that_shares():
    assert plan_shared_decode([seq([A]), seq([B])], PAGE, "auto", 8, 2) is None
    assert plan_shared_decode([seq([A]), seq([A])], PAGE, "off", 8, 2) is None
    s0, s1 = seq([A, B]), seq([C, A], start=5)
    o0, o1 = s0.private_runs[0].pages[0], s1.private_runs[0].pages[0]
    plan = plan_shared_decode([s0, s1], PAGE, "auto", 8, 2)
    # every run is a pair: chunks held once and the sequences' own pages too (all precede the
    # query), so there is no private table
    assert sorted((b, plan.chunks[c], s, p) for b, c, s, p in plan.pairs) == sorted([
        (0, (A[0], 7), 0, 0), (0, (B[0], 12), 7, 7), (0, ([o0], 3), 0, 19), (1, (C[0], 2), 5, 5),
        (1, (A[0], 7), 7, 7), (1, ([o1], 3), 0, 14)])
    assert plan.private is None
    assert plan.pairs_per_tile == 32 // 4      # 1.33 sequences per cached chunk: small tiles
    wide = plan_shared_decode([seq([A])] * 9, PAGE, "auto", 8, 2)
    assert wide.pairs_per_tile == 64 // 4
    on = plan_shared_decode([seq([A]), seq([B])], PAGE, "on", 8, 2)
    assert on is not None and len(on.pairs) == 4


def test_a_chunk_is_its_pages_not_its_first_page():
    """Two prefix runs that start on the same page but continue on different pages hold different KV."""
    plan = plan_shared_decode([seq([([1, 2], 8)]), seq([([1, 3], 8)]), seq([([1, 2], 8)])], PAGE, "auto", 4, 4)
    cached = [c for _, c, _, _ in plan.pairs if plan.chunks[c][1] == 8]
    assert len(plan.chunks) == 2 + 3 and sorted(cached) == [0, 0, 2]


def test_steps_it_does_not_group():
    hidden = seq([A, A])
    hidden.cached_runs[0] = Run(pos=0, length=7, pages=(1, 2), rot_shift=0, hidden=frozenset({3}))
    assert plan_shared_decode([hidden, seq([A])], PAGE, "on", 8, 2) is None
    # a run reaching past the query's position keeps its causal mask: it stays in the private table
    late = seq([A])
    late.num_tokens = 5
    plan = plan_shared_decode([late, seq([B]), seq([B])], PAGE, "auto", 8, 2)
    assert all(b != 0 for b, _, _, _ in plan.pairs)
    assert plan.private[0][0] == [1, 2, late.private_runs[0].pages[0]]
    assert plan.private[1][0] == []


def test_packed_arrays_round_trip_through_their_buckets():
    seqs = [seq([A, B]), seq([B, C]), seq([B]), seq([A], start=3)]
    plan = plan_shared_decode(seqs, PAGE, "auto", 8, 2)
    plan.pairs_per_tile = 2     # several tiles for B (held by three)
    batch = 8                   # the graph's batch bucket: rows 4..7 are padding
    lists = plan.grouped(batch)
    key = plan.shape(lists, page_step=4)
    assert key[0] == bucket(len(plan.pairs)) and key[4] == 4
    buf = torch.tensor(plan.packed(lists, key, batch), dtype=torch.int32)
    got = unpack(buf, key, batch, plan.pairs_per_tile)
    want = SharedChunks.from_pairs(plan.chunks, plan.pairs, batch, plan.pairs_per_tile)
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert g.numel() >= w.numel() and torch.equal(g[:w.numel()], w), f
    assert got.tile_pairs[want.tile_pairs.numel():].eq(0).all()          # padding tiles hold no pair
    assert torch.equal(got.seq_indptr, want.seq_indptr)
    # B's three pairs over two tiles: 1 + 2 (even spread), never 2 + 1 with an empty third
    b = next(i for i, (pages, _) in enumerate(plan.chunks) if pages == B[0])
    assert sorted(n for c, n in zip(want.tile_chunk.tolist(), want.tile_pairs.tolist()) if c == b) == [1, 2]
