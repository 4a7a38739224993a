"""Explicit per-slot positions in the page table (table.slot_pos_row / slot_pos).

Shared chunk pages seen with some slots hidden (HIDDEN_POS), the hidden tokens recomputed into
compact private pages whose slots carry scattered positions, private tokens stored out of order,
a sequence whose every key is hidden: lazy_decode / lazy_prefill against the fp64 reference, and
the reference against the prompt each case means (built without the table's encoding).
"""
import pytest
import torch

from _cases import CHUNKS, DTYPES, MIXED, PREFILL, TOL, Case, inv_freq_for, rel_err
from lazy_rag.bench.block_attention import (block_attention_decode, block_gather_rotate,
                                            block_gather_rotate_ref)
from lazy_rag.kernels import (HIDDEN_POS, PageTable, lazy_decode, lazy_prefill,
                              paged_attention_ref, rope_cos_sin, rotate)

ROPE_MODES = ["rotate_q", "none"]
# hidden: slots hidden in about half of the shared chunk entries, recomputed into a compact run;
# compact: private tokens stored shuffled with explicit positions; both: the two, plus sequence 2
# (over chunks 2 and 0, which other sequences see) with every slot hidden.
LAYOUTS = {
    "hidden": dict(hide=0.3),
    "compact": dict(scatter=True),
    "both": dict(hide=0.3, scatter=True, all_hidden=2),
}


def _case(seqs, layout, *, G, D, page, dtype, seed):
    return Case(seqs, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=seed,
                **LAYOUTS[layout])


def _ref(c, inv, rope_mode, table=None):
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages,
                               c.table if table is None else table, inv.to(c.q.device),
                               rope_mode, compute_dtype=torch.float64)


def _poisoned(c):
    return torch.full_like(c.q, float("nan"))


# (G, D, page, layout, num_splits): GQA 1..8 over decode and prefill together, head dims 64 and
# 128, pages of 4, 16 (two pages per 32-key tile: the scalar shift branch) and 64 (a chunk per
# page); num_splits 3 merges splits that see no key.
DECODE = [(1, 64, 4, "both", None), (2, 128, 16, "hidden", None), (4, 64, 16, "both", 3),
          (5, 128, 4, "compact", None), (7, 64, 64, "hidden", None), (8, 64, 64, "both", None)]
PREFILL_SHAPES = [(1, 128, 16, "both"), (3, 64, 4, "compact"), (6, 64, 64, "both"),
                  (8, 64, 16, "hidden")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_mode", ROPE_MODES)
@pytest.mark.parametrize("G,D,page,layout,splits", DECODE)
def test_decode(G, D, page, layout, splits, rope_mode, dtype):
    c = _case(MIXED, layout, G=G, D=D, page=page, dtype=dtype, seed=G * 5 + page)
    inv, _ = inv_freq_for("default", D)
    out = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv.to(c.q.device),
                      rope_mode=rope_mode, num_splits=splits, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, rope_mode)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_mode", ROPE_MODES)
@pytest.mark.parametrize("G,D,page,layout", PREFILL_SHAPES)
def test_prefill(G, D, page, layout, rope_mode, dtype):
    c = _case(PREFILL, layout, G=G, D=D, page=page, dtype=dtype, seed=G + page)
    inv, _ = inv_freq_for("default", D)
    out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                       inv.to(c.q.device), rope_mode=rope_mode, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, rope_mode)) < TOL[dtype]


def test_all_hidden_sequence_gives_zeros():
    """A sequence whose every key is hidden (its private pages are NaN) returns exact zeros,
    through the split merge too."""
    c = _case(PREFILL, "both", G=2, D=64, page=16, dtype=DTYPES[0], seed=7)
    inv = inv_freq_for("default", 64)[0].to(c.q.device)
    rows = slice(int(c.qo_indptr[2]), int(c.qo_indptr[3]))
    for splits in (1, 4):
        out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table, inv,
                           num_splits=splits, out=_poisoned(c))
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert torch.isfinite(out).all()


def _without_rows(table: PageTable, m: int, page: int) -> PageTable:
    """The same table with every entry's slot_pos_row -1 (and m unused explicit rows)."""
    return PageTable(table.indptr, table.page_ids, table.page_pos, table.page_len,
                     table.rot_shift, table.max_pages,
                     torch.full_like(table.page_ids, -1),
                     torch.zeros(m, page, dtype=torch.int32, device=table.page_ids.device))


@pytest.mark.parametrize("rope_mode,m", [("rotate_q", 3), ("none", 0)])
def test_rows_of_minus_one_change_nothing(rope_mode, m):
    """A table whose every slot_pos_row is -1 gives bit-identical results to the same table
    without slot positions (decode with a split merge, and prefill). Decode over tiles of two
    pages is the exception: rotate_q takes the two row groups there (MULTI_SHIFT 4) without slot
    positions and the branch (3) with them, which round differently; so the bit-identical decode
    runs tiles of four pages (the same variant for both tables), and the two-page tiles agree to
    the tolerance."""
    c = Case(PREFILL, CHUNKS, Hkv=2, G=3, D=64, page=16, dtype=DTYPES[-1], seed=m)
    inv = inv_freq_for("default", 64)[0].to(c.q.device)
    rows = _without_rows(c.table, m, c.page)
    for table in (c.table, rows):
        assert table.has_slot_pos == (table is rows)
    dq, dp = c.q[:4], c.q_pos[c.qo_indptr[1:].long() - 1]
    args = (c.k_pages, c.v_pages)
    a = lazy_decode(dq, *args, c.table, dp, inv, rope_mode=rope_mode, num_splits=2,
                    block_n=4 * c.page)
    b = lazy_decode(dq, *args, rows, dp, inv, rope_mode=rope_mode, num_splits=2,
                    block_n=4 * c.page)
    assert torch.equal(a, b)
    a = lazy_decode(dq, *args, c.table, dp, inv, rope_mode=rope_mode, num_splits=2,
                    block_n=2 * c.page)
    b = lazy_decode(dq, *args, rows, dp, inv, rope_mode=rope_mode, num_splits=2,
                    block_n=2 * c.page)
    assert rel_err(a, b) < TOL[DTYPES[-1]]
    a = lazy_prefill(c.q, c.qo_indptr, c.q_pos, *args, c.table, inv, rope_mode=rope_mode)
    b = lazy_prefill(c.q, c.qo_indptr, c.q_pos, *args, rows, inv, rope_mode=rope_mode)
    assert torch.equal(a, b)
    assert torch.equal(_ref(c, inv, rope_mode), _ref(c, inv, rope_mode, rows))


def _prompt_attention(c, inv, rope_mode):
    """fp64 attention of every query over the visible keys its Case built (c.tokens: page, slot,
    position, rot_shift), rotating with the reference's fp32 RoPE; no page table involved."""
    G = c.H // c.Hkv
    inv = inv.to(c.q.device)
    out = torch.zeros(c.q.shape, dtype=torch.float64, device=c.q.device)
    for b, tokens in enumerate(c.tokens):
        qs, qe = int(c.qo_indptr[b]), int(c.qo_indptr[b + 1])
        if not tokens or qe == qs:
            continue
        page, slot, pos, shift = (torch.tensor(x, device=c.q.device) for x in zip(*tokens))
        k = c.k_pages[page, :, slot].repeat_interleave(G, dim=1)       # [n, H, D]
        v = c.v_pages[page, :, slot].repeat_interleave(G, dim=1).double()
        q, m = c.q[qs:qe], c.q_pos[qs:qe].long()
        if rope_mode == "none":   # query and keys used as stored
            scores = torch.einsum("thd,nhd->htn", q.double(), k.double())
        else:   # rotate_q: query rotated by (m - shift of each key)
            cq, sq = rope_cos_sin(m[:, None] - shift[None, :], inv)    # [t, n, D/2]
            qr = rotate(q[:, None], cq[:, :, None], sq[:, :, None]).double()  # [t, n, H, D]
            scores = torch.einsum("tnhd,nhd->htn", qr, k.double())
        scores = scores * c.D ** -0.5
        scores = scores.masked_fill(~(pos[None, :] <= m[:, None])[None], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[qs:qe] = torch.einsum("htn,nhd->thd", p, v)
    return out


@pytest.mark.parametrize("rope_mode", ["rotate_q", "none"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reference_means_the_prompt(layout, rope_mode):
    """The oracle reads explicit rows as the contract says: its result is attention over the
    prompt each case was built to mean (hidden slots gone, explicit positions for visibility,
    each entry's rot_shift for rotate_q)."""
    c = _case(PREFILL, layout, G=2, D=64, page=4, dtype=torch.float32, seed=13)
    inv = inv_freq_for("default", 64)[0]
    # Both rotate in fp32; torch's vectorised and scalar cos/sin may differ by an ulp, so the
    # two agree to fp32 rounding (a wrong position or a leaked hidden key is an O(1) error).
    assert rel_err(_ref(c, inv, rope_mode), _prompt_attention(c, inv, rope_mode)) < 1e-6


def test_block_copies_refuse_slot_positions():
    c = _case(MIXED, "hidden", G=2, D=64, page=4, dtype=DTYPES[0], seed=3)
    inv = inv_freq_for("default", 64)[0].to(c.q.device)
    with pytest.raises(ValueError, match="slot positions"):
        block_gather_rotate(c.k_pages, c.v_pages, c.table, inv)
    with pytest.raises(ValueError, match="slot positions"):
        block_gather_rotate_ref(c.k_pages, c.v_pages, c.table, inv)
    with pytest.raises(ValueError, match="slot positions"):
        block_attention_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv)


def test_from_lists_to_and_sequences():
    """from_lists builds both tensors (rows in entry order), to() and sequences() keep them."""
    t = PageTable.from_lists([[5, 6], [7]], [[0, 4], [0]], [[4, 2], [3]], [[0, 0], [0]],
                             slot_pos=[[None, [9, HIDDEN_POS, 0, 0]], [[2, 1, 0, HIDDEN_POS]]])
    assert t.slot_pos_row.tolist() == [-1, 0, 1]
    assert t.slot_pos.tolist() == [[9, HIDDEN_POS, 0, 0], [2, 1, 0, HIDDEN_POS]]
    assert t.slot_pos.dtype == t.slot_pos_row.dtype == torch.int32
    moved = t.to("cpu")
    assert torch.equal(moved.slot_pos, t.slot_pos) and torch.equal(moved.slot_pos_row,
                                                                    t.slot_pos_row)
    second = t.sequences(1, 2)
    assert second.indptr.tolist() == [0, 1] and second.page_ids.tolist() == [7]
    assert second.max_pages == 1 and t.sequences(0, 2).max_pages == 2
    assert second.slot_pos[second.slot_pos_row[0]].tolist() == [2, 1, 0, HIDDEN_POS]
    plain = PageTable.from_lists([[1]], [[0]], [[1]], slot_pos=[[None]])
    assert plain.slot_pos_row.tolist() == [-1] and plain.slot_pos.shape[0] == 0
    with pytest.raises(ValueError):
        PageTable.from_lists([[1, 2]], [[0, 4]], [[4, 4]], slot_pos=[[[0, 1, 2, 3], [4, 5]]])
    with pytest.raises(ValueError):
        PageTable(t.indptr, t.page_ids, t.page_pos, t.page_len, slot_pos_row=t.slot_pos_row)
