"""shared_chunk_decode: decode attention that reads each shared chunk's KV once per step.

Position-free chunk pages can be held by many sequences of a batch at different offsets (a
popular document retrieved by many requests). lazy_decode gives every sequence its own programs,
so a chunk held by n sequences is read n times per layer per step, and each program's query tile
is G real rows padded to 16 for the tensor cores (decode has one query token). Here a step's
(sequence, chunk) pairs are grouped by chunk instead:

- the shared part: one program per (work tile, KV head, split of the chunk's pages); a work tile
  is up to `pairs_per_tile` pairs of one chunk, and its query tile stacks their query rows (row r
  = pair r // GP, head r % GP, as the per-sequence kernel packs GQA heads), each row rotated once,
  at the start, by its own sequence's (query position - the chunk's rot_shift there). Every K/V
  tile of the chunk is loaded once and applied to all of them: MMA-sized tiles in decode. A chunk
  always lies before its sequences' decode token, so every key is visible: no position mask, only
  the chunk's length masks the last page's tail. Each program writes its pairs' fp32 partial
  outputs and log2-sum-exps.
- the private part: everything else each sequence attends to (its own pages, chunks no other
  sequence of the step holds) through lazy_decode with return_lse, into fp32.
- a merge kernel per (sequence, query head) combines the private part with its pairs' partials by
  their log-sum-exps (the split merge of paged_attention.py, over more terms).

Exactness: the scores use the same fp32 angle (m - s) * inv_freq as lazy_decode's rotate_q and
the reference; the result differs from one lazy_decode call over the union table only by the
order of the softmax sums (fp32). Keys must be stored as rope_mode="rotate_q" does (the engine's
format); "none" (keys rotated at their logical positions) cannot be shared across offsets.

SharedChunks (all int32 on the pool's device, built by SharedChunks.from_pairs or the engine):

    chunk_indptr  [C + 1]  chunk c's pages are chunk_pages[chunk_indptr[c] : chunk_indptr[c+1]]
    chunk_pages   [nnz]    physical pages, in token order
    chunk_len     [C]      tokens in the chunk (its last page holds the remainder)
    tile_chunk    [T]      work tile t covers pairs tile_pair0[t] .. + tile_pairs[t] - 1, all of
    tile_pair0    [T]      chunk tile_chunk[t]; tile_pairs[t] == 0 marks a padding tile (the
    tile_pairs    [T]      captured graphs pad T to a bucket)
    pair_seq      [NP]     the sequence (row of q) of each pair
    pair_shift    [NP]     the chunk's rot_shift in that sequence (rotate_q)
    pair_pos      [NP]     the chunk's first logical position there (the reference's table; a window)
    seq_indptr    [B + 1]  sequence b's pairs are seq_pairs[seq_indptr[b] : seq_indptr[b+1]]
    seq_pairs     [NP]
    max_chunk_pages int    host side: the largest chunk's pages (sizes the split grid, no sync)
    pairs_per_tile  int    host side: pairs in a full work tile (query rows = pairs * GP)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .triton_import import tl, triton
from .decode import copy_into, lazy_decode
from .page_table import PageTable, interpreting, use_triton
from .paged_attention import LN2, _rotate_query, _scaled_pv, cap_window_args, fp8_args, soft_cap, split_count
from .reference import paged_attention_ref
from .v_layout import load_v, v_args


# SharedChunks' tensor fields, in order
FIELDS = ("chunk_indptr", "chunk_pages", "chunk_len", "tile_chunk", "tile_pair0", "tile_pairs", "pair_seq",
          "pair_shift", "pair_pos", "seq_indptr", "seq_pairs")


def group_pairs(chunks, pairs, num_seqs: int, pairs_per_tile: int) -> dict[str, list]:
    """SharedChunks' fields as lists. chunks: per chunk, (its pages, its token count); pairs:
    (sequence, chunk index, rot_shift, first logical position) in any order. Pairs are grouped by
    chunk into work tiles of at most pairs_per_tile, a chunk's pairs spread evenly over its tiles
    (a chunk of 17 pairs at 16 per tile: 9 + 8, not 16 + 1)."""
    pairs = sorted(pairs, key=lambda p: (p[1], p[0]))
    out = {f: [] for f in FIELDS}
    out["chunk_indptr"].append(0)
    for pages, n in chunks:
        out["chunk_pages"].extend(pages)
        out["chunk_indptr"].append(len(out["chunk_pages"]))
        out["chunk_len"].append(n)
    i = 0
    while i < len(pairs):
        c = pairs[i][1]
        j = i
        while j < len(pairs) and pairs[j][1] == c:
            j += 1
        n_tiles = -(-(j - i) // pairs_per_tile)
        for k in range(n_tiles):
            a, e = i + (j - i) * k // n_tiles, i + (j - i) * (k + 1) // n_tiles
            out["tile_chunk"].append(c)
            out["tile_pair0"].append(a)
            out["tile_pairs"].append(e - a)
        i = j
    per_seq = [[] for _ in range(num_seqs)]
    for k, (b, _, shift, pos) in enumerate(pairs):
        per_seq[b].append(k)
        out["pair_seq"].append(b)
        out["pair_shift"].append(shift)
        out["pair_pos"].append(pos)
    out["seq_indptr"].append(0)
    for ks in per_seq:
        out["seq_pairs"].extend(ks)
        out["seq_indptr"].append(len(out["seq_pairs"]))
    return out


@dataclass
class SharedChunks:
    """One decode step's (sequence, chunk) pairs grouped by chunk (fields: module docstring)."""

    chunk_indptr: torch.Tensor
    chunk_pages: torch.Tensor
    chunk_len: torch.Tensor
    tile_chunk: torch.Tensor
    tile_pair0: torch.Tensor
    tile_pairs: torch.Tensor
    pair_seq: torch.Tensor
    pair_shift: torch.Tensor
    pair_pos: torch.Tensor
    seq_indptr: torch.Tensor
    seq_pairs: torch.Tensor
    max_chunk_pages: int
    pairs_per_tile: int

    @staticmethod
    def from_pairs(chunks, pairs, num_seqs: int, pairs_per_tile: int, device="cpu") -> "SharedChunks":
        """SharedChunks of group_pairs' lists (arguments as there), on `device`."""
        lists = group_pairs(chunks, pairs, num_seqs, pairs_per_tile)
        t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        return SharedChunks(*(t(lists[f]) for f in FIELDS),
                            max_chunk_pages=max((len(p) for p, _ in chunks), default=0),
                            pairs_per_tile=pairs_per_tile)

    @property
    def num_pairs(self) -> int:
        return self.pair_seq.numel()

    def union_table(self, private: PageTable, page_size: int) -> PageTable:
        """Every sequence's private entries followed by its chunks' pages (host round trip): the
        one page table lazy_decode or the reference would read for the same attention."""
        h = {k: getattr(self, k).tolist() for k in ("chunk_indptr", "chunk_pages", "chunk_len", "pair_shift",
                                                     "pair_pos", "seq_indptr", "seq_pairs")}
        chunk_of = [0] * self.num_pairs
        for t, c in enumerate(self.tile_chunk.tolist()):
            p0, n = int(self.tile_pair0[t]), int(self.tile_pairs[t])
            for k in range(p0, p0 + n):
                chunk_of[k] = c
        ptr = private.indptr.tolist()
        cols = {k: getattr(private, k).tolist() for k in ("page_ids", "page_pos", "page_len")}
        shift = private.rot_shift.tolist() if private.rot_shift is not None else [0] * len(cols["page_ids"])
        ids, pos, lens, rot = [], [], [], []
        for b in range(len(ptr) - 1):
            a, e = ptr[b], ptr[b + 1]
            ids.append(cols["page_ids"][a:e])
            pos.append(cols["page_pos"][a:e])
            lens.append(cols["page_len"][a:e])
            rot.append(shift[a:e])
            for k in h["seq_pairs"][h["seq_indptr"][b]:h["seq_indptr"][b + 1]]:
                c = chunk_of[k]
                pages = h["chunk_pages"][h["chunk_indptr"][c]:h["chunk_indptr"][c + 1]]
                n = h["chunk_len"][c]
                for j, pg in enumerate(pages):
                    ids[b].append(pg)
                    pos[b].append(h["pair_pos"][k] + j * page_size)
                    lens[b].append(min(page_size, n - j * page_size))
                    rot[b].append(h["pair_shift"][k])
        return PageTable.from_lists(ids, pos, lens, rot, device=private.indptr.device)


# tiles_per_split follows the context's length: not specialised on its value, so that one
# compiled variant serves every length (as the runs prefill kernel's entries_per_split)
@triton.jit(do_not_specialize=["tiles_per_split"])
def _shared_chunk_kernel(
    Q, stride_qt, stride_qh,
    K, V, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_vd,
    CHUNK_INDPTR, CHUNK_PAGES, CHUNK_LEN, TILE_CHUNK, TILE_PAIR0, TILE_PAIRS, PAIR_SEQ, PAIR_SHIFT, QPOS,
    INV_FREQ, rope_scale, qk_scale_log2,
    PO, stride_pop, stride_pos, stride_poh, LSE, stride_lp, stride_ls,
    tiles_per_split,
    G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    PPT: tl.constexpr, BLOCK_N: tl.constexpr, FAST_TRIG: tl.constexpr, DOT_PREC: tl.constexpr,
    K_SCALE=None, V_SCALE=None, stride_ksp=None, stride_ksh=None, stride_vsp=None, stride_vsh=None,
    KV_FP8: tl.constexpr = False, SCALE_V_TILE: tl.constexpr = False, QK_F16: tl.constexpr = False,
    V_KEYS_MAJOR: tl.constexpr = False,
    PAIR_POS=None, softcap_log2=None, window=None, SOFTCAP: tl.constexpr = False, WINDOWED: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    dtype = Q.dtype.element_ty
    n_pairs = tl.load(TILE_PAIRS + tile)
    if n_pairs > 0:              # a padding tile (captured graphs) does nothing
        c = tl.load(TILE_CHUNK + tile)
        p0 = tl.load(TILE_PAIR0 + tile)
        r = tl.arange(0, ROWS)
        pr = r // GP
        h = r % GP
        row_ok = (pr < n_pairs) & (h < G)
        pair = p0 + pr
        b = tl.load(PAIR_SEQ + pair, mask=row_ok, other=0)
        shift = tl.load(PAIR_SHIFT + pair, mask=row_ok, other=0)
        qp = tl.load(QPOS + b, mask=row_ok, other=0)
        head = kvh * G + h
        dh = tl.arange(0, HALF)
        dfull = tl.arange(0, 2 * HALF)
        q_off = b.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
        q1 = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(Q + q_off + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
        freq = tl.load(INV_FREQ + dh)
        # each row once, at its own offset: the angle (m - s) * f in fp32, as the reference
        qa, qb = _rotate_query(q1, q2, qp - shift, freq, rope_scale, dtype, FAST_TRIG)
        if WINDOWED:   # each row's chunk starts at its own position: the window is per row
            c_pos = tl.load(PAIR_POS + pair, mask=row_ok, other=0)

        e_start = tl.load(CHUNK_INDPTR + c)
        e_end = tl.load(CHUNK_INDPTR + c + 1)
        c_len = tl.load(CHUNK_LEN + c)
        n_tiles = tl.cdiv(e_end - e_start, PPT)
        t_lo = split * tiles_per_split
        t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
        n = tl.arange(0, BLOCK_N)
        slot = n // PAGE
        off = n % PAGE

        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, 2 * HALF], dtype=tl.float32)
        for tt in range(t_lo, t_hi):
            e = e_start + tt * PPT + slot
            tok = (tt * PPT + slot) * PAGE + off
            e_ok = (slot < PPT) & (e < e_end)
            k_ok = e_ok & (tok < c_len)
            pid = tl.load(CHUNK_PAGES + e, mask=e_ok, other=0)
            k_base = pid.to(tl.int64)[:, None] * stride_kp + off[:, None] * stride_kt + dh[None, :]
            k1 = tl.load(K + k_base + kvh * stride_kh, mask=k_ok[:, None], other=0.0)
            k2 = tl.load(K + k_base + kvh * stride_kh + HALF, mask=k_ok[:, None], other=0.0)
            if KV_FP8:
                k1 = k1.to(dtype)
                k2 = k2.to(dtype)
            sc = tl.dot(qa, tl.trans(k1), input_precision=DOT_PREC)
            sc = tl.dot(qb, tl.trans(k2), acc=sc, input_precision=DOT_PREC)
            if KV_FP8:
                ks = tl.load(K_SCALE + pid.to(tl.int64) * stride_ksp + kvh * stride_ksh + off, mask=k_ok,
                             other=0.0).to(tl.float32)
                sc = sc * (ks * qk_scale_log2)[None, :]
            else:
                sc = sc * qk_scale_log2
            if SOFTCAP:
                sc = soft_cap(sc, softcap_log2)
            if WINDOWED:
                vis = k_ok[None, :] & (qp[:, None] - (c_pos[:, None] + tok[None, :]) < window)
                sc = tl.where(vis, sc, float("-inf"))
            else:
                sc = tl.where(k_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            v = load_v(V + kvh * stride_vh, pid, off, stride_vp, stride_vt, stride_vd, e_ok, k_ok,
                       2 * HALF, PAGE, V_KEYS_MAJOR)
            if KV_FP8:
                vs = tl.load(V_SCALE + pid.to(tl.int64) * stride_vsp + kvh * stride_vsh + off, mask=k_ok,
                             other=0.0).to(tl.float32)
                pv, v = _scaled_pv(p, v, vs, dtype, SCALE_V_TILE)
            else:
                pv = p.to(dtype)
            acc = tl.dot(pv, v, acc=acc, input_precision=DOT_PREC)
            m_i = m_new

        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        pair64 = pair.to(tl.int64)
        tl.store(PO + pair64[:, None] * stride_pop + split * stride_pos + head[:, None] * stride_poh + dfull[None, :],
                 o, mask=row_ok[:, None])
        tl.store(LSE + pair64 * stride_lp + split * stride_ls + head, lse, mask=row_ok)


# num_splits: not specialised on its value, one variant per SP (as the attention kernels' counts)
@triton.jit(do_not_specialize=["num_splits"])
def _merge_shared_kernel(PRIV_O, stride_ot, stride_oh, PRIV_LSE, stride_plt,
                         PO, stride_pop, stride_pos, stride_poh, LSE, stride_lp, stride_ls,
                         SEQ_INDPTR, SEQ_PAIRS, OUT, stride_out, stride_ouh, num_splits,
                         SP: tl.constexpr, D: tl.constexpr, HAS_PRIVATE: tl.constexpr):
    """out[b, h] = the private part (HAS_PRIVATE) and sequence b's pairs' split partials,
    weighted by 2^(lse - max) and normalised (online over the pairs: a sequence holds any
    number); a row with nothing to attend to gets zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    s = tl.arange(0, SP)
    s_ok = s < num_splits
    if HAS_PRIVATE:
        m = tl.load(PRIV_LSE + b * stride_plt + h) / LN2         # natural log -> log2
        has = m > float("-inf")
        m = tl.where(has, m, -1.0e30)
        w = tl.where(has, 1.0, 0.0)
        den = w
        num = tl.load(PRIV_O + b.to(tl.int64) * stride_ot + h * stride_oh + d) * w
    else:
        m = -1.0e30
        den = 0.0
        num = tl.zeros([D], dtype=tl.float32)
    j0 = tl.load(SEQ_INDPTR + b)
    j1 = tl.load(SEQ_INDPTR + b + 1)
    for j in range(j0, j1):
        k = tl.load(SEQ_PAIRS + j).to(tl.int64)
        lse = tl.load(LSE + k * stride_lp + s * stride_ls + h, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        ws = tl.exp2(lse - m_new)                               # -inf (empty split) -> 0
        po = tl.load(PO + k * stride_pop + s[:, None] * stride_pos + h * stride_poh + d[None, :],
                     mask=s_ok[:, None], other=0.0)
        num = num * alpha + tl.sum(po * ws[:, None], axis=0)
        den = den * alpha + tl.sum(ws, axis=0)
        m = m_new
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_out + h * stride_ouh + d, o.to(OUT.dtype.element_ty))


def shared_chunk_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, private: PageTable | None,
                        shared: SharedChunks, q_pos: torch.Tensor, inv_freq: torch.Tensor, *,
                        attention_scaling: float = 1.0, sm_scale: float | None = None,
                        out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                        block_n: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, split_target: float = 4.0, softcap: float | None = None,
                        window: int | None = None) -> torch.Tensor:
    """Decode attention (rope_mode="rotate_q") of q [B, H, D] at q_pos [B] over each sequence's
    private entries (`private`, one CSR row per sequence, its own new token's page included) and its
    shared chunks (`shared`): the same result as lazy_decode over the union of both (module
    docstring), each shared chunk's pages read once for all its sequences. `private` None: every
    key is in `shared` (a decode step whose own pages are pairs too: every key precedes the
    query, so no run needs the causal mask). fp8 pages come with
    k_scale / v_scale as in lazy_decode. Tuning: block_n keys per KV tile, num_warps, num_stages,
    num_splits (splits of a chunk's pages; None: about split_target programs per SM). softcap,
    window: as lazy_decode (a window masks a shared chunk's keys per pair, from pair_pos).
    Returns [B, H, D] in q.dtype (written into `out` if given). No host sync: capturable."""
    B, H, D = q.shape
    if not use_triton(q):
        page = k_pages.shape[2]
        if private is None:
            private = PageTable.from_lists([[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)],
                                           [[] for _ in range(B)], device=q.device)
        res = paged_attention_ref(q, torch.arange(B + 1, dtype=torch.int32, device=q.device), q_pos, k_pages,
                                  v_pages, shared.union_table(private, page), inv_freq, "rotate_q",
                                  attention_scaling, sm_scale, k_scale=k_scale, v_scale=v_scale,
                                  softcap=softcap, window=window)
        return copy_into(out, res)
    num_pages, Hkv, page, _ = k_pages.shape
    assert D % 32 == 0 and H % Hkv == 0, "head_dim multiple of 32, H % Hkv == 0"
    assert k_pages.stride(-1) == 1 and q.stride(-1) == 1
    v_layout = v_args(v_pages)
    # the private part, in fp32 with its log-sum-exps (natural log)
    priv = priv_lse = q
    if private is not None:
        priv = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
        priv, priv_lse = lazy_decode(q, k_pages, v_pages, private, q_pos, inv_freq, rope_mode="rotate_q",
                                     attention_scaling=attention_scaling, sm_scale=sm_scale, out=priv,
                                     return_lse=True, k_scale=k_scale, v_scale=v_scale, softcap=softcap,
                                     window=window)
    scaled = fp8_args(q, k_pages, v_pages, k_scale, v_scale, qk_f16=False)
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    rows = max(16, triton.next_power_of_2(shared.pairs_per_tile * GP))
    interp = interpreting() and not q.is_cuda
    if block_n is None:
        block_n = 32 if interp else 64
    ppt = max(1, block_n // page)
    bn = triton.next_power_of_2(ppt * page)
    n_tiles = shared.tile_chunk.numel()
    n_kv_tiles = max(1, triton.cdiv(max(shared.max_chunk_pages, 1), ppt))
    splits, tiles_per_split = split_count(q.device, max(n_tiles, 1) * Hkv, n_kv_tiles, num_splits, split_target)
    NP = max(shared.num_pairs, 1)
    po = torch.empty(NP, splits, H, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(NP, splits, H, dtype=torch.float32, device=q.device)
    scale = D ** -0.5 if sm_scale is None else sm_scale
    meta = cap_window_args(softcap, window)
    if window is not None:
        meta["PAIR_POS"] = shared.pair_pos
    if not interp:
        meta["num_warps"] = num_warps or (4 if rows <= 64 else 8)
        meta["num_stages"] = num_stages or 2
    if n_tiles:
        _shared_chunk_kernel[(n_tiles, Hkv, splits)](
            q, q.stride(0), q.stride(1),
            k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_layout["stride_vd"],
            shared.chunk_indptr, shared.chunk_pages, shared.chunk_len, shared.tile_chunk, shared.tile_pair0,
            shared.tile_pairs, shared.pair_seq, shared.pair_shift, q_pos,
            inv_freq, float(attention_scaling), float(scale * math.log2(math.e)),
            po, po.stride(0), po.stride(1), po.stride(2), lse, lse.stride(0), lse.stride(1),
            tiles_per_split,
            G=G, GP=GP, ROWS=rows, HALF=D // 2, PAGE=page, PPT=ppt, BLOCK_N=bn, FAST_TRIG=not interp,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            V_KEYS_MAJOR=v_layout["V_KEYS_MAJOR"], **scaled, **meta)
    if out is None:
        out = torch.empty_like(q)
    _merge_shared_kernel[(B, H)](priv, priv.stride(0), priv.stride(1), priv_lse, priv_lse.stride(0),
                                 po, po.stride(0), po.stride(1), po.stride(2), lse, lse.stride(0), lse.stride(1),
                                 shared.seq_indptr, shared.seq_pairs, out, out.stride(0), out.stride(1), splits,
                                 SP=triton.next_power_of_2(splits), D=D, HAS_PRIVATE=private is not None)
    return out
