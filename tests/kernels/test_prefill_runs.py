"""The runs prefill kernel (kernels/prefill_runs.py, lazy_prefill's) against the fp64 reference,
its run / mask segmentation against a python mirror, and the benchmarks' tiles prefill
(lazy_rag.bench.tiles_prefill) beside it.

Shapes put run boundaries everywhere a tile can meet them: pages of 1 (32 entries per tile), 4
(runs of 1 and 3 pages, shorter than an 8-page tile), 16 (two pages per tile, the 64-token chunk
ending on a tile edge; or one page per tile, the scalar-page path), 64 (every chunk one page,
most partial), 12 (one page per 16-key tile: lanes past the page); split-KV ranges cutting runs;
query tiles of a few tokens, so that one sequence's tiles see different unmasked prefixes and
trimmed masked parts; a sequence with no page entry and a query row placed before every key
(rows that see no key: zeros, lse -inf).
"""
import pytest
import torch
import triton
import triton.language as tl

from _cases import CHUNKS, DTYPES, PREFILL, TOL, Case, inv_freq_for, rel_err
from lazy_rag.bench.tiles_prefill import tiles_block_m, tiles_prefill
from lazy_rag.kernels import PrefillPlan, lazy_prefill, paged_attention_ref, plan_prefill
from lazy_rag.kernels.prefill_runs import _run_bounds

# PREFILL plus a sequence of private tokens only, and one with no page entry at all
SEQS = PREFILL + [([], 6, 2), ([], 0, 2)]
LAYOUTS = {"plain": dict(), "hidden": dict(hide=0.3), "compact": dict(scatter=True),
           "both": dict(hide=0.3, scatter=True, all_hidden=2)}

# (G, D, page, block_n, block_m, num_splits, layout, rope_mode, pos_base, q_rotation)
CASES = [
    (1, 64, 4, 32, 8, 1, "plain", "rotate_q", 0, "token"),     # runs shorter than 8-page tiles
    (2, 128, 16, 32, 8, 3, "plain", "rotate_q", 100_000, "token"),  # 2 pages / tile, far
    (4, 64, 16, 16, 4, 7, "plain", "rotate_q", 0, "row"),      # one page per tile, 7 splits
    (8, 64, 1, 32, 2, None, "plain", "rotate_q", 3_000, "token"),  # 32 1-token pages / tile
    (3, 64, 64, 128, 4, 2, "plain", "rotate_q", 0, "token"),   # a chunk per (partial) page
    (5, 128, 8, 32, 4, 1, "both", "rotate_q", 0, "row"),       # slot positions, all hidden
    (1, 64, 16, 64, 16, 5, "compact", "rotate_q", 500, "token"),
    (2, 64, 4, 32, 8, 3, "hidden", "none", 0, "token"),
    (4, 128, 16, 32, 8, 1, "plain", "none", 0, "token"),
    (3, 64, 12, 16, 8, 2, "plain", "rotate_q", 0, "token"),    # page 12 in a 16-key tile
]


def _case(G, D, page, layout, dtype, pos_base, seed):
    c = Case(SEQS, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=seed,
             pos_base=pos_base + 64, **LAYOUTS[layout])
    # sequence 1's first query sits before every key of its sequence: it sees none
    c.q_pos[int(c.qo_indptr[1])] = pos_base
    return c


def _ref(c, rope_mode):
    inv = inv_freq_for("default", c.D)[0].to(c.q.device)
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table, inv,
                               rope_mode, compute_dtype=torch.float64, return_lse=True)


def _prefill(c, rope_mode, plan=None, fn=lazy_prefill, **kw):
    inv = inv_freq_for("default", c.D)[0].to(c.q.device)
    return fn(c.q, c.qo_indptr, c.q_pos, c.k_pages, c.v_pages, c.table, inv,
                        rope_mode=rope_mode, plan=plan, out=torch.full_like(c.q, float("nan")),
                        return_lse=True, **kw)


def _check(out, lse, ref_out, ref_lse, dtype):
    assert rel_err(out, ref_out) < TOL[dtype]
    lse, ref_lse = lse.double().cpu(), ref_lse.cpu()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (lse - ref_lse)[~empty].abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G,D,page,block_n,block_m,splits,layout,rope_mode,pos_base,q_rotation",
                         CASES)
def test_runs_kernel(G, D, page, block_n, block_m, splits, layout, rope_mode, pos_base,
                     q_rotation, dtype):
    c = _case(G, D, page, layout, dtype, pos_base, seed=G * 11 + page)
    plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=block_m)
    out, lse = _prefill(c, rope_mode, plan, block_n=block_n, num_splits=splits,
                        q_rotation=q_rotation)
    ref_out, ref_lse = _ref(c, rope_mode)
    rows = c.qo_indptr[-2:].tolist()      # the sequence with no entry: zeros, -inf
    assert torch.equal(out[rows[0]:rows[1]].cpu(), torch.zeros_like(out[rows[0]:rows[1]]).cpu())
    assert torch.isneginf(ref_lse[int(c.qo_indptr[1])]).all()
    _check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("rope_mode", ["rotate_q", "none"])
def test_padding_tiles_and_kernels_agree(rope_mode):
    """Query tiles that own no row (a CUDA-graph plan padded to a fixed tile count) write
    nothing; the runs kernel and the benchmarks' tiles prefill agree with each other and the
    reference."""
    dtype = DTYPES[0]
    c = _case(4, 64, 16, "plain", dtype, 0, seed=5)
    plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=8)
    n = c.q.shape[0]
    dev = c.q.device
    pad = lambda t, v: torch.cat([t, torch.full((3,), v, dtype=t.dtype, device=dev)])  # noqa
    padded = PrefillPlan(pad(plan.tile_seq, c.table.batch_size - 1), pad(plan.tile_q0, n), 8)
    ref_out, ref_lse = _ref(c, rope_mode)
    runs = _prefill(c, rope_mode, padded, num_splits=2)
    tiles = _prefill(c, rope_mode, plan, fn=tiles_prefill)
    unpadded = _prefill(c, rope_mode, plan)
    for out, lse in (runs, tiles, unpadded):
        _check(out, lse, ref_out, ref_lse, dtype)


def test_keys_stored_unrotated_have_no_kernel():
    """rope_mode "rotate_k" (keys stored unrotated, rotated per key) is no storage the kernels
    serve: refused, not computed some other way."""
    c = _case(2, 64, 16, "plain", DTYPES[0], 0, seed=1)
    with pytest.raises(ValueError, match="rotate_k"):
        _prefill(c, "rotate_k")
    with pytest.raises(ValueError, match="rotate_k"):
        _prefill(c, "rotate_k", fn=tiles_prefill)


# ---------------------------------------------------------------------------------------------
# The segmentation itself: _run_bounds against a python mirror. The attention tests above
# cannot see it (a kernel that masked every tile and never trimmed would pass them, slowly).
# ---------------------------------------------------------------------------------------------

@triton.jit
def _bounds_probe(ROT_SHIFT, PAGE_POS, PAGE_LEN, SLOT_POS_ROW, ARGS, OUT, BY_SHIFT: tl.constexpr,
                  HAS_SLOT_POS: tl.constexpr, SCAN: tl.constexpr, PPT: tl.constexpr):
    i = tl.program_id(0)
    e = tl.load(ARGS + 4 * i)
    e_hi = tl.load(ARGS + 4 * i + 1)
    q_min = tl.load(ARGS + 4 * i + 2)
    q_max = tl.load(ARGS + 4 * i + 3)
    s0 = tl.load(ROT_SHIFT + e)
    run_end, mid, stop = _run_bounds(ROT_SHIFT, PAGE_POS, PAGE_LEN, SLOT_POS_ROW, e, e_hi, s0, q_min,
                                     q_max, BY_SHIFT, HAS_SLOT_POS, SCAN, PPT)
    tl.store(OUT + 3 * i, run_end)
    tl.store(OUT + 3 * i + 1, mid)
    tl.store(OUT + 3 * i + 2, stop)


def _bounds_mirror(shift, pos, length, rows, e, e_hi, q_min, q_max, by_shift, ppt):
    run_end = e_hi
    if by_shift:
        run_end = next((j for j in range(e, e_hi) if shift[j] != shift[e]), e_hi)
    # an entry with explicit slot positions (row >= 0) is masked and never trimmed
    mid = next((j for j in range(e, run_end) if pos[j] + length[j] - 1 > q_min or rows[j] >= 0), run_end)
    last = max([j for j in range(e, run_end) if pos[j] <= q_max or rows[j] >= 0], default=e - 1)
    stop = max(min(last + 1, run_end), mid)
    if mid < stop:          # the masked part starts on the run's tile grid
        mid = e + (mid - e) // ppt * ppt
    return run_end, mid, stop


@pytest.mark.parametrize("scan,ppt", [(4, 1), (64, 3), (64, 8)])
@pytest.mark.parametrize("by_shift,slot_pos", [(True, False), (True, True), (False, False)])
def test_run_bounds(by_shift, slot_pos, scan, ppt):
    g = torch.Generator().manual_seed(scan + ppt + 2 * by_shift + slot_pos)
    n = 150
    # runs of 1..20 entries; positions mostly increasing by page (ordered private pages and
    # chunks), with shuffled stretches (entries need not be sorted)
    shift, pos, length = [], [], []
    p = 0
    while len(shift) < n:
        k = int(torch.randint(1, 21, (1,), generator=g))
        s = int(torch.randint(0, 4, (1,), generator=g)) * 100
        for _ in range(k):
            ln = int(torch.randint(1, 5, (1,), generator=g))
            shift.append(s)
            pos.append(p)
            length.append(ln)
            p += ln
    shift, pos, length = shift[:n], pos[:n], length[:n]
    # with slot positions, about one entry in eight has explicit ones (a recompute's hidden slots)
    rows = [int(r) if slot_pos and float(u) < 0.125 else -1
            for r, u in zip(torch.randint(0, 10, (n,), generator=g), torch.rand(n, generator=g))]
    for a in range(0, n - 12, 12):
        sl = slice(a, a + 6)
        perm = torch.randperm(6, generator=g).tolist()
        pos[sl] = [pos[sl][i] for i in perm]
        length[sl] = [length[sl][i] for i in perm]
    args = []
    for _ in range(120):
        e = int(torch.randint(0, n, (1,), generator=g))
        e_hi = int(torch.randint(e + 1, n + 1, (1,), generator=g))
        q_min = int(torch.randint(-5, p + 5, (1,), generator=g))
        q_max = q_min + int(torch.randint(0, 40, (1,), generator=g))
        args.append((e, e_hi, q_min, q_max))
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = torch.zeros(len(args), 3, dtype=torch.int32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    flat = t([v for a in args for v in a]).to(dev)
    out = out.to(dev)
    _bounds_probe[(len(args),)](t(shift).to(dev), t(pos).to(dev), t(length).to(dev), t(rows).to(dev), flat,
                                out, BY_SHIFT=by_shift, HAS_SLOT_POS=slot_pos, SCAN=scan, PPT=ppt)
    want = [_bounds_mirror(shift, pos, length, rows, *a, by_shift, ppt) for a in args]
    assert out.cpu().tolist() == [list(w) for w in want]
    # the cases above do reach every outcome: unmasked prefixes, masked rests, trimmed tails
    assert any(m > a[0] for (_, m, _), a in zip(want, args))
    assert any(s > m for (_, m, s) in want)
    assert any(r > s for (r, _, s) in want)
    if slot_pos:   # explicit entries did end unmasked prefixes that positions alone would not have
        plain = [_bounds_mirror(shift, pos, length, [-1] * n, *a, by_shift, ppt) for a in args]
        assert any(w[1] < p[1] for w, p in zip(want, plain))


def test_tile_rows_and_split_target_follow_the_measured_rules():
    """The runs kernel's tile size keeps the GPU full of (tile, KV head) programs (prefill.runs_rows;
    132 SMs, 8 KV heads, GQA 4: the H100 sweep's shapes), and a sequence that fits one tile splits
    the KV over one program per SM instead of two (plan_split_target)."""
    from lazy_rag.kernels.prefill import plan_split_target, runs_rows

    gp, hkv, sms = 4, 8, 132
    assert runs_rows(32 * gp, 16 * 32 * gp, hkv, sms) == 128        # B16 +32: one tile each
    assert runs_rows(512 * gp, 16 * 512 * gp, hkv, sms) == 256      # B16 +512: 1024 programs at 256 rows
    assert runs_rows(512 * gp, 512 * gp, hkv, sms) == 64            # B1 +512: 256 programs at 64 rows
    assert runs_rows(82 * gp, 32 * 82 * gp, hkv, sms) == 128        # 32 paper requests: 328 programs
    assert plan_split_target(32, 32, 8) == 1.0 and plan_split_target(33, 32, 8) == 2.0


def test_an_encode_batch_of_any_size_takes_a_full_build_batchs_tiles(monkeypatch):
    """An index build's encode (prefill.encode_block_m): the tile a full batch of 256-token chunks
    picks (16k tokens of the 8B shape on 132 SMs: 256 rows), also for an update's few chunks,
    whose own size would pick 128 rows, a kernel variant the build never compiled; 128 rows at
    most in fp32 (prefill.max_rows)."""
    from lazy_rag.kernels import paged_attention
    from lazy_rag.kernels.prefill import default_block_m, encode_block_m, plan_prefill
    from lazy_rag.kernels.prefill_runs import default_tuning

    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 132)
    full = default_block_m(256, 32, 8, "cuda", total=16384)
    assert full * 4 == 256
    assert default_block_m(256, 32, 8, "cuda", total=1300) * 4 == 128      # an update's own pick
    assert encode_block_m(256, 32, 8, "cuda") == full
    assert encode_block_m(30, 32, 8, "cuda") == default_block_m(30, 32, 8, "cuda", total=16384)
    assert encode_block_m(256, 32, 8, "cpu") == default_block_m(256, 32, 8, "cpu")
    # the plan marks the encode (one split, a full batch's launch tuning: below); a request's
    # plan leaves both to the launch
    assert plan_prefill([0, 5, 9], 32, 8, "cpu", encode=True).full_batch
    assert not plan_prefill([0, 5, 9], 32, 8, "cpu").full_batch
    # 128-row tiles (fp32, or short chunks): a few programs would take 8 warps, a full batch 4
    assert default_tuning(128, False, 12, 132)["num_warps"] == 8
    assert default_tuning(128, False, None, 132) == default_tuning(128, False, 4096, 132)
    # fp32 compute: never 256-row tiles (more shared memory than an SM has: the launch fails)
    assert encode_block_m(256, 32, 8, "cuda", torch.float32) * 4 == 128
    assert default_block_m(256, 32, 8, "cuda", total=16384, dtype=torch.float32) * 4 == 128
    assert default_block_m(256, 32, 8, "cuda", total=16384, dtype=torch.bfloat16) == full
    # 256-wide heads (Gemma): half the rows (256 x 256 ran out of registers in ptxas), tuned as
    # the 128-wide tile of as many elements, never more than 2 stages
    assert encode_block_m(256, 16, 8, "cuda", torch.bfloat16, head_dim=256) * 2 == 128
    assert default_block_m(256, 16, 8, "cuda", total=16384, head_dim=256) * 2 == 128
    assert default_tuning(128, False, None, 132, head_dim=256) == dict(block_n=64, num_warps=16, num_stages=2)
    assert default_tuning(64, False, None, 132, head_dim=256)["num_stages"] == 2
    # the tiles prefill's own tiles: 64 rows at most in fp32, 256 in 16 bits
    assert tiles_block_m(512, 32, 8, "cuda", dtype=torch.float32) * 4 == 64
    assert tiles_block_m(512, 32, 8, "cuda", dtype=torch.float16) * 4 == 256


@pytest.mark.parametrize("G", [2, 4])
def test_head_dim_256_with_a_full_batchs_tiles_and_tuning(G):
    """Gemma's 256-wide heads with the tiles and launch tuning a full batch picks
    (``encode=True``; on the GPU 128 rows, 16 warps, 2 stages, which compile: 256 rows ran out of
    registers), against the reference."""
    dtype = DTYPES[0]
    c = _case(G, 256, 16, "plain", dtype, 0, seed=G)
    plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, dtype=c.q.dtype, encode=True, head_dim=256)
    out, lse = _prefill(c, "rotate_q", plan)
    _check(out, lse, *_ref(c, "rotate_q"), dtype)
