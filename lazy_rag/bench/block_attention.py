"""Block-Attention's decode, the baseline the lazy kernels are benchmarked against
(benchmarks/attention_kernels.py): one fused kernel gathers each sequence's pages into a
per-request contiguous K/V and re-rotates the keys to their logical positions; ordinary attention
(torch SDPA / flash) then runs on the copy. The engine's own block mode copies inside its pool
instead (kernels/page_copy.py); nothing of the runtime imports this.

This is the honest competitor of the lazy kernels: it reads every cached page once and writes
it once (2x the KV bytes of a lazy read), plus the request-resident copy it materialises.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lazy_rag.kernels.kv_quant import FP8
from lazy_rag.kernels.page_table import DEFAULT_ROPE_MODE, PageTable, interpreting, use_triton
from lazy_rag.kernels.reference import gather_tokens
from lazy_rag.kernels.rope import apply_rope, cos_sin, rope_cos_sin, rotate
from lazy_rag.kernels.triton_import import tl, triton

# How the pool stores keys (the gather kernel's ROPE_MODE): the lazy kernels' two storages and
# "rotate_k", keys stored unrotated (the storage Block-Attention itself assumes)
BLOCK_ROPE_MODES = {"none": 0, "rotate_k": 1, "rotate_q": 2}


@triton.jit
def _gather_rotate_kernel(
    K, V, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
    PAGE_IDS, PAGE_POS, PAGE_LEN, ROT_SHIFT, ENTRY_SEQ, DST,
    KO, VO, stride_ob, stride_oh, stride_ot,
    INV_FREQ, rope_scale,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, ROPE_MODE: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    e = tl.program_id(0)
    kvh = tl.program_id(1)
    tblk = tl.program_id(2)
    pid = tl.load(PAGE_IDS + e).to(tl.int64)
    plen = tl.load(PAGE_LEN + e)
    seq = tl.load(ENTRY_SEQ + e).to(tl.int64)
    dst = tl.load(DST + e)
    off = tblk * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = off < plen
    dh = tl.arange(0, HALF)
    dfull = tl.arange(0, 2 * HALF)
    k_off = pid * stride_kp + kvh * stride_kh + off[:, None] * stride_kt + dh[None, :]
    k1 = tl.load(K + k_off, mask=ok[:, None], other=0.0)
    k2 = tl.load(K + k_off + HALF, mask=ok[:, None], other=0.0)
    v = tl.load(V + pid * stride_vp + kvh * stride_vh + off[:, None] * stride_vt + dfull[None, :],
                mask=ok[:, None], other=0.0)
    if ROPE_MODE != 0:
        freq = tl.load(INV_FREQ + dh)
        if ROPE_MODE == 1:   # unrotated store: rotate by the logical position, scaled
            ang = (tl.load(PAGE_POS + e) + off).to(tl.float32)[:, None] * freq[None, :]
            c, s = cos_sin(ang, FAST_TRIG)
            c = c * rope_scale
            s = s * rope_scale
        else:             # stored at (pos - shift): pure rotation by the shift
            shift = tl.load(ROT_SHIFT + e).to(tl.float32)
            c, s = cos_sin(shift * freq[None, :] + tl.zeros([BLOCK_T, HALF], tl.float32),
                           FAST_TRIG)
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        k1 = (k1f * c - k2f * s).to(KO.dtype.element_ty)
        k2 = (k2f * c + k1f * s).to(KO.dtype.element_ty)
    o_off = seq * stride_ob + kvh * stride_oh + (dst + off).to(tl.int64)[:, None] * stride_ot
    tl.store(KO + o_off + dh[None, :], k1, mask=ok[:, None])
    tl.store(KO + o_off + HALF + dh[None, :], k2, mask=ok[:, None])
    tl.store(VO + o_off + dfull[None, :], v, mask=ok[:, None])


def block_gather_rotate(k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable,
                        inv_freq: torch.Tensor, *, rope_mode: str = DEFAULT_ROPE_MODE,
                        attention_scaling: float = 1.0, max_len: int | None = None,
                        zero_pad: bool = True):
    """Materialise per-sequence contiguous K/V with keys rotated at their logical positions.

    rope_mode: how the pool stores keys ("rotate_q" chunk-local rotation with table.rot_shift,
    "rotate_k" unrotated, "none" already rotated: plain gather). Sequence b's tokens land in
    table order. max_len: T of the output (default table.max_pages * page_size, no host sync).
    A table with explicit slot positions is refused (ValueError).
    Returns k, v [B, Hkv, T, D] (pool dtype; past kv_len zeros if zero_pad else undefined) and
    kv_len [B] int32. fp8 pools are refused (the engine's block mode copies with copy_rotate_run,
    which requantises; this is the benchmarks' baseline).
    """
    if k_pages.dtype == FP8:
        raise ValueError("block_gather_rotate takes bf16 / fp16 / fp32 pages, not float8_e4m3fn")
    if not use_triton(k_pages):
        k, v, kv_len, _ = block_gather_rotate_ref(k_pages, v_pages, table, inv_freq, rope_mode,
                                                  attention_scaling, max_len)
        return k, v, kv_len
    refuse_slot_pos(table, "block_gather_rotate")
    if rope_mode not in BLOCK_ROPE_MODES:
        raise ValueError(f"unknown rope_mode {rope_mode!r}: one of {sorted(BLOCK_ROPE_MODES)}")
    if rope_mode == "rotate_q" and table.rot_shift is None:
        raise ValueError("rope_mode='rotate_q' needs table.rot_shift")
    mode = BLOCK_ROPE_MODES[rope_mode]
    num_pages, Hkv, page, D = k_pages.shape
    B = table.batch_size
    T = max_len if max_len is not None else table.max_pages * page
    dev = k_pages.device
    alloc = torch.zeros if zero_pad else torch.empty
    ko = alloc(B, Hkv, T, D, dtype=k_pages.dtype, device=dev)
    vo = alloc(B, Hkv, T, D, dtype=k_pages.dtype, device=dev)
    counts = (table.indptr[1:] - table.indptr[:-1]).long()
    nnz = table.page_ids.numel()
    entry_seq = torch.repeat_interleave(torch.arange(B, device=dev, dtype=torch.int32), counts,
                                        output_size=nnz)
    lens = table.page_len.long()
    incl = torch.cumsum(lens, 0)
    seq_start = torch.cat([incl.new_zeros(1), incl])[table.indptr[:-1].long()]
    dst = (incl - lens - seq_start[entry_seq.long()]).to(torch.int32)
    kv_len = torch.zeros(B, dtype=torch.int64, device=dev).index_add_(0, entry_seq.long(), lens)
    block_t = min(triton.next_power_of_2(page), 64)
    rot = table.rot_shift if table.rot_shift is not None else table.page_pos
    if nnz:
        meta = {} if interpreting() and not k_pages.is_cuda else {"num_warps": 4}
        _gather_rotate_kernel[(nnz, Hkv, triton.cdiv(page, block_t))](
            k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            table.page_ids, table.page_pos, table.page_len, rot, entry_seq, dst,
            ko, vo, ko.stride(0), ko.stride(1), ko.stride(2),
            inv_freq, float(attention_scaling),
            HALF=D // 2, BLOCK_T=block_t, ROPE_MODE=mode,
            FAST_TRIG=k_pages.is_cuda, **meta)
    return ko, vo, kv_len.to(torch.int32)


def block_attention_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           table: PageTable, q_pos: torch.Tensor, inv_freq: torch.Tensor, *,
                           rope_mode: str = DEFAULT_ROPE_MODE, attention_scaling: float = 1.0,
                           sm_scale: float | None = None, max_len: int | None = None,
                           equal_lengths: bool = False) -> torch.Tensor:
    """Block-Attention decode end to end: fused gather + re-rotate, rotate q at q_pos, SDPA.

    q [B, H, D] unrotated; rope_mode: how the pool stores keys (as block_gather_rotate); returns
    [B, H, D]. equal_lengths=True (every sequence has exactly max_len tokens) skips the padding
    mask and the zero fill.
    """
    k, v, kv_len = block_gather_rotate(k_pages, v_pages, table, inv_freq, rope_mode=rope_mode,
                                       attention_scaling=attention_scaling, max_len=max_len,
                                       zero_pad=not equal_lengths)
    qr = apply_rope(q, q_pos, inv_freq, attention_scaling)          # [B, H, D]
    mask = None
    if not equal_lengths:
        mask = (torch.arange(k.shape[2], device=q.device)[None, :] < kv_len[:, None].long())
        mask = mask[:, None, None, :]
    o = F.scaled_dot_product_attention(qr[:, :, None, :], k, v, attn_mask=mask, scale=sm_scale,
                                       enable_gqa=True)
    return o[:, :, 0, :]


def refuse_slot_pos(table: PageTable, what: str) -> None:
    """The Block-Attention copies lay tokens out in table order at page_pos + slot; they have no
    use for explicit slot positions, so a table that carries them is an error there."""
    if table.has_slot_pos:
        raise ValueError(f"{what} does not support explicit slot positions (table.slot_pos): "
                         "use lazy_decode / lazy_prefill / paged_attention_ref")


def block_gather_rotate_ref(k_pages, v_pages, table: PageTable, inv_freq,
                            rope_mode: str = DEFAULT_ROPE_MODE, attention_scaling: float = 1.0,
                            max_len: int | None = None):
    """Block-Attention's materialised copy: per sequence, contiguous K/V in table order with keys
    re-rotated to their logical positions.

    rope_mode describes how the pool stores keys: "rotate_k" unrotated (rotate by pos, scaled),
    "rotate_q" rotated at (pos - rot_shift) (rotate by rot_shift, pure rotation), "none" already
    at logical positions (copy). Returns k, v [B, Hkv, T, D] (pool dtype, zero padded past
    kv_len), kv_len [B] int32, pos [B, T] int32 (-1 padding). No explicit slot positions.
    """
    refuse_slot_pos(table, "block_gather_rotate")
    B = table.batch_size
    Hkv, D = k_pages.shape[1], k_pages.shape[3]
    seqs = [gather_tokens(k_pages, v_pages, table, b) for b in range(B)]
    T = max_len if max_len is not None else max([s[0].shape[0] for s in seqs] + [1])
    dev = k_pages.device
    ko = torch.zeros(B, Hkv, T, D, dtype=k_pages.dtype, device=dev)
    vo = torch.zeros_like(ko)
    kv_len = torch.zeros(B, dtype=torch.int32, device=dev)
    pos = torch.full((B, T), -1, dtype=torch.int32, device=dev)
    inv_freq = inv_freq.float().to(dev)
    for b, (k, v, kpos, kshift) in enumerate(seqs):
        n = k.shape[0]
        if rope_mode == "rotate_k":
            c, s = rope_cos_sin(kpos, inv_freq, attention_scaling)
            k = rotate(k, c[:, None], s[:, None])
        elif rope_mode == "rotate_q":
            c, s = rope_cos_sin(kshift, inv_freq, 1.0)
            k = rotate(k, c[:, None], s[:, None])
        ko[b, :, :n] = k.to(k_pages.dtype).transpose(0, 1)
        vo[b, :, :n] = v.transpose(0, 1)
        kv_len[b] = n
        pos[b, :n] = kpos.to(torch.int32)
    return ko, vo, kv_len, pos
