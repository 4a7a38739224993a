"""copy_rotate_run: Block-Attention's per-request copy inside the engine's pool, fused.

Block mode places a chunk in the pool once (keys at chunk-local rotation, like lazy) and, for
each request, copies it into the request's own pages at the chunk's offset with the keys
re-rotated to their logical positions. Every layer and KV head of every source page is one
program: read K and V once, rotate K by the constant angle ``shift * inv_freq`` (fp32; the
layer's own inv_freq for a model whose layers have different RoPE tables), write
both to the destination slots, which may straddle page boundaries (the chunk need not start on
a page boundary of the request's run). Bytes moved: the chunk's KV read once and written once,
the floor for a materialised copy.

Pool layout: ``k, v [num_layers, num_pages, num_kv_heads, page_size, head_dim]`` (engine
``PagePool``), k head_dim contiguous; v either so or keys-major (an fp8 pool: v_layout.py).
"""
from __future__ import annotations

import torch

from .triton_import import tl, triton
from .kv_quant import check_scales, quant_scale, quantize
from .page_table import interpreting, use_triton
from .reference import copy_rotate_run_ref


@triton.jit
def _copy_rotate_kernel(K, V, s_l, s_p, s_h, s_t, v_l, v_p, v_h, v_t, v_d, SRC, DST, n_tokens, first_slot, shift, INV_FREQ,
                        freq_l, NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, HALF: tl.constexpr,
                        KS=None, VS=None, ss_l=None, ss_p=None, ss_h=None,
                        KV_FP8: tl.constexpr = False, SOFT_FP8: tl.constexpr = False):
    pg = tl.program_id(0)                 # source page within the chunk
    lh = tl.program_id(1)                 # layer * NUM_HEADS + head
    layer = (lh // NUM_HEADS).to(tl.int64)
    head = (lh % NUM_HEADS).to(tl.int64)
    src = tl.load(SRC + pg).to(tl.int64)
    slot = tl.arange(0, PAGE)
    t = pg * PAGE + slot                  # token index within the chunk
    ok = t < n_tokens
    d = first_slot + t                    # slot index within the destination run
    dst = tl.load(DST + d // PAGE, mask=ok, other=0).to(tl.int64)
    base = layer * s_l + head * s_h
    dh = tl.arange(0, HALF)
    s_off = base + src * s_p + slot.to(tl.int64)[:, None] * s_t
    d_off = base + dst[:, None] * s_p + (d % PAGE).to(tl.int64)[:, None] * s_t
    m = ok[:, None]
    k1 = tl.load(K + s_off + dh[None, :], mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(K + s_off + HALF + dh[None, :], mask=m, other=0.0).to(tl.float32)
    if KV_FP8:   # dequantise (exact), rotate, quantise again with the rotated row's own scale
        sc_base = layer * ss_l + head * ss_h
        sc_src = sc_base + src * ss_p + slot
        sc_dst = sc_base + dst * ss_p + d % PAGE
        ks = tl.load(KS + sc_src, mask=ok, other=0.0).to(tl.float32)[:, None]
        k1 = k1 * ks
        k2 = k2 * ks
    ang = shift * tl.load(INV_FREQ + layer * freq_l + dh)
    c = tl.cos(ang)[None, :]
    s = tl.sin(ang)[None, :]
    if KV_FP8:
        r1 = k1 * c - k2 * s
        r2 = k2 * c + k1 * s
        rs = quant_scale(tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1)))
        tl.store(K + d_off + dh[None, :], quantize(r1, rs[:, None], SOFT_FP8), mask=m)
        tl.store(K + d_off + HALF + dh[None, :], quantize(r2, rs[:, None], SOFT_FP8), mask=m)
        tl.store(KS + sc_dst, rs.to(tl.float16), mask=ok)
        tl.store(VS + sc_dst, tl.load(VS + sc_src, mask=ok, other=0.0), mask=ok)
    else:
        tl.store(K + d_off + dh[None, :], (k1 * c - k2 * s).to(K.dtype.element_ty), mask=m)
        tl.store(K + d_off + HALF + dh[None, :], (k2 * c + k1 * s).to(K.dtype.element_ty), mask=m)
    # values in the V pages' own layout (dims- or keys-major: v_layout.py)
    v_base = layer * v_l + head * v_h
    vs_off = v_base + src * v_p + slot.to(tl.int64)[:, None] * v_t + dh[None, :] * v_d
    vd_off = v_base + dst[:, None] * v_p + (d % PAGE).to(tl.int64)[:, None] * v_t \
        + dh[None, :] * v_d
    v1 = tl.load(V + vs_off, mask=m, other=0.0)
    v2 = tl.load(V + vs_off + HALF * v_d, mask=m, other=0.0)
    tl.store(V + vd_off, v1, mask=m)
    tl.store(V + vd_off + HALF * v_d, v2, mask=m)


def copy_rotate_run(k: torch.Tensor, v: torch.Tensor, src_pages: torch.Tensor, n_tokens: int,
                    dst_pages: torch.Tensor, first_slot: int, shift: int, inv_freq: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Copy the first ``n_tokens`` slots of ``src_pages`` (in order) to slots ``first_slot ..``
    of the run ``dst_pages``, every layer, keys rotated by ``shift`` positions (values copied).

    k, v       [L, P, Hkv, page, D] pool (modified in place; source and destination pages must
               not overlap)
    src_pages  [ceil(n_tokens / page)] int, dst_pages [m] int (device tensors)
    inv_freq   [D/2] fp32: the model's RoPE frequencies, or [L, D/2]: each layer's own (no
               attention_scaling: it was applied once when the keys were first rotated)
    k_scale, v_scale  [L, P, Hkv, page] for a float8_e4m3fn pool (kernels/kv_quant.py): each
               key is dequantised, rotated in fp32 and quantised again with a new scale (a second
               rounding of the key); values and their scales are copied as they are
    """
    check_scales(k[0], None if k_scale is None else k_scale[0], "copy_rotate_run k")
    if not use_triton(k):
        copy_rotate_run_ref(k, v, src_pages, n_tokens, dst_pages, first_slot, shift, inv_freq,
                            k_scale, v_scale)
        return
    L, _, H, page, D = k.shape
    assert k.stride(-1) == 1 and D % 2 == 0
    assert page & (page - 1) == 0 and (D // 2) & (D // 2 - 1) == 0, "page and head_dim/2: powers of 2"
    if n_tokens <= 0:
        return
    meta = {} if interpreting() and not k.is_cuda else {"num_warps": 4}
    grid = (triton.cdiv(n_tokens, page), L * H)
    inv_freq = inv_freq.to(device=k.device, dtype=torch.float32).contiguous()
    scaled = {}
    if k_scale is not None:
        assert v_scale.stride() == k_scale.stride() and k_scale.stride(-1) == 1
        scaled = dict(KS=k_scale, VS=v_scale, ss_l=k_scale.stride(0), ss_p=k_scale.stride(1),
                      ss_h=k_scale.stride(2), KV_FP8=True,
                      SOFT_FP8=interpreting() and not k.is_cuda)
    _copy_rotate_kernel[grid](k, v, k.stride(0), k.stride(1), k.stride(2), k.stride(3), *v.stride(),
                              src_pages, dst_pages, n_tokens, first_slot, float(shift), inv_freq,
                              inv_freq.stride(0) if inv_freq.dim() == 2 else 0,   # one table: every layer's
                              NUM_HEADS=H, PAGE=page, HALF=D // 2, **scaled, **meta)
