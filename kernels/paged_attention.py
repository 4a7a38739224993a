"""The one Triton attention kernel behind lazy_decode and lazy_prefill, and its split merge.

A program owns (a tile of BLOCK_M query tokens of one sequence) x (one KV head) x (one split of
that sequence's page list). The G query heads that share the KV head are packed into the rows
of the Q tile (row r = token r // GP, head r % GP, GP = G rounded up to a power of two), so each
K/V tile is read once per KV head whatever the GQA ratio. Decode is BLOCK_M = 1 (rows padded to
16 for tl.dot).

A KV tile is PPT consecutive entries of the sequence's page list (BLOCK_N = PPT * PAGE_SIZE
keys, rounded up to a power of two; the rest masked). Key n of the tile is token n % PAGE of
entry n // PAGE; its logical position is page_pos + n % PAGE.

RoPE (ROPE_MODE):
  0 none      q and keys used as given (keys stored rotated at logical positions).
  1 rotate_k  keys stored unrotated: the query is rotated once at m, every loaded key tile at
              its keys' positions (one cos/sin per key and frequency, shared by all G heads).
  2 rotate_q  keys stored rotated at (pos - rot_shift): the query is rotated by (m - s0), s0 the
              shift of the tile's first entry, and only re-rotated when s0 changes (once per
              chunk, not per tile); keys are used as stored. Keys of a tile entry whose shift
              differs from s0 (a chunk boundary inside the tile) get their scores from a second
              pair of QK dots with the query rotated by (m - s_j), so every score uses the
              reference's exact fp32 angle (rotating those keys by s_j - s0 instead would cost
              fp32 angle error proportional to |s_j - s0|). MULTI_SHIFT picks how: with two pages
              per tile (page 64, 128 keys: the GPU decode case) a uniform scalar `if s1 != s0`
              (variant 3); with more pages per tile a `while` loop over the distinct shifts
              (variant 2). The while loop is exact but stops Triton from software-pipelining the
              KV loop (no cp.async in the PTX): on an H200 it cost +34% in decode (B32 x 8k:
              342 us vs 257 us with variant 3 vs 255 us for rope="none").

Multi-head programs (heads_per_program = HG > 1): one program covers HG consecutive KV heads,
with rows = HG x G query heads; cos/sin of a key tile is computed once for the HG heads and each
head's scores are selected by row. Correct and tested, but slower on the H200 (bigger per-stage
shared memory, fewer programs): not the default.

Timing probes (DIAG, measured on the H200 at B32 x 8k, see BENCHMARKS.md): 1 = rotate_k with
cos/sin replaced by two FMAs (same loads and rotation), 2 = rotate_k with keys only staged
through fp32 registers. An optional `cos_sin_table` ([n_pos, D] fp32/bf16, cos | sin halves
at positions 0..n_pos-1; the caller must cover every key position, the kernel clamps) replaces
the in-kernel cos/sin by loads; slower on the H200 (L2 traffic), kept for measurement.

Online softmax in base 2 (fp32); output either written directly (one split) or as per-split
fp32 partials + log2-sum-exp merged by _merge_kernel (flash-decoding).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .page_table import PageTable, ROPE_MODES, interpreting
from .rope import cos_sin


@triton.jit
def _paged_attn_kernel(
    Q, stride_qt, stride_qh,
    K, V, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
    INDPTR, PAGE_IDS, PAGE_POS, PAGE_LEN, ROT_SHIFT,
    TILE_SEQ, TILE_Q0, QO_INDPTR, QPOS,
    INV_FREQ, rope_scale, qk_scale_log2, CS_TAB, cs_tab_len,
    O, stride_ot, stride_oh,
    PO, stride_pot, stride_poh, stride_pos,
    LSE, stride_lt, stride_lh,
    tiles_per_split,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    HALF: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE_MODE: tl.constexpr, FAST_TRIG: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr, QROT_CACHE: tl.constexpr, HG: tl.constexpr,
    MULTI_SHIFT: tl.constexpr, USE_TAB: tl.constexpr, DIAG: tl.constexpr,
):
    tile = tl.program_id(0)
    kvg = tl.program_id(1)       # group of HG consecutive KV heads
    split = tl.program_id(2)
    dtype = K.dtype.element_ty

    b = tl.load(TILE_SEQ + tile)
    q0 = tl.load(TILE_Q0 + tile)
    q_end = tl.load(QO_INDPTR + b + 1)

    r = tl.arange(0, ROWS)
    t = r // (GP * HG)
    rh = (r // GP) % HG           # KV head of the row within the group
    h = r % GP
    qi = q0 + t
    row_ok = (t < BLOCK_M) & (h < G) & (qi < q_end)
    head = (kvg * HG + rh) * G + h
    dh = tl.arange(0, HALF)
    dfull = tl.arange(0, 2 * HALF)

    q_off = qi.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
    q1 = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(Q + q_off + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qp = tl.load(QPOS + qi, mask=row_ok, other=-1)           # padded rows see no key
    freq = tl.load(INV_FREQ + dh)

    if ROPE_MODE == 1:
        c, s = cos_sin(qp.to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
        c = c * rope_scale
        s = s * rope_scale
        qa = (q1 * c - q2 * s).to(dtype)
        qb = (q2 * c + q1 * s).to(dtype)
    else:
        qa = q1.to(dtype)
        qb = q2.to(dtype)
    p_start = tl.load(INDPTR + b)
    cur_shift = p_start * 0 - 2147483647       # no shift seen yet
    p_end = tl.load(INDPTR + b + 1)
    n_tiles = tl.cdiv(p_end - p_start, PPT)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)

    n = tl.arange(0, BLOCK_N)
    slot = n // PAGE
    off = n % PAGE

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, 2 * HALF], dtype=tl.float32)

    for tt in range(t_lo, t_hi):
        e0 = p_start + tt * PPT
        e = e0 + slot
        e_ok = (slot < PPT) & (e < p_end)
        pid = tl.load(PAGE_IDS + e, mask=e_ok, other=0)
        plen = tl.load(PAGE_LEN + e, mask=e_ok, other=0)
        ppos = tl.load(PAGE_POS + e, mask=e_ok, other=0)
        k_ok = e_ok & (off < plen)
        kpos = ppos + off
        k_base = pid.to(tl.int64)[:, None] * stride_kp + off[:, None] * stride_kt + dh[None, :]
        v_base = pid.to(tl.int64)[:, None] * stride_vp + off[:, None] * stride_vt \
            + dfull[None, :]

        if ROPE_MODE == 1:
            # cos/sin of the tile's keys: once per key and frequency, shared by the HG KV heads
            # of the program and the G query heads of each.
            if USE_TAB:
                tab = tl.minimum(kpos, cs_tab_len - 1).to(tl.int64)[:, None] * (2 * HALF) \
                    + dh[None, :]
                ck = tl.load(CS_TAB + tab, mask=k_ok[:, None], other=0.0).to(tl.float32)
                sk = tl.load(CS_TAB + tab + HALF, mask=k_ok[:, None], other=0.0).to(tl.float32)
            elif DIAG == 1:     # timing probe: no trig, same rotation
                ang = kpos.to(tl.float32)[:, None] * freq[None, :]
                ck = 1.0 - ang * 1e-30
                sk = ang * 1e-30
            elif DIAG != 2:
                ck, sk = cos_sin(kpos.to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
                ck = ck * rope_scale
                sk = sk * rope_scale
        elif ROPE_MODE == 2:
            s0 = tl.load(ROT_SHIFT + e0)
            if QROT_CACHE:
                if s0 != cur_shift:
                    cq, sq = cos_sin((qp - s0).to(tl.float32)[:, None] * freq[None, :],
                                     FAST_TRIG)
                    cq = cq * rope_scale
                    sq = sq * rope_scale
                    qa = (q1 * cq - q2 * sq).to(dtype)
                    qb = (q2 * cq + q1 * sq).to(dtype)
                    cur_shift = s0
            else:   # rotate every tile: ROWS x D/2 cos/sin, no branch in the loop body
                cq, sq = cos_sin((qp - s0).to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
                cq = cq * rope_scale
                sq = sq * rope_scale
                qa = (q1 * cq - q2 * sq).to(dtype)
                qb = (q2 * cq + q1 * sq).to(dtype)
            if MULTI_SHIFT == 3:
                s1 = tl.load(ROT_SHIFT + e0 + 1, mask=e0 + 1 < p_end, other=0)
            if MULTI_SHIFT == 1:
                # PPT == 2: the second page may start a new chunk. Its keys always get their
                # scores from the query rotated by their own shift (identical to the first
                # dot's when the shifts agree), with no data-dependent control flow.
                s1 = tl.load(ROT_SHIFT + e0 + 1, mask=e0 + 1 < p_end, other=0)
                c1, s1n = cos_sin((qp - s1).to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
                c1 = c1 * rope_scale
                s1n = s1n * rope_scale
                qa1 = (q1 * c1 - q2 * s1n).to(dtype)
                qb1 = (q2 * c1 + q1 * s1n).to(dtype)

        sc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for hh in tl.static_range(HG):
            kvh = kvg * HG + hh
            k1 = tl.load(K + k_base + kvh * stride_kh, mask=k_ok[:, None], other=0.0)
            k2 = tl.load(K + k_base + kvh * stride_kh + HALF, mask=k_ok[:, None], other=0.0)
            if ROPE_MODE == 1:
                k1f = k1.to(tl.float32)
                k2f = k2.to(tl.float32)
                if DIAG == 2:   # timing probe: register round trip only, no trig/rotation
                    k1 = (k1f * rope_scale).to(dtype)
                    k2 = (k2f * rope_scale).to(dtype)
                else:
                    k1 = (k1f * ck - k2f * sk).to(dtype)
                    k2 = (k2f * ck + k1f * sk).to(dtype)
            sch = tl.dot(qa, tl.trans(k1), input_precision=DOT_PREC)
            sch = tl.dot(qb, tl.trans(k2), acc=sch, input_precision=DOT_PREC)
            if ROPE_MODE == 2:
                if MULTI_SHIFT == 1:
                    sc1 = tl.dot(qa1, tl.trans(k1), input_precision=DOT_PREC)
                    sc1 = tl.dot(qb1, tl.trans(k2), acc=sc1, input_precision=DOT_PREC)
                    sch = tl.where((slot == 1)[None, :], sc1, sch)
                elif MULTI_SHIFT == 3:
                    # PPT == 2: redo the dots for the second page only when it starts a new
                    # chunk (a uniform scalar branch: keeps the loop software-pipelined).
                    if s1 != s0:
                        c1, s1n = cos_sin((qp - s1).to(tl.float32)[:, None] * freq[None, :],
                                          FAST_TRIG)
                        c1 = c1 * rope_scale
                        s1n = s1n * rope_scale
                        qa1 = (q1 * c1 - q2 * s1n).to(dtype)
                        qb1 = (q2 * c1 + q1 * s1n).to(dtype)
                        sc1 = tl.dot(qa1, tl.trans(k1), input_precision=DOT_PREC)
                        sc1 = tl.dot(qb1, tl.trans(k2), acc=sc1, input_precision=DOT_PREC)
                        sch = tl.where((slot == 1)[None, :], sc1, sch)
                elif MULTI_SHIFT == 2:
                    # PPT > 2 (small pages): keys of the tile whose page shift differs from
                    # s0 get their scores from the query rotated by their own shift, one extra
                    # pair of dots per distinct shift, so every score uses angle (m - s_j) * f
                    # computed exactly as the reference does. (Rotating those keys by s_j - s0
                    # instead would cost fp32 angle error proportional to |s_j - s0|.)
                    sh = tl.load(ROT_SHIFT + e, mask=k_ok, other=0)
                    todo = k_ok & (sh != s0)
                    while tl.max(todo.to(tl.int32), axis=0) > 0:
                        su = tl.min(tl.where(todo, sh, 2147483647), axis=0)
                        cu, su_sin = cos_sin((qp - su).to(tl.float32)[:, None] * freq[None, :],
                                             FAST_TRIG)
                        cu = cu * rope_scale
                        su_sin = su_sin * rope_scale
                        qa2 = (q1 * cu - q2 * su_sin).to(dtype)
                        qb2 = (q2 * cu + q1 * su_sin).to(dtype)
                        sc2 = tl.dot(qa2, tl.trans(k1), input_precision=DOT_PREC)
                        sc2 = tl.dot(qb2, tl.trans(k2), acc=sc2, input_precision=DOT_PREC)
                        sel = todo & (sh == su)
                        sch = tl.where(sel[None, :], sc2, sch)
                        todo = todo & (sh != su)
            if HG == 1:
                sc = sch
            else:
                sc = tl.where((rh == hh)[:, None], sch, sc)
        sc = sc * qk_scale_log2
        vis = k_ok[None, :] & (kpos[None, :] <= qp[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        for hh in tl.static_range(HG):
            v = tl.load(V + v_base + (kvg * HG + hh) * stride_vh, mask=k_ok[:, None], other=0.0)
            if HG == 1:
                ph = p.to(dtype)
            else:
                ph = tl.where((rh == hh)[:, None], p, 0.0).to(dtype)
            acc = tl.dot(ph, v, acc=acc, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        o_off = qi.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dfull[None, :]
        tl.store(O + o_off, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        po_off = qi.to(tl.int64)[:, None] * stride_pot + head[:, None] * stride_poh \
            + split * stride_pos + dfull[None, :]
        tl.store(PO + po_off, o, mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + qi.to(tl.int64) * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(PO, stride_pot, stride_poh, LSE, stride_lt, stride_lh, O, stride_ot, stride_oh,
                  num_splits, SP: tl.constexpr, D: tl.constexpr):
    """out[t, h] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); all-empty rows -> 0."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    ok = s < num_splits
    lse = tl.load(LSE + t * stride_lt + h * stride_lh + s, mask=ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    po = tl.load(PO + t * stride_pot + h * stride_poh + s[:, None] * D + d[None, :],
                 mask=ok[:, None], other=0.0)
    num = tl.sum(po * w[:, None], axis=0)
    den = tl.sum(w, axis=0)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + d, o.to(O.dtype.element_ty))


LAST_KERNEL = None   # the last compiled attention kernel launched (register / smem report)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def launch(q, qo_indptr, q_pos, k_pages, v_pages, table: PageTable, inv_freq, *, rope: str,
           attention_scaling: float, sm_scale: float | None, tile_seq, tile_q0, block_m: int,
           max_tiles_hint: int, num_splits: int | None, out: torch.Tensor | None,
           block_n: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, split_target: float = 2.0,
           qrot_cache: bool = True, heads_per_program: int = 1,
           multi_shift: int | None = None, cos_sin_table: torch.Tensor | None = None,
           diag: int = 0):
    """Shared launcher. q [Tq, H, D]; tile_seq / tile_q0 [num_q_tiles] int32 (sequence and first
    query row of each query tile); max_tiles_hint: host-side max page entries of a sequence."""
    Tq, H, D = q.shape
    num_pages, Hkv, page, Dk = k_pages.shape
    assert Dk == D and D % 32 == 0 and H % Hkv == 0, "head_dim multiple of 32, H % Hkv == 0"
    assert k_pages.stride(-1) == 1 and v_pages.stride(-1) == 1 and q.stride(-1) == 1
    assert k_pages.dtype == v_pages.dtype == q.dtype
    mode = ROPE_MODES[rope]
    if mode == 2 and table.rot_shift is None:
        raise ValueError("rope='rotate_q' needs table.rot_shift")
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    hg = heads_per_program
    assert Hkv % hg == 0 and hg & (hg - 1) == 0, "heads_per_program: power of 2 dividing Hkv"
    rows = max(16, block_m * GP * hg)
    interp = interpreting() and not q.is_cuda
    if block_n is None:   # H200 sweep (B32 x 8k, d128, page 64): 128 keys/tile, 4 warps best
        block_n = 32 if interp else 128
    ppt = max(1, block_n // page)
    bn = triton.next_power_of_2(ppt * page)
    n_kv_tiles = max(1, triton.cdiv(max(max_tiles_hint, 1), ppt))
    n_q_tiles = tile_seq.numel()
    if num_splits is None:
        target = int(split_target * _num_sms(q.device))
        num_splits = max(1, min(n_kv_tiles, 64, triton.cdiv(target, n_q_tiles * (Hkv // hg))))
    num_splits = max(1, min(num_splits, n_kv_tiles, 64))
    tiles_per_split = triton.cdiv(n_kv_tiles, num_splits)
    num_splits = triton.cdiv(n_kv_tiles, tiles_per_split)
    direct = num_splits == 1

    if out is None:
        out = torch.empty_like(q)
    if direct:
        po = lse = out  # unused
        po_strides = (0, 0, 0)
        l_strides = (0, 0)
    else:
        po = torch.empty(Tq, H, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(Tq, H, num_splits, dtype=torch.float32, device=q.device)
        po_strides = (po.stride(0), po.stride(1), po.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    scale = D ** -0.5 if sm_scale is None else sm_scale
    rot = table.rot_shift if table.rot_shift is not None else table.page_pos
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    meta = {}
    if not interp:
        # H200 sweeps: decode (16 rows) 4 warps, stages 2-4 equal; prefill (128-256 rows)
        # 8 warps, 2 stages.
        meta["num_warps"] = num_warps or (4 if rows <= 64 else 8)
        meta["num_stages"] = num_stages or (3 if rows <= 64 else 2)
    if multi_shift is None:
        # 0: one page per tile, one shift. 3: two pages, uniform branch (decode; keeps the loop
        # pipelined). 2: the general while loop (small pages, and prefill, as last benchmarked;
        # the H200 probe of 3 in prefill: 16-42% faster at B1 / +32 tokens, 4% slower at
        # B16 +512, see prefill_sweep in benchmarks/results/kernels_h200.json). Variant 1 (both
        # dots unconditionally) runs out of shared memory at prefill's 256 rows.
        multi_shift = 0 if ppt == 1 else (3 if ppt == 2 and rows <= 64 else 2)
    if mode != 2:
        multi_shift = 0
    if cos_sin_table is not None:
        tab, tab_len = cos_sin_table, cos_sin_table.shape[0]
    else:
        tab, tab_len = inv_freq, 1
    grid = (n_q_tiles, Hkv // hg, num_splits)
    global LAST_KERNEL
    LAST_KERNEL = _paged_attn_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        table.indptr, table.page_ids, table.page_pos, table.page_len, rot,
        tile_seq, tile_q0, qo_indptr, q_pos,
        inv_freq, float(attention_scaling), float(scale * math.log2(math.e)), tab, tab_len,
        out, out.stride(0), out.stride(1),
        po, *po_strides, lse, *l_strides,
        tiles_per_split,
        G=G, GP=GP, BLOCK_M=block_m, ROWS=rows, HALF=D // 2, PAGE=page, PPT=ppt, BLOCK_N=bn,
        ROPE_MODE=mode, FAST_TRIG=not interp, DIRECT=direct, DOT_PREC=dot_prec,
        QROT_CACHE=qrot_cache, HG=hg, MULTI_SHIFT=multi_shift,
        USE_TAB=cos_sin_table is not None, DIAG=diag, **meta,
    )
    if not direct:
        _merge_kernel[(Tq, H)](po, po.stride(0), po.stride(1), lse, lse.stride(0), lse.stride(1),
                               out, out.stride(0), out.stride(1), num_splits,
                               SP=triton.next_power_of_2(num_splits), D=D)
    return out
