"""The tiles attention kernel: lazy_decode's; its split merge and the split-KV helpers the runs
kernel shares.

Prefill runs prefill_runs.py: there a program
walks its page list as runs of equal rot_shift with a plain flash-attention inner loop (query
rotated once per run, loop-invariant; no causal mask where every key is visible; one K=D QK
dot), because this kernel's per-tile shift handling (below) keeps the query loop-carried and,
in prefill, made rotate_q 3.6x slower than rope_mode "none" on an H200 (+512 tokens over 10k,
B16: 20.9 ms vs 5.75 ms). Decode stays here: with one query row its rotate_q costs <= 2% over
"none" (two row groups or the uniform scalar branch, MULTI_SHIFT 4 / 3).

A program owns (a tile of BLOCK_M query tokens of one sequence) x (one KV head) x (one split of
that sequence's page list). The G query heads that share the KV head are packed into the rows
of the Q tile (row r = token r // GP, head r % GP, GP = G rounded up to a power of two), so each
K/V tile is read once per KV head whatever the GQA ratio. Decode is BLOCK_M = 1 (rows padded to
16 for tl.dot).

A KV tile is PPT consecutive entries of the sequence's page list (BLOCK_N = PPT * PAGE_SIZE
keys, rounded up to a power of two; the rest masked). Key n of the tile is token n % PAGE of
entry n // PAGE; its logical position is page_pos + n % PAGE, or, with HAS_SLOT_POS (the table
has explicit slot positions, page_table.py), slot_pos[row, n % PAGE] for an entry with a row;
hidden slots are masked out like a page's tail. Without explicit positions HAS_SLOT_POS is
False and the kernel is the one it was before they existed.

RoPE (ROPE_MODE):
  0 none      q and keys used as given (keys stored rotated at logical positions).
  2 rotate_q  keys stored rotated at (pos - rot_shift): the query is rotated by (m - s0), s0 the
              shift of the tile's first entry, and only re-rotated when s0 changes (once per chunk,
              not per tile); keys are used as stored. Keys of a tile entry whose shift differs from
              s0 (a chunk boundary inside the tile) get their scores from a second pair of QK dots
              with the query rotated by (m - s_j), so every score uses the reference's exact fp32
              angle (rotating those keys by s_j - s0 instead would cost fp32 angle error
              proportional to |s_j - s0|). In decode where registers are short (RELOAD_Q,
              reload_query) each re-rotation loads q again (_query_halves) instead of keeping an
              fp32 copy live across the KV loop: fp8 decode under its register cap then spills
              almost nothing. MULTI_SHIFT picks how, from the tile shape: 0 with one page per tile
              (nothing to do); with two pages per tile in decode (page 64, 128 keys: the GPU decode
              case) 4 where the Q tile's padded rows have room for the heads twice (2 * GP <= 16:
              GQA up to 8), two row groups: rows h and GP + h both hold head h, group 0 sees only
              the tile's first page and group 1 its second, each group's query rotated by its own
              page's shift (re-rotated when either changes), and the groups of a head merged by
              their maxima in the epilogue (_merge_row_groups), so a tile across a chunk boundary
              costs no extra dot and no branch, and the K tile is not held live for one; else 3, a
              uniform scalar `if s1 != s0` redoing the dots; 2 otherwise, a `while` loop over the
              tile's distinct shifts. The while loop is exact but stops Triton from
              software-pipelining the KV loop (no cp.async in the PTX): on an H200 it cost +34% in
              decode (B32 x 8k: 342 us vs 257 us with variant 3 vs 255 us for rope_mode="none").
              Variant 4 took the fp8 decode loop (B32 x 8k) from 1,474 to 1,119 sm_90 SASS
              instructions and its spills to none (counted by benchmarks/ptx_fp8_loop.py).

Measured slower than the choices above on the H200 (B32 x 8k): rotating the query in every tile,
both second-page dots unconditionally, cos/sin tables, and programs covering several KV heads.

Online softmax in base 2 (fp32); output either written directly (one split) or as per-split
fp32 partials + log2-sum-exp merged by _merge_kernel (flash-decoding).

fp8 pages (per-token scales, kv_quant.py): each score column times its key's scale; the values
either enter P @ V as (P * v_scale) @ v8 (_scaled_pv), or, in decode with 16-bit compute
(FOLD_V), the value scales fold into the scores: score_n + log2 v_scale_n, so that
p_n = 2^(score_n - m) * v_scale_n (m the row max of the folded scores, so p <= 1 fits fp16) and
P @ V runs in fp16 over v8 exactly as stored (one cvt per pair of elements); the softmax sum
takes each fold back out (l += p_n / v_scale_n = 2^(score_n - m)), so o = acc / l and the
log2-sum-exp m + log2 l keep their meaning, and an approximate log2 or reciprocal (the SFU's,
value_fold) scales a key's term in the numerator and the denominator alike. The tiles' scales
are loaded one tile ahead. Fewer instructions per tile and fewer spills under the decode
register cap: faster on an H200, unchanged for batched decode on an H100, faster there at B1.
Prefill keeps _scaled_pv: the fold measured slower in the runs kernel.

Row log-sum-exp (launch(return_lse=True)): the natural-log log-sum-exp of each query row's
visible scaled scores (sm_scale * q.k), -inf for a row that sees no key, so that a caller can
attend to disjoint key groups in separate calls and merge them exactly. Written only when asked,
behind a constexpr WRITE_LSE (False by default) in each kernel: with one split the attention
kernel's DIRECT epilogue writes it; with several the attention kernel is the usual one (it
already writes per-split log2 partials) and _merge_kernel writes the merged lse. The default
calls compile to the same code as before the flags existed (TTIR to cubin, checked for sm_90).
"""
from __future__ import annotations

import functools
import math

import torch

from .triton_import import tl, triton
from .kv_quant import check_scales
from .page_table import PageTable, ROPE_MODES, interpreting, rope_mode_code
from .rope import cos_sin
from .v_layout import load_v, v_args

# ln 2: the kernels keep log-sum-exps in base 2 (exp2 / log2); the returned lse is natural-log.
LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap) in fp32 (Gemma 2's score soft-cap; tl has no tanh): tanh(y) =
    sign(y) (1 - e^(-2|y|)) / (1 + e^(-2|y|)), whose exponential lies in (0, 1] for every y (no
    overflow), within a few fp32 ulps of 1 in absolute terms.
    The kernels hold base-2 scores x = s * log2(e) and call this with cap * log2(e):
    c' tanh(x / c') with c' = cap log2(e) is exactly log2(e) * cap tanh(s / cap), the natural
    score's cap taken to base 2 (cap_window_args)."""
    t = tl.exp2(tl.abs(x) / cap * -2.8853900817779268)     # e^(-2|x| / cap)
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th) * cap


def cap_window_args(softcap: float | None, window: int | None) -> dict:
    """The attention kernels' soft-cap and sliding-window keyword arguments: none where off (the
    kernels' defaults, compiled out), else SOFTCAP with the cap in base-2 units (soft_cap) and
    WINDOWED with the window (a query at p sees keys at p - window + 1 .. p)."""
    args = {}
    if softcap is not None:
        assert softcap > 0, softcap
        args.update(softcap_log2=float(softcap) * LOG2E, SOFTCAP=True)
    if window is not None:
        assert window >= 1, window
        args.update(window=int(window), WINDOWED=True)
    return args


@triton.jit
def _rotate_query(q1, q2, rel_pos, freq, rope_scale, dtype: tl.constexpr, FAST_TRIG: tl.constexpr):
    """Query halves rotated by the angle rel_pos * freq (fp32 angle and cos/sin, times
    rope_scale), cast to the pool dtype for tl.dot. Inlined by Triton at each call."""
    c, s = cos_sin(rel_pos.to(tl.float32)[:, None] * freq[None, :], FAST_TRIG)
    c = c * rope_scale
    s = s * rope_scale
    return (q1 * c - q2 * s).to(dtype), (q2 * c + q1 * s).to(dtype)


@triton.jit
def qk_f16_scale(q1, q2, rope_scale):
    """(q_mul, q_div): powers of two for an fp16 QK dot over fp8 keys (QK_F16). e4m3 -> fp16 is
    one cvt per pair of keys' elements against e4m3 -> fp16 -> bf16 (one more per element), so
    with bf16 compute the query is taken to fp16 instead, times q_mul, and the scores times
    q_div = 1 / q_mul (folded into the scalar qk scale: nothing in the KV loop).
    Range: q_mul puts the tile's bound B = max over rows and pairs of sqrt(q1^2 + q2^2) *
    max(|rope_scale|, 1), which bounds every rotated (or unrotated) query element, in
    [2^13, 2^14): no element can pass fp16's 65504, whatever q's size; and the tile's largest
    elements get fp16's 11-bit significand (bf16: 8), any element above B * 2^-27 a normal fp16.
    Exact: both factors are powers of two, from B's exponent field E clamped to [14, 254]
    (q_mul = 2^(140 - E), q_div = 2^(E - 140): a zero or NaN bound gives finite factors)."""
    nrm = tl.max(tl.max(q1 * q1 + q2 * q2, axis=1), axis=0)
    bound = tl.sqrt(nrm) * tl.maximum(tl.abs(rope_scale), 1.0)
    e = (bound.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 14), 254)
    q_mul = ((267 - e) << 23).to(tl.float32, bitcast=True)
    q_div = ((e - 13) << 23).to(tl.float32, bitcast=True)
    return q_mul, q_div


@triton.jit
def _scaled_pv(p, v8, vs, dtype: tl.constexpr, SCALE_V_TILE: tl.constexpr):
    """The P @ V operands for fp8 values with per-key scales vs [BLOCK_N] (fp32): P's column n
    times vs[n] and v8 converted (exact), since P @ (v8 * vs[:, None]) == (P * vs[None, :]) @ v8:
    ROWS x BLOCK_N multiplies instead of BLOCK_N x D (16 rows in decode). SCALE_V_TILE (fp16
    compute): v8 * vs dequantised in registers instead, because p * vs, smaller than p by the
    scale, would fall into fp16's subnormals."""
    if SCALE_V_TILE:
        return p.to(dtype), (v8.to(tl.float32) * vs[:, None]).to(dtype)
    return (p * vs[None, :]).to(dtype), v8.to(dtype)


# the smallest per-token scale the quantiser writes (kv_quant.AMAX_MIN / 448)
SCALE_MIN = tl.constexpr(2.0 ** -14)


@triton.jit
def value_fold(ptrs, mask, FAST: tl.constexpr):
    """(log2 vs, 1 / vs) of a tile's per-key value scales vs [BLOCK_N] (fp32), for FOLD_V (see
    the kernel): the scores take + log2 vs, the softmax sum * (1 / vs). Keys not loaded get
    vs = 1; a scale is never taken below SCALE_MIN (a slot never quantised holds 0, and zero
    values, which then stay 0). FAST (GPU): the SFU's lg2.approx / rcp.approx, one instruction
    each per key (libdevice's log2f is a long sequence); their errors cancel between the
    numerator and the denominator. Else (the interpreter) exact."""
    vs = tl.maximum(tl.load(ptrs, mask=mask, other=1.0).to(tl.float32), SCALE_MIN)
    if FAST:
        lg = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [vs],
                                       dtype=tl.float32, is_pure=True, pack=1)
        rc = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [vs],
                                       dtype=tl.float32, is_pure=True, pack=1)
    else:
        lg = tl.log2(vs)
        rc = 1.0 / vs
    return lg, rc


@triton.jit
def _tile_shifts(ROT_SHIFT, p_start, p_end, tt, t_hi, PPT: tl.constexpr):
    """MULTI_SHIFT 4: the rot_shifts (s0, s1) of tile tt's two pages (s1 = s0 where the tile has
    one page), loaded a tile ahead as plain loads: software-pipelined, they were shared-memory
    copies whose wait and barrier opened every tile."""
    e0 = p_start + tt * PPT
    ok = tt < t_hi
    s0 = tl.load(ROT_SHIFT + e0, mask=ok, other=0)
    has1 = ok & (e0 + 1 < p_end)
    return s0, tl.where(has1, tl.load(ROT_SHIFT + e0 + 1, mask=has1, other=0), s0)


@triton.jit
def _scale_pages(PAGE_IDS, PAGE_LEN, p_start, p_end, tt, t_hi, slot, off, PPT: tl.constexpr):
    """FOLD_V: (page id, in use) of each key of tile tt, for _tile_scales a tile later: loaded
    two tiles ahead, so that no scale load waits on the page-id load it is addressed by (plain
    loads, their latency was exposed every tile); nothing is read for tt >= t_hi."""
    e = p_start + tt * PPT + slot
    ok = (slot < PPT) & (e < tl.minimum(p_end, p_start + t_hi * PPT))
    pid = tl.load(PAGE_IDS + e, mask=ok, other=0)
    return pid, ok & (off < tl.load(PAGE_LEN + e, mask=ok, other=0))


@triton.jit
def _tile_scales(K_SCALE, V_SCALE, stride_ksp, stride_ksh, stride_vsp, stride_vsh, pid, ok, kvh,
                 off, FAST: tl.constexpr):
    """FOLD_V: the per-key scales (ks fp32, and value_fold's log2 / reciprocal of the value
    scales) of a tile's keys on pages pid, masked to the slots in use (ok: _scale_pages)."""
    pid = pid.to(tl.int64)
    ks = tl.load(K_SCALE + pid * stride_ksp + kvh * stride_ksh + off, mask=ok,
                 other=0.0).to(tl.float32)
    lvs, rvs = value_fold(V_SCALE + pid * stride_vsp + kvh * stride_vsh + off, ok, FAST)
    return ks, lvs, rvs


@triton.jit
def _tile_rows(TILE_SEQ, TILE_Q0, QO_INDPTR, tile, kvh, G: tl.constexpr, GP: tl.constexpr,
               BLOCK_M: tl.constexpr, ROWS: tl.constexpr, TWO_GROUPS: tl.constexpr = False):
    """A query tile's rows (both attention kernels): row r is token r // GP of the tile and
    query head kvh * G + r % GP. Returns (sequence b, its first query row q0 and query end q_end,
    each row's token index qi, row_ok, head)."""
    b = tl.load(TILE_SEQ + tile)
    q0 = tl.load(TILE_Q0 + tile)
    q_end = tl.load(QO_INDPTR + b + 1)
    qi, row_ok, head = _rows_of(q0, q_end, kvh, G, GP, BLOCK_M, ROWS, TWO_GROUPS)
    return b, q0, q_end, qi, row_ok, head


@triton.jit
def _rows_of(q0, q_end, kvh, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
             ROWS: tl.constexpr, TWO_GROUPS: tl.constexpr = False):
    """_tile_rows' (qi, row_ok, head) from the tile's first query row q0 and query end q_end.
    TWO_GROUPS (decode, MULTI_SHIFT 4): rows r and r + GP are both head r % GP of the one query
    token, in row groups 0 and 1."""
    r = tl.arange(0, ROWS)
    if TWO_GROUPS:
        h = r % GP
        qi = q0 + r * 0
        row_ok = (r < 2 * GP) & (h < G) & (qi < q_end)
    else:
        t = r // GP
        h = r % GP
        qi = q0 + t
        row_ok = (t < BLOCK_M) & (h < G) & (qi < q_end)
    return qi, row_ok, kvh * G + h


@triton.jit
def _merge_row_groups(acc, l_i, m_i, q0, q_end, kvh, G: tl.constexpr, GP: tl.constexpr,
                      ROWS: tl.constexpr, D: tl.constexpr):
    """MULTI_SHIFT 4's epilogue: each head's row groups (rows h, h + GP, ...; groups past the
    second saw no key) merged by their running maxima, as the split merge does, into GP rows:
    (acc, l_i, m_i, qi, head, row_ok) for _write_tile."""
    NG: tl.constexpr = ROWS // GP
    m2 = tl.reshape(m_i, [NG, GP])
    mx = tl.max(m2, axis=0)
    w = tl.exp2(m2 - mx[None, :])
    l_out = tl.sum(w * tl.reshape(l_i, [NG, GP]), axis=0)
    acc_out = tl.sum(w[:, :, None] * tl.reshape(acc, [NG, GP, D]), axis=0)
    h = tl.arange(0, GP)
    qi = q0 + h * 0
    return acc_out, l_out, mx, qi, kvh * G + h, (h < G) & (qi < q_end)


@triton.jit
def _query_halves(Q, stride_qt, stride_qh, INV_FREQ, q0, q_end, kvh, zero, q_mul,
                  G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                  HALF: tl.constexpr, QK_F16: tl.constexpr, TWO_GROUPS: tl.constexpr):
    """The tile's query halves (fp32, times q_mul with QK_F16) and the RoPE frequencies, loaded
    again where rotate_q re-rotates the query (a new chunk), so that no fp32 copy of q stays
    live across the KV loop (RELOAD_Q). `zero` is 0, opaque to the compiler: every index is
    built on it, so that nothing here is hoisted out of the loop to hold registers there. The
    tile's rows come from the scalars q0, q_end the kernel loaded at its start: loading them
    again here (TILE_SEQ, then QO_INDPTR at the sequence) put two dependent loads before the
    query's own on every re-rotation."""
    qi, row_ok, head = _rows_of(q0 + zero, q_end, kvh, G, GP, BLOCK_M, ROWS, TWO_GROUPS)
    dh = tl.arange(0, HALF) + zero
    q_off = qi.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
    q1 = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(Q + q_off + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if QK_F16:
        q1 = q1 * q_mul
        q2 = q2 * q_mul
    return q1, q2, tl.load(INV_FREQ + dh)


@triton.jit
def _query_at_shift(q1, q2, freq, rel_pos, rope_scale, Q, stride_qt, stride_qh, INV_FREQ, q0,
                    q_end, kvh, zero, q_mul, dtype: tl.constexpr, G: tl.constexpr,
                    GP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                    HALF: tl.constexpr, QK_F16: tl.constexpr, FAST_TRIG: tl.constexpr,
                    RELOAD_Q: tl.constexpr, TWO_GROUPS: tl.constexpr = False):
    """rotate_q's query rotated by rel_pos (_rotate_query): from the halves q1, q2 and freq the
    kernel keeps, or, with RELOAD_Q, from the query loaded again (_query_halves)."""
    if RELOAD_Q:
        q1, q2, freq = _query_halves(Q, stride_qt, stride_qh, INV_FREQ, q0, q_end, kvh, zero,
                                     q_mul, G, GP, BLOCK_M, ROWS, HALF, QK_F16, TWO_GROUPS)
    return _rotate_query(q1, q2, rel_pos, freq, rope_scale, dtype, FAST_TRIG)


@triton.jit
def _write_tile(acc, l_i, m_i, qi, head, row_ok, split, O, stride_ot, stride_oh,
                PO, stride_pot, stride_poh, stride_pos, LSE, stride_lt, stride_lh,
                D: tl.constexpr, DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A program's epilogue (both attention kernels): with DIRECT the normalised output (and,
    with WRITE_LSE, each row's natural-log lse); else its split's fp32 partial and log2-sum-exp
    for _merge_kernel."""
    d = tl.arange(0, D)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        o_off = qi.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(O + o_off, o.to(O.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            # the row's natural-log lse into LSE [Tq, H] (the caller merges key groups by it)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")) * LN2
            tl.store(LSE + qi.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_ok)
    else:
        po_off = qi.to(tl.int64)[:, None] * stride_pot + head[:, None] * stride_poh \
            + split * stride_pos + d[None, :]
        tl.store(PO + po_off, o, mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + qi.to(tl.int64) * stride_lt + head * stride_lh + split, lse, mask=row_ok)


# tiles_per_split follows the context's length: not specialised on its value, so that one
# compiled variant serves every length (as the runs prefill kernel's entries_per_split)
@triton.jit(do_not_specialize=["tiles_per_split"])
def _paged_attn_kernel(
    Q, stride_qt, stride_qh,
    K, V, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_vd,
    INDPTR, PAGE_IDS, PAGE_POS, PAGE_LEN, ROT_SHIFT, SLOT_POS_ROW, SLOT_POS, stride_sp,
    TILE_SEQ, TILE_Q0, QO_INDPTR, QPOS,
    INV_FREQ, rope_scale, qk_scale_log2,
    O, stride_ot, stride_oh,
    PO, stride_pot, stride_poh, stride_pos,
    LSE, stride_lt, stride_lh,
    tiles_per_split,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    HALF: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE_MODE: tl.constexpr, FAST_TRIG: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr, MULTI_SHIFT: tl.constexpr, HAS_SLOT_POS: tl.constexpr,
    WRITE_LSE: tl.constexpr = False,
    K_SCALE=None, V_SCALE=None, stride_ksp=None, stride_ksh=None, stride_vsp=None,
    stride_vsh=None, KV_FP8: tl.constexpr = False, SCALE_V_TILE: tl.constexpr = False,
    QK_F16: tl.constexpr = False, V_KEYS_MAJOR: tl.constexpr = False,
    FOLD_V: tl.constexpr = False, RELOAD_Q: tl.constexpr = False,
    softcap_log2=None, window=None, SOFTCAP: tl.constexpr = False, WINDOWED: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    dtype = Q.dtype.element_ty      # the compute dtype (the pool's, unless it is fp8)
    if QK_F16:
        qk_dtype = tl.float16       # fp8 keys: the QK dot in fp16 (see qk_f16_scale)
    else:
        qk_dtype = dtype

    TWO_GROUPS: tl.constexpr = MULTI_SHIFT == 4
    b, q0, q_end, qi, row_ok, head = _tile_rows(TILE_SEQ, TILE_Q0, QO_INDPTR, tile, kvh, G, GP,
                                                BLOCK_M, ROWS, TWO_GROUPS)
    dh = tl.arange(0, HALF)

    q1, q2, freq = _query_halves(Q, stride_qt, stride_qh, INV_FREQ, q0, q_end, kvh, 0, 1.0, G, GP,
                                 BLOCK_M, ROWS, HALF, False, TWO_GROUPS)
    qp = tl.load(QPOS + qi, mask=row_ok, other=-1)           # padded rows see no key
    q_mul = 1.0
    if QK_F16:
        q_mul, q_div = qk_f16_scale(q1, q2, rope_scale)
        q1 = q1 * q_mul
        q2 = q2 * q_mul
        qk_scale_log2 = qk_scale_log2 * q_div

    qa = q1.to(qk_dtype)
    qb = q2.to(qk_dtype)
    p_start = tl.load(INDPTR + b)
    cur_shift = p_start * 0 - 2147483647       # no shift seen yet
    cur_shift1 = cur_shift                      # MULTI_SHIFT 4: row group 1's
    zero = tl.minimum(p_start, 0)               # 0 (p_start >= 0), opaque: _query_halves
    p_end = tl.load(INDPTR + b + 1)
    n_tiles = tl.cdiv(p_end - p_start, PPT)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)

    n = tl.arange(0, BLOCK_N)
    slot = n // PAGE
    off = n % PAGE
    if TWO_GROUPS:
        grp = tl.arange(0, ROWS) // GP           # each row's group
        s0_n, s1_n = _tile_shifts(ROT_SHIFT, p_start, p_end, t_lo, t_hi, PPT)

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, 2 * HALF], dtype=tl.float32)
    if FOLD_V:
        pid_n, ok_n = _scale_pages(PAGE_IDS, PAGE_LEN, p_start, p_end, t_lo, t_hi, slot, off,
                                   PPT)
        ks_n, lvs_n, rvs_n = _tile_scales(K_SCALE, V_SCALE, stride_ksp, stride_ksh, stride_vsp,
                                          stride_vsh, pid_n, ok_n, kvh, off, FAST_TRIG)
        pid_n, ok_n = _scale_pages(PAGE_IDS, PAGE_LEN, p_start, p_end, t_lo + 1, t_hi, slot, off,
                                   PPT)

    for tt in range(t_lo, t_hi):
        e0 = p_start + tt * PPT
        e = e0 + slot
        e_ok = (slot < PPT) & (e < p_end)
        pid = tl.load(PAGE_IDS + e, mask=e_ok, other=0)
        plen = tl.load(PAGE_LEN + e, mask=e_ok, other=0)
        ppos = tl.load(PAGE_POS + e, mask=e_ok, other=0)
        k_ok = e_ok & (off < plen)
        kpos = ppos + off
        if HAS_SLOT_POS:
            # an entry with row >= 0 takes its keys' positions from SLOT_POS; hidden slots
            # (HIDDEN_POS) leave k_ok: never loaded, never visible
            srow = tl.load(SLOT_POS_ROW + e, mask=e_ok, other=-1)
            explicit = k_ok & (srow >= 0)
            xpos = tl.load(SLOT_POS + srow.to(tl.int64) * stride_sp + off, mask=explicit,
                           other=0)
            kpos = tl.where(explicit, xpos, kpos)
            k_ok = k_ok & (kpos != 2147483647)
        k_base = pid.to(tl.int64)[:, None] * stride_kp + off[:, None] * stride_kt + dh[None, :]

        if ROPE_MODE == 2:
            if MULTI_SHIFT == 4:
                # row group 0 scores the tile's first page, group 1 its second (vis below):
                # each group's query rotated by its own page's shift, and again only when that
                # changes, so a tile across a chunk boundary costs no second pair of dots
                s0, s1 = s0_n, s1_n
                s0_n, s1_n = _tile_shifts(ROT_SHIFT, p_start, p_end, tt + 1, t_hi, PPT)
                if (s0 != cur_shift) | (s1 != cur_shift1):
                    qa, qb = _query_at_shift(q1, q2, freq, qp - tl.where(grp == 0, s0, s1),
                                             rope_scale, Q, stride_qt, stride_qh, INV_FREQ, q0,
                                             q_end, kvh, zero, q_mul, qk_dtype, G, GP, BLOCK_M,
                                             ROWS, HALF, QK_F16, FAST_TRIG, RELOAD_Q, TWO_GROUPS)
                    cur_shift = s0
                    cur_shift1 = s1
            else:
                s0 = tl.load(ROT_SHIFT + e0)
                if s0 != cur_shift:  # a new chunk: rotate the query once for all its tiles
                    qa, qb = _query_at_shift(q1, q2, freq, qp - s0, rope_scale, Q, stride_qt,
                                             stride_qh, INV_FREQ, q0, q_end, kvh, zero, q_mul,
                                             qk_dtype, G, GP, BLOCK_M, ROWS, HALF, QK_F16,
                                             FAST_TRIG, RELOAD_Q)
                    cur_shift = s0
                if MULTI_SHIFT == 3:
                    s1 = tl.load(ROT_SHIFT + e0 + 1, mask=e0 + 1 < p_end, other=0)

        if V_KEYS_MAJOR:
            # the K tile masked per page, like the V tile: no page-length load then stands
            # between a tile's page ids and its copies (plain and synchronous in the software
            # pipeline, it stalled every tile); a page's unused slots get their scores masked
            # (vis) whatever they hold
            k_mask = e_ok
        else:
            k_mask = k_ok
        k1 = tl.load(K + k_base + kvh * stride_kh, mask=k_mask[:, None], other=0.0)
        k2 = tl.load(K + k_base + kvh * stride_kh + HALF, mask=k_mask[:, None], other=0.0)
        if KV_FP8:
            # e4m3 -> compute dtype is exact; the per-token scales multiply the scores below
            k1 = k1.to(qk_dtype)
            k2 = k2.to(qk_dtype)
            if FOLD_V:
                # this tile's scales, loaded one iteration ahead (their pages two): plain
                # loads, which the software pipeline leaves synchronous, had their latency
                # exposed every tile
                ks, lvs, rvs = ks_n, lvs_n, rvs_n
                ks_n, lvs_n, rvs_n = _tile_scales(K_SCALE, V_SCALE, stride_ksp, stride_ksh,
                                                  stride_vsp, stride_vsh, pid_n, ok_n, kvh, off,
                                                  FAST_TRIG)
                pid_n, ok_n = _scale_pages(PAGE_IDS, PAGE_LEN, p_start, p_end, tt + 2, t_hi,
                                           slot, off, PPT)
            else:
                s_off = pid.to(tl.int64) * stride_ksp + kvh * stride_ksh + off
                ks = tl.load(K_SCALE + s_off, mask=k_ok, other=0.0).to(tl.float32)
        sc = tl.dot(qa, tl.trans(k1), input_precision=DOT_PREC)
        sc = tl.dot(qb, tl.trans(k2), acc=sc, input_precision=DOT_PREC)
        if ROPE_MODE == 2:
            if MULTI_SHIFT == 3:
                # PPT == 2: redo the dots for the second page only when it starts a new
                # chunk (a uniform scalar branch: keeps the loop software-pipelined).
                if s1 != s0:
                    qa1, qb1 = _query_at_shift(q1, q2, freq, qp - s1, rope_scale, Q, stride_qt,
                                               stride_qh, INV_FREQ, q0, q_end, kvh, zero, q_mul,
                                               qk_dtype, G, GP, BLOCK_M, ROWS, HALF, QK_F16,
                                               FAST_TRIG, RELOAD_Q)
                    sc1 = tl.dot(qa1, tl.trans(k1), input_precision=DOT_PREC)
                    sc1 = tl.dot(qb1, tl.trans(k2), acc=sc1, input_precision=DOT_PREC)
                    sc = tl.where((slot == 1)[None, :], sc1, sc)
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
                    qa2, qb2 = _rotate_query(q1, q2, qp - su, freq, rope_scale, qk_dtype,
                                             FAST_TRIG)
                    sc2 = tl.dot(qa2, tl.trans(k1), input_precision=DOT_PREC)
                    sc2 = tl.dot(qb2, tl.trans(k2), acc=sc2, input_precision=DOT_PREC)
                    sel = todo & (sh == su)
                    sc = tl.where(sel[None, :], sc2, sc)
                    todo = todo & (sh != su)
        if KV_FP8:
            sc = sc * (ks * qk_scale_log2)[None, :]     # column n times k_scale[n]
        else:
            sc = sc * qk_scale_log2
        if SOFTCAP:   # the scaled score's cap, before the fold, the mask and the softmax
            sc = soft_cap(sc, softcap_log2)
        if FOLD_V:
            sc = sc + lvs[None, :]      # plus log2 v_scale[n]: the value scales' fold
        vis = k_ok[None, :] & (kpos[None, :] <= qp[:, None])
        if WINDOWED:
            vis = vis & (qp[:, None] - kpos[None, :] < window)
        if TWO_GROUPS:
            vis = vis & (slot[None, :] == grp[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        if FOLD_V:   # each term back in the softmax's own units: sum_n 2^(score_n - m)
            l_i = l_i * alpha + tl.sum(p * rvs[None, :], axis=1)
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = load_v(V + kvh * stride_vh, pid, off, stride_vp, stride_vt, stride_vd, e_ok, k_ok,
                   2 * HALF, PAGE, V_KEYS_MAJOR)
        if FOLD_V:
            pv = p.to(tl.float16)   # <= 1; v8 exactly as stored, one cvt per pair of elements
            v = v.to(tl.float16)
        elif KV_FP8:
            vs = tl.load(V_SCALE + pid.to(tl.int64) * stride_vsp + kvh * stride_vsh + off,
                         mask=k_ok, other=0.0).to(tl.float32)
            pv, v = _scaled_pv(p, v, vs, dtype, SCALE_V_TILE)
        else:
            pv = p.to(dtype)
        acc = tl.dot(pv, v, acc=acc, input_precision=DOT_PREC)
        m_i = m_new

    if TWO_GROUPS:
        acc, l_i, m_i, qi, head, row_ok = _merge_row_groups(acc, l_i, m_i, q0, q_end, kvh, G, GP,
                                                            ROWS, 2 * HALF)
    _write_tile(acc, l_i, m_i, qi, head, row_ok, split, O, stride_ot, stride_oh, PO, stride_pot,
                stride_poh, stride_pos, LSE, stride_lt, stride_lh, 2 * HALF, DIRECT, WRITE_LSE)


# num_splits: not specialised on its value, one variant per SP (as the attention kernels' counts)
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(PO, stride_pot, stride_poh, LSE, stride_lt, stride_lh, O, stride_ot, stride_oh,
                  num_splits, SP: tl.constexpr, D: tl.constexpr,
                  LSE_OUT=None, stride_lot=None, stride_loh=None, WRITE_LSE: tl.constexpr = False):
    """out[t, h] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); all-empty rows -> 0.
    WRITE_LSE: also lse_out[t, h] = ln 2 * log2(sum_s 2^lse_s) (-inf for all-empty rows). The
    LSE_OUT arguments default to None, which Triton specializes away: the default launch
    compiles to the kernel it was before they existed."""
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
    if WRITE_LSE:
        lse_row = tl.where(den > 0, mx + tl.log2(tl.where(den > 0, den, 1.0)), float("-inf"))
        tl.store(LSE_OUT + t * stride_lot + h * stride_loh, lse_row * LN2)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _multi_shift_variant(rope_mode_code: int, pages_per_tile: int, rows: int, block_m: int,
                         gp: int, slot_pos: bool) -> int:
    """How rotate_q handles a tile whose pages have different rot_shifts (module docstring):
    0 nothing to handle (not rotate_q, or one page per tile), 4 two pages per tile in decode
    where the padded query rows hold a second copy of the heads (two row groups), 3 two pages
    per tile in other decode (uniform scalar branch), 2 otherwise (while loop over the tile's
    distinct shifts). A table with explicit slot positions keeps 3: with their per-tile loads
    (synchronous in the software pipeline) 4 measured 10-15% slower on an H100."""
    if rope_mode_code != ROPE_MODES["rotate_q"] or pages_per_tile == 1:
        return 0
    if pages_per_tile == 2 and block_m == 1 and 2 * gp <= rows and not slot_pos:
        return 4
    # Prefill keeps the while loop, as last benchmarked: the H200 probe of 3 in prefill was
    # 16-42% faster at B1 / +32 tokens but 4% slower at B16 +512 (prefill_sweep records in
    # benchmarks/results/kernels_h200.json).
    return 3 if pages_per_tile == 2 and rows <= 64 else 2


def _slot_pos_args(table: PageTable, page: int, dummy: torch.Tensor):
    """SLOT_POS_ROW, SLOT_POS, its row stride (dummies when the table has no explicit rows)."""
    if not table.has_slot_pos:
        return dummy, dummy, 0
    sp = table.slot_pos
    assert sp.dim() == 2 and (sp.shape[0] == 0 or (sp.shape[1] == page and sp.stride(1) == 1)), \
        "slot_pos: [m, page_size] int32, unit stride along slots"
    assert table.slot_pos_row.dtype == sp.dtype == torch.int32
    return table.slot_pos_row, sp, sp.stride(0)


# split-KV programs per sequence at most (a B1 sweep on an H100 found 64-256 splits slower than
# 32 for bf16 and fp8 pages at 8k and 32k: benchmarks/decode_floor.py --sweep lifts the cap)
MAX_SPLITS = 64


def split_count(device, n_programs: int, n_kv_tiles: int, num_splits: int | None,
                split_target: float, per_sm: int | None = None) -> tuple[int, int]:
    """(num_splits, tiles_per_split) of split-KV over n_kv_tiles tiles per sequence, for
    n_programs (query tile, KV head) programs: num_splits None picks about split_target programs
    per SM, or, with per_sm (how many programs the kernel's registers and shared memory let one
    SM hold), wave_splits' count; at most MAX_SPLITS, no more than tiles, and no split left empty
    by the rounding."""
    if num_splits is None and per_sm:
        num_splits = wave_splits(n_programs, n_kv_tiles, per_sm * _num_sms(device))
    if num_splits is None:
        target = int(split_target * _num_sms(device))
        num_splits = max(1, min(n_kv_tiles, MAX_SPLITS, triton.cdiv(target, n_programs)))
    num_splits = max(1, min(num_splits, n_kv_tiles, MAX_SPLITS))
    tiles_per_split = triton.cdiv(n_kv_tiles, num_splits)
    return triton.cdiv(n_kv_tiles, tiles_per_split), tiles_per_split


@functools.lru_cache(maxsize=1024)   # one search per launch shape: eager decode asks every layer
def wave_splits(n_programs: int, n_kv_tiles: int, slots: int) -> int:
    """The split count for n_programs programs of n_kv_tiles KV tiles each when `slots` programs
    run at once: each count's time taken as (waves of programs) x (tiles per program + 1, the
    program's fixed work: query, epilogue, its partial for the merge), and the smallest count
    within 3% of the best. A count that leaves a partial last wave (B32 x 8k in 2 splits on 3
    programs per SM: 512 programs, 1.3 waves) costs as much as a whole one, which the plain
    programs-per-SM target does not see."""
    costs = []
    for s in range(1, min(n_kv_tiles, 64) + 1):
        per = triton.cdiv(n_kv_tiles, s)
        waves = triton.cdiv(n_programs * triton.cdiv(n_kv_tiles, per), slots)
        costs.append((waves * (per + 1), s))
    best = min(c for c, _ in costs)
    return min(s for c, s in costs if c <= 1.03 * best)


# fp8 decode (the tiles kernel at <= 64 rows, 4 warps, keys-major V): the loop is bound by
# latency, with two programs (8 warps) per SM at the ~250 registers the compiler takes; capped at
# 168 registers, three programs share an SM (65,536 / (128 threads x 168)) for a few spilled
# bytes, and wave_splits fills whole waves of them.
FP8_DECODE_MAXNREG = 168
FP8_DECODE_PER_SM = 3
# ... and a deeper software pipeline for them: Triton gives the K/V tiles one shared-memory buffer
# at num_stages 2-4 (the page-id load they depend on takes a stage of its own) and two from 5, so
# that the next tile's bytes are in flight while this one is read. Two buffers take ~72 KB a
# program: three programs fit the 227 KB of a Hopper (or Blackwell data-centre) SM; on a GPU with
# less shared memory per SM the launch keeps the default stages, which leave room for the three.
FP8_DECODE_STAGES = 5
FP8_DECODE_STAGES_SMEM = 3 * 72 * 1024


def _smem_per_sm(device) -> int:
    """Shared memory per SM in bytes (the GPU's; 0 off the GPU)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", None)
    if smem is None:     # older torch: Hopper and later data-centre parts have 228 KB
        smem = 228 * 1024 if props.major in (9, 10) else 100 * 1024
    return smem


def fp8_decode_stages(num_stages: int | None, smem_per_sm: int) -> int | None:
    """num_stages for a launch that fp8_decode_occupancy takes: the caller's, else
    FP8_DECODE_STAGES where three programs' two K/V buffers fit the SM (else None: the
    default)."""
    if num_stages is None and smem_per_sm >= FP8_DECODE_STAGES_SMEM:
        return FP8_DECODE_STAGES
    return num_stages


def fp8_decode_occupancy(fp8: bool, rows: int, interp: bool, num_warps: int | None,
                         keys_major: bool, programs: int, num_sms: int) -> bool:
    """Whether a launch takes FP8_DECODE_MAXNREG registers and wave_splits: fp8 pages, decode
    rows, the default 4 warps, V keys-major (the pool's layout: dims-major V spills far more at
    the cap), on the GPU, and more programs (at the plain split count) than one wave of two per
    SM. A launch that fits in one wave (a few sequences) has nothing to gain from occupancy and
    would only pay the spills."""
    return (fp8 and rows <= 64 and not interp and num_warps in (None, 4) and keys_major
            and programs > 2 * num_sms)


def split_outputs(q, out, num_splits: int, return_lse: bool):
    """The attention kernel's output arguments: (out, row_lse, po, po_strides, lse, l_strides).
    One split (DIRECT) writes `out` (and row_lse, with return_lse) itself; several write fp32
    per-split partials po [Tq, H, splits, D] and their log2-sum-exps lse [Tq, H, splits] for
    merge_splits."""
    Tq, H, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    row_lse = torch.empty(Tq, H, dtype=torch.float32, device=q.device) if return_lse else None
    if num_splits == 1:
        po = lse = out  # unused
        po_strides = (0, 0, 0)
        l_strides = (0, 0)
        if return_lse:       # the DIRECT epilogue writes the rows' lse itself
            lse = row_lse
            l_strides = (row_lse.stride(0), row_lse.stride(1))
    else:
        po = torch.empty(Tq, H, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(Tq, H, num_splits, dtype=torch.float32, device=q.device)
        po_strides = (po.stride(0), po.stride(1), po.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    return out, row_lse, po, po_strides, lse, l_strides


def merge_splits(po, lse, out, row_lse, num_splits: int) -> None:
    """_merge_kernel over split_outputs' partials into out (and row_lse when not None)."""
    Tq, H, D = out.shape
    # without row_lse the LSE_OUT arguments stay None (specialized away by Triton)
    lse_out = {}
    if row_lse is not None:
        lse_out = dict(LSE_OUT=row_lse, stride_lot=row_lse.stride(0),
                       stride_loh=row_lse.stride(1), WRITE_LSE=True)
    _merge_kernel[(Tq, H)](po, po.stride(0), po.stride(1), lse, lse.stride(0), lse.stride(1),
                           out, out.stride(0), out.stride(1), num_splits,
                           SP=triton.next_power_of_2(num_splits), D=D, **lse_out)


def launch(q, qo_indptr, q_pos, k_pages, v_pages, table: PageTable, inv_freq, *, rope_mode: str,
           attention_scaling: float, sm_scale: float | None, tile_seq, tile_q0, block_m: int,
           max_tiles_hint: int, num_splits: int | None, out: torch.Tensor | None,
           block_n: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, split_target: float = 2.0, return_lse: bool = False,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           qk_f16: bool | str = True, maxnreg: int | None = None, softcap: float | None = None,
           window: int | None = None):
    """The tiles kernel's launcher (lazy_decode's; with block_m > 1 the kernel benchmarks' tiles
    prefill, lazy_rag.bench.tiles_prefill; the runs kernel's launch_runs takes the same
    arguments). q [Tq, H, D]; tile_seq / tile_q0
    [num_q_tiles] int32 (sequence and first query row of each query tile); max_tiles_hint:
    host-side max page entries of a sequence.
    Tuning (defaults from H200 sweeps): block_n keys per KV tile, num_warps, num_stages,
    num_splits (split-KV programs per sequence; None: about split_target programs per SM),
    maxnreg (a cap on registers per thread, for more programs per SM; None: the compiler's,
    or FP8_DECODE_MAXNREG where fp8_decode_occupancy says, whose split count is then
    wave_splits' and whose num_stages, unless given, fp8_decode_stages').
    Returns out [Tq, H, D]; with return_lse, (out, lse): lse [Tq, H] fp32, each row's natural-log
    log-sum-exp of its visible scores sm_scale * q.k (-inf for a row that sees no key).
    fp8 pages (float8_e4m3fn) come with k_scale / v_scale [num_pages, Hkv, page] (kv_quant.py);
    q is then in the compute dtype. qk_f16: fp8 keys' QK dot in fp16 with bf16 compute
    (qk_f16_scale; fp8_args). softcap: scores sm_scale * q.k soft-capped, cap * tanh(s / cap),
    before the mask and softmax (and in the lse); window: a query at p sees only keys at
    p - window + 1 .. p (cap_window_args)."""
    Tq, H, D = q.shape
    num_pages, Hkv, page, Dk = k_pages.shape
    assert Dk == D and D % 32 == 0 and H % Hkv == 0, "head_dim multiple of 32, H % Hkv == 0"
    assert k_pages.stride(-1) == 1 and q.stride(-1) == 1
    v_layout = v_args(v_pages)
    mode = rope_mode_code(rope_mode, table)
    scaled = fp8_args(q, k_pages, v_pages, k_scale, v_scale, qk_f16)
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    rows = max(16, block_m * GP)
    interp = interpreting() and not q.is_cuda
    if block_n is None:   # H200 sweep (B32 x 8k, d128, page 64): 128 keys/tile, 4 warps best
        block_n = 32 if interp else 128
    ppt = max(1, block_n // page)
    bn = triton.next_power_of_2(ppt * page)
    n_kv_tiles = max(1, triton.cdiv(max(max_tiles_hint, 1), ppt))
    n_programs = tile_seq.numel() * Hkv
    splits_asked = num_splits
    num_splits, tiles_per_split = split_count(q.device, n_programs, n_kv_tiles, splits_asked,
                                              split_target)
    if maxnreg is None and fp8_decode_occupancy(bool(scaled), rows, interp, num_warps,
                                                v_layout["V_KEYS_MAJOR"],
                                                n_programs * num_splits, _num_sms(q.device)):
        maxnreg = FP8_DECODE_MAXNREG
        num_stages = fp8_decode_stages(num_stages, _smem_per_sm(q.device))
        num_splits, tiles_per_split = split_count(q.device, n_programs, n_kv_tiles, splits_asked,
                                                  split_target, FP8_DECODE_PER_SM)
    direct = num_splits == 1
    out, row_lse, po, po_strides, lse, l_strides = split_outputs(q, out, num_splits, return_lse)
    scale = D ** -0.5 if sm_scale is None else sm_scale
    rot = table.rot_shift if table.rot_shift is not None else table.page_pos
    slot_row, slot_pos, stride_sp = _slot_pos_args(table, page, table.page_pos)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    meta = {}
    if not interp:
        # H200 sweeps: decode (16 rows) 4 warps, stages 2-4 equal; prefill (128-256 rows)
        # 8 warps, 2 stages.
        meta["num_warps"] = num_warps or (4 if rows <= 64 else 8)
        meta["num_stages"] = num_stages or (3 if rows <= 64 else 2)
        if maxnreg:
            meta["maxnreg"] = maxnreg
    grid = (tile_seq.numel(), Hkv, num_splits)
    _paged_attn_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_layout["stride_vd"],
        table.indptr, table.page_ids, table.page_pos, table.page_len, rot,
        slot_row, slot_pos, stride_sp,
        tile_seq, tile_q0, qo_indptr, q_pos,
        inv_freq, float(attention_scaling), float(scale * math.log2(math.e)),
        out, out.stride(0), out.stride(1),
        po, *po_strides, lse, *l_strides,
        tiles_per_split,
        G=G, GP=GP, BLOCK_M=block_m, ROWS=rows, HALF=D // 2, PAGE=page, PPT=ppt, BLOCK_N=bn,
        ROPE_MODE=mode, FAST_TRIG=not interp, DIRECT=direct, DOT_PREC=dot_prec,
        MULTI_SHIFT=_multi_shift_variant(mode, ppt, rows, block_m, GP, table.has_slot_pos),
        HAS_SLOT_POS=table.has_slot_pos,
        WRITE_LSE=return_lse and direct, V_KEYS_MAJOR=v_layout["V_KEYS_MAJOR"],
        RELOAD_Q=reload_query(mode, rows, bool(scaled), maxnreg), **scaled,
        **fold_args(scaled, rows, q.dtype), **cap_window_args(softcap, window), **meta,
    )
    if not direct:
        merge_splits(po, lse, out, row_lse, num_splits)
    return (out, row_lse) if return_lse else out


def reload_query(mode: int, rows: int, fp8: bool, maxnreg: int | None) -> bool:
    """RELOAD_Q: rotate_q decode (<= 64 rows) loads the query again at each re-rotation instead
    of keeping it live across the KV loop. Taken where registers are short: bf16 decode (at the
    compiler's ~255) and fp8 decode under a register cap; an uncapped fp8 launch (one wave of a
    few sequences) has registers to spare and would only pay the reloads' latency."""
    return mode == ROPE_MODES["rotate_q"] and rows <= 64 and (not fp8 or bool(maxnreg))


def fold_args(scaled: dict, rows: int, compute_dtype) -> dict:
    """FOLD_V for the tiles kernel: fp8 pages, 16-bit compute and at most 64 rows (decode; on
    the GPU prefill tiles are 128-256 rows). Larger tiles keep the scaled P @ V (the fold
    measured slower in the runs kernel's prefill, 7ccb782), and the other launches compile as
    before (nothing passed)."""
    if scaled and rows <= 64 and compute_dtype in (torch.float16, torch.bfloat16):
        return dict(FOLD_V=True)
    return {}


def fp8_args(q, k_pages, v_pages, k_scale, v_scale, qk_f16: bool = True) -> dict:
    """The attention kernels' fp8 keyword arguments (both kernels): none for pages in q's dtype
    (the arguments stay None, specialized away: the kernels compile as without them), else the
    scale tensors, their page and head strides, KV_FP8, SCALE_V_TILE (fp16 compute) and QK_F16
    (the QK dot in fp16: qk_f16_scale; taken with bf16 compute when qk_f16, and with fp32
    compute only when forced, qk_f16 == "force", for the CPU tests)."""
    check_scales(k_pages, k_scale, "k_pages")
    check_scales(v_pages, v_scale, "v_pages")
    if k_scale is None:
        assert k_pages.dtype == v_pages.dtype == q.dtype
        return {}
    assert v_pages.dtype == k_pages.dtype and q.dtype in (torch.float32, torch.float16,
                                                         torch.bfloat16)
    return dict(K_SCALE=k_scale, V_SCALE=v_scale, stride_ksp=k_scale.stride(0),
                stride_ksh=k_scale.stride(1), stride_vsp=v_scale.stride(0),
                stride_vsh=v_scale.stride(1), KV_FP8=True,
                SCALE_V_TILE=q.dtype == torch.float16,
                QK_F16=bool(qk_f16) and (q.dtype == torch.bfloat16 or qk_f16 == "force"))
