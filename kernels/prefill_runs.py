"""The prefill attention kernel over runs of equal rot_shift (lazy_prefill's).

Why a second kernel: in paged_attention._paged_attn_kernel (the "tiles" kernel, still
lazy_decode's) rotate_q re-rotates the query inside the KV loop whenever a tile's
shift changes and handles tiles that straddle two chunks, so the query operand is a loop-carried
value changed in a branch; on an H200 that prefill ran at 9.5% of roofline against 34.6% for the
same kernel with no RoPE (+512 new tokens over 10k cached, B16). This kernel's hot loop is a
plain flash-attention loop instead:

Runs. A sequence's page list is cut into runs: maximal stretches of consecutive entries with
the same rot_shift (a chunk is one run; private pages, shift 0, are another). An outer `while`
walks the runs of the program's range of entries; per run it rotates the query once by
(m - shift) (the reference's exact fp32 angle) and then runs an inner `for` over the run's KV
tiles (PPT entries each, the last one partial) in which the query is loop-invariant: no branch
on shifts, no layout change of the query, so Triton can software-pipeline it like the
flash-attention tutorial's loop. Tiles never straddle runs, which is what makes every score
exact with one query rotation. The run's end is found in the kernel (_run_bounds: a vector scan
of the next SCAN entries' shifts, one L2 round trip per run), so the launch needs no host sync,
no precomputed table field and no extra kernel: the call is CUDA-graph capturable as is.

Mask only where needed. Each run is further cut, from its page positions, into an unmasked
prefix (entries whose every key is at or before the tile's first query position: visible to
every row, typically the cached chunks) and a masked rest, trimmed after the last entry that
holds a key at or before the tile's last query position (typically the new tokens' own pages).
The unmasked loop applies only the page-tail mask, folded into the scale multiply as an additive
0 / -inf bias (one FMA); the masked loop applies the causal visibility rule. The masked part
starts on the run's tile grid, so tiles are the same whichever loop takes them. With explicit
slot positions (HAS_SLOT_POS) page_pos describes only the ordinary entries (slot_pos_row -1):
an entry with explicit positions ends the unmasked prefix and is never trimmed, so its tile
takes the masked loop (hidden slots never visible), while the ordinary entries around it are
cut as without slot positions; a table whose explicit rows are all -1 therefore runs exactly
the same loops as the same table without them, bit-identical (tests/kernels). With a sliding
window (WINDOWED) there is no unmasked part: the prefix whose keys lie before every row's window
is skipped instead, and the rest takes the masked loop, which applies the window.

One QK dot. The rotated query is one full [ROWS, D] tile in the pool dtype and K one
[BLOCK_N, D] tile: one K=D dot per tile instead of two of D/2. The rotation (_rotated_query,
tuning key q_rotation) computes cos/sin once per token and frequency and joins the rotated
halves into the full tile ("token", the default), or per row and dimension from q and its
rotate_half partner (d + D/2) % D ("row", elementwise only, 2 * GP times the SFU work); the
products are the reference's either way.

rope_mode "none" uses the same loops with the query loaded once (one run per range of entries,
cut only by position). The grid, the GQA packing of query rows, split-KV over ranges of entries (a split's
runs are the runs intersected with its range) and the epilogue (direct, or fp32 partials +
log2-sum-exp merged by paged_attention._merge_kernel) are the tiles kernel's.
"""
from __future__ import annotations

import math

import torch

from .triton_import import tl, triton
from . import paged_attention
from .page_table import PageTable, ROPE_MODES, interpreting, rope_mode_code
from .paged_attention import (_scaled_pv, _tile_rows, _write_tile, cap_window_args, merge_splits,
                              soft_cap, split_count, split_outputs)
from .rope import cos_sin
from .v_layout import load_v, v_args

BIG = tl.constexpr(2147483647)   # int32 max: "no such entry" for min-reductions
SCAN = 64                        # entries per step of the run-end scan (a 2048-token chunk at
                                 # page 64 is 32 entries: one step)


@triton.jit
def _run_bounds(ROT_SHIFT, PAGE_POS, PAGE_LEN, SLOT_POS_ROW, e, e_hi, s0, lo, q_max,
                BY_SHIFT: tl.constexpr, HAS_SLOT_POS: tl.constexpr, SCAN: tl.constexpr,
                PPT: tl.constexpr):
    """The run that starts at entry e (< e_hi) as (run_end, mid, stop): run_end the first entry
    of [e, e_hi) whose rot_shift differs from s0 (e_hi if none; without BY_SHIFT, e_hi);
    entries [e, mid) hold only keys at positions <= lo (the tile's first query position: the
    unmasked loop; with a window, that minus the window: keys out of every row's window,
    skipped), [mid, stop) the rest up to the last entry with a key at a position <= q_max
    (masked loop); [stop, run_end) hold no key visible to the tile. When there is a masked
    part, mid is rounded down to the tile grid e + k * PPT, so the tiles are those of an
    all-masked run, at the cost of at most one masked tile that needed no mask. With
    HAS_SLOT_POS an entry with explicit positions (row >= 0: its keys' positions are not
    page_pos + j) counts as holding a late key and a used one: never in the unmasked prefix,
    never trimmed."""
    run_end = e_hi
    first_late = e_hi
    last_use = e - 1
    i = tl.arange(0, SCAN)
    j = e
    while j < run_end:
        idx = j + i
        ok = idx < run_end
        if BY_SHIFT:
            sh = tl.load(ROT_SHIFT + idx, mask=ok, other=0)
            brk = tl.min(tl.where(ok & (sh != s0), idx, BIG), axis=0)
            run_end = tl.minimum(run_end, brk)
        pp = tl.load(PAGE_POS + idx, mask=ok, other=0)
        pl = tl.load(PAGE_LEN + idx, mask=ok, other=0)
        inrun = idx < run_end
        is_late = pp + pl - 1 > lo
        is_used = pp <= q_max
        if HAS_SLOT_POS:
            explicit = tl.load(SLOT_POS_ROW + idx, mask=ok, other=-1) >= 0
            is_late = is_late | explicit
            is_used = is_used | explicit
        late = tl.min(tl.where(inrun & is_late, idx, BIG), axis=0)
        first_late = tl.minimum(first_late, late)
        use = tl.max(tl.where(inrun & is_used, idx, -1), axis=0)
        last_use = tl.maximum(last_use, use)
        j += SCAN
    mid = tl.minimum(first_late, run_end)
    stop = tl.maximum(tl.minimum(last_use + 1, run_end), mid)
    mid = tl.where(mid < stop, e + (mid - e) // PPT * PPT, mid)
    return run_end, mid, stop


@triton.jit
def _rotated_query(Q, stride_qt, stride_qh, QPOS, q0, q_end, kvh, zero, s0, INV_FREQ,
                   rope_scale, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr, dtype: tl.constexpr,
                   FAST_TRIG: tl.constexpr, BY_TOKEN: tl.constexpr, q_mul=None,
                   SCALE_Q: tl.constexpr = False):
    """The tile's query [ROWS, D] rotated by (position - s0) (fp32 angle (m - s0) * freq,
    cos/sin times rope_scale, as the reference), one full-width tile in the pool dtype for a
    single K=D dot. Loaded from Q again at each run, so no fp32 copy of q stays live across the
    KV loops.
    BY_TOKEN: cos/sin once per token and frequency, [ROWS // GP, D/2] (the GP rows of a token
    share its angle; 2 * GP times fewer SFU ops than per row and dimension), broadcast to the
    rows, the halves rotated (x1 c - x2 s, x2 c + x1 s) and joined into [ROWS, D] (join /
    permute / reshape: layout shuffles, once per run). Else: per row and dimension, q at d and
    its rotate_half partner (d + D/2) % D with sign times full-width cos/sin of
    freq[d % (D/2)], elementwise only. The same products either way.
    `zero` is 0, but opaque to the compiler (the caller's min(e, 0)): every index here is
    built on it, so that none of this function's address / mask / position tensors is hoisted
    out of the run loop, where they would hold registers across the KV loops (measured in
    the sm_90 compile: spills without it).
    SCALE_Q: q times q_mul (a power of two, paged_attention.qk_f16_scale) before the rotation."""
    r = tl.arange(0, ROWS) + zero
    qi = q0 + r // GP
    row_ok = (r // GP < BLOCK_M) & (r % GP < G) & (qi < q_end)
    q_row = qi.to(tl.int64) * stride_qt + (kvh * G + r % GP) * stride_qh
    if BY_TOKEN:
        f = tl.max_contiguous(tl.multiple_of(tl.arange(0, D // 2) + zero, D // 2), D // 2)
        tok = tl.arange(0, ROWS // GP) + zero
        tok_pos = tl.load(QPOS + q0 + tok, mask=(tok < BLOCK_M) & (q0 + tok < q_end), other=0)
        freq = tl.load(INV_FREQ + f)
        c, s = cos_sin((tok_pos - s0).to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
        c = tl.reshape(tl.broadcast_to((c * rope_scale)[:, None, :], (ROWS // GP, GP, D // 2)),
                       (ROWS, D // 2))
        s = tl.reshape(tl.broadcast_to((s * rope_scale)[:, None, :], (ROWS // GP, GP, D // 2)),
                       (ROWS, D // 2))
        q_off = q_row[:, None] + f[None, :]
        x1 = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(Q + q_off + D // 2, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if SCALE_Q:
            x1 = x1 * q_mul
            x2 = x2 * q_mul
        r1 = (x1 * c - x2 * s).to(dtype)
        r2 = (x2 * c + x1 * s).to(dtype)
        return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (ROWS, D))
    else:
        d = tl.max_contiguous(tl.multiple_of(tl.arange(0, D) + zero, D), D)
        partner = (d + D // 2) % D
        qp = tl.load(QPOS + qi, mask=row_ok, other=0)
        x = tl.load(Q + q_row[:, None] + d[None, :], mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
        y = tl.load(Q + q_row[:, None] + partner[None, :], mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
        y = tl.where((d < D // 2)[None, :], -y, y)
        if SCALE_Q:
            x = x * q_mul
            y = y * q_mul
        freq = tl.load(INV_FREQ + d % (D // 2))
        c, s = cos_sin((qp - s0).to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
        return (x * (c * rope_scale) + y * (s * rope_scale)).to(dtype)


@triton.jit
def _attend(acc, l_i, m_i, qr, qp, K_h, V_h, stride_kp, stride_kt: tl.constexpr, stride_vp,
            stride_vt: tl.constexpr, stride_vd: tl.constexpr,
            PAGE_IDS, PAGE_POS, PAGE_LEN, SLOT_POS_ROW, SLOT_POS, stride_sp, qk_scale_log2,
            e_a, e_b, D: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
            HAS_SLOT_POS: tl.constexpr, KS_h=None, VS_h=None, stride_ksp=None,
            stride_vsp=None, KV_FP8: tl.constexpr = False, SCALE_V_TILE: tl.constexpr = False,
            PV_DTYPE: tl.constexpr = None, V_KEYS_MAJOR: tl.constexpr = False,
            softcap_log2=None, window=None, SOFTCAP: tl.constexpr = False,
            WINDOWED: tl.constexpr = False):
    """Online softmax over entries [e_a, e_b) in tiles of PPT entries, query qr fixed. MASKED:
    each key visible iff its position <= the row's position (explicit slot positions and
    hidden slots with HAS_SLOT_POS) and, WINDOWED, > the row's position - window; else every
    loaded key is visible to every row (the caller guarantees it: never WINDOWED) and only the
    page tails are masked. SOFTCAP: the scaled scores soft-capped (paged_attention.soft_cap)
    before the mask. KV_FP8: fp8 pages with per-token scales
    KS_h / VS_h (this KV head's [num_pages, page] rows): scores column-scaled, values through
    paged_attention._scaled_pv, in PV_DTYPE (None: qr's dtype; the compute dtype where qr is fp16
    for the QK dot, QK_F16). V_KEYS_MAJOR: V pages keys-major (v_layout.py)."""
    dtype = qr.dtype
    if PV_DTYPE is None:
        pv_dtype = dtype
    else:
        pv_dtype = PV_DTYPE
    n = tl.arange(0, BLOCK_N)
    slot = n // PAGE
    off = n % PAGE
    d = tl.arange(0, D)
    for e0 in range(e_a, e_b, PPT):
        if PPT == 1:
            # one page per tile: scalar page fields, so the K / V tile's address is one
            # scalar base plus constant offsets (fewer registers); lanes past the page (BLOCK_N
            # is PAGE rounded up to a power of two) masked
            e = e0
            pid = tl.load(PAGE_IDS + e0).to(tl.int64)
            plen = tl.load(PAGE_LEN + e0)
            e_ok = n < PAGE
        else:
            e = e0 + slot
            e_ok = (slot < PPT) & (e < e_b)
            pid = tl.load(PAGE_IDS + e, mask=e_ok, other=0).to(tl.int64)
            plen = tl.load(PAGE_LEN + e, mask=e_ok, other=0)
        k_ok = e_ok & (off < plen)
        if PPT == 1:
            k_ptr = K_h + pid * stride_kp + off[:, None] * stride_kt + d[None, :]
            if not V_KEYS_MAJOR:
                v_ptr = V_h + pid * stride_vp + off[:, None] * stride_vt + d[None, :]
        else:
            k_ptr = K_h + pid[:, None] * stride_kp + off[:, None] * stride_kt + d[None, :]
            if not V_KEYS_MAJOR:
                v_ptr = V_h + pid[:, None] * stride_vp + off[:, None] * stride_vt + d[None, :]
        if MASKED:
            if PPT == 1:
                kpos = tl.load(PAGE_POS + e) + off
            else:
                kpos = tl.load(PAGE_POS + e, mask=e_ok, other=0) + off
            if HAS_SLOT_POS:
                # an entry with row >= 0 takes its keys' positions from SLOT_POS; hidden slots
                # (HIDDEN_POS) leave k_ok: never loaded, never visible
                if PPT == 1:
                    srow = tl.load(SLOT_POS_ROW + e) + tl.zeros_like(off)
                else:
                    srow = tl.load(SLOT_POS_ROW + e, mask=e_ok, other=-1)
                explicit = k_ok & (srow >= 0)
                xpos = tl.load(SLOT_POS + srow.to(tl.int64) * stride_sp + off, mask=explicit,
                               other=0)
                kpos = tl.where(explicit, xpos, kpos)
                k_ok = k_ok & (kpos != 2147483647)
        k = tl.load(k_ptr, mask=k_ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(dtype)      # exact; the scale multiplies the score column instead
            col = (tl.load(KS_h + pid * stride_ksp + off, mask=k_ok, other=0.0).to(tl.float32)
                   * qk_scale_log2)[None, :]
        else:
            col = qk_scale_log2
        qk = tl.dot(qr, tl.trans(k), input_precision=DOT_PREC)
        qk = qk * col
        if SOFTCAP:
            qk = soft_cap(qk, softcap_log2)
        if MASKED:
            vis = k_ok[None, :] & (kpos[None, :] <= qp[:, None])
            if WINDOWED:
                vis = vis & (qp[:, None] - kpos[None, :] < window)
            qk = tl.where(vis, qk, float("-inf"))
        else:   # the page tail's mask as an additive bias (with the multiply above, one FMA)
            qk = qk + tl.where(k_ok, 0.0, float("-inf"))[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if V_KEYS_MAJOR:
            v = load_v(V_h, pid + tl.zeros_like(off), off, stride_vp, stride_vt, stride_vd,
                       e_ok, k_ok, D, PAGE, True)
        else:
            v = tl.load(v_ptr, mask=k_ok[:, None], other=0.0)
        if KV_FP8:
            vs = tl.load(VS_h + pid * stride_vsp + off, mask=k_ok, other=0.0).to(tl.float32)
            pv, v = _scaled_pv(p, v, vs, pv_dtype, SCALE_V_TILE)
        else:
            pv = p.to(dtype)
        acc = tl.dot(pv, v, acc=acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


# entries_per_split follows the context's length: not specialised on its value (Triton's
# divisible-by-16 and equal-to-1 variants), so that one compiled variant serves every length
# (a machine's first 8B build compiled a second one when it reached a multiple of 16)
@triton.jit(do_not_specialize=["entries_per_split"])
def _prefill_runs_kernel(
    Q, stride_qt, stride_qh,
    K, V, stride_kp, stride_kh, stride_kt: tl.constexpr, stride_vp, stride_vh,
    stride_vt: tl.constexpr, stride_vd: tl.constexpr,
    INDPTR, PAGE_IDS, PAGE_POS, PAGE_LEN, ROT_SHIFT, SLOT_POS_ROW, SLOT_POS, stride_sp,
    TILE_SEQ, TILE_Q0, QO_INDPTR, QPOS,
    INV_FREQ, rope_scale, qk_scale_log2,
    O, stride_ot, stride_oh,
    PO, stride_pot, stride_poh, stride_pos,
    LSE, stride_lt, stride_lh,
    entries_per_split,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE_Q: tl.constexpr, FAST_TRIG: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_SLOT_POS: tl.constexpr, SCAN: tl.constexpr,
    ROTATE_BY_TOKEN: tl.constexpr, WRITE_LSE: tl.constexpr = False,
    K_SCALE=None, V_SCALE=None, stride_ksp=None, stride_ksh=None, stride_vsp=None,
    stride_vsh=None, KV_FP8: tl.constexpr = False, SCALE_V_TILE: tl.constexpr = False,
    QK_F16: tl.constexpr = False, V_KEYS_MAJOR: tl.constexpr = False,
    softcap_log2=None, window=None, SOFTCAP: tl.constexpr = False, WINDOWED: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    dtype = Q.dtype.element_ty      # the compute dtype (the pool's, unless it is fp8)

    b, q0, q_end, qi, row_ok, head = _tile_rows(TILE_SEQ, TILE_Q0, QO_INDPTR, tile, kvh, G, GP,
                                                BLOCK_M, ROWS)
    d = tl.arange(0, D)
    q_row = qi.to(tl.int64) * stride_qt + head * stride_qh
    qp = tl.load(QPOS + qi, mask=row_ok, other=-1)           # padded rows: never stored
    q_min = tl.min(tl.where(row_ok, qp, BIG), axis=0)
    q_max = tl.max(tl.where(row_ok, qp, -1), axis=0)
    n_rows = tl.sum(row_ok.to(tl.int32), axis=0)

    p_start = tl.load(INDPTR + b)
    p_end = tl.load(INDPTR + b + 1)
    e = p_start + split * entries_per_split
    e_hi = tl.minimum(e + entries_per_split, p_end)
    e_hi = tl.where(n_rows > 0, e_hi, e)     # a tile with no row (graph padding): no KV loop
    K_h = K + kvh * stride_kh
    V_h = V + kvh * stride_vh
    if KV_FP8:
        KS_h = K_SCALE + kvh * stride_ksh
        VS_h = V_SCALE + kvh * stride_vsh
    else:
        KS_h = K_SCALE
        VS_h = V_SCALE

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    if QK_F16:
        # fp8 keys, bf16 compute: the QK dot in fp16 (paged_attention.qk_f16_scale), the query
        # times q_mul, the scores times q_div (in the scalar scale)
        hf = tl.arange(0, D // 2)
        q_h = Q + q_row[:, None] + hf[None, :]
        q_mul, q_div = paged_attention.qk_f16_scale(
            tl.load(q_h, mask=row_ok[:, None], other=0.0).to(tl.float32),
            tl.load(q_h + D // 2, mask=row_ok[:, None], other=0.0).to(tl.float32), rope_scale)
        qk_scale_log2 = qk_scale_log2 * q_div
        qk_dtype: tl.constexpr = tl.float16
    else:
        q_mul = None
        qk_dtype: tl.constexpr = dtype
    if not ROTATE_Q:   # rope_mode "none": q as given, loop-invariant for the whole program
        qr = tl.load(Q + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        if QK_F16:
            qr = (qr.to(tl.float32) * q_mul).to(tl.float16)

    while e < e_hi:
        if ROTATE_Q:
            s0 = tl.load(ROT_SHIFT + e)
        else:
            s0 = 0
        if WINDOWED:
            # no key is visible to every row by its position alone (a window hides keys far
            # behind a row): no unmasked loop; entries whose keys are all at or before
            # q_min - window are out of every row's window, and skipped
            lo = q_min - window
        else:
            lo = q_min
        run_end, mid, stop = _run_bounds(ROT_SHIFT, PAGE_POS, PAGE_LEN, SLOT_POS_ROW, e, e_hi, s0,
                                         lo, q_max, ROTATE_Q, HAS_SLOT_POS, SCAN, PPT)
        if ROTATE_Q:   # once per run: the inner loops see a loop-invariant query
            # min(e, 0) is 0 (e >= 0) but opaque to the compiler: the query's address math
            # stays inside this loop instead of holding registers across the KV loops
            qr = _rotated_query(Q, stride_qt, stride_qh, QPOS, q0, q_end, kvh,
                                tl.minimum(e, 0), s0, INV_FREQ, rope_scale, G, GP, BLOCK_M,
                                ROWS, D, qk_dtype, FAST_TRIG, ROTATE_BY_TOKEN, q_mul, QK_F16)
        if not WINDOWED:   # [e, mid): ordinary entries whose keys every row sees
            acc, l_i, m_i = _attend(acc, l_i, m_i, qr, qp, K_h, V_h, stride_kp, stride_kt,
                                    stride_vp, stride_vt, stride_vd, PAGE_IDS, PAGE_POS,
                                    PAGE_LEN, SLOT_POS_ROW, SLOT_POS, stride_sp, qk_scale_log2,
                                    e, mid, D, PAGE, PPT, BLOCK_N, DOT_PREC, False,
                                    HAS_SLOT_POS, KS_h, VS_h, stride_ksp, stride_vsp, KV_FP8,
                                    SCALE_V_TILE, dtype, V_KEYS_MAJOR, softcap_log2, None,
                                    SOFTCAP, False)
        acc, l_i, m_i = _attend(acc, l_i, m_i, qr, qp, K_h, V_h, stride_kp, stride_kt,
                                stride_vp, stride_vt, stride_vd, PAGE_IDS, PAGE_POS, PAGE_LEN,
                                SLOT_POS_ROW, SLOT_POS, stride_sp, qk_scale_log2, mid, stop,
                                D, PAGE, PPT, BLOCK_N, DOT_PREC, True, HAS_SLOT_POS,
                                KS_h, VS_h, stride_ksp, stride_vsp, KV_FP8, SCALE_V_TILE, dtype,
                                V_KEYS_MAJOR, softcap_log2, window, SOFTCAP, WINDOWED)
        e = run_end

    _write_tile(acc, l_i, m_i, qi, head, row_ok, split, O, stride_ot, stride_oh, PO, stride_pot,
                stride_poh, stride_pos, LSE, stride_lt, stride_lh, D, DIRECT, WRITE_LSE)

def default_tuning(rows: int, interp: bool, n_programs: int | None, num_sms: int, head_dim: int = 128) -> dict:
    """block_n, num_warps, num_stages when the caller gives none, from the H100 sweep
    (benchmarks/results/kernels_h100_sweep.json, rotate_q, 10k cached tokens; the sm_90
    compiles pointed the same way on block_n): 64 keys per KV tile (one page at the engine's
    page size 64: the PPT == 1 path; 128 keys was 1.1-2x slower everywhere); 256 rows with 16
    warps and 2 stages (B16 +512: 3.79 ms, 51% of roofline); fewer (tile, KV head) programs than
    half the SMs, split over the KV, 8 warps and 2 stages (B1 +32, 8 programs: 40.6 us vs 50.2 us
    with 4 warps); otherwise 4 warps and 3 stages (B16 +32, 128 programs: 306 us vs 372 us with 8). (Split-KV's
    split_target comes with the plan: prefill.plan_split_target.) n_programs None: as many as
    a full batch has (an index build's encode of any size compiles the full batch's kernel).
    Wider heads (Gemma's 256) take the tuning of the head_dim-128 tile with as many elements
    (rows x head_dim: as many registers per thread) and at most 2 stages (a 64-key K/V stage is
    64 KB at head_dim 256: three and the query tile overflow an SM's shared memory)."""
    if interp:
        return dict(block_n=32, num_warps=None, num_stages=None)
    if head_dim > 128:
        tuned = default_tuning(rows * head_dim // 128, interp, n_programs, num_sms)
        return {**tuned, "num_stages": min(tuned["num_stages"], 2)}
    if rows >= 256:
        return dict(block_n=64, num_warps=16, num_stages=2)
    if n_programs is not None and 2 * n_programs < num_sms:
        return dict(block_n=64, num_warps=8, num_stages=2)
    return dict(block_n=64, num_warps=4, num_stages=3)


def launch_runs(q, qo_indptr, q_pos, k_pages, v_pages, table: PageTable, inv_freq, *,
                rope_mode: str, attention_scaling: float, sm_scale: float | None, tile_seq,
                tile_q0, block_m: int, max_tiles_hint: int, num_splits: int | None,
                out: torch.Tensor | None, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                split_target: float = 2.0, return_lse: bool = False,
                q_rotation: str = "token", k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, qk_f16: bool | str = True,
                full_batch: bool = False, softcap: float | None = None,
                window: int | None = None):
    """The runs kernel's launcher; arguments and result as paged_attention.launch (rope_mode
    "rotate_q" or "none" only). Split-KV splits each sequence's entries into ranges of
    tiles_per_split * PPT entries, sized from max_tiles_hint on the host as the tiles kernel.
    q_rotation: how the query is rotated at each run, "token" (cos/sin per token, then
    join / permute / reshape into the rows) or "row" (cos/sin per row and dimension,
    elementwise only): _rotated_query. full_batch: tuned as a batch that fills the GPU whatever
    this one's program count (an encode batch: PrefillPlan.full_batch). softcap, window: as
    paged_attention.launch (a window skips what lies before every row's window and sends the
    rest through the masked loop)."""
    Tq, H, D = q.shape
    num_pages, Hkv, page, Dk = k_pages.shape
    assert Dk == D and D % 32 == 0 and H % Hkv == 0, "head_dim multiple of 32, H % Hkv == 0"
    assert D & (D - 1) == 0, "head_dim a power of two"
    assert k_pages.stride(-1) == 1 and q.stride(-1) == 1
    v_layout = v_args(v_pages)
    scaled = paged_attention.fp8_args(q, k_pages, v_pages, k_scale, v_scale, qk_f16)
    assert q_rotation in ("token", "row"), q_rotation
    rotate_q = rope_mode_code(rope_mode, table) == ROPE_MODES["rotate_q"]
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    rows = max(16, block_m * GP)
    interp = interpreting() and not q.is_cuda
    tun = default_tuning(rows, interp, None if full_batch else tile_seq.numel() * Hkv,
                         paged_attention._num_sms(q.device), D)
    block_n = block_n or tun["block_n"]
    ppt = max(1, block_n // page)
    bn = triton.next_power_of_2(ppt * page)
    n_kv_tiles = max(1, triton.cdiv(max(max_tiles_hint, 1), ppt))
    num_splits, tiles_per_split = split_count(q.device, tile_seq.numel() * Hkv, n_kv_tiles,
                                              num_splits, split_target)
    direct = num_splits == 1
    out, row_lse, po, po_strides, lse, l_strides = split_outputs(q, out, num_splits, return_lse)
    scale = D ** -0.5 if sm_scale is None else sm_scale
    rot = table.rot_shift if rotate_q else table.page_pos     # unread for "none"
    slot_row, slot_pos, stride_sp = paged_attention._slot_pos_args(table, page, table.page_pos)
    meta = {}
    if not interp:
        meta["num_warps"] = num_warps or tun["num_warps"]
        meta["num_stages"] = num_stages or tun["num_stages"]
    grid = (tile_seq.numel(), Hkv, num_splits)
    _prefill_runs_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_layout["stride_vd"],
        table.indptr, table.page_ids, table.page_pos, table.page_len, rot,
        slot_row, slot_pos, stride_sp,
        tile_seq, tile_q0, qo_indptr, q_pos,
        inv_freq, float(attention_scaling), float(scale * math.log2(math.e)),
        out, out.stride(0), out.stride(1),
        po, *po_strides, lse, *l_strides,
        tiles_per_split * ppt,
        G=G, GP=GP, BLOCK_M=block_m, ROWS=rows, D=D, PAGE=page, PPT=ppt, BLOCK_N=bn,
        ROTATE_Q=rotate_q, FAST_TRIG=not interp, DIRECT=direct,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SLOT_POS=table.has_slot_pos, SCAN=SCAN, ROTATE_BY_TOKEN=q_rotation == "token",
        WRITE_LSE=return_lse and direct, V_KEYS_MAJOR=v_layout["V_KEYS_MAJOR"], **scaled,
        **cap_window_args(softcap, window), **meta,
    )
    if not direct:
        merge_splits(po, lse, out, row_lse, num_splits)
    return (out, row_lse) if return_lse else out
