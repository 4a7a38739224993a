"""lazy_decode / lazy_prefill, and the benchmarks' Block-Attention baseline
(lazy_rag.bench.block_attention), against the torch reference (fp64 oracle)."""
import inspect

import pytest
import torch

from _cases import CHUNKS, DTYPES, MIXED, PREFILL, TOL, Case, inv_freq_for, rel_err
from lazy_rag.bench.block_attention import (block_attention_decode, block_gather_rotate,
                                            block_gather_rotate_ref)
from lazy_rag.bench.tiles_prefill import tiles_prefill
from lazy_rag.kernels import (DEFAULT_ROPE_MODE, apply_rope, lazy_decode, lazy_prefill,
                              paged_attention_ref, plan_prefill)

ROPE_MODES = ["rotate_q", "none"]


def _ref(c, inv, scale, rope_mode):
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                               inv.to(c.q.device), rope_mode, scale, compute_dtype=torch.float64)


def _poisoned(c):
    return torch.full_like(c.q, float("nan"))


# (G, D, page): GQA 1/3/4/7/8, head dim 64/128, pages of 1, 4 (not dividing 37/50/23) and 16.
SHAPES = [(1, 64, 4), (3, 64, 16), (4, 128, 4), (7, 64, 1), (8, 128, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_mode", ROPE_MODES)
@pytest.mark.parametrize("G,D,page", SHAPES)
def test_decode(G, D, page, rope_mode, dtype):
    c = Case(MIXED, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G * 7 + page)
    inv, scale = inv_freq_for("default", D)
    out = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv.to(c.q.device),
                      rope_mode=rope_mode, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, scale, rope_mode)) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("rope_mode", ["rotate_q", "none"])
def test_decode_splits_shuffled(splits, rope_mode):
    """Split-KV merge (including splits with no tile) and page lists out of position order."""
    dtype = DTYPES[0]
    c = Case(MIXED, CHUNKS, Hkv=1, G=4, D=64, page=4, dtype=dtype, seed=splits, shuffle=True)
    inv, scale = inv_freq_for("default", 64)
    out = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv.to(c.q.device),
                      rope_mode=rope_mode, num_splits=splits, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, scale, rope_mode)) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("G", [1, 4, 7, 8, 16])
def test_decode_two_pages_per_tile(G, splits):
    """rotate_q decode over tiles of two pages (the GPU's default: 128-key tiles over 64-slot
    pages; here 32 keys over pages of 16, on the GPU too): the chunks (37, 1, 50, 9, 64, 23
    tokens) start pages, so many tiles hold two chunks' keys at different shifts. G <= 8 takes
    the two row groups (MULTI_SHIFT 4: the padded query rows score the second page, each group
    merged at the end), G = 16 leaves no padded rows and takes the branch (3). Output and
    log-sum-exp against the reference, with one split (the direct epilogue) and three."""
    from lazy_rag.kernels.page_table import ROPE_MODES
    from lazy_rag.kernels.paged_attention import _multi_shift_variant
    dtype = DTYPES[0]
    gp = 1 << (G - 1).bit_length()
    assert _multi_shift_variant(ROPE_MODES["rotate_q"], 2, max(16, gp), 1, gp, False) == \
        (4 if G <= 8 else 3)
    assert _multi_shift_variant(ROPE_MODES["rotate_q"], 2, max(16, gp), 1, gp, True) == 3
    c = Case(MIXED, CHUNKS, Hkv=2, G=G, D=64, page=16, dtype=dtype, seed=G + splits)
    inv, scale = inv_freq_for("default", 64)
    out, lse = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv.to(c.q.device),
                           rope_mode="rotate_q", block_n=32, num_splits=splits,
                           out=_poisoned(c), return_lse=True)
    ref, ref_lse = paged_attention_ref(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                                       inv.to(c.q.device), "rotate_q", scale,
                                       compute_dtype=torch.float64, return_lse=True)
    assert rel_err(out, ref) < TOL[dtype]
    assert (lse.double().cpu() - ref_lse.cpu()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_mode", ROPE_MODES)
@pytest.mark.parametrize("G,D,page", [(1, 64, 16), (3, 128, 4), (8, 64, 1)])
def test_prefill(G, D, page, rope_mode, dtype):
    c = Case(PREFILL, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G + page)
    inv, scale = inv_freq_for("default", D)
    out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                       inv.to(c.q.device), rope_mode=rope_mode, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, scale, rope_mode)) < TOL[dtype]


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn"])
def test_scaling_types_far_positions(kind):
    """Every RoPE scaling type (yarn's attention_scaling included) at positions past 100k
    (rotate_q: "none" takes no rotation)."""
    rope_mode = "rotate_q"
    dtype = DTYPES[0]
    c = Case(PREFILL, CHUNKS, Hkv=1, G=4, D=64, page=8, dtype=dtype, seed=3, pos_base=131_000)
    inv, scale = inv_freq_for(kind, 64)
    out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                       inv.to(c.q.device), rope_mode=rope_mode, attention_scaling=scale,
                       num_splits=2, out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, scale, rope_mode)) < TOL[dtype]


def test_strategies_agree():
    """The same prompt stored three ways (unrotated / chunk-local / rotated at logical
    positions) gives the same attention through the benchmarks' Block-Attention (rotate_k: keys
    copied and rotated at their positions) and the lazy kernels' rotate_q / none.

    Near position 0 only: at 100k the strategies differ by transformers' own fp32 angle rounding
    (fl(m*f) - fl(p*f) vs fl((m-a)*f) - fl((p-a)*f), ~6e-3 rad at f=1), which is no kernel error;
    each strategy is checked against its exact reference at 100k+ elsewhere."""
    dtype = DTYPES[0]
    D = 64
    c = Case(MIXED, CHUNKS, Hkv=2, G=2, D=D, page=4, dtype=dtype, seed=11, pos_base=1_003)
    inv, scale = inv_freq_for("yarn", D)
    inv = inv.to(c.q.device)
    t = c.table
    k_local = c.k_pages.clone()
    off = torch.arange(c.page, device=c.q.device)
    for e in range(t.page_ids.numel()):      # shared chunk pages: same rotation in every entry
        pid = int(t.page_ids[e])
        pos = int(t.page_pos[e]) + off
        k_local[pid] = apply_rope(c.k_pages[pid], (pos - int(t.rot_shift[e]))[None, :].expand(
            c.Hkv, -1), inv, scale, heads_dim=None)
    # Shared chunks sit at different offsets per sequence: run one sequence per call so each
    # page's "absolute" rotation is that sequence's.
    for b in range(t.batch_size):
        s, e = int(t.indptr[b]), int(t.indptr[b + 1])
        tb = t.sequences(b, b + 1)
        ka = c.k_pages.clone()
        for j in range(s, e):
            pid = int(t.page_ids[j])
            pos = int(t.page_pos[j]) + off
            ka[pid] = apply_rope(c.k_pages[pid], pos[None, :].expand(c.Hkv, -1), inv, scale,
                                 heads_dim=None)
        q, qp = c.q[b:b + 1], c.q_pos[b:b + 1]
        o1 = block_attention_decode(q, c.k_pages, c.v_pages, tb, qp, inv, rope_mode="rotate_k",
                                    attention_scaling=scale)
        o2 = lazy_decode(q, k_local, c.v_pages, tb, qp, inv, rope_mode="rotate_q",
                         attention_scaling=scale)
        o3 = lazy_decode(apply_rope(q, qp, inv, scale), ka, c.v_pages, tb, qp, inv,
                         rope_mode="none")
        tol = 3 * TOL[dtype] if dtype != torch.float32 else 1e-4
        assert rel_err(o2, o1) < tol and rel_err(o3, o1) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_mode", ["rotate_k", "rotate_q", "none"])
@pytest.mark.parametrize("page", [1, 16])
def test_block_gather_rotate(page, rope_mode, dtype):
    c = Case(MIXED, CHUNKS, Hkv=2, G=4, D=64, page=page, dtype=dtype, seed=page,
             pos_base=100_500)
    inv, scale = inv_freq_for("llama3", 64)
    inv = inv.to(c.q.device)
    k, v, n = block_gather_rotate(c.k_pages, c.v_pages, c.table, inv, rope_mode=rope_mode,
                                  attention_scaling=scale)
    kr, vr, nr, _ = block_gather_rotate_ref(c.k_pages, c.v_pages, c.table, inv, rope_mode, scale)
    assert torch.equal(n.cpu(), nr.cpu())
    for b in range(len(n)):
        m = int(n[b])
        assert rel_err(k[b, :, :m], kr[b, :, :m]) < TOL[dtype]
        assert torch.equal(v[b, :, :m].cpu(), vr[b, :, :m].cpu())


def test_block_attention_decode_matches_the_reference():
    """Block-Attention (copy + SDPA) over the chunk-local store computes the lazy kernels'
    function (over its own unrotated store: test_strategies_agree)."""
    rope_mode = "rotate_q"
    dtype = DTYPES[0]
    c = Case(MIXED, CHUNKS, Hkv=2, G=4, D=64, page=4, dtype=dtype, seed=5, pos_base=7)
    inv, scale = inv_freq_for("default", 64)
    inv = inv.to(c.q.device)
    blk = block_attention_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv,
                                 rope_mode=rope_mode)
    ref = _ref(c, inv.cpu(), scale, rope_mode)
    assert rel_err(blk, ref) < 3 * TOL[dtype]


@pytest.mark.parametrize("block_m", [None, 16, 32])
def test_two_pages_per_tile(block_m):
    """The tiles kernel's rotate_q with two pages per KV tile (the GPU's page-64 / 128-key case)
    where chunk boundaries fall inside tiles: decode (block_m None) and prefill of 64 rows take
    the uniform scalar branch, prefill of 128 rows the while loop; every score is exact either
    way. (Prefill through the benchmarks' tiles_prefill: the runs kernel, lazy_prefill's, never
    puts two shifts in one tile; test_prefill_runs.py.)"""
    dtype = DTYPES[0]
    c = Case(MIXED if block_m is None else PREFILL, CHUNKS, Hkv=2, G=4, D=64, page=16,
             dtype=dtype, seed=21, pos_base=90_000)
    inv, scale = inv_freq_for("default", 64)
    if block_m is None:
        out = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, inv.to(c.q.device),
                          rope_mode="rotate_q", block_n=32, out=_poisoned(c))
    else:
        plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=block_m)
        out = tiles_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table,
                            inv.to(c.q.device), rope_mode="rotate_q", plan=plan, block_n=32,
                            out=_poisoned(c))
    assert rel_err(out, _ref(c, inv, scale, "rotate_q")) < TOL[dtype]


def test_default_rope_mode_is_rotate_q():
    """Every entry point defaults to DEFAULT_ROPE_MODE (the engine's store format)."""
    assert DEFAULT_ROPE_MODE == "rotate_q"
    for fn in (lazy_decode, lazy_prefill, paged_attention_ref, block_gather_rotate,
               block_gather_rotate_ref, block_attention_decode):
        assert inspect.signature(fn).parameters["rope_mode"].default == DEFAULT_ROPE_MODE
