"""return_lse: each query row's log-sum-exp from lazy_decode / lazy_prefill, and its use.

The lse (natural log, over the row's visible keys of sm_scale * q.k, -inf for a row that sees no
key) against the fp64 reference on every launcher path (a single split writes it in the
attention kernel's epilogue, forced splits in the merge kernel); then what it is for: one
sequence's keys split into two groups (its shared chunk pages and its private pages, two page
tables over the same pool), attended separately and merged by their lse, equal to one call over
all keys; and APE's merge (the chunk group at temperature T and scale S) against a direct fp64
computation of the APE attention.
"""
import math

import pytest
import torch

from _cases import CHUNKS, DTYPES, MIXED, PREFILL, TOL, Case, inv_freq_for, rel_err
from lazy_rag.kernels import (PageTable, lazy_decode, lazy_prefill, paged_attention_ref,
                              rope_cos_sin, rotate)
import lazy_rag.kernels.decode as decode_module
import lazy_rag.kernels.prefill as prefill_module

# plain: no explicit slot positions (HAS_SLOT_POS off); hidden / compact / both as in
# test_slot_positions.py ("both" hides every key of sequence 2: its rows' lse is -inf).
LAYOUTS = {
    "plain": dict(),
    "hidden": dict(hide=0.3),
    "compact": dict(scatter=True),
    "both": dict(hide=0.3, scatter=True, all_hidden=2),
}


def _case(seqs, layout, *, G, D, page, dtype, seed):
    return Case(seqs, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=seed,
                **LAYOUTS[layout])


def _poisoned(c):
    return torch.full_like(c.q, float("nan"))


def _attend(c, table, rope_mode, *, decode, **kw):
    """lazy_decode (one query per sequence) or lazy_prefill of the case's queries over `table`."""
    inv = inv_freq_for("default", c.D)[0].to(c.q.device)
    if decode:
        return lazy_decode(c.q, c.k_pages, c.v_pages, table, c.q_pos, inv, rope_mode=rope_mode,
                           **kw)
    return lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, table, inv,
                        rope_mode=rope_mode, **kw)


def _ref(c, table, rope_mode, sm_scale=None):
    inv = inv_freq_for("default", c.D)[0].to(c.q.device)
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, table, inv,
                               rope_mode, 1.0, sm_scale, compute_dtype=torch.float64,
                               return_lse=True)


def _assert_lse_close(lse, ref_lse, dtype):
    """fp32 [Tq, H]; -inf exactly where the reference sees no key; elsewhere within TOL (an lse
    error d scales the row's softmax normalizer by e^d, a relative error of about d)."""
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    lse, ref_lse = lse.double().cpu(), ref_lse.cpu()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.isfinite(lse[~empty]).all()
    assert (lse - ref_lse)[~empty].abs().max().item() < TOL[dtype]


# (G, D, page, layout, num_splits, rope_mode): GQA 1..8, head dims 64 and 128, pages 4, 16 (two
# pages per 32-key tile) and 64; num_splits 1 (the DIRECT epilogue), None (the heuristic), 2..64
# (the merge kernel; 64 leaves splits with no tile), every layout and rope mode.
DECODE = [(1, 64, 4, "plain", 1, "rotate_q"), (2, 128, 16, "hidden", 3, "none"),
          (3, 64, 64, "both", None, "none"), (5, 128, 4, "compact", 64, "rotate_q"),
          (7, 64, 16, "both", 2, "rotate_q"), (8, 64, 64, "hidden", 1, "none")]
PREFILL_SHAPES = [(1, 128, 16, "both", 1, "rotate_q"), (3, 64, 4, "hidden", 3, "none"),
                  (6, 64, 64, "compact", None, "none"), (8, 64, 16, "hidden", 2, "rotate_q")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D,page,layout,splits,rope_mode", DECODE)
def test_decode_lse(G, D, page, layout, splits, rope_mode, dtype):
    c = _case(MIXED, layout, G=G, D=D, page=page, dtype=dtype, seed=100 + G * 7 + page)
    out, lse = _attend(c, c.table, rope_mode, decode=True, num_splits=splits,
                       out=_poisoned(c), return_lse=True)
    ref_out, ref_lse = _ref(c, c.table, rope_mode)
    assert rel_err(out, ref_out) < TOL[dtype]
    _assert_lse_close(lse, ref_lse, dtype)
    assert torch.isneginf(ref_lse).any() == (layout == "both")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D,page,layout,splits,rope_mode", PREFILL_SHAPES)
def test_prefill_lse(G, D, page, layout, splits, rope_mode, dtype):
    c = _case(PREFILL, layout, G=G, D=D, page=page, dtype=dtype, seed=200 + G + page)
    out, lse = _attend(c, c.table, rope_mode, decode=False, num_splits=splits,
                       out=_poisoned(c), return_lse=True)
    ref_out, ref_lse = _ref(c, c.table, rope_mode)
    assert rel_err(out, ref_out) < TOL[dtype]
    _assert_lse_close(lse, ref_lse, dtype)
    assert torch.isneginf(ref_lse).any() == (layout == "both")


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("splits", [1, 3])
def test_return_lse_leaves_out_unchanged(splits, decode):
    """return_lse only adds the lse: out is bit-identical to the default call's, and the
    default call returns a tensor, not a tuple."""
    c = _case(MIXED if decode else PREFILL, "plain", G=4, D=64, page=16, dtype=DTYPES[-1],
              seed=300 + splits)
    plain = _attend(c, c.table, "rotate_q", decode=decode, num_splits=splits)
    assert isinstance(plain, torch.Tensor)
    out, _ = _attend(c, c.table, "rotate_q", decode=decode, num_splits=splits, return_lse=True)
    assert torch.equal(out, plain)


def test_reference_path_returns_lse(monkeypatch):
    """Off the Triton path (CPU without the interpreter) the entry points return the
    reference's (out, lse), writing into `out` when given."""
    c = _case(PREFILL, "both", G=2, D=64, page=4, dtype=torch.float32, seed=400)
    monkeypatch.setattr(decode_module, "use_triton", lambda t: False)
    monkeypatch.setattr(prefill_module, "use_triton", lambda t: False)
    ref_out, ref_lse = _ref(c, c.table, "rotate_q")
    given = _poisoned(c)
    out, lse = _attend(c, c.table, "rotate_q", decode=False, out=given, return_lse=True)
    assert out is given and rel_err(out, ref_out) < 1e-6
    _assert_lse_close(lse, ref_lse, torch.float32)
    assert isinstance(_attend(c, c.table, "rotate_q", decode=False), torch.Tensor)
    last = c.qo_indptr[1:].long() - 1         # decode: the last query of each sequence
    out, lse = lazy_decode(c.q[last], c.k_pages, c.v_pages, c.table, c.q_pos[last],
                           inv_freq_for("default", 64)[0], return_lse=True)
    assert rel_err(out, ref_out[last]) < 1e-6
    _assert_lse_close(lse, ref_lse[last], torch.float32)


# ---------------------------------------------------------------------------------------------
# What the lse is for: attending to disjoint key groups separately and merging
# ---------------------------------------------------------------------------------------------

def _entries(table: PageTable, keep: torch.Tensor) -> PageTable:
    """The table with only the entries where keep is True (per sequence, in order)."""
    counts = table.indptr[1:] - table.indptr[:-1]
    seq = torch.repeat_interleave(torch.arange(table.batch_size, device=counts.device),
                                  counts.long())
    kept = torch.bincount(seq[keep], minlength=table.batch_size)
    indptr = torch.cat([kept.new_zeros(1), kept.cumsum(0)]).to(torch.int32)
    sel = lambda t: None if t is None else t[keep]  # noqa: E731
    return PageTable(indptr, sel(table.page_ids), sel(table.page_pos), sel(table.page_len),
                     sel(table.rot_shift), int(kept.max()), sel(table.slot_pos_row),
                     table.slot_pos)


def _chunk_and_private(c):
    """Two page tables over the same pool: each sequence's shared chunk pages, and its private
    pages (recomputed and new tokens)."""
    chunk = torch.isin(c.table.page_ids,
                       torch.tensor(c.chunk_page_ids, dtype=torch.int32, device=c.q.device))
    return _entries(c.table, chunk), _entries(c.table, ~chunk)


def _merge(groups):
    """What the engine does with per-group (out, lse): o = sum_g e^(lse_g - m) o_g /
    sum_g e^(lse_g - m), lse = m + ln sum_g e^(lse_g - m), m = max_g lse_g (fp64; a row that
    sees no key in any group gets zeros and -inf)."""
    lse = torch.stack([g[1].double() for g in groups])            # [groups, Tq, H]
    m = lse.max(dim=0).values
    m = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lse - m)
    den = w.sum(dim=0)
    o = sum(w[i][..., None] * g[0].double() for i, g in enumerate(groups))
    return o / torch.where(den > 0, den, 1.0)[..., None], m + torch.log(den)


# a sequence with no chunk (its chunk group sees no key) on top of the usual batch
GROUP_DECODE = MIXED + [([], 4, 1)]
GROUP_PREFILL = PREFILL + [([], 6, 2)]


def _group_case(decode, dtype, seed):
    return Case(GROUP_DECODE if decode else GROUP_PREFILL, CHUNKS, Hkv=2, G=3, D=64, page=16,
                dtype=dtype, seed=seed, **LAYOUTS["both"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_two_groups_merge_to_one_call(decode, dtype):
    """Chunk keys (forced into 3 splits: the merge kernel's lse) and private keys (one split:
    the DIRECT epilogue's lse) attended separately, merged by lse: the call over all keys."""
    c = _group_case(decode, dtype, seed=500 + decode)
    chunk, private = _chunk_and_private(c)
    groups = [_attend(c, chunk, "rotate_q", decode=decode, num_splits=3, return_lse=True),
              _attend(c, private, "rotate_q", decode=decode, num_splits=1, return_lse=True)]
    assert torch.isneginf(groups[0][1]).any()        # the chunkless sequence, the hidden one
    out, lse = _merge(groups)
    ref_out, ref_lse = _ref(c, c.table, "rotate_q")
    assert rel_err(out, ref_out) < TOL[dtype]
    _assert_lse_close(lse.float(), ref_lse, dtype)
    one_out, one_lse = _attend(c, c.table, "rotate_q", decode=decode, return_lse=True)
    assert rel_err(out, one_out) < TOL[dtype]
    _assert_lse_close(one_lse, ref_lse, dtype)


def _ape_attention(c, sm_scale, T, S):
    """APE's attention computed directly in fp64 from the keys each case built (c.tokens, no
    page table, rotate_q as the reference rotates): a softmax over all visible keys where a
    chunk key's logit is s/T + (T - 1) lse_c + ln S (lse_c = logsumexp of the row's visible
    chunk logits s/T), a private key's is s, s = sm_scale * q.k. This is the chunk group's
    softmax at temperature T weighted by S (sum_c e^(s/T))^T against the private keys' sum e^s."""
    inv = inv_freq_for("default", c.D)[0].to(c.q.device)
    G = c.H // c.Hkv
    chunk_ids = torch.tensor(c.chunk_page_ids, device=c.q.device)
    out = torch.zeros(c.q.shape, dtype=torch.float64, device=c.q.device)
    for b, tokens in enumerate(c.tokens):
        qs, qe = int(c.qo_indptr[b]), int(c.qo_indptr[b + 1])
        if not tokens or qe == qs:
            continue
        page, slot, pos, shift = (torch.tensor(x, device=c.q.device) for x in zip(*tokens))
        k = c.k_pages[page, :, slot].repeat_interleave(G, dim=1).double()   # [n, H, D]
        v = c.v_pages[page, :, slot].repeat_interleave(G, dim=1).double()
        q, m = c.q[qs:qe], c.q_pos[qs:qe].long()
        cq, sq = rope_cos_sin(m[:, None] - shift[None, :], inv)               # [t, n, D/2]
        qr = rotate(q[:, None], cq[:, :, None], sq[:, :, None]).double()     # [t, n, H, D]
        s = torch.einsum("tnhd,nhd->htn", qr, k) * sm_scale
        visible = (pos[None, :] <= m[:, None])[None]                          # [1, t, n]
        in_chunk = torch.isin(page, chunk_ids)[None, None]
        chunk_logit = torch.where(visible & in_chunk, s / T, float("-inf"))
        lse_c = torch.logsumexp(chunk_logit, dim=-1, keepdim=True)
        lift = torch.where(torch.isneginf(lse_c), 0.0, (T - 1) * lse_c) + math.log(S)
        logit = torch.where(in_chunk, chunk_logit + lift,
                            torch.where(visible, s, float("-inf")))
        p = torch.softmax(logit, dim=-1).nan_to_num(0.0)
        out[qs:qe] = torch.einsum("htn,nhd->thd", p, v)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_ape_merge(decode, dtype):
    """APE: the chunk group attended at sm_scale / T (lse_c -> T * lse_c + ln S), merged with
    the private group by lse, equals APE's attention computed directly."""
    T, S, sm_scale = 0.6, 1.7, 0.11
    c = _group_case(decode, dtype, seed=600 + decode)
    chunk, private = _chunk_and_private(c)
    o_c, lse_c = _attend(c, chunk, "rotate_q", decode=decode, sm_scale=sm_scale / T,
                         return_lse=True)
    o_p, lse_p = _attend(c, private, "rotate_q", decode=decode, sm_scale=sm_scale,
                         num_splits=2, return_lse=True)
    out, _ = _merge([(o_c, T * lse_c.double() + math.log(S)), (o_p, lse_p)])
    assert rel_err(out, _ape_attention(c, sm_scale, T, S)) < TOL[dtype]


def test_ape_reference_is_plain_attention_at_t1():
    """The direct APE computation at T = 1, S = 1 is ordinary attention (the oracle's)."""
    c = _group_case(True, torch.float32, seed=700)
    ref_out, _ = _ref(c, c.table, "rotate_q", sm_scale=0.11)
    assert rel_err(_ape_attention(c, 0.11, 1.0, 1.0), ref_out) < 1e-6
