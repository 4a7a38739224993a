"""Gemma 2's attention in the kernels: soft-capped scores (softcap * tanh(s / softcap) of the
scaled score s = sm_scale * q.k, before the mask and the softmax) and sliding windows (a query at
p sees keys at p - window + 1 .. p, transformers' sliding-window mask).

The torch reference is checked first against a direct fp64 computation from each case's own list
of visible keys (Case.tokens, built independently of the page table); then every kernel the
engine calls on CUDA against the reference: lazy_decode (the tiles kernel: one and several
splits, fp8 pages with the value-scale fold), lazy_prefill (the runs kernel, with its lse), and
shared_chunk_decode (a window masks a shared chunk per sequence). Windows shorter than a page and
than a chunk, edges inside chunks and across chunk boundaries, explicit slot positions; caps
small enough to change the output by far more than the tolerances (shown).
"""
import pytest
import torch

from _cases import CHUNKS, DEVICE, DTYPES, MIXED, PREFILL, TOL, Case, inv_freq_for, rel_err
from test_fp8 import fp8_pages
from test_shared_chunks import SharingCase
from lazy_rag.kernels import lazy_decode, lazy_prefill, paged_attention_ref


def _case(seqs, *, G, D, page, dtype, seed, layout="plain"):
    extra = {"plain": {}, "hidden": dict(hide=0.3), "compact": dict(scatter=True)}[layout]
    return Case(seqs, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=seed, **extra)


def _inv(c):
    return inv_freq_for("default", c.D)[0].to(c.q.device)


def _ref(c, sm_scale, softcap, window, return_lse=False, pages=None, scales=None):
    k_pages, v_pages = pages or (c.k_pages, c.v_pages)
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, k_pages, v_pages, c.table, _inv(c),
                               "rotate_q", 1.0, sm_scale, compute_dtype=torch.float64,
                               return_lse=return_lse, softcap=softcap, window=window,
                               **(scales or {}))


def _rotated(x, angle):
    """x [D] rotated by angle [D/2] (rotate_half's layout), in fp64."""
    x1, x2 = x.chunk(2)
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])


def _direct(c, sm_scale, softcap, window):
    """fp64 attention from Case.tokens: each row's query rotated by (its position - the key's
    rot_shift) against every listed key at or before it and within the window."""
    inv = _inv(c).double().cpu()
    G = c.H // c.Hkv
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    for b, tokens in enumerate(c.tokens):
        for row in range(int(c.qo_indptr[b]), int(c.qo_indptr[b + 1])):
            m = int(c.q_pos[row])
            keys = [t for t in tokens if t[2] <= m and (window is None or m - t[2] < window)]
            if not keys:
                continue
            for h in range(c.H):
                s, vals = [], []
                for page, slot, _, shift in keys:
                    q = _rotated(c.q[row, h].double().cpu(), (m - shift) * inv)
                    s.append(float(q @ c.k_pages[page, h // G, slot].double().cpu()) * sm_scale)
                    vals.append(c.v_pages[page, h // G, slot].double().cpu())
                s = torch.tensor(s, dtype=torch.float64)
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[row, h] = torch.softmax(s, 0) @ torch.stack(vals)
    return out


# (window, softcap): a window shorter than a page (3 < page 4 or 16), one edge across chunks of
# 37 and 50 tokens (20), no window; caps that bite (scores of a few units: here sm_scale 0.5 at
# head_dim 32; the kernel tests' head_dim ** -0.5 at 64 and 128, caps 1-3)
CAP_WINDOW = [(3, 1.5), (20, None), (None, 2.0), (20, 4.0)]


@pytest.mark.parametrize("window,softcap", CAP_WINDOW)
@pytest.mark.parametrize("layout", ["plain", "hidden"])
def test_reference_matches_direct_computation(window, softcap, layout):
    c = _case(PREFILL, G=2, D=32, page=4, dtype=torch.float32, seed=1, layout=layout)
    # (the reference rotates in fp32 and returns q's dtype: agreement to fp32's RoPE angles)
    assert rel_err(_ref(c, 0.5, softcap, window), _direct(c, 0.5, softcap, window)) < 1e-4


def test_the_cap_and_the_window_change_the_output():
    """Neither is a no-op at the sizes the kernel tests use: each moves the output by far more
    than any tolerance (so a kernel that ignored one would fail its test)."""
    c = _case(PREFILL, G=2, D=64, page=16, dtype=torch.float32, seed=2)
    plain = _ref(c, None, None, None)
    for cap in (1.0, 1.5, 2.0, 3.0):
        assert rel_err(_ref(c, None, cap, None), plain) > 1e-2
    assert rel_err(_ref(c, None, None, 20), plain) > 1e-2
    assert rel_err(_ref(c, None, 1.5, 20), _ref(c, None, 1.5, 21)) > 1e-3   # the edge itself


# (G, D, page, layout, splits, window, softcap): splits 1 (the direct epilogue) and several (the
# merge); pages 4 (eight per 32-key tile: MULTI_SHIFT 2's while loop), 16 (two per tile: the two
# row groups of MULTI_SHIFT 4, or with explicit slot positions 3's scalar branch) and 64; GQA
# 1-4; a cap alone (page 64)
DECODE = [(1, 64, 4, "plain", 1, 3, 1.5), (3, 64, 16, "hidden", None, 20, 3.0),
          (4, 128, 64, "compact", 3, 40, None), (2, 64, 16, "plain", 2, 9, 1.0),
          (2, 64, 64, "plain", None, None, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D,page,layout,splits,window,softcap", DECODE)
def test_decode(G, D, page, layout, splits, window, softcap, dtype):
    c = _case(MIXED, G=G, D=D, page=page, dtype=dtype, seed=G + page, layout=layout)
    out, lse = lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, _inv(c),
                           num_splits=splits, softcap=softcap, window=window, return_lse=True)
    ref, ref_lse = _ref(c, None, softcap, window, return_lse=True)
    assert rel_err(out, ref) < TOL[dtype]
    assert (lse.double().cpu() - ref_lse.cpu()).abs().max() < TOL[dtype]


# (G, D, page, layout, window, softcap): new tokens whose windows reach back into a chunk, past
# it, and only over their own tokens
PREFILL_SHAPES = [(2, 64, 16, "plain", 5, 1.5), (1, 128, 4, "compact", 24, 2.0),
                  (4, 64, 64, "hidden", 9, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D,page,layout,window,softcap", PREFILL_SHAPES)
def test_prefill(G, D, page, layout, window, softcap, dtype):
    c = _case(PREFILL, G=G, D=D, page=page, dtype=dtype, seed=10 + G, layout=layout)
    out, lse = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table, _inv(c),
                            softcap=softcap, window=window, return_lse=True)
    ref, ref_lse = _ref(c, None, softcap, window, return_lse=True)
    assert rel_err(out, ref) < TOL[dtype]
    assert (lse.double().cpu() - ref_lse.cpu()).abs().max() < TOL[dtype]


def test_fp8_decode_caps_before_the_value_fold():
    """fp8 pages in fp16 decode fold the value scales into the scores (paged_attention's FOLD_V):
    the cap must take the score before the fold, as the reference over the dequantised pages."""
    dtype = torch.float16
    c = _case(MIXED, G=4, D=64, page=16, dtype=dtype, seed=5)
    (k8, v8, ks, vs), deq = fp8_pages(c, 5)
    out = lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), softcap=1.0, window=11,
                      k_scale=ks, v_scale=vs)
    assert rel_err(out, _ref(c, None, 1.0, 11, pages=deq)) < 2e-3


@pytest.mark.parametrize("window,softcap", [(7, 1.0), (30, None)])
def test_shared_chunk_decode(window, softcap):
    """Each pair's window from its own chunk position: a window of 7 leaves most shared chunks
    out of sight (their keys all masked for some sequences), 30 cuts through them."""
    dtype = DTYPES[0]
    c = SharingCase(B=5, n_chunks=4, G=2, D=64, page=16, dtype=dtype, seed=3, pairs_per_tile=3)
    out = c.run(softcap=softcap, window=window)
    B = c.q.shape[0]
    ref = paged_attention_ref(c.q, torch.arange(B + 1, dtype=torch.int32, device=c.q.device), c.q_pos,
                              c.k_pages, c.v_pages, c.union, c.inv, "rotate_q", c.scaling,
                              compute_dtype=torch.float64, softcap=softcap, window=window)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(c.run(), ref) > 1e-2     # the window (and cap) matter here


def test_prefill_window_edge_at_every_offset():
    """Windows 1 to 3 pages, one page per KV tile (block_n = page: 4 under the interpreter, 16 on
    a GPU, whose tensor-core dot needs K >= 16): for some window a page's last key lands on the
    edge of a query tile's window (q_min - window + 1, the oldest key its first row still sees),
    where the runs kernel's skip of pages out of every row's window must stop."""
    dtype = DTYPES[0]
    page = 16 if DEVICE == "cuda" else 4
    c = _case([([0, 2], 20, 9), ([3, 1], 6, 6)], G=2, D=64, page=page, dtype=dtype, seed=21)
    for window in range(1, 3 * page + 1):
        out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table, _inv(c),
                           window=window, block_n=page)
        assert rel_err(out, _ref(c, None, None, window)) < TOL[dtype], window
